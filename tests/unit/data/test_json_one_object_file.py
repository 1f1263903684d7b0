"""A .json data file holding one pretty-printed JSON object (neither JSON lines nor an array) is read as the same
object written on one line is: one row when named directly, and in a folder or glob data when it has a column the
dataset reads, else skipped as not data and counted once. It used to be read as JSON lines: one bad record per
line of the file (and, in a folder, a record skipped as not data)."""
from __future__ import annotations

import json
import logging
import os

from megatron_vlm.data.bad_records import BadRecordLog
from megatron_vlm.data.config import DataConfig
from megatron_vlm.data.sources import open_split
from megatron_vlm.rl.prompts.dataset import load_prompt_dataset


def _msg(q, a):
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}


def test_a_pretty_printed_record_named_directly_is_one_row(tmp_path):
    path = tmp_path / "one.json"
    path.write_text(json.dumps(_msg("q1", "a1"), indent=2) + "\n")
    log = BadRecordLog()
    src = open_split(DataConfig(train_path=str(path)), "train", log)
    assert not log.entries
    assert len(src) == 1 and src.get(0).messages[-1]["content"] == "a1"
    assert src.locate(0) == (str(path), 1)


def test_a_pretty_printed_object_without_the_columns_is_one_bad_record_as_on_one_line(tmp_path):
    counts = []
    for name, text in (("line.json", json.dumps({"version": 2, "splits": ["train"]})),
                       ("pretty.json", json.dumps({"version": 2, "splits": ["train"]}, indent=2))):
        (tmp_path / name).write_text(text + "\n")
        log = BadRecordLog()
        try:
            open_split(DataConfig(train_path=str(tmp_path / name)), "train", log)
        except Exception as e:  # noqa: BLE001 -- the same outcome for both spellings is what is checked
            counts.append(type(e).__name__)
            continue
        counts.append(len(log.to_dict()["records"]))
    assert counts == [1, 1], counts


def test_a_folder_reads_a_pretty_printed_record_and_skips_other_objects_once(tmp_path, caplog):
    root = tmp_path / "data"
    root.mkdir()
    (root / "a.json").write_text(json.dumps(_msg("q1", "a1"), indent=2))
    (root / "b.jsonl").write_text(json.dumps(_msg("q2", "a2")) + "\n")
    (root / "info.json").write_text(json.dumps({"version": 2, "description": "my set"}, indent=2))
    log = BadRecordLog()
    with caplog.at_level(logging.INFO, logger="megatron_vlm"):
        src = open_split(DataConfig(train_path=str(root)), "train", log)
    assert [os.path.relpath(f, root) for f in src.files] == ["a.json", "b.jsonl"]
    assert [src.get(i).messages[-1]["content"] for i in range(len(src))] == ["a1", "a2"]
    assert not log.entries
    skipped = [r.getMessage() for r in caplog.records if "skipped as not data" in r.getMessage()]
    assert len(skipped) == 1 and "1 .json files skipped as not data: info.json" in skipped[0], skipped


def test_grpo_reads_a_pretty_printed_prompt_record(tmp_path):
    (tmp_path / "p.json").write_text(json.dumps({"problem": "p1", "answer": "1"}, indent=2))
    assert [s.answer for s in load_prompt_dataset(tmp_path / "p.json", columns={"prompt": "problem", "answer": "answer"}).samples] == ["1"]
