"""`data.columns` with a `messages` column of ordinary role / content turns: the `image` (one per row) and `system`
columns the mapping names are used, as they are for the prompt / answer and conversations layouts (they were
ignored: the row trained without its image, or was dropped as a mismatch, and without its system turn)."""
from __future__ import annotations

from pathlib import Path

import pytest

from megatron_vlm.data.bad_records import BadRecordError
from megatron_vlm.data.hf_source import record_from_columns

TURNS = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
         {"role": "assistant", "content": "A cat."}]


def _record(tmp_path: Path, row: dict, columns: dict):
    return record_from_columns(row, columns, root=tmp_path, source="d.parquet", index=0)


def test_the_image_column_fills_the_image_item(tmp_path):
    rec = _record(tmp_path, {"msgs": TURNS, "img": "cat.png"}, {"messages": "msgs", "image": "img"})
    (item,) = [it for m in rec.messages if not isinstance(m["content"], str) for it in m["content"] if it["type"] == "image"]
    assert Path(str(item["image"])).name == "cat.png"


def test_the_system_column_becomes_the_system_turn_unless_the_row_has_one(tmp_path):
    rec = _record(tmp_path, {"msgs": TURNS[1:], "sys": "Be brief."}, {"messages": "msgs", "system": "sys"})
    assert rec.messages[0] == {"role": "system", "content": "Be brief."}
    own = [{"role": "system", "content": "Own."}, *TURNS[1:]]
    rec = _record(tmp_path, {"msgs": own, "sys": "Be brief."}, {"messages": "msgs", "system": "sys"})
    assert [m for m in rec.messages if m["role"] == "system"] == [{"role": "system", "content": "Own."}]


def test_an_image_without_an_item_is_still_a_mismatch(tmp_path):
    with pytest.raises(BadRecordError) as e:
        _record(tmp_path, {"msgs": TURNS[1:], "img": "cat.png"}, {"messages": "msgs", "image": "img"})
    assert e.value.category == "placeholder_mismatch"


def test_image_markers_in_text_messages_take_the_image_column(tmp_path):
    """ms-swift's layout in a table: text contents with "<image>" markers and an images column."""
    turns = [{"role": "user", "content": "<image>What is it?"}, {"role": "assistant", "content": "A cat."}]
    rec = _record(tmp_path, {"msgs": turns, "imgs": ["cat.png"]}, {"messages": "msgs", "images": "imgs"})
    user = rec.messages[0]["content"]
    assert [it["type"] for it in user] == ["image", "text"] and Path(str(user[0]["image"])).name == "cat.png"
    assert user[1]["text"] == "What is it?"
    with pytest.raises(BadRecordError) as e:
        _record(tmp_path, {"msgs": turns, "imgs": ["cat.png", "dog.png"]}, {"messages": "msgs", "images": "imgs"})
    assert e.value.category == "placeholder_mismatch"
