"""LLaVA / ShareGPT "conversations" data read by the messages reader (and the hf source), as these projects write it.

LLaVA-Instruct ships one JSON array per file (llava_v1_5_mix665k.json) of {"id", "image", "conversations":
[{"from": "human", "value": "<image>\\n..."}, {"from": "gpt", ...}]}; LLaMA-Factory's and ms-swift's "sharegpt"
files add a top-level "system" and "images" / "videos" lists. Both were refused as "no 'messages' key" (and a JSON
array file as one malformed line). Each record must train exactly what the same conversation written in our
messages form trains: the same tokens, the same label mask (assistant turns only), the same pixels.
"""
from __future__ import annotations

import json

import pytest
import torch

from megatron_vlm.data.bad_records import BadRecordLog
from megatron_vlm.data.config import DataConfig
from megatron_vlm.data.conversations import messages_from_conversations
from megatron_vlm.data.data_files import DataFileError
from megatron_vlm.data.hf_source import HFRecords
from megatron_vlm.data.messages import read_messages_jsonl
from megatron_vlm.data.processing import process_record
from megatron_vlm.data.sources import open_split
from megatron_vlm.data.table_rows import TableRows

IMG = "coco/train2017/000000033471.jpg"


def _human(v):
    return {"from": "human", "value": v}


def _gpt(v):
    return {"from": "gpt", "value": v}


LLAVA = [  # llava_v1_5_mix665k.json's layout: one array, "image" for one image, none for a text-only record
    {"id": "000000033471", "image": IMG,
     "conversations": [_human("<image>\nWhat colour is the square?"), _gpt("The square is red."),
                       _human("How many shapes are there?"), _gpt("There are two shapes.")]},
    {"id": "text-1", "conversations": [_human("What is two plus three?"), _gpt("Five.")]},
    {"id": "bad-marker", "conversations": [_human("<image>\nWhat is shown?"), _gpt("A cup.")]},       # no image
    {"id": "bad-image", "image": IMG, "conversations": [_human("What is shown?"), _gpt("A cup.")]},   # no marker
    {"id": "bad-from", "conversations": [_human("Hi"), {"from": "bing", "value": "Hello"}]},
    {"id": "bad-empty", "conversations": []},
    {"id": "bad-end", "conversations": [_human("Hi"), _gpt("Hello"), _human("And then?")]},
]

# The same two good records in our messages form: what they must train identically to.
LLAVA_AS_MESSAGES = [
    {"messages": [{"role": "user", "content": [{"type": "image", "image": IMG},
                                               {"type": "text", "text": "\nWhat colour is the square?"}]},
                  {"role": "assistant", "content": "The square is red."},
                  {"role": "user", "content": "How many shapes are there?"},
                  {"role": "assistant", "content": "There are two shapes."}], "id": "000000033471"},
    {"messages": [{"role": "user", "content": "What is two plus three?"}, {"role": "assistant", "content": "Five."}],
     "id": "text-1"},
]

SHAREGPT = {  # LLaMA-Factory / ms-swift "sharegpt": top-level system, "images" with markers, two exchanges
    "system": "You describe pictures.",
    "conversations": [_human("Compare <image> and <image>."), _gpt("The first is red, the second is blue."),
                      _human("Which is larger?"), _gpt("The second.")],
    "images": ["img/a.png", "img/b.png"], "source": "sharegpt"}

SHAREGPT_AS_MESSAGES = {
    "messages": [{"role": "system", "content": "You describe pictures."},
                 {"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image", "image": "img/a.png"},
                                              {"type": "text", "text": " and "}, {"type": "image", "image": "img/b.png"},
                                              {"type": "text", "text": "."}]},
                 {"role": "assistant", "content": "The first is red, the second is blue."},
                 {"role": "user", "content": "Which is larger?"},
                 {"role": "assistant", "content": "The second."}], "source": "sharegpt"}


@pytest.fixture
def data(tmp_path, write_image):
    write_image(tmp_path / IMG, size=(56, 84), seed=1)
    write_image(tmp_path / "img" / "a.png", size=(56, 56), seed=2)
    write_image(tmp_path / "img" / "b.png", size=(84, 56), seed=3)
    (tmp_path / "llava_mix.json").write_text(json.dumps(LLAVA, indent=2))  # pretty-printed, as many copies are
    (tmp_path / "llava_ref.jsonl").write_text("".join(json.dumps(r) + "\n" for r in LLAVA_AS_MESSAGES))
    mixed = [SHAREGPT, SHAREGPT_AS_MESSAGES, {**SHAREGPT, "system": "Be brief.",
                                              "conversations": [{"from": "system", "value": "x"}] + SHAREGPT["conversations"]}]
    (tmp_path / "sharegpt.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mixed))
    return tmp_path


def _same_training(got, want, proc):
    a, b = process_record(got, proc, max_frames=4), process_record(want, proc, max_frames=4)
    assert torch.equal(a.input_ids, b.input_ids)
    assert torch.equal(a.label_mask, b.label_mask)
    assert (a.pixel_values is None) == (b.pixel_values is None)
    if a.pixel_values is not None:
        assert torch.equal(a.pixel_values, b.pixel_values) and torch.equal(a.image_grid_thw, b.image_grid_thw)
    return a


def _trained_text(sample, proc) -> str:
    return proc.tokenizer.decode(sample.input_ids[sample.label_mask].tolist())


def test_llava_json_array_file_trains_as_its_messages_form(data, proc):
    log = BadRecordLog()
    recs = read_messages_jsonl(data / "llava_mix.json", bad_records=log)
    assert [(r.index, r.meta) for r in recs] == [(0, {"id": "000000033471"}), (1, {"id": "text-1"})]
    assert recs[0].messages[0]["content"] == [{"type": "image", "image": str(data / IMG)},
                                              {"type": "text", "text": "\nWhat colour is the square?"}]
    assert recs[1].messages == [{"role": "user", "content": "What is two plus three?"},
                                {"role": "assistant", "content": "Five."}]
    bad = {b.index: (b.category, b.detail) for b in log.entries}
    assert {k: c for k, (c, _) in bad.items()} == {2: "placeholder_mismatch", 3: "placeholder_mismatch",
                                                   4: "invalid_record", 5: "invalid_record", 6: "invalid_record"}
    assert "1 <image> markers" in bad[2][1] and "0 <image> markers" in bad[3][1]
    assert "'bing'" in bad[4][1] and "empty" in bad[5][1] and "ends on a 'human'" in bad[6][1]
    refs = read_messages_jsonl(data / "llava_ref.jsonl")
    first = _same_training(recs[0], refs[0], proc)
    _same_training(recs[1], refs[1], proc)
    trained = _trained_text(first, proc)
    assert "The square is red." in trained and "There are two shapes." in trained
    assert "colour" not in trained and "How many" not in trained


def test_sharegpt_jsonl_with_system_and_images_mixed_with_messages_lines(data, proc):
    log = BadRecordLog()
    recs = read_messages_jsonl(data / "sharegpt.jsonl", bad_records=log)
    assert [r.index for r in recs] == [1, 2]
    assert recs[0].messages == recs[1].messages and recs[0].meta == recs[1].meta == {"source": "sharegpt"}
    assert recs[0].images() == [str(data / "img" / "a.png"), str(data / "img" / "b.png")]
    assert [(b.index, b.category) for b in log.entries] == [(3, "invalid_record")]
    assert "'system' turn must come first" in log.entries[0].detail
    sample = _same_training(recs[0], recs[1], proc)
    trained = _trained_text(sample, proc)
    assert "The first is red" in trained and "The second." in trained and "describe" not in trained


def test_training_source_reads_the_array_file_and_names_elements(data):
    log = BadRecordLog()
    src = open_split(DataConfig(train_path=str(data / "llava_mix.json")), "train", log)
    assert len(src) == 2 and [src.locate(i)[1] for i in range(2)] == [0, 1]
    assert src.get(1).messages[-1]["content"] == "Five."
    assert sorted(b.index for b in log.entries) == [2, 3, 4, 5, 6]


def test_json_array_files_element_errors_and_broken_files(tmp_path):
    good = {"conversations": [_human("é?"), _gpt("ü.")]}
    text = "\ufeff[" + json.dumps(good, ensure_ascii=False) + ', 7, ["x"],\n' + json.dumps(good) + "]\n"
    (tmp_path / "a.json").write_text(text)
    rows = TableRows(tmp_path / "a.json")
    assert [rows.locate(i)[1] for i in range(len(rows))] == [0, 3]
    assert rows.row(0) == good and rows.row(1) == good
    assert [(k, e.category) for _, k, e in rows.errors] == [(1, "malformed_json"), (2, "malformed_json")]
    (tmp_path / "empty.json").write_text(" [ ]\n")
    assert len(TableRows(tmp_path / "empty.json")) == 0
    for name, broken in {"cut.json": text[:-10], "comma.json": "[{}, ]", "extra.json": "[{}] {}"}.items():
        (tmp_path / name).write_text(broken)
        with pytest.raises(DataFileError, match=name):
            TableRows(tmp_path / name)


def test_hf_source_reads_a_conversations_column(data, proc):
    row = {"id": 1, "conversations": LLAVA[0]["conversations"], "image": IMG, "system": "Be brief."}
    (data / "ov.jsonl").write_text(json.dumps(row) + "\n" + json.dumps({**row, "image": None}) + "\n")
    src = HFRecords(data / "ov.jsonl", {"messages": "conversations", "image": "image", "system": "system"})
    rec = src.get(0)
    assert rec.messages[0] == {"role": "system", "content": "Be brief."}
    assert rec.messages[1:] == read_messages_jsonl(data / "llava_ref.jsonl")[0].messages
    with pytest.raises(Exception, match="placeholder_mismatch"):
        src.get(1)


def test_tool_turns_and_roles_never_guessed():
    call = json.dumps({"name": "lookup", "arguments": {"q": "x"}})
    got = messages_from_conversations([_human("Find x"), {"from": "function_call", "value": call},
                                       {"from": "observation", "value": "42"}, _gpt("It is 42.")])
    assert got[1] == {"role": "assistant", "content": "",
                      "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {"q": "x"}}}]}
    assert got[2] == {"role": "tool", "content": "42"}
    for turns, match in [([_human("<image>"), _gpt("x")], "markers"),
                         ([_human("a"), _gpt("<image> b")], "'gpt' turn"),
                         ([_human("a"), {"from": "function_call", "value": "not json"}], "must be JSON"),
                         ([{"from": "chatgpt", "value": "a"}], "unknown 'from'")]:
        with pytest.raises(Exception, match=match):
            messages_from_conversations(turns)


def test_videos_take_their_markers_and_ambiguous_records_are_refused():
    from megatron_vlm.data.bad_records import BadRecordError
    from megatron_vlm.data.messages import record_from_messages_row

    row = {"conversations": [_human("<video>Describe <image>"), _gpt("A cup moves.")],
           "videos": [["f0.png", "f1.png"]], "images": ["x.png"]}
    rec = record_from_messages_row(row, lambda r: r, source="t", index=1)
    assert rec.messages[0]["content"] == [{"type": "video", "video": ["f0.png", "f1.png"]},
                                          {"type": "text", "text": "Describe "}, {"type": "image", "image": "x.png"}]
    for bad, match in [({**row, "messages": []}, "both 'messages' and 'conversations'"),
                       ({**row, "image": "y.png"}, "both 'image' and 'images'"),
                       ({**row, "videos": []}, "1 <video> markers"),
                       ({**row, "system": ["x"]}, "'system' must be a string")]:
        with pytest.raises(BadRecordError, match=match):
            record_from_messages_row(bad, lambda r: r, source="t", index=1)
