"""Review tests of the SFT step (`SFTStep` run by `run_loop`) on a tiny stand-in model and loader,
against plain torch:

- the update equals one SGD step on the loss summed over every trained token of the step's
  micro-batches divided by their total count (not a mean of per-micro-batch means);
- the "lr" metric logged for step s is the learning rate the optimizer used in step s (seen by a
  torch optimizer step pre-hook), not the next step's.
"""
from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch
from torch import nn

from megatron_vlm.training.loop import run_loop
from megatron_vlm.training.optim import OptimState
from megatron_vlm.training.sft import SFTStep


class TinyLM(nn.Module):
    """Token log-probs of pre-shifted labels, the `TokenLogprobModel` contract."""

    def __init__(self, vocab: int = 11, dim: int = 6):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, batch: dict) -> torch.Tensor:
        labels = batch["labels"].reshape(-1)
        logits = self.head(self.embed(batch["input_ids"].reshape(-1)))
        sel = labels != -100
        return torch.log_softmax(logits[sel], -1).gather(-1, labels[sel][:, None]).squeeze(-1)


def _pack(g: torch.Generator, n: int, trained: int) -> dict:
    ids = torch.randint(0, 11, (1, n), generator=g)
    labels = torch.full((1, n), -100)
    labels[0, :trained] = torch.randint(0, 11, (trained,), generator=g)
    return {"input_ids": ids, "labels": labels, "num_label_tokens": torch.tensor(trained),
            "num_samples": torch.tensor(1)}


class ListLoader:
    def __init__(self, packs):
        self.packs, self.epoch = packs, 0

    def __iter__(self):
        return iter(self.packs)

    def state_dict(self):
        return {}

    def mark(self):
        """`SFTDataLoader.mark`: this stand-in saves no position (`state_dict`), so nothing to remember."""

    def rewind(self):
        """`SFTDataLoader.rewind`: nothing to put back (no position saved)."""


class Recorder:
    def __init__(self):
        self.rows = []

    def set_start(self, step):
        pass

    def log(self, split, step, metrics):
        self.rows.append((split, step, dict(metrics)))


class NoCheckpoints:
    enabled = export_at_end = False

    def periodic_due(self, step):
        return False


class NeverStop:
    def should_stop(self, device):
        return False

    def pending(self):
        return False


def _run(tmp_path: Path, model: nn.Module, packs, micro: int, steps: int, lr_lambda, pre_hook=None) -> NS:
    """Run `steps` SFT steps through the loop; the run's pieces (optimizer, metrics rows) come back."""
    cfg = NS(train=NS(micro_batches_per_step=micro, log_every=1, max_grad_norm=0.0, eval_every=0))
    ctx = NS(cfg=cfg, env=NS(device=torch.device("cpu"), world_size=1, rank=0, is_main=True), run_dir=tmp_path,
             stop=NeverStop(), device=torch.device("cpu"), to_device=lambda b: b)
    bundle = NS(model=model, wrapper=model, dims=NS(dp_size=1), trainable_params=list(model.parameters()),
                moe_balancer=None, pipeline=None)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    optim = OptimState(opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda))
    if pre_hook is not None:
        opt.register_step_pre_hook(pre_hook)
    metrics = Recorder()
    step = SFTStep(ctx, bundle, optim, metrics, ListLoader(packs), total_steps=steps, evaluate=lambda s: {})
    code = run_loop(ctx, step, total_steps=steps, checkpointer=NoCheckpoints(), metrics=metrics, log_every=1)
    return NS(code=code, optim=optim, metrics=metrics)


def test_micro_batch_loss_is_normalised_by_the_step_token_count(tmp_path):
    g = torch.Generator().manual_seed(0)
    packs = [_pack(g, 9, 7), _pack(g, 5, 1)]  # very different token counts per micro-batch
    model = TinyLM()
    ref = copy.deepcopy(model)
    job = _run(tmp_path, model, packs, micro=2, steps=1, lr_lambda=lambda s: 1.0)
    assert job.code == 0

    # plain torch: one SGD step (lr 0.5) on -sum(log p) / total trained tokens of both packs
    logp = torch.cat([ref(p) for p in packs])
    (-logp.sum() / logp.numel()).backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.5 * p.grad
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    loss = job.metrics.rows[0][2]["loss"]
    assert abs(loss - float(-logp.detach().sum() / logp.numel())) < 1e-5


def test_logged_lr_is_the_lr_used_by_that_step(tmp_path):
    g = torch.Generator().manual_seed(1)
    packs = [_pack(g, 6, 3) for _ in range(3)]
    model = TinyLM()
    used = []
    job = _run(tmp_path, model, packs, micro=1, steps=3, lr_lambda=lambda s: 0.1 * (s + 1),
               pre_hook=lambda opt, args, kwargs: used.append(opt.param_groups[0]["lr"]))
    assert job.code == 0
    logged = [m["lr"] for split, _, m in job.metrics.rows if split == "train"]
    assert len(used) == 3
    assert logged == used


class StatefulLoader(ListLoader):
    def state_dict(self):
        return {"global_packs_consumed": 4, "dp_size": 1}

    def load_state_dict(self, state):
        self.loaded = state


@pytest.mark.parametrize("kind", ["sft", "pair"])
def test_skipped_records_survive_a_kill_and_a_resume(tmp_path, kind):
    """bad_records.json is written with every checkpoint (a run killed after it keeps the summary), and a
    resumed run counts the records skipped before its checkpoint (their packs are not read again) once,
    next to the records it finds again while planning. The pair trainers (DPO, reward model) too: they kept
    neither (a resumed run's summary lost the records skipped before its checkpoint)."""
    import json

    from megatron_vlm.data.bad_records import BadRecordLog
    from megatron_vlm.training.pair_step import PairStep

    ctx = NS(cfg=NS(train=NS(micro_batches_per_step=1, max_grad_norm=0.0)),
             env=NS(device=torch.device("cpu"), world_size=1, rank=0, is_main=True), run_dir=tmp_path)
    model = TinyLM()
    bundle = NS(model=model, wrapper=model, dims=NS(dp_size=1), trainable_params=list(model.parameters()),
                moe_balancer=None, pipeline=None)

    def sft_step(log: BadRecordLog) -> SFTStep:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        optim = OptimState(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
        if kind == "pair":
            return PairStep(ctx, bundle, optim, Recorder(), StatefulLoader([]), bad_records=log)
        return SFTStep(ctx, bundle, optim, Recorder(), StatefulLoader([]), total_steps=8, bad_records=log)

    first = BadRecordLog()
    first.add("d.jsonl", 3, "missing_image", "planned")      # found while planning (again after a resume)
    first.add("d.jsonl", 9, "corrupt_image", "in a pack")    # found while a pack of steps 1-4 was processed
    state = sft_step(first).data_state(4)
    on_disk = json.loads((tmp_path / "bad_records.json").read_text())
    assert {(r["index"], r["skips"]) for r in on_disk["records"]} == {(3, 1), (9, 1)}

    again = BadRecordLog()
    again.add("d.jsonl", 3, "missing_image", "planned")
    resumed = sft_step(again)
    resumed.load_data_state(state, 4)
    resumed.finish()
    summary = json.loads((tmp_path / "bad_records.json").read_text())
    assert summary["num_skips"] == 2 and {(r["index"], r["category"]) for r in summary["records"]} == {
        (3, "missing_image"), (9, "corrupt_image")}


def test_ranks_that_read_the_same_packs_count_a_skipped_record_once(tmp_path, monkeypatch):
    """tp / cp ranks and pp stages of one data-parallel group process the same packs, so each logs the same
    skipped record; the summary counts it once per data shard, and still adds up different shards."""
    import json

    import megatron_vlm.training.bad_record_summary as summary_mod
    from megatron_vlm.data.bad_records import BadRecordLog

    def rank_log(*indices):
        log = BadRecordLog()
        for i in indices:
            log.add("d.jsonl", i, "corrupt_image", "pixels")
        return log.to_dict()["records"]

    # 4 ranks: tp = 2 inside dp = 2 (world ranks 0, 1 read shard 0; ranks 2, 3 read shard 1)
    parts = [(0, rank_log(5)), (0, rank_log(5)), (1, rank_log(5, 8)), (1, rank_log(5, 8))]
    monkeypatch.setattr(summary_mod, "all_gather_objects", lambda obj: parts)
    summary_mod.write_bad_record_summary(BadRecordLog(), tmp_path, is_main=True, dp_rank=0)
    d = json.loads((tmp_path / "bad_records.json").read_text())
    assert {(r["index"], r["skips"]) for r in d["records"]} == {(5, 2), (8, 1)} and d["num_skips"] == 3


def test_a_full_disk_while_writing_the_summary_is_logged_not_raised(tmp_path, monkeypatch, caplog):
    """SFT rewrites bad_records.json with every checkpoint, just before the save: a full disk there used to raise
    OSError out of the step's data state (a traceback) instead of reaching the checkpoint save, which reports it as
    one clear error with the previous checkpoint intact."""
    import errno
    import logging
    import os

    import megatron_vlm.training.bad_record_summary as summary_mod
    from megatron_vlm.data.bad_records import BadRecordLog

    def enospc(self, path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(BadRecordLog, "write_summary", enospc)
    records = BadRecordLog()
    records.add("d.jsonl", 3, "corrupt_image", "pixels")
    with caplog.at_level(logging.WARNING, logger="megatron_vlm"):
        summary_mod.write_bad_record_summary(records, tmp_path, is_main=True, announce=False, dp_rank=0)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "could not write" in said and "bad_records.json" in said and "disk full" in said
