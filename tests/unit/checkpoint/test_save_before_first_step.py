"""A checkpoint saved before the optimizer's first step (PPO's policy during `rl.critic.warmup_steps`) leaves the
optimizer as it was: torch's `get_state_dict` makes the state of an optimizer that has none by a step with zero
gradients at lr 0, which counts a step, so the first real update was AdamW's second one (another bias correction)
and a run that saved a checkpoint in its warm-up trained differently from one that did not. The first update after
such a save, and after resuming from it, must be torch.optim.AdamW's first one, for fp32 and bf16 moments."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from megatron_vlm.checkpoint.manager import CheckpointManager
from megatron_vlm.training.optim import build_optimizer


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    torch.manual_seed(1)
    model(torch.randn(4, 16)).square().sum().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("moments", ["fp32", "bf16"])
def test_a_save_before_the_first_step_changes_no_update(tmp_path, moments):
    cfg = SimpleNamespace(lr=1e-2, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, moments_dtype=moments)
    reference = _model()
    _step(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0, fused=True))

    model = _model()
    untouched = copy.deepcopy(model)
    opt = build_optimizer(model, cfg, "cpu")
    CheckpointManager(tmp_path, keep_last=0, rank=0).save(1, model, opt, {})
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), untouched.parameters()))
    _step(model, opt)

    resumed = _model()
    resumed_opt = build_optimizer(resumed, cfg, "cpu")
    CheckpointManager(tmp_path, keep_last=0, rank=0).load(tmp_path / "checkpoints" / "step_1", resumed, resumed_opt)
    _step(resumed, resumed_opt)

    tol = 0 if moments == "fp32" else 2e-3 * 1e-2  # bf16 moments: within a rounding of the first update (lr-sized)
    for p, q, r in zip(model.parameters(), resumed.parameters(), reference.parameters()):
        torch.testing.assert_close(p, r, rtol=0, atol=tol)
        torch.testing.assert_close(q, r, rtol=0, atol=tol)
