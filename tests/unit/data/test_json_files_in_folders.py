""".json data files are read from a folder or a glob in `data.train_path`, and dataset metadata .json files are not.

A folder or glob took .jsonl (and .parquet / .arrow for type "hf") only: LLaVA / ShareGPT .json files in a folder
were left out silently (or "no data files" when they were all there was), though one named directly was read. Now
a .json file there is data when it holds one JSON array or JSON lines, decided by its content as for a file named
directly; the .json files next to data that are not data are skipped and counted in one log line: what
`save_to_disk` writes (dataset_info.json, state.json, dataset_dict.json, the last one a one-line object) and any
other file of one pretty-printed object (a model's config.json). A resume checks the .json files' content too.
"""
from __future__ import annotations

import json
import logging
import os
import shutil

import datasets
import pytest

from megatron_vlm.data.bad_records import BadRecordLog
from megatron_vlm.data.config import DataConfig
from megatron_vlm.data.data_files import HF_SUFFIXES, MESSAGES_SUFFIXES, find_data_files
from megatron_vlm.data.loader import build_sft_dataloader
from megatron_vlm.data.sources import open_split
from megatron_vlm.errors import ConfigError
from megatron_vlm.rl.prompts.dataset import load_prompt_dataset
from megatron_vlm.training.sft import SFTStep


def _msg(q, a):
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}


def _llava(q, a):
    return {"id": q, "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}


@pytest.fixture
def folder(tmp_path):
    """root/a/llava.json (a pretty-printed array), root/b.jsonl, root/c.json (JSON lines in a .json), a model's
    config.json, and a DatasetDict saved with `save_to_disk` (root/hf: dataset_dict.json, <split>/state.json,
    <split>/dataset_info.json, <split>/*.arrow)."""
    root = tmp_path / "data"
    (root / "a").mkdir(parents=True)
    (root / "a" / "llava.json").write_text(json.dumps([_llava("q1", "a1"), _llava("q2", "a2")], indent=2))
    (root / "b.jsonl").write_text(json.dumps(_msg("q3", "a3")) + "\n")
    (root / "c.json").write_text(json.dumps(_msg("q4", "a4")) + "\n" + json.dumps(_msg("q5", "a5")) + "\n")
    (root / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 8}, indent=2))
    ds = datasets.Dataset.from_dict({"problem": ["p"], "answer": ["1"]})
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(root / "hf"))
    return root


def _answers(src):
    return [(os.path.relpath(src.locate(i)[0], src.name if os.path.isdir(src.name) else "."), src.locate(i)[1],
             src.get(i).messages[-1]["content"]) for i in range(len(src))]


def test_a_folder_reads_json_array_and_json_lines_files_and_skips_metadata(folder, caplog):
    assert (folder / "hf" / "dataset_dict.json").read_text().count("\n") == 0  # one line: looks like JSON lines
    log = BadRecordLog()
    with caplog.at_level(logging.INFO, logger="megatron_vlm"):
        src = open_split(DataConfig(train_path=str(folder)), "train", log)
    assert _answers(src) == [("a/llava.json", 0, "a1"), ("a/llava.json", 1, "a2"), ("b.jsonl", 1, "a3"),
                             ("c.json", 1, "a4"), ("c.json", 2, "a5")]
    assert not log.entries  # no metadata file was read as records
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 1 and "6 .json files" in skipped[0], skipped
    for name in ("config.json", "dataset_dict.json", "dataset_info.json", "state.json"):
        assert name in skipped[0]

    # The same files, whatever the order the file system lists them in: sorted by their full path.
    assert find_data_files(folder, MESSAGES_SUFFIXES) == sorted(find_data_files(folder, MESSAGES_SUFFIXES))
    glob = open_split(DataConfig(train_path=str(folder / "**" / "*.json")), "train")
    assert [(os.path.relpath(f, folder)) for f in glob.files] == ["a/llava.json", "c.json"]
    assert [glob.get(i).messages[-1]["content"] for i in range(len(glob))] == ["a1", "a2", "a4", "a5"]


def test_hf_folders_take_json_files_and_grpo_reads_the_same(folder):
    shutil.rmtree(folder / "a")
    for f in ("b.jsonl", "c.json"):
        (folder / f).unlink()
    (folder / "more.json").write_text(json.dumps([{"problem": "p2", "answer": "2"}, {"problem": "p3", "answer": "3"}]))
    files = find_data_files(folder, HF_SUFFIXES)
    assert [os.path.relpath(f, folder) for f in files] == [
        "hf/test/data-00000-of-00001.arrow", "hf/train/data-00000-of-00001.arrow", "more.json"]
    columns = {"prompt": "problem", "answer": "answer"}
    src = open_split(DataConfig(type="hf", train_path=str(folder), columns=columns), "train")
    assert [src.get(i).meta["answer"] for i in range(len(src))] == ["1", "1", "2", "3"]
    grpo = load_prompt_dataset(folder, columns=columns)
    assert [s.answer for s in grpo.samples] == ["1", "1", "2", "3"]
    assert not grpo.bad_records.entries


def test_a_folder_of_metadata_only_is_a_config_error_naming_what_was_skipped(folder):
    with pytest.raises(ConfigError) as e:
        open_split(DataConfig(train_path=str(folder / "hf")), "train")
    msg = str(e.value)
    assert msg.startswith("data.train_path: no .jsonl / .json data files at") and "5 .json files skipped" in msg, msg


def test_a_resume_checks_the_json_files_of_a_folder(folder, proc):
    cfg = DataConfig(train_path=str(folder), max_tokens_per_pack=256, num_workers=0)
    state = {**build_sft_dataloader(cfg, proc, seed=0, dp_rank=0, dp_size=1).state_dict(), "global_packs_consumed": 1}
    assert [os.path.relpath(f["file"], folder.resolve()) for f in state["data_files"]["files"]] == [
        "a/llava.json", "b.jsonl", "c.json"]
    (folder / "hf" / "train" / "state.json").write_text("{}")  # metadata is not data: the resume is unaffected
    build_sft_dataloader(cfg, proc, seed=0, dp_rank=0, dp_size=1).load_state_dict(state)

    arr = folder / "a" / "llava.json"
    st = arr.stat()
    arr.write_text(json.dumps([_llava("q1", "b1"), _llava("q2", "b2")], indent=2))  # same size, other answers
    assert arr.stat().st_size == st.st_size
    os.utime(arr, ns=(st.st_atime_ns, st.st_mtime_ns))
    step = SFTStep.__new__(SFTStep)
    step.loader = build_sft_dataloader(cfg, proc, seed=0, dp_rank=0, dp_size=1)
    with pytest.raises(ConfigError, match=f"{arr.resolve()} is not the file the checkpoint was written reading"):
        step.load_data_state(state, 1)


def test_the_skipped_files_are_logged_once_per_process_and_by_rank_0_only(folder, tmp_path, caplog, monkeypatch):
    """The eval benchmarks list their files twice (checked before the model is built, then read), and every rank
    lists them: the line used to repeat on every call of every rank."""
    def lines():
        return [r.getMessage() for r in caplog.records if "skipped as not data" in r.getMessage()]

    monkeypatch.delenv("RANK", raising=False)
    with caplog.at_level(logging.INFO, logger="megatron_vlm"):
        for _ in range(3):
            find_data_files(folder, MESSAGES_SUFFIXES)
    assert len(lines()) == 1, lines()
    other = tmp_path / "other"
    shutil.copytree(folder / "hf", other / "hf")
    (other / "d.jsonl").write_text(json.dumps(_msg("q", "a")) + "\n")
    caplog.clear()
    monkeypatch.setenv("RANK", "1")  # torchrun's rank of this process: rank 0 says it for the same folder
    with caplog.at_level(logging.INFO, logger="megatron_vlm"):
        find_data_files(other, MESSAGES_SUFFIXES)
    assert lines() == []
    monkeypatch.setenv("RANK", "0")
    with caplog.at_level(logging.INFO, logger="megatron_vlm"):
        find_data_files(other, MESSAGES_SUFFIXES)
        find_data_files(other / "**" / "*", MESSAGES_SUFFIXES)  # a glob: another path, its own line
    assert len(lines()) == 2 and "5 .json files skipped" in lines()[0], lines()


def test_finding_a_one_line_array_file_in_a_folder_does_not_read_it_whole(tmp_path):
    """json.dump without indent writes a whole annotation file on one line: deciding that it is data must not read
    that line (every rank resolves the folder; the array itself is indexed by streaming)."""
    import tracemalloc

    rec = _llava("q" * 200, "a" * 800)
    path = tmp_path / "data" / "one_line.json"
    path.parent.mkdir()
    with open(path, "w") as f:
        json.dump([rec] * 4_000, f)
    size = path.stat().st_size
    tracemalloc.start()
    try:
        found = find_data_files(path.parent, MESSAGES_SUFFIXES)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert found == [path]
    assert peak < size / 8, f"finding a {size / 2**20:.1f} MiB file peaked at {peak / 2**20:.1f} MiB"
    # a JSON-lines .json file whose first row is longer than what is peeked at is still data
    long_rows = path.parent / "long_rows.json"
    long_rows.write_text(json.dumps(_msg("q" * 300_000, "a")) + "\n" + json.dumps(_msg("q", "a")) + "\n")
    assert find_data_files(path.parent, MESSAGES_SUFFIXES) == [long_rows, path]


def test_a_one_object_json_file_is_data_only_with_a_column_the_dataset_reads(tmp_path, caplog):
    """A .json file of one object on one line found in a folder used to be one row whatever its keys: an info.json
    ({"version": 2}) beside the data became a bad record of a messages split, and ended an "hf" split (its columns
    missing) or a GRPO prompt set. Now such a file (and any JSON-lines .json file) is data when its first object has
    a column the dataset reads (messages / conversations; the mapped ones of `data.columns`), like a record, and
    skipped as not data otherwise, logged once; .jsonl files are read as before (one line: one row)."""
    root = tmp_path / "data"
    root.mkdir()
    (root / "one.json").write_text(json.dumps(_msg("q1", "a1")) + "\n")  # one record on one line: data
    (root / "two.json").write_text(json.dumps(_llava("q2", "a2")))  # no newline at the end: data
    (root / "info.json").write_text(json.dumps({"version": 2, "description": "my set"}) + "\n")  # metadata
    (root / "zz.jsonl").write_text(json.dumps(_msg("q3", "a3")) + "\n")
    log = BadRecordLog()
    with caplog.at_level(logging.INFO, logger="megatron_vlm"):
        src = open_split(DataConfig(train_path=str(root)), "train", log)
    assert [os.path.relpath(f, root) for f in src.files] == ["one.json", "two.json", "zz.jsonl"]
    assert [src.get(i).messages[-1]["content"] for i in range(len(src))] == ["a1", "a2", "a3"]
    assert not log.entries
    skipped = [r for r in caplog.records if "skipped as not data" in r.getMessage()]
    assert len(skipped) == 1 and skipped[0].levelno == logging.WARNING, [r.getMessage() for r in skipped]
    assert "1 .json files skipped as not data: info.json" in skipped[0].getMessage()
    assert "messages" in skipped[0].getMessage() and "conversations" in skipped[0].getMessage()

    # a .jsonl file of one line is one row whatever it holds (a bad record here, counted)
    (root / "meta.jsonl").write_text(json.dumps({"version": 2}) + "\n")
    log = BadRecordLog()
    src = open_split(DataConfig(train_path=str(root)), "train", log)
    assert "meta.jsonl" in [os.path.relpath(f, root) for f in src.files]
    assert [e["source"] for e in log.to_dict()["records"]] == [str(root / "meta.jsonl")]


def test_hf_and_grpo_folders_skip_a_one_object_json_file_without_their_columns(tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    (root / "rows.json").write_text(json.dumps({"problem": "p1", "answer": "1"}) + "\n")
    (root / "more.jsonl").write_text(json.dumps({"problem": "p2", "answer": "2"}) + "\n")
    (root / "info.json").write_text(json.dumps({"version": 2, "splits": ["train"]}))
    columns = {"prompt": "problem", "answer": "answer"}
    src = open_split(DataConfig(type="hf", train_path=str(root), columns=columns), "train")
    assert [os.path.relpath(f, root) for f in src.rows.files] == ["more.jsonl", "rows.json"]
    assert [src.get(i).meta["answer"] for i in range(len(src))] == ["2", "1"]
    grpo = load_prompt_dataset(root, columns=columns)
    assert [s.answer for s in grpo.samples] == ["2", "1"]
    (root / "more.jsonl").unlink()
    (root / "rows.json").write_text(json.dumps({"problem": "p1", "answer": "1", "images": []}) + "\n")
    assert [s.answer for s in load_prompt_dataset(root, schema="geometry3k").samples] == ["1"]  # a layout's columns
    assert [s.answer for s in load_prompt_dataset(root).samples] == ["1"]  # detected from the files read
