"""SFT and GRPO read `[data]` files through one reader (megatron_vlm.data.table_rows): a nested tree
of parquet, arrow and jsonl files (written here with `datasets`, nothing downloaded) gives the same
rows in the same order to both, GRPO reads .arrow files and searches folders recursively, and a bad
row is skipped and counted under the same file, line / row and category by both paths."""
from __future__ import annotations

import json

import datasets
import pytest

from megatron_vlm.data.bad_records import BadRecordLog
from megatron_vlm.data.config import DataConfig
from megatron_vlm.data.data_files import MESSAGES_SUFFIXES
from megatron_vlm.data.loader import build_sft_dataloader
from megatron_vlm.data.messages import read_messages_jsonl
from megatron_vlm.data.sources import open_split
from megatron_vlm.data.table_rows import TableRows
from megatron_vlm.rl.prompts.dataset import load_prompt_dataset

COLUMNS = {"prompt": "problem", "answer": "answer", "images": "images"}
FEATURES = datasets.Features({"problem": datasets.Value("string"), "answer": datasets.Value("string"),
                              "images": datasets.List(datasets.Image())})


@pytest.fixture
def tree(tmp_path, write_image):
    """root/a/b/ (a `save_to_disk` folder: .arrow + .json side files), root/a/train.parquet with a row
    whose answer is missing (row 1), root/c.jsonl with a malformed line (3) and a missing image (4)."""
    root = tmp_path / "data"
    png = [write_image(tmp_path / f"p{k}.png", colour=(40 * k, 0, 0)).read_bytes() for k in range(4)]
    datasets.Dataset.from_dict({"problem": ["<image>Find a.", "<image>Find b."], "answer": ["1", "2"],
                                "images": [[{"bytes": png[0], "path": None}], [{"bytes": png[1], "path": None}]]},
                               features=FEATURES).save_to_disk(str(root / "a" / "b"))
    datasets.Dataset.from_dict({"problem": ["<image>Find c.", "<image>Find d.", "<image>Find e."],
                                "answer": ["3", None, "5"],
                                "images": [[{"bytes": png[2], "path": None}], [{"bytes": png[3], "path": None}],
                                           [{"bytes": png[3], "path": None}]]},
                               features=FEATURES).to_parquet(str(root / "a" / "train.parquet"))
    write_image(root / "img" / "f.png")
    lines = [json.dumps({"problem": "<image>Find f.", "answer": "6", "images": ["img/f.png"]}),
             "",
             "{not json",
             json.dumps({"problem": "<image>Find g.", "answer": "7", "images": ["img/missing.png"]}),
             json.dumps({"problem": "Find h.", "answer": "8", "images": []})]
    (root / "c.jsonl").write_text("\n".join(lines) + "\n")
    return root


def _image_data(ref):
    return ref["bytes"] if isinstance(ref, dict) else ref


def test_sft_and_grpo_read_the_same_rows_in_the_same_order(tree):
    arrow = str(next((tree / "a" / "b").glob("*.arrow")))
    parquet, jsonl = str(tree / "a" / "train.parquet"), str(tree / "c.jsonl")
    rows = TableRows(tree)
    assert [str(f) for f in rows.files] == [arrow, parquet, jsonl]  # recursive, sorted, .json side files ignored
    expected = [(arrow, 0), (arrow, 1), (parquet, 0), (parquet, 1), (parquet, 2), (jsonl, 1), (jsonl, 4), (jsonl, 5)]
    assert [rows.locate(i) for i in range(len(rows))] == expected

    src = open_split(DataConfig(type="hf", train_path=str(tree), columns=COLUMNS), "train")
    assert [src.locate(i) for i in range(len(src))] == expected
    sft = []
    for i in range(len(src)):
        if i == 3:  # the parquet row without an answer
            continue
        r = src.get(i)
        sft.append((r.source, r.index, r.meta["answer"], [_image_data(im) for im in r.images()]))

    grpo = load_prompt_dataset(tree, columns=COLUMNS)
    assert grpo.schema == "geometry3k"
    got = [(s.source, s.index, s.answer, s.images()) for s in grpo.samples]
    missing = (jsonl, 4, "7", [str(tree / "img" / "missing.png")])  # GRPO checks image files when reading
    assert got == [x for x in sft if x != missing]
    assert [(s, i) for s, i, _, _ in sft] == [e for e in expected if e != (parquet, 1)]
    assert [a for _, _, a, _ in sft] == ["1", "2", "3", "5", "6", "7", "8"]


def test_a_bad_row_is_skipped_and_counted_identically(tree, proc):
    cfg = DataConfig(type="hf", train_path=str(tree), columns=COLUMNS, num_workers=0)
    sft = build_sft_dataloader(cfg, proc, seed=0, dp_rank=0, dp_size=1).bad_records
    grpo = load_prompt_dataset(tree, columns=COLUMNS).bad_records
    where = lambda log: sorted((b.source, b.index, b.category) for b in log.entries)  # noqa: E731
    assert where(sft) == where(grpo) == sorted([
        (str(tree / "a" / "train.parquet"), 1, "invalid_record"),
        (str(tree / "c.jsonl"), 3, "malformed_json"),
        (str(tree / "c.jsonl"), 4, "missing_image"),
    ])
    assert sft.to_dict()["by_category"] == grpo.to_dict()["by_category"]


def test_grpo_reads_arrow_files_in_nested_folders(tree):
    out = load_prompt_dataset(tree / "a", columns=COLUMNS)
    assert [s.answer for s in out.samples] == ["1", "2", "3", "5"]
    assert [pid for pid, _ in out.skipped] == ["train.parquet:1"]
    assert out[0].prompt_id == "b/data-00000-of-00001.arrow:0"
    one = load_prompt_dataset(next((tree / "a" / "b").glob("*.arrow")), columns=COLUMNS)
    assert [s.answer for s in one.samples] == ["1", "2"]


def test_messages_jsonl_folder_same_records_for_sft_and_grpo(tmp_path):
    msg = lambda q, a: json.dumps({"messages": [{"role": "user", "content": q},  # noqa: E731
                                                {"role": "assistant", "content": a}]})
    (tmp_path / "x" / "y").mkdir(parents=True)
    (tmp_path / "x" / "y" / "b.jsonl").write_text(msg("q1", "a1") + "\n[1]\n" + msg("q2", "a2") + "\n")
    (tmp_path / "x" / "a.jsonl").write_text("\n" + msg("q3", "a3") + "\n")
    (tmp_path / "x" / "notes.parquet").write_bytes(b"not read for messages_jsonl")
    log = BadRecordLog()
    sft = read_messages_jsonl(tmp_path / "x", bad_records=log)
    grpo = load_prompt_dataset(tmp_path / "x", schema="messages", suffixes=MESSAGES_SUFFIXES)
    a, b = str(tmp_path / "x" / "a.jsonl"), str(tmp_path / "x" / "y" / "b.jsonl")
    assert [(r.source, r.index, r.messages[-1]["content"]) for r in sft] == [(a, 2, "a3"), (b, 1, "a1"), (b, 3, "a2")]
    assert [(s.source, s.index, s.answer) for s in grpo.samples] == [(r.source, r.index, r.messages[-1]["content"]) for r in sft]
    assert [(e.source, e.index, e.category) for e in log.entries] == [(b, 2, "malformed_json")]
    assert [(e.source, e.index, e.category) for e in grpo.bad_records.entries] == [(b, 2, "malformed_json")]


def test_image_placeholder_count_is_checked_identically(tmp_path, write_image, proc):
    """A prompt whose "<image>" markers do not match its images (two markers, one image; a marker and no
    image) is a "placeholder_mismatch" in SFT as in GRPO; a prompt without markers takes its images."""
    write_image(tmp_path / "a.png")
    rows = [("<image> and <image>: which is larger?", ["a.png"]), ("<image> What colour?", []),
            ("What colour?", ["a.png"]), ("<image> What colour?", ["a.png"])]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"problem": q, "answer": "red", "images": ims}) + "\n" for q, ims in rows))
    cfg = DataConfig(type="hf", train_path=str(path), columns=COLUMNS, num_workers=0)
    sft = build_sft_dataloader(cfg, proc, seed=0, dp_rank=0, dp_size=1).bad_records
    grpo = load_prompt_dataset(path, columns=COLUMNS).bad_records
    where = lambda log: [(b.index, b.category) for b in log.entries]  # noqa: E731
    assert where(sft) == where(grpo) == [(1, "placeholder_mismatch"), (2, "placeholder_mismatch")]
    assert "2 <image> placeholders but 1 images" in sft.entries[0].detail
