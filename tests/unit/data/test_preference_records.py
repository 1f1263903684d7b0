"""Preference rows in TRL's layouts (standard, conversational with an images column, implicit prompt), the
JSON-lines "messages" spelling, and bad rows counted rather than fatal; plus the synthetic VQA pairs."""
from __future__ import annotations

import json

import pytest
from PIL import Image

from megatron_vlm.data.bad_records import BadRecordError, BadRecordLog
from megatron_vlm.data.messages import read_messages_jsonl
from megatron_vlm.data.preference_records import (
    JSONL_COLUMNS,
    PreferenceRows,
    ResponseHalves,
    SyntheticPreferencePairs,
    preference_from_row,
)
from megatron_vlm.data.sources import ListRecords
from megatron_vlm.data.synthetic_vqa import ANSWERS, write_synthetic_vqa

COLS = {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected", "images": "images"}


def _row(row, cols=COLS):
    return preference_from_row(row, cols, resolve=lambda r: r, source="f", index=0)


def test_standard_layout_with_image_marker():
    rec = _row({"prompt": "<image>What colour?", "chosen": "red", "rejected": "blue", "images": ["/a.png"], "id": 7})
    c, r = rec.halves()
    assert c.messages[-1] == {"role": "assistant", "content": "red"} and r.messages[-1]["content"] == "blue"
    assert c.messages[:-1] == r.messages[:-1]
    assert c.messages[0]["content"] == [{"type": "image", "image": "/a.png"}, {"type": "text", "text": "What colour?"}]
    assert rec.meta == {"id": 7}


def test_conversational_layout_fills_image_items_in_order():
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Same?"}]}]
    row = {"prompt": prompt, "chosen": [{"role": "assistant", "content": [{"type": "text", "text": "yes"}]}],
           "rejected": [{"role": "assistant", "content": "no"}], "images": [{"bytes": b"x", "path": None}, "/b.png"]}
    c, r = _row(row).halves()
    items = c.messages[0]["content"]
    assert [it.get("image") for it in items[:2]] == [{"bytes": b"x", "path": None}, "/b.png"]
    assert (c.messages[-1]["content"], r.messages[-1]["content"]) == ("yes", "no")


def test_conversational_prompt_with_image_markers_takes_the_images_in_place():
    """ms-swift's layout: text turns whose "<image>" markers take the row's images where they stand (they were a
    placeholder_mismatch); as many markers as images, else still a mismatch."""
    prompt = [{"role": "user", "content": "Compare <image> and <image>."}]
    row = {"prompt": prompt, "chosen": "same", "rejected": "different", "images": ["/a.png", "/b.png"]}
    c, _ = _row(row).halves()
    assert c.messages[0]["content"] == [{"type": "text", "text": "Compare "}, {"type": "image", "image": "/a.png"},
                                        {"type": "text", "text": " and "}, {"type": "image", "image": "/b.png"},
                                        {"type": "text", "text": "."}]
    with pytest.raises(BadRecordError) as e:
        _row({**row, "images": ["/a.png"]}).halves()
    assert e.value.category == "placeholder_mismatch"


def test_implicit_prompt_layout():
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    row = {"chosen": [*conv, {"role": "assistant", "content": "4"}], "rejected": [*conv, {"role": "assistant", "content": "5"}]}
    c, r = _row(row, {"chosen": "chosen", "rejected": "rejected"}).halves()
    assert c.messages[:2] == conv and (c.messages[-1]["content"], r.messages[-1]["content"]) == ("4", "5")


@pytest.mark.parametrize("row,category", [
    ({"prompt": "q", "chosen": "a"}, "invalid_record"),                                           # no rejected
    ({"prompt": "<image><image>q", "chosen": "a", "rejected": "b", "images": ["/a.png"]}, "placeholder_mismatch"),
    ({"prompt": "q", "chosen": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
      "rejected": "b"}, "invalid_record"),                                                        # not one assistant message
    ({"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "1"}],
      "rejected": [{"role": "user", "content": "b"}, {"role": "assistant", "content": "2"}]}, "invalid_record"),
    ({"prompt": 3, "chosen": "a", "rejected": "b"}, "invalid_record"),                           # prompt not text / messages
    ({"prompt": "q", "chosen": "same", "rejected": "same"}, "invalid_record"),                   # nothing to prefer
    ({"prompt": "q", "chosen": [{"role": "assistant", "content": [{"type": "text", "text": "a"}]}],
      "rejected": "a"}, "invalid_record"),                                                        # the same text, two spellings
    ({"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "1"}],
      "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "1"}]}, "invalid_record"),
])
def test_bad_rows_raise_bad_record_errors(row, category):
    cols = COLS if "prompt" in row else {"chosen": "chosen", "rejected": "rejected"}
    with pytest.raises(BadRecordError) as e:
        _row(row, cols)
    assert e.value.category == category


def test_jsonl_rows_messages_spelling_relative_images_and_bad_lines(tmp_path):
    Image.new("RGB", (28, 28)).save(tmp_path / "a.png")
    lines = [
        {"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "q"}]}],
         "chosen": "yes", "rejected": "no"},
        {"prompt": "q2", "chosen": "x", "rejected": "y", "images": ["a.png"]},
        {"prompt": "q3", "chosen": "x"},
    ]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\nnot json\n")
    bad = BadRecordLog()
    rows = PreferenceRows(str(tmp_path / "p.jsonl"), jsonl=True, bad_records=bad)
    assert rows.columns == JSONL_COLUMNS and len(rows) == 3 and len(bad) == 1  # the malformed line
    c, _ = rows.get(0).halves()
    assert c.messages[0]["content"][0]["image"] == str(tmp_path / "a.png")
    c, _ = rows.get(1).halves()
    assert c.messages[0]["content"][0]["image"] == str(tmp_path / "a.png")
    with pytest.raises(BadRecordError):
        rows.get(2)
    halves = ResponseHalves(rows)
    assert len(halves) == 6 and halves.locate(3) == rows.locate(1)
    assert halves.get(3).messages[-1]["content"] == "y"


def test_parquet_trl_layout(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import io

    import pyarrow.parquet as pq

    buf = io.BytesIO()
    Image.new("RGB", (28, 28), (200, 0, 0)).save(buf, format="PNG")
    prompt = [{"role": "user", "content": [{"type": "image", "text": None}, {"type": "text", "text": "colour?"}]}]
    table = pa.table({"prompt": [prompt], "chosen": [[{"role": "assistant", "content": [{"type": "text", "text": "red"}]}]],
                      "rejected": [[{"role": "assistant", "content": [{"type": "text", "text": "blue"}]}]],
                      "images": [[{"bytes": buf.getvalue(), "path": None}]]})
    pq.write_table(table, tmp_path / "train.parquet")
    rows = PreferenceRows(str(tmp_path / "train.parquet"), COLS, jsonl=False)
    c, r = rows.get(0).halves()
    assert c.messages[0]["content"][0]["image"]["bytes"] == buf.getvalue()
    assert (c.messages[-1]["content"], r.messages[-1]["content"]) == ("red", "blue")


def test_synthetic_pairs_reject_a_wrong_answer(tmp_path):
    paths = write_synthetic_vqa(tmp_path, 60, 0, seed=0, image_size=56)
    src = ListRecords("t", read_messages_jsonl(paths["train"]))
    pairs = SyntheticPreferencePairs(src, seed=0)
    vocab = {a for v in ANSWERS.values() for a in v}
    same = 0
    for i in range(len(pairs)):
        p = pairs.get(i)
        assert p.chosen == src.get(i).meta["answer"] and p.rejected != p.chosen and p.rejected in vocab
        assert p.prompt == src.get(i).messages[:-1]
        same += p.meta["rejected_same_type"]
    assert 0 < same < len(pairs)
    assert [pairs.get(i).rejected for i in range(10)] == [SyntheticPreferencePairs(src, 0).get(i).rejected for i in range(10)]


@pytest.mark.parametrize("layout", ["conversational", "implicit"])
def test_system_column_reaches_a_messages_prompt(layout):
    """A "system" column is the system turn of every prompt layout, as the SFT reader's messages rows take it (a row
    whose prompt has its own system turn keeps that one): it was dropped without a word for a messages prompt."""
    user = {"role": "user", "content": "2+2?"}
    if layout == "conversational":
        row, cols = {"prompt": [user], "chosen": "4", "rejected": "5"}, JSONL_COLUMNS
    else:
        row = {"chosen": [user, {"role": "assistant", "content": "4"}],
               "rejected": [user, {"role": "assistant", "content": "5"}]}
        cols = {"chosen": "chosen", "rejected": "rejected", "system": "system"}
    c, r = _row({**row, "system": "Be brief."}, cols).halves()
    for half in (c, r):
        assert half.messages[:2] == [{"role": "system", "content": "Be brief."}, user]
    own = {"role": "system", "content": "Mine."}
    if layout == "conversational":
        row = {**row, "prompt": [own, user]}
    else:
        row = {k: [own, *v] for k, v in row.items()}
    c, _ = _row({**row, "system": "Be brief."}, cols).halves()
    assert c.messages[:2] == [own, user]


@pytest.mark.parametrize("text", ["[1] Paris, as the atlas says.", "[Paris](https://en.wikipedia.org/wiki/Paris)",
                                  "[2, 3] are the roots."])
def test_a_text_that_starts_with_a_bracket_is_text(text):
    """A response or prompt text that starts with "[" (a citation, a markdown link, a list in prose) is text: it was
    taken for a JSON-encoded message list and the pair refused as malformed_json. A string that is one (a list of
    message objects, as a table may store it) is still read as messages, and a broken one still refused."""
    c, r = _row({"prompt": "[Geography] Capital of France?", "chosen": text, "rejected": "Lyon."}).halves()
    assert (c.messages[-1]["content"], r.messages[-1]["content"]) == (text, "Lyon.")
    assert c.messages[0]["content"][-1]["text"] == "[Geography] Capital of France?"
    encoded = json.dumps([{"role": "assistant", "content": text}])
    assert _row({"prompt": "q", "chosen": encoded, "rejected": "Lyon."}).chosen == text
    with pytest.raises(BadRecordError) as e:
        _row({"prompt": "q", "chosen": encoded[:-2], "rejected": "Lyon."})
    assert e.value.category == "malformed_json"
