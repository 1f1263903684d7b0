"""A GRPO checkpoint's data state keeps the prompts skipped mid-run, and a resume puts them back once.

A prompt the encoder refuses when a step draws it is found during the run, not at start-up: a
resumed run does not draw the steps before its checkpoint again, so those skips must come from the
checkpoint (the whole-job version, kill and resume: tests/integration/test_grpo_bad_records_resume.py).
Asynchronous GRPO's rollout ranks hand their skips to training rank 0 with each step's samples.
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from megatron_vlm.data.bad_records import BadRecordLog
from megatron_vlm.rl.asynchronous.trainer import AsyncGRPOLoopStep
from megatron_vlm.rl.trainer import GRPOLoopStep


def _loop_step(tmp_path, log: BadRecordLog, *, is_main=True, dp_rank=0, dp_size=1) -> GRPOLoopStep:
    cfg = SimpleNamespace(train=SimpleNamespace(seed=0), rl=SimpleNamespace(batch=SimpleNamespace(prompts_per_step=2)))
    ctx = SimpleNamespace(cfg=cfg, run_dir=tmp_path, env=SimpleNamespace(is_main=is_main))
    grpo = SimpleNamespace(shards=SimpleNamespace(rank=dp_rank, world=dp_size),
                           policy=SimpleNamespace(critic=None, bundle=SimpleNamespace()))  # no MoE balancer
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


def test_async_skip_count_is_that_of_the_records_in_the_checkpoint(monkeypatch):
    """`data/skipped_prompts` of an asynchronous step counts what its checkpoint's log holds: the rollout ranks' skips
    of the steps trained so far (each payload's count is its rank's total up to that step, whatever it generated
    ahead) plus those of the trainer's own encoder (held-out prompts it could not encode: in the run's log like the
    synchronous loop's, and in the synchronous count). The count used to be the rollout ranks' alone."""
    import megatron_vlm.rl.asynchronous.trainer as async_trainer

    skip = {"source": "p.jsonl", "index": 2, "category": "corrupt_image", "detail": "truncated", "skips": 1}
    t = AsyncGRPOLoopStep.__new__(AsyncGRPOLoopStep)
    t.bridge = _Bridge({0: {"step": 0, "bad_records": [skip], "skipped": 1, "reward_fail": {}, "samples": [],
                            "busy_s": 1.0, "idle_s": 0.0, "gen_s": 1.0, "reward_s": 0.0}})
    t.role = SimpleNamespace(allocation=SimpleNamespace(rollout=1, train=1))
    t.total_steps, t._prefetch, t.bad_records, t._last_end, t.k = 1, None, BadRecordLog(), 0.0, 0
    t.model, t._trainable = None, []
    t.rl = SimpleNamespace(batch=SimpleNamespace(prompts_per_step=2))
    t.train_set = list(range(4))
    from megatron_vlm.training.running_totals import RunningTotals

    t.totals = RunningTotals()
    # the held-out evaluation before step 0 (rl.eval.at_start) met a prompt the trainer's encoder refused: its log is
    # the run's, its count is what the step's metrics report for this rank's encoder (step_metrics)
    t.bad_records.add("held_out.jsonl", 5, "corrupt_image", "truncated")
    t._round = lambda step, payloads: None
    t.grpo = SimpleNamespace(train_on_rounds=lambda step, rounds, timer, extra_metrics: {"data/skipped_prompts": 1.0})
    monkeypatch.setattr(async_trainer, "push_weights", lambda *a, **k: 0.0)
    metrics = t.train_step(0, log=True)
    assert t.bad_records.total_skips == 2
    assert metrics["data/skipped_prompts"] == 2.0


def test_a_rollout_rank_running_ahead_hands_each_step_its_own_skips():
    """A rollout rank generates up to max_head_offpolicyness steps ahead of the trainer; each step's item carries the
    rank's skip count when that step was encoded (not counting later steps) and exactly that step's records."""
    import queue

    from megatron_vlm.rl.asynchronous.rollout_rank import _generate_loop, _State
    from megatron_vlm.rl.prompts.dataset import prompt_batches

    skips = BadRecordLog()

    class Encoder:
        skipped = 0

        def encode(self, i):
            if i % 2:  # odd prompts cannot be encoded
                self.skipped += 1
                skips.add("p.jsonl", i + 1, "corrupt_image", "truncated")
                return None
            return SimpleNamespace(input_ids=torch.tensor([i]))  # an encoded prompt's ids (their digest is sent)

    rl = SimpleNamespace(asynchronous=SimpleNamespace(max_head_offpolicyness=2), batch=SimpleNamespace(group_size=2,
                         prompts_per_step=4), rollout=SimpleNamespace(max_new_tokens=4, temperature=1.0, top_p=1.0,
                                                                        top_k=0, stop=[]))
    ctx = SimpleNamespace(cfg=SimpleNamespace(rl=rl, train=SimpleNamespace(seed=3)), env=SimpleNamespace(device="cpu"))
    role = SimpleNamespace(rank=0, allocation=SimpleNamespace(rollout=1))
    engine = SimpleNamespace(generate=lambda prompts, params, generator: SimpleNamespace(samples=[], seconds=0.0))
    todo: queue.Queue = queue.Queue()
    train_set = list(range(16))
    _generate_loop(ctx, role, _State(0), engine, Encoder(), train_set, todo, 0, 3, None, skips)  # version 0: steps 0-2
    items = [todo.get_nowait() for _ in range(3)]
    batches = prompt_batches(len(train_set), 4, seed=3, start_step=0)
    odd = [sum(i % 2 for i in next(batches)) for _ in range(3)]
    assert [it["step"] for it in items] == [0, 1, 2]
    assert [it["skipped"] for it in items] == [sum(odd[:b + 1]) for b in range(3)]
    assert [sum(r["skips"] for r in it["bad_records"]) for it in items] == odd
