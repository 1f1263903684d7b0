"""The columns of a JSON-lines or JSON array file are those of all its rows, as Hugging Face `datasets` infers a JSON
file's columns (a row without a key holds null there): a mixed file whose first record is text-only (no "images"
key) was refused whole ("columns ['images'] not in the dataset", exit 2) under `columns = {messages = ...,
images = "images"}`, although every row reads."""
from __future__ import annotations

import json

import datasets
import pytest
from PIL import Image

from megatron_vlm.data.hf_source import HFRecords
from megatron_vlm.data.table_rows import TableRows

ROWS = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]},
                      {"role": "assistant", "content": "red"}], "images": ["a.png"], "id": 7}]


def _write(folder, layout):
    Image.new("RGB", (28, 28), "red").save(folder / "a.png")
    path = folder / ("t.jsonl" if layout == "lines" else "t.json")
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS) if layout == "lines" else json.dumps(ROWS))
    return path


@pytest.mark.parametrize("layout", ["lines", "array"])
def test_columns_are_those_datasets_reads(tmp_path, layout):
    path = _write(tmp_path, layout)
    reference = datasets.Dataset.from_json(str(path), cache_dir=str(tmp_path / "cache")).column_names
    assert TableRows(path).columns(path) == reference == ["messages", "images", "id"]


@pytest.mark.parametrize("layout", ["lines", "array"])
def test_a_text_only_first_row_does_not_refuse_the_file(tmp_path, layout):
    path = _write(tmp_path, layout)
    src = HFRecords(path, {"messages": "messages", "images": "images"})
    assert [src.get(i).images() for i in range(len(src))] == [[], [str(tmp_path / "a.png")]]
