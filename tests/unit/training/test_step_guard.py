"""Non-finite loss / gradient norm guard (`training.step_guard`) at the optimizer-step call sites of
the SFT step and the GRPO update: a non-finite step is skipped (weights untouched), counted
(`skipped_steps`, logged as train/skipped_steps); N in a row stop the run with `NonFiniteStepError`
before any checkpoint holds a non-finite weight; the config key is validated."""
from __future__ import annotations

import copy
import math
from types import SimpleNamespace as NS

import pytest
import torch

from megatron_vlm.config.loader import ConfigError, from_dict
from megatron_vlm.config.sections import TrainConfig
from megatron_vlm.training.loop import run_loop
from megatron_vlm.training.optim import OptimState
from megatron_vlm.training.sft import SFTStep
from megatron_vlm.training.step_guard import NonFiniteStepError, StepGuard
from tests.unit.rl.test_review_grpo_update import TinyPolicy, _logp, _samples, _step
from tests.unit.training.test_review_sft_step import ListLoader, NeverStop, NoCheckpoints, Recorder, TinyLM, _pack


class PoisonLM(TinyLM):
    """TinyLM whose log-probs are NaN for packs marked "poison"."""

    def forward(self, batch):
        out = super().forward(batch)
        return out * float("nan") if batch.get("poison") else out


class SavingCheckpointer(NoCheckpoints):
    """Saves (a copy of the weights) after every step."""
    enabled = True

    def __init__(self, model):
        self.model, self.saved = model, []

    def periodic_due(self, step):
        return True

    def save(self, step, data_state):
        self.saved.append((step, copy.deepcopy(self.model.state_dict())))


def _sft(tmp_path, model, packs, steps, max_consecutive, checkpointer=None):
    cfg = NS(train=NS(micro_batches_per_step=1, log_every=1, max_grad_norm=1.0, eval_every=0,
                      max_consecutive_skipped_steps=max_consecutive))
    ctx = NS(cfg=cfg, env=NS(device=torch.device("cpu"), world_size=1, rank=0, is_main=True), run_dir=tmp_path,
             stop=NeverStop(), device=torch.device("cpu"), to_device=lambda b: b)
    bundle = NS(model=model, wrapper=model, dims=NS(dp_size=1), trainable_params=list(model.parameters()), moe_balancer=None, pipeline=None)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    updates = []
    opt.register_step_pre_hook(lambda o, a, k: updates.append(1))
    optim = OptimState(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    metrics = Recorder()
    step = SFTStep(ctx, bundle, optim, metrics, ListLoader(packs), total_steps=steps, evaluate=lambda s: {})
    code = run_loop(ctx, step, total_steps=steps, checkpointer=checkpointer or NoCheckpoints(), metrics=metrics, log_every=1)
    return NS(code=code, metrics=metrics, updates=len(updates))


def _finite(model_or_sd) -> bool:
    sd = model_or_sd if isinstance(model_or_sd, dict) else model_or_sd.state_dict()
    return all(bool(torch.isfinite(t).all()) for t in sd.values())


def test_sft_skips_a_non_finite_step_and_counts_it(tmp_path):
    g = torch.Generator().manual_seed(0)
    packs = [_pack(g, 8, 5) for _ in range(4)]
    packs[1]["poison"] = True
    model = PoisonLM()
    job = _sft(tmp_path, model, packs, steps=4, max_consecutive=2)
    assert job.code == 0 and job.updates == 3  # step 2's update was skipped
    rows = [m for split, _, m in job.metrics.rows if split == "train"]
    assert [r["skipped_steps"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert math.isnan(rows[1]["loss"]) and math.isfinite(rows[2]["loss"])
    assert _finite(model)


def test_sft_consecutive_non_finite_steps_stop_before_a_bad_checkpoint(tmp_path):
    g = torch.Generator().manual_seed(1)
    packs = [_pack(g, 8, 5) for _ in range(5)]
    for p in packs[1:]:
        p["poison"] = True
    model = PoisonLM()
    ckpt = SavingCheckpointer(model)
    with pytest.raises(NonFiniteStepError, match=r"2 optimizer steps in a row .*max_consecutive_skipped_steps = 2"):
        _sft(tmp_path, model, packs, steps=5, max_consecutive=2, checkpointer=ckpt)
    assert [s for s, _ in ckpt.saved] == [1, 2]  # step 3 raised before its checkpoint
    assert all(_finite(sd) for _, sd in ckpt.saved) and _finite(model)


def test_grpo_update_skips_non_finite_updates():
    g = torch.Generator().manual_seed(2)
    policy = TinyPolicy()
    samples = _samples(g, 4)
    with torch.no_grad():
        for s in samples:
            s.old_logp = _logp(policy, s)
    samples[0].advantage = float("inf")
    before = copy.deepcopy(policy.state_dict())
    grpo = _step(policy, lambda s: 1.0, mini_batches=1)
    grpo.policy.guard.max_consecutive = 2
    upd = grpo.policy.update(0, samples, samples[0])
    assert grpo.policy.guard.skipped == 1 and not math.isfinite(upd.grad_norms[0])
    for k, v in policy.state_dict().items():
        torch.testing.assert_close(v, before[k])  # untouched
    with pytest.raises(NonFiniteStepError):
        grpo.policy.update(1, samples, samples[0])


def test_guard_resets_on_a_finite_step_and_zero_never_stops():
    guard = StepGuard(2, torch.device("cpu"))
    assert not guard.allow(float("nan"), 1.0, step=1)
    assert guard.allow(1.0, 1.0, step=2)
    assert not guard.allow(1.0, torch.tensor(float("inf")), step=3)
    assert guard.skipped == 2 and guard.consecutive == 1
    never = StepGuard(0, torch.device("cpu"))
    assert not any(never.allow(float("nan"), 0.0, step=i) for i in range(10))


def test_config_key_validated():
    assert from_dict(TrainConfig, {"max_steps": 1}, "train").max_consecutive_skipped_steps == 5
    with pytest.raises(ConfigError, match="train.max_consecutive_skipped_steps"):
        from_dict(TrainConfig, {"max_steps": 1, "max_consecutive_skipped_steps": -1}, "train")
