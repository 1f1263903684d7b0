"""The algorithm registries (megatron_vlm/rl/algorithms): one per family, filled by a decorator, read by
the public calls and the config.

- the shipped policy losses, advantage estimators (group ones and PPO's token one, `gae`), value and preference
  losses are registered under their config names, and each family takes registrations the same way;
- a name registered twice is an error, an unknown one a ValueError naming the config key and the choices;
- a newly registered policy loss / advantage estimator is what `policy_loss(variant=...)` /
  `compute_group_advantages(estimator=...)` run (checked against the formula written out in torch here);
- the loss spec is frozen and built once per run by the GRPO update, not per micro-batch;
- a newly registered preference loss is a valid `dpo.loss_type` and what the DPO step's loss runs.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from megatron_vlm.errors import ConfigError
from megatron_vlm.rl.advantages import compute_group_advantages
from megatron_vlm.rl.algorithms.advantage_estimators import ADVANTAGE_ESTIMATORS, register_advantage
from megatron_vlm.rl.algorithms.policy_losses import POLICY_LOSSES, PolicyLossSpec, PolicyTerms
from megatron_vlm.rl.algorithms.preference_losses import PREFERENCE_LOSSES
from megatron_vlm.rl.algorithms.registry import Registry
from megatron_vlm.rl.algorithms.value_losses import VALUE_LOSSES
from megatron_vlm.rl.losses import policy_loss

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def scratch(monkeypatch):
    """Registrations made by a test are undone after it (each registry's table is a copy for the test)."""
    for reg in (POLICY_LOSSES, ADVANTAGE_ESTIMATORS, VALUE_LOSSES, PREFERENCE_LOSSES):
        monkeypatch.setattr(reg, "_entries", dict(reg._entries))


def test_shipped_algorithms_are_registered_under_their_config_names():
    assert POLICY_LOSSES.names() == ["clip", "gspo", "gspo_token", "cispo"]
    assert ADVANTAGE_ESTIMATORS.names() == ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                                            "gae"]
    assert VALUE_LOSSES.names() == ["clipped"] and PREFERENCE_LOSSES.names() == ["sigmoid", "ipo", "simpo"]


def test_duplicate_and_unknown_names_are_errors():
    reg: Registry = Registry("demo family", "rl.demo")
    reg.register("a")(len)
    with pytest.raises(ValueError, match="'a' is registered already"):
        reg.register("a")(len)
    with pytest.raises(ValueError, match=r"rl\.demo: must be one of \['a'\], got 'b'"):
        reg.get("b")
    with pytest.raises(ValueError, match="policy_loss: must be one of"):
        POLICY_LOSSES.get("nope")


def test_a_registered_policy_loss_is_what_policy_loss_runs(scratch):
    @POLICY_LOSSES.register("reinforce")
    def reinforce(logp, log_ratio, adv, mask, seq_ids, lo, hi):
        zero = torch.zeros_like(mask)
        return PolicyTerms(pg=-adv * logp, ratio=torch.exp(log_ratio), clipped=zero, clipped_low=zero, clipped_high=zero)

    g = torch.Generator().manual_seed(0)
    logp = torch.randn(7, generator=g, requires_grad=True)
    adv = torch.randn(7, generator=g)
    mask = torch.tensor([True] * 6 + [False])
    out = policy_loss(logp, logp.detach(), adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2, loss_agg="token-mean",
                      variant="reinforce")
    expected = -(adv * logp)[mask].sum() / 6  # REINFORCE, token-mean
    torch.testing.assert_close(out.loss, expected)
    assert out.metrics["clip_frac"] == 0


def test_a_registered_advantage_estimator_is_what_the_advantages_use(scratch):
    @register_advantage("max_baseline", std_normalisable=False)
    def max_baseline(r, *, normalize_std, eps):
        return r - r.max(dim=1, keepdim=True).values

    rewards = torch.tensor([0.0, 1.0, 0.5, 2.0, 2.0, 1.0])
    out = compute_group_advantages(rewards, 3, estimator="max_baseline")
    torch.testing.assert_close(out.advantages, torch.tensor([-1.0, 0.0, -0.5, 0.0, 0.0, -1.0]))
    with pytest.raises(ValueError, match="normalize_adv_std"):
        compute_group_advantages(rewards, 3, estimator="max_baseline", normalize_std=True)


def test_value_and_preference_losses_register_the_same_way(scratch):
    @VALUE_LOSSES.register("mse")
    def mse(values, old_values, returns, mask, *, clip_range, loss_agg, seq_ids=None, normalizer=None,
            max_response_length=None):
        return ((values - returns)[mask] ** 2).mean() / 2, {}

    @PREFERENCE_LOSSES.register("hinge")
    def hinge(chosen, rejected, ref_chosen, ref_rejected, chosen_tokens, rejected_tokens, *, beta, simpo_gamma=0.0):
        return torch.relu(1 - beta * ((chosen - ref_chosen) - (rejected - ref_rejected)))

    assert VALUE_LOSSES.get("mse") is mse and PREFERENCE_LOSSES.get("hinge") is hinge
    with pytest.raises(ValueError, match="dpo.loss_type: must be one of \\['sigmoid', 'ipo', 'simpo', 'hinge'\\]"):
        PREFERENCE_LOSSES.get("kto")


def test_the_dpo_step_and_the_registry_name_the_same_functions():
    from megatron_vlm.training.dpo.losses import PREFERENCE_LOSSES as DPO_LOSSES

    assert {n: PREFERENCE_LOSSES.get(n) for n in PREFERENCE_LOSSES.names()} == DPO_LOSSES


def test_the_spec_is_frozen_and_validated_when_built():
    spec = PolicyLossSpec(clip_ratio_low=0.2, clip_ratio_high=0.28)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.variant = "gspo"  # type: ignore[misc]
    with pytest.raises(ValueError, match="variant: must be one of"):
        PolicyLossSpec(clip_ratio_low=0.2, clip_ratio_high=0.2, variant="nope")
    with pytest.raises(ValueError, match="rollout_correction_cap"):
        PolicyLossSpec(clip_ratio_low=0.2, clip_ratio_high=0.2, rollout_correction="tis", rollout_correction_cap=1.0)


def test_the_grpo_update_builds_the_spec_once(monkeypatch):
    """A GRPO step with several micro-batches and two mini-batches validates the loss settings once (when the
    update is built), not per micro-batch."""
    from tests.unit.rl.test_grpo_step_algorithms import _grpo, _pool, _rl

    built = []
    post_init = PolicyLossSpec.__post_init__
    monkeypatch.setattr(PolicyLossSpec, "__post_init__", lambda self: (built.append(1), post_init(self))[1])
    rl = _rl(mini_batches_per_step=2)
    grpo, _, seen = _grpo(rl, _pool(8))
    assert len(built) == 1
    grpo.run(0, _pool(8)[:4])
    assert len(seen["samples"]) > 2 and len(built) == 1


def test_a_registered_preference_loss_is_what_the_dpo_step_runs(scratch):
    from megatron_vlm.config import load_config
    from megatron_vlm.data.batch import IGNORE_INDEX
    from megatron_vlm.training.dpo.step import preference_terms

    @PREFERENCE_LOSSES.register("hinge")
    def hinge(chosen, rejected, ref_chosen, ref_rejected, chosen_tokens, rejected_tokens, *, beta, simpo_gamma=0.0):
        return torch.relu(1 - beta * ((chosen - ref_chosen) - (rejected - ref_rejected)))

    cfg = load_config(REPO / "launch" / "configs" / "demo_dpo.toml", overrides=['dpo.loss_type="hinge"'])
    assert cfg.dpo is not None and cfg.dpo.loss_type == "hinge"
    # one pack of two pairs: sequences of 3, 2, 4, 3 tokens, every token after the first labelled
    cu = torch.tensor([0, 3, 5, 9, 12], dtype=torch.int32)
    labels = torch.zeros(1, 12, dtype=torch.long)
    labels[0, cu[1:].long() - 1] = IGNORE_INDEX
    batch = {"labels": labels, "cu_seqlens": cu, "num_pairs": torch.tensor(2)}
    logp = -torch.arange(1.0, 9.0) / 4
    ref = (torch.tensor([-1.0, -3.0]), torch.tensor([-1.5, -2.0]))
    losses, sums = preference_terms(cfg.dpo, logp, batch, ref)
    chosen, rejected = torch.stack([logp[0:2].sum(), logp[3:6].sum()]), torch.stack([logp[2:3].sum(), logp[6:8].sum()])
    torch.testing.assert_close(losses, hinge(chosen, rejected, *ref, None, None, beta=cfg.dpo.beta))
    assert sums["loss"] == pytest.approx(float(losses.sum()))
    with pytest.raises(ConfigError, match=r"dpo\.loss_type: must be one of \['sigmoid', 'ipo', 'simpo', 'hinge'\]"):
        load_config(REPO / "launch" / "configs" / "demo_dpo.toml", overrides=['dpo.loss_type="kto"'])
