"""Media beside role / content messages and in JSON array files: what each record trains must be what the same
conversation written with explicit image items trains (tokens, label mask, pixels), or the record is refused.

Two layouts trained wrongly without an error: a messages row whose "<image>" markers came with LLaVA's singular
top-level "image" (the marker stayed as text and the image was never seen, while the GRPO reader placed it), and a
row with both image items without a path and "<image>" text markers (the images filled the items and the markers
were trained as literal text)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_vlm.data.bad_records import BadRecordError, BadRecordLog
from megatron_vlm.data.hf_source import record_from_columns
from megatron_vlm.data.messages import read_messages_jsonl, record_from_messages_row
from megatron_vlm.data.processing import estimate_length, process_record


def _user(c):
    return {"role": "user", "content": c}


def _asst(c):
    return {"role": "assistant", "content": c}


def _record(row, root):
    return record_from_messages_row(json.loads(json.dumps(row)), lambda r: str(root / r), source="t", index=1)


def _same_training(got, want, proc):
    a, b = process_record(got, proc, max_frames=4), process_record(want, proc, max_frames=4)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.label_mask, b.label_mask)
    assert torch.equal(a.pixel_values, b.pixel_values)
    assert estimate_length(got, proc, max_frames=4) == a.input_ids.numel()


@pytest.fixture
def root(tmp_path, write_image):
    write_image(tmp_path / "a.png", size=(56, 84), seed=1)
    write_image(tmp_path / "b.png", size=(84, 56), seed=2)
    return tmp_path


def test_singular_image_key_goes_to_the_marker(root, proc):
    explicit = {"messages": [_user([{"type": "image", "image": "a.png"}, {"type": "text", "text": "\nWhat?"}]),
                             _asst("A cup.")], "id": 7}
    marked = {"messages": [_user("<image>\nWhat?"), _asst("A cup.")], "image": "a.png", "id": 7}
    rec = _record(marked, root)
    assert rec.meta == {"id": 7}
    _same_training(rec, _record(explicit, root), proc)
    video = _record({"messages": [_user("<video>Describe."), _asst("x")], "video": ["a.png", "a.png"]}, root)
    conv = _record({"conversations": [{"from": "human", "value": "<video>Describe."}, {"from": "gpt", "value": "x"}],
                    "video": ["a.png", "a.png"]}, root)
    for rec in (video, conv):  # a list under "video" is one video's frames, not two videos
        assert rec.messages[0]["content"][0] == {"type": "video", "video": [str(root / "a.png")] * 2}


@pytest.mark.parametrize("where", ["string", "text_item"])
def test_items_without_path_and_markers_together_are_refused(root, where):
    marker_turn = "<image>And this?" if where == "string" else [{"type": "text", "text": "<image>And this?"}]
    row = {"messages": [_user([{"type": "image"}, {"type": "text", "text": "What?"}]), _asst("x"),
                        _user(marker_turn), _asst("y")], "images": ["a.png"]}
    with pytest.raises(BadRecordError, match="placeholder_mismatch|markers"):
        _record(row, root)
    cols = {"messages": "messages", "images": "images"}
    with pytest.raises(BadRecordError, match="markers"):
        record_from_columns(json.loads(json.dumps(row)), cols, root=root, source="t", index=0)


def test_conversations_and_marked_messages_estimate_their_processed_length(root, proc):
    conv = {"system": "Be brief.", "images": ["a.png", "b.png"],
            "conversations": [{"from": "human", "value": "Compare <image> and <image>."}, {"from": "gpt", "value": "Red."},
                              {"from": "human", "value": "Which?"}, {"from": "gpt", "value": "The second."}]}
    swift = {"messages": [{"role": "system", "content": "Be brief."}, _user("Compare <image> and <image>."),
                          _asst("Red."), _user("Which?"), _asst("The second.")], "images": ["a.png", "b.png"]}
    explicit = {"messages": [{"role": "system", "content": "Be brief."},
                             _user([{"type": "text", "text": "Compare "}, {"type": "image", "image": "a.png"},
                                    {"type": "text", "text": " and "}, {"type": "image", "image": "b.png"},
                                    {"type": "text", "text": "."}]),
                             _asst("Red."), _user("Which?"), _asst("The second.")]}
    for row in (conv, swift):
        _same_training(_record(row, root), _record(explicit, root), proc)


def test_array_files_with_leading_blanks_and_json_lines_named_json(root):
    rec = {"messages": [_user("Hi"), _asst("Hello")]}
    (root / "ws.json").write_text("\ufeff\n\n  \t\r\n" + " " * 70000 + "\n[\n  " + json.dumps(rec) + "\n]\n")
    (root / "lines.json").write_text(json.dumps(rec) + "\n" + json.dumps(rec) + "\n")
    log = BadRecordLog()
    assert [r.index for r in read_messages_jsonl(root / "ws.json", bad_records=log)] == [0]
    assert [r.index for r in read_messages_jsonl(root / "lines.json", bad_records=log)] == [1, 2]
    assert not log.entries


def test_grpo_and_preference_prompts_refuse_markers_beside_items(root):
    from megatron_vlm.data.preference_records import JSONL_COLUMNS, preference_from_row
    from megatron_vlm.rl.prompts.dataset import load_prompt_dataset

    mixed = [_user([{"type": "image"}, {"type": "text", "text": "<image>What colour?"}])]
    rows = [{"messages": mixed, "images": ["a.png"], "answer": "red"},
            {"messages": [_user([{"type": "image"}, {"type": "text", "text": "What colour?"}])], "images": ["a.png"],
             "answer": "red"}]
    (root / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = load_prompt_dataset(root / "p.jsonl", prompt_template="{problem}")
    assert [s.problem for s in out.samples] == ["What colour?"]
    assert [(b.index, b.category) for b in out.bad_records.entries] == [(1, "placeholder_mismatch")]
    row = {"prompt": mixed, "chosen": "red", "rejected": "blue", "images": ["a.png"]}
    with pytest.raises(BadRecordError, match="marker beside image items"):
        preference_from_row(row, JSONL_COLUMNS, resolve=lambda r: str(root / r), source="t", index=0)


@pytest.mark.parametrize("reader", ["messages", "columns"])
def test_marked_messages_with_a_message_that_is_no_object_is_an_invalid_record(reader):
    """A marked messages list holding something other than a message object ("oops") is the invalid record the
    unmarked list gives, naming the message; it was an AttributeError counted as "unexpected_error"."""
    row = {"messages": [_user("<image> What?"), "oops", _asst("red")], "images": ["a.png"]}
    with pytest.raises(BadRecordError) as e:
        if reader == "messages":
            record_from_messages_row(row, lambda r: r, source="t", index=1)
        else:
            record_from_columns(row, {"messages": "messages", "images": "images"}, root=Path("/"), source="t", index=0)
    assert e.value.category == "invalid_record" and "messages[1]" in e.value.detail
