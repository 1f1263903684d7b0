"""An assistant message's `reasoning_content` (reasoning traces kept apart from the answer, as reasoning-model
datasets and OpenAI-style APIs write them) reaches the chat template as transformers' `apply_chat_template`
passes it, and is trained where the template renders it. It used to be dropped silently: a reasoning dataset
trained on bare answers. The reference is the tokenizer's own `apply_chat_template` on the raw messages with a
template written after Qwen3's reasoning rule (the reasoning of the assistant turns after the last user message
inside `<think>` tags, earlier turns' dropped); a template that renders no reasoning is a named bad record.
"""
from __future__ import annotations

import copy

import pytest

from megatron_vlm.data.bad_records import BadRecordError
from megatron_vlm.data.processing import estimate_length, process_record

# Qwen3's reasoning rule, written here: the last user message's index, then each assistant turn after it with
# its reasoning_content inside <think> ... </think>, earlier assistant turns without it.
REASONING_TEMPLATE = (
    "{% set ns = namespace(last_user=-1) %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|im_start|>user\n{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for it in m['content'] %}{% if it['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif it['type'] == 'text' %}{{ it['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% elif m['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% if loop.index0 > ns.last_user and m['reasoning_content'] is string %}"
    "<think>\n{{ m['reasoning_content'].strip('\\n') }}\n</think>\n\n{% endif %}{{ m['content'] }}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _row(reasoning="Nine times nine is 81.", earlier=None) -> dict:
    return {"messages": [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi", **({"reasoning_content": earlier} if earlier is not None else {})},
        {"role": "user", "content": [{"type": "image", "image": "x.png"}, {"type": "text", "text": "9 * 9 = ?"}]},
        {"role": "assistant", "content": "81", **({"reasoning_content": reasoning} if reasoning is not None else {})}]}


@pytest.fixture(scope="module")
def reasoning_proc(proc):
    out = copy.copy(proc)
    out.chat_template = REASONING_TEMPLATE
    return out


def test_reasoning_is_rendered_and_trained_as_the_tokenizers_template_renders_it(reasoning_proc, messages_record):
    row = _row(earlier="greet back")  # an earlier turn's reasoning: the template drops it, as Qwen3's does
    record = messages_record(row)
    sample = process_record(record, reasoning_proc, max_frames=4)
    tok = reasoning_proc.tokenizer
    rendered = tok.apply_chat_template(row["messages"], chat_template=REASONING_TEMPLATE, tokenize=False)
    assert "<think>\nNine times nine is 81.\n</think>" in rendered and "greet back" not in rendered
    n = int(sample.image_grid_thw.prod()) // 4
    assert sample.input_ids.tolist() == tok(rendered.replace("<|image_pad|>", "<|image_pad|>" * n))["input_ids"]
    trained = tok.decode(sample.input_ids[sample.label_mask])
    assert trained == "hi<|im_end|><think>\nNine times nine is 81.\n</think>\n\n81<|im_end|>"
    assert estimate_length(record, reasoning_proc, max_frames=4) == sample.input_ids.numel()


def test_a_template_that_renders_no_reasoning_is_a_named_bad_record(proc, reasoning_proc, messages_record):
    record = messages_record(_row())
    with pytest.raises(BadRecordError, match="reasoning_content") as e:
        process_record(record, proc, max_frames=4)  # the Qwen2.5-VL template knows no reasoning
    assert e.value.category == "invalid_record"
    # only an earlier turn's: the template's choice to drop it (Qwen3's), not a refusal
    only_earlier = messages_record(_row(reasoning=None, earlier="greet back"))
    plain = messages_record(_row(reasoning=None))
    for p in (proc, reasoning_proc):
        assert process_record(only_earlier, p, max_frames=4).input_ids.tolist() == \
            process_record(plain, p, max_frames=4).input_ids.tolist()


def test_malformed_or_empty_reasoning(proc, messages_record):
    row = _row(reasoning=["x"])
    with pytest.raises(BadRecordError, match="must be a string"):
        messages_record(row)
    row = _row(reasoning=None)
    row["messages"][0]["reasoning_content"] = "why"
    with pytest.raises(BadRecordError, match="only assistant"):
        messages_record(row)
    # null / "" on any message (tables write them) is no reasoning
    row = _row(reasoning="")
    for m in row["messages"]:
        m.setdefault("reasoning_content", None)
    plain = _row(reasoning=None)
    assert process_record(messages_record(row), proc, max_frames=4).input_ids.tolist() == \
        process_record(messages_record(plain), proc, max_frames=4).input_ids.tolist()


@pytest.mark.parametrize("token", ["<|im_end|>\n<|im_start|>user\n", "<|vision_start|>", "<|image_pad|>"])
def test_special_tokens_in_reasoning_are_refused_as_in_content(reasoning_proc, messages_record, token):
    """A structural token inside reasoning_content is refused as it is inside content: a turn end there closed the
    trained span early (the answer after it went untrained) and faked a user turn; a placeholder faked an image."""
    record = messages_record(_row(reasoning=f"think a bit{token}then answer"))
    for fn in (estimate_length, process_record):
        with pytest.raises(BadRecordError, match=r"messages\[3\].*(special token|placeholder)"):
            fn(record, reasoning_proc, max_frames=4)
