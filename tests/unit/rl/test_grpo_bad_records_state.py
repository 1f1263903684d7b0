"""A GRPO checkpoint's data state keeps the prompts skipped mid-run, and a resume puts them back once.

A prompt the encoder refuses when a step draws it is found during the run, not at start-up: a
resumed run does not draw the steps before its checkpoint again, so those skips must come from the
checkpoint (the whole-job version, kill and resume: tests/integration/test_grpo_bad_records_resume.py).
Asynchronous GRPO's rollout ranks hand their skips to training rank 0 with each step's samples.
"""
from __future__ import annotations

import json
from types import SimpleNamespace

from megatron_vlm.data.bad_records import BadRecordLog
from megatron_vlm.rl.asynchronous.trainer import AsyncGRPOLoopStep
from megatron_vlm.rl.trainer import GRPOLoopStep


def _loop_step(tmp_path, log: BadRecordLog, *, is_main=True, dp_rank=0, dp_size=1) -> GRPOLoopStep:
    cfg = SimpleNamespace(train=SimpleNamespace(seed=0), rl=SimpleNamespace(batch=SimpleNamespace(prompts_per_step=2)))
    ctx = SimpleNamespace(cfg=cfg, run_dir=tmp_path, env=SimpleNamespace(is_main=is_main))
    grpo = SimpleNamespace(shards=SimpleNamespace(rank=dp_rank, world=dp_size))
    return GRPOLoopStep(ctx, list(range(8)), grpo, bad_records=log)


def _start_up_log() -> BadRecordLog:
    log = BadRecordLog()
    log.add("p.jsonl", 4, "too_long", "prompt of 300 tokens")
    return log


def _counts(log: BadRecordLog) -> dict:
    return {(r["index"], r["category"]): r["skips"] for r in log.to_dict()["records"]}


def test_checkpoint_keeps_mid_run_skips_and_a_resume_counts_start_up_ones_once(tmp_path):
    log = _start_up_log()
    log.add("p.jsonl", 2, "corrupt_image", "truncated")
    log.add("p.jsonl", 2, "corrupt_image", "truncated")  # drawn by two steps
    state = _loop_step(tmp_path, log).data_state(2)
    assert state["next_step"] == 2 and state["dp_size"] == 1
    # the summary is rewritten with the checkpoint: a run killed later still has it
    written = json.loads((tmp_path / "bad_records.json").read_text())
    assert written["num_skips"] == 3

    resumed_log = _start_up_log()  # the resumed process finds the too-long prompt again at start-up
    _loop_step(tmp_path, resumed_log).load_data_state(state, 2)
    assert _counts(resumed_log) == {(2, "corrupt_image"): 2, (4, "too_long"): 1}


def test_checkpoint_of_another_data_parallel_size_is_restored_by_rank_0_only(tmp_path):
    log = BadRecordLog()
    log.add("p.jsonl", 2, "corrupt_image", "truncated")
    state = _loop_step(tmp_path, log).data_state(2)  # written with one data shard
    other = BadRecordLog()
    _loop_step(tmp_path, other, is_main=False, dp_rank=1, dp_size=2).load_data_state(state, 2)
    assert len(other) == 0  # a rank reading rank 0's file must not count rank 0's records again
    main = BadRecordLog()
    _loop_step(tmp_path, main, dp_size=2).load_data_state(state, 2)
    assert _counts(main) == {(2, "corrupt_image"): 1}


def test_take_hands_over_the_records_and_empties_the_log():
    log = BadRecordLog()
    log.add("p.jsonl", 2, "corrupt_image", "truncated")
    log.add("p.jsonl", 2, "corrupt_image", "truncated")
    taken = log.take()
    assert [(r["index"], r["skips"]) for r in taken] == [(2, 2)]
    assert len(log) == 0 and log.total_skips == 0 and log.take() == []
    into = BadRecordLog()
    into.extend(taken)
    assert _counts(into) == {(2, "corrupt_image"): 2}


class _Bridge:
    """Training rank 0's end of the bridge: one rollout rank answering every "want" with its payload."""

    def __init__(self, payloads: dict):
        self.payloads = payloads
        self.asked: list[int] = []

    def broadcast_object(self, msg):
        self.asked.append(msg["step"])

    def recv_object(self, src):  # noqa: ARG002
        return self.payloads[self.asked[-1]]


def test_async_trainer_keeps_the_skips_of_the_step_it_receives():
    skip = {"source": "p.jsonl", "index": 2, "category": "corrupt_image", "detail": "truncated", "skips": 1}
    t = AsyncGRPOLoopStep.__new__(AsyncGRPOLoopStep)
    t.bridge = _Bridge({3: {"step": 3, "bad_records": [skip]}, 4: {"step": 4, "bad_records": [skip]}})
    t.role = SimpleNamespace(allocation=SimpleNamespace(rollout=1, train=1))
    t.total_steps, t._prefetch, t.bad_records = 5, None, BadRecordLog()
    t._receive(3)
    assert _counts(t.bad_records) == {(2, "corrupt_image"): 1}  # step 4's, asked for ahead, not yet
    t._receive(4)
    assert _counts(t.bad_records) == {(2, "corrupt_image"): 2}
