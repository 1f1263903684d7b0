"""The rollout ranks encode prompts with the trainer's generation budget.

The trainer re-encodes every prompt of a step's groups (rl/asynchronous/trainer.py `_round`) with its encoder, whose
budget is the larger of rl.rollout.max_new_tokens and rl.eval.max_new_tokens (rl/trainer.py); a prompt the rollout
rank accepted with the smaller budget but the trainer refuses stopped the run ("encoded on the rollout rank but not
here"). The up-front length filter uses the larger budget, but a prompt can still grow past it afterwards (the
environment's tools added to the system turn with [rl.env]): both sides must draw the same line."""
from __future__ import annotations

import types

from megatron_vlm.rl.asynchronous import rollout_rank as rr
from megatron_vlm.rl.asynchronous.allocation import Allocation
from megatron_vlm.rl.asynchronous.bridge import Role
from tests.unit.rl.test_async_rollout_failure import rollout_rank_context
from tests.unit.rl.test_async_rollout_sigterm import _StoppingTrainer


def test_the_rollout_encoder_leaves_the_trainers_generation_budget(monkeypatch, tmp_path):
    ctx = rollout_rank_context(monkeypatch, tmp_path)
    ctx.cfg.rl.rollout.max_new_tokens = 4
    ctx.cfg.rl.eval = types.SimpleNamespace(max_new_tokens=16)
    seen = {}

    def encoder(*a, **k):
        seen.update(k)
        return types.SimpleNamespace(encode=lambda s: object(), skipped=0)

    monkeypatch.setattr(rr, "PromptEncoder", encoder)
    role = Role(name="rollout", rank=0, allocation=Allocation(rollout=1, train=1), global_rank=1,
                bridge=_StoppingTrainer())
    rr.run_rollout_rank(ctx, role)
    assert seen["max_new_tokens"] == 16
