"""Tool-use traces in the OpenAI / transformers message format train on what the chat template renders.

A trace writes the model's calls as an assistant message's `tool_calls` (content often empty) and the tool specs as
the record's top-level `tools`; transformers' `apply_chat_template(messages, tools=...)` hands both to the template
(Qwen3-VL's renders `<tool_call>` blocks and a `# Tools` system turn). The pipeline used to drop both: a call-only
turn was refused as an "empty assistant answer", a turn with text and a call trained on the text alone, and the
specs never reached the text. The reference is the tokenizer's own `apply_chat_template` on the raw messages;
a template that ignores `tool_calls` / `tools` gives a named bad record rather than a trace without its calls.
"""
from __future__ import annotations

import copy
import json

import pytest

from megatron_vlm.data.bad_records import BadRecordError
from megatron_vlm.data.processing import estimate_length, process_record

# Written here after the behaviour of Qwen3's tool template: specs in the first system turn, each call a
# <tool_call> JSON block after the assistant's text, consecutive tool replies in one user turn. Newlines after a
# block tag are written as expressions: transformers renders templates with trim_blocks.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n"
    "{% endif %}# Tools\n<tools>{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}{{ '\\n' }}</tools><|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|im_start|>user\n{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for it in m['content'] %}{% if it['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif it['type'] == 'text' %}{{ it['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% elif m['role'] == 'assistant' %}<|im_start|>assistant\n{{ m['content'] or '' }}"
    "{% for c in m['tool_calls'] or [] %}{% if c['function'] is defined %}{% set c = c['function'] %}{% endif %}"
    "{% if not loop.first or m['content'] %}{{ '\\n' }}{% endif %}<tool_call>\n{\"name\": \"{{ c['name'] }}\", \"arguments\": "
    "{% if c['arguments'] is string %}{{ c['arguments'] }}{% else %}{{ c['arguments'] | tojson }}{% endif %}}"
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "<|im_start|>user{% endif %}{{ '\\n' }}<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "calculate", "description": "evaluate",
                                           "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]


def _row(*, text: str = "", tools=TOOLS) -> dict:
    call = {"type": "function", "function": {"name": "calculate", "arguments": {"expression": "47 * 83"}}}
    row = {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image", "image": "x.png"}, {"type": "text", "text": "47 * 83 = ?"}]},
        {"role": "assistant", "content": text or None, "tool_calls": [call]},
        {"role": "tool", "content": "3901"},
        {"role": "assistant", "content": "3901"}]}
    if tools is not None:
        row["tools"] = tools
    return row


@pytest.fixture(scope="module")
def tool_proc(proc):
    out = copy.copy(proc)
    out.chat_template = TOOL_TEMPLATE
    return out


@pytest.mark.parametrize("text", ["", "Let me compute."])
def test_tool_trace_matches_the_tokenizers_chat_template(tool_proc, text, messages_record):
    row = _row(text=text)
    record = messages_record(row)
    sample = process_record(record, tool_proc, max_frames=4)
    tok = tool_proc.tokenizer
    rendered = tok.apply_chat_template(row["messages"], tools=row["tools"], chat_template=TOOL_TEMPLATE, tokenize=False)
    assert rendered.count("<tool_call>") == 1 and "# Tools" in rendered
    n = int(sample.image_grid_thw.prod()) // 4
    want = tok(rendered.replace("<|image_pad|>", "<|image_pad|>" * n))["input_ids"]
    assert sample.input_ids.tolist() == want
    trained = tok.decode(sample.input_ids[sample.label_mask])
    call = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "47 * 83"}}\n</tool_call><|im_end|>'
    assert trained == ("Let me compute.\n" if text else "") + call + "3901<|im_end|>"
    assert estimate_length(record, tool_proc, max_frames=4) == sample.input_ids.numel()


def test_tools_given_as_a_json_string_are_parsed(tool_proc, messages_record):
    """Table columns often hold the specs as one JSON string: the same text as the list."""
    listed = process_record(messages_record(_row()), tool_proc, max_frames=4)
    as_text = process_record(messages_record(_row(tools=json.dumps(TOOLS))), tool_proc, max_frames=4)
    assert as_text.input_ids.tolist() == listed.input_ids.tolist()
    with pytest.raises(BadRecordError, match="not JSON"):
        process_record(messages_record(_row(tools="[{")), tool_proc, max_frames=4)


def test_a_template_that_drops_tool_calls_is_a_named_bad_record(proc, tool_proc, messages_record):
    record = messages_record(_row(text="Let me compute.", tools=None))
    with pytest.raises(BadRecordError, match="tool_calls") as e:
        process_record(record, proc, max_frames=4)  # the Qwen2.5-VL template knows no tool_calls
    assert e.value.category == "invalid_record"
    with_tools = messages_record(_row(text="Let me compute."))
    bare = copy.copy(tool_proc)
    bare.chat_template = TOOL_TEMPLATE.replace("{% if tools %}", "{% if false %}")
    with pytest.raises(BadRecordError, match="tools"):
        estimate_length(with_tools, bare, max_frames=4)


def test_malformed_tool_calls_are_invalid_records(messages_record):
    for bad, where in (("x", "must be a list"), ([{"function": {"arguments": "{}"}}], "name")):
        row = _row(text="t")
        row["messages"][2]["tool_calls"] = bad
        with pytest.raises(BadRecordError, match=where):
            messages_record(row)
    row = _row(text="t")
    row["messages"][1]["tool_calls"] = row["messages"][2]["tool_calls"]
    with pytest.raises(BadRecordError, match="only assistant"):
        messages_record(row)


def test_empty_tool_calls_lists_are_no_calls(proc, messages_record):
    """Tables (pandas, datasets) write `tool_calls: []` on every message: an empty list is no call, on any role,
    and the record trains as one without the key."""
    row = {"messages": [{"role": "system", "content": "Be brief.", "tool_calls": []},
                        {"role": "user", "content": [{"type": "image", "image": "x.png"}, {"type": "text", "text": "hi"}],
                         "tool_calls": []},
                        {"role": "assistant", "content": "hello", "tool_calls": []}]}
    plain = json.loads(json.dumps(row))
    for m in plain["messages"]:
        del m["tool_calls"]
    a = process_record(messages_record(row), proc, max_frames=4)
    b = process_record(messages_record(plain), proc, max_frames=4)
    assert a.input_ids.tolist() == b.input_ids.tolist() and a.label_mask.tolist() == b.label_mask.tolist()


def test_the_public_apply_chat_template_renders_what_the_template_renders(proc):
    """Like transformers' `apply_chat_template`: a template without tool support renders the conversation without
    the specs (no error); refusing such traces is the training pipeline's rule, not the public method's."""
    messages = [{"role": "user", "content": "hi"}]
    assert proc.apply_chat_template(messages, tools=TOOLS) == proc.apply_chat_template(messages)


WEATHER = {"type": "function", "function": {"name": "weather", "description": "forecast", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_a_list_valued_tools_column_of_an_hf_dataset_reaches_the_template(tool_proc, tmp_path, fmt, messages_record):
    """`[data] type = "hf"`: a "tools" column holding the specs as a list (a parquet list of structs, a JSON list)
    renders as the messages_jsonl source's top-level "tools" does; it used to be dropped with the other non-scalar
    columns. Two rows with different specs: Arrow gives each row every field of both, None where absent."""
    from megatron_vlm.data.hf_source import HFRecords

    rows = [_row(), _row(tools=[WEATHER])]
    table = [{"messages": json.dumps(r["messages"]), "tools": r["tools"]} for r in rows]
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(table), tmp_path / "d.parquet")
    else:
        (tmp_path / "d.jsonl").write_text("".join(json.dumps(t) + "\n" for t in table))
    src = HFRecords(tmp_path / f"d.{fmt}", {"messages": "messages"}, cache_dir=str(tmp_path / "cache"))
    for i, row in enumerate(rows):
        record = src.get(i)
        assert record.tools == row["tools"]
        want = process_record(messages_record(row), tool_proc, max_frames=4)
        assert process_record(record, tool_proc, max_frames=4).input_ids.tolist() == want.input_ids.tolist()


@pytest.mark.parametrize("token", ["<|im_end|>", "<|im_start|>", "<|image_pad|>"])
def test_special_tokens_in_tool_specs_are_refused_as_in_messages(tool_proc, messages_record, token):
    """The specs are rendered into the prompt like message text: a structural token there is refused as it is in a
    message (it was tokenised as the special token, a fake turn marker or image in the system turn)."""
    tools = copy.deepcopy(TOOLS)
    tools[0]["function"]["description"] = f"evaluate {token} it"
    record = messages_record(_row(text="t", tools=tools))
    for fn in (estimate_length, process_record):
        with pytest.raises(BadRecordError, match=r"tools.*(special token|placeholder)"):
            fn(record, tool_proc, max_frames=4)
