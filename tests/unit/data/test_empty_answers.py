"""An empty assistant answer is a counted bad record, never a trained sample (data/processing.py).

Found by running jobs: records whose assistant turn was "" or whitespace trained silently (their only
label the end-of-turn token), and a file of nothing but such records ran to the end, "learning" to
answer nothing. Now: skipped and counted as "invalid_record" at planning time, a split of only such
records is a config error before training, and an empty reference answer is refused for generation
(held-out answer accuracy) the same way.
"""
from __future__ import annotations

import json

import pytest

from megatron_vlm.data.config import DataConfig
from megatron_vlm.data.loader import build_eval_dataloader, build_sft_dataloader
from megatron_vlm.errors import ConfigError


def _rec(*answers: str) -> str:
    msgs = []
    for i, a in enumerate(answers):
        msgs += [{"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": a}]
    return json.dumps({"messages": msgs}) + "\n"


def _write(tmp_path, lines: list[str]):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(lines))
    return path


def test_empty_answers_are_skipped_and_counted(tmp_path, proc):
    path = _write(tmp_path, [_rec("red"), _rec(""), _rec(" \n\t"), _rec("", "blue"), _rec("green", "blue")])
    cfg = DataConfig(type="messages_jsonl", train_path=str(path), num_workers=0, max_tokens_per_pack=256, shuffle=False)
    loader = build_sft_dataloader(cfg, proc, seed=0, dp_rank=0, dp_size=1)
    assert [(b.index, b.category) for b in loader.bad_records.entries] == [(2, "invalid_record"), (3, "invalid_record"),
                                                                            (4, "invalid_record")]
    assert all("empty assistant answer" in b.detail for b in loader.bad_records.entries)
    assert loader.bad_records.entries[2].detail.startswith("messages[1]: ")
    it = iter(loader)
    trained = sum(int(next(it)["num_samples"]) for _ in range(loader.packs_per_epoch))
    assert trained == 2  # lines 1 and 5


def test_a_split_of_only_empty_answers_is_a_config_error(tmp_path, proc):
    path = _write(tmp_path, [_rec(""), _rec("  ")])
    cfg = DataConfig(type="messages_jsonl", train_path=str(path), num_workers=0, max_tokens_per_pack=256)
    with pytest.raises(ConfigError, match=r"^data\.train: no usable samples .*invalid_record.*empty assistant answer"):
        build_sft_dataloader(cfg, proc, seed=0, dp_rank=0, dp_size=1)


def test_an_empty_reference_answer_is_refused_for_generation(tmp_path, proc):
    path = _write(tmp_path, [_rec("red"), _rec("  ")])
    cfg = DataConfig(type="messages_jsonl", train_path=str(path), eval_path=str(path), num_workers=0,
                     max_tokens_per_pack=256)
    loader = build_eval_dataloader(cfg, proc, dp_rank=0, dp_size=1, mode="generation", batch_size=4)
    (batch,) = list(loader)
    assert batch["answers"] == ["red"] and batch["sample_valid"].tolist() == [True]
    assert [(b.index, b.category) for b in loader.bad_records.entries] == [(2, "invalid_record")]
    assert "reference answer" in loader.bad_records.entries[0].detail
