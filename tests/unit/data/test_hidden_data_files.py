"""A folder given as a data path is searched as Hugging Face `datasets` searches a data folder: hidden files and
folders (".ipynb_checkpoints/train-checkpoint.jsonl", Jupyter's autosaved copies; ".train.jsonl") and "__" folders
("__pycache__") are not data. They were read, so a folder where a notebook had opened the training file trained on
every record twice (the copy, possibly stale, beside the file), with no word about it."""
from __future__ import annotations

import json

from datasets.data_files import resolve_pattern

from megatron_vlm.data.data_files import find_data_files
from megatron_vlm.data.messages import read_messages_jsonl


def _folder(tmp_path):
    row = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}) + "\n"
    for rel in ("train.jsonl", "sub/more.jsonl", ".ipynb_checkpoints/train-checkpoint.jsonl", ".train.jsonl",
                "sub/.cache/x.jsonl", "__pycache__/y.jsonl"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(row)
    return tmp_path


def test_folder_search_leaves_out_what_datasets_leaves_out(tmp_path):
    folder = _folder(tmp_path)
    reference = sorted(resolve_pattern("**", base_path=str(folder), allowed_extensions=[".jsonl"]))
    assert reference == [str(folder / "sub/more.jsonl"), str(folder / "train.jsonl")]
    assert sorted(str(f) for f in find_data_files(folder, (".jsonl", ".json"))) == reference
    assert len(read_messages_jsonl(folder)) == 2


def test_a_hidden_file_named_directly_is_read(tmp_path):
    folder = _folder(tmp_path)
    assert find_data_files(folder / ".train.jsonl") == [folder / ".train.jsonl"]
