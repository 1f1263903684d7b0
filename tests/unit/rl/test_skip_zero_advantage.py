"""`rl.update.skip_zero_advantage`: the update leaves completions with advantage exactly 0 out of its forwards and
backwards, and the step is the one that forwards them (same parameters up to float rounding), because their
loss and gradient are 0 and the normaliser still counts them.

On the scripted GRPO step of test_grpo_step_algorithms.py (tiny policy, scripted engine and reward: the
"constant" prompts get the same reward for every completion, so their groups have advantage 0), with AdamW
(momentum and weight decay move parameters even at zero gradient, so a skipped step would show):
- a mix of informative and constant groups: the same parameters, fewer tokens forwarded;
- a step whose groups are all constant: the optimizer still steps (one zero-gradient forward), as it does
  when they are forwarded;
- where the gradient at advantage 0 is not 0 (KL term, entropy bonus, MoE) or the key is false, nothing is
  skipped.
"""
from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch

from megatron_vlm.training.optim import OptimState
from tests.unit.rl.test_grpo_step_algorithms import _grpo, _pool, _rl, constant


def _run(skip: bool, steps, **rl_kw):
    """GRPOStep with AdamW; runs `steps` (a list of prompt batches); returns (parameters, metrics, tokens forwarded)."""
    rl = _rl(skip_zero_advantage=skip, **rl_kw)
    grpo, _, _ = _grpo(rl, _pool(40))
    policy = grpo.policy.bundle.wrapper
    opt = torch.optim.AdamW(policy.parameters(), lr=0.05, weight_decay=0.1)
    grpo.policy.optim = OptimState(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    seen = {"tokens": 0}
    forward = policy.forward

    def counting(batch, **kw):
        seen["tokens"] += int((batch["labels"] != -100).sum())
        return forward(batch, **kw)

    policy.forward = counting
    metrics = [grpo.run(i, batch, prompt_pool=_pool(40)) for i, batch in enumerate(steps)]
    return [p.detach().clone() for p in policy.parameters()], metrics, seen["tokens"], grpo


def test_skipping_zero_advantage_completions_gives_the_same_update_with_fewer_tokens():
    pool = _pool(8)  # p0, p2, ... constant (advantage 0); p1, p3, ... informative
    steps = [pool[:4], pool[4:8]]
    p_on, m_on, tok_on, grpo = _run(True, steps)
    p_off, m_off, tok_off, _ = _run(False, steps)
    assert grpo.policy.skip_zero_adv
    assert tok_on < tok_off  # the constant groups were not forwarded
    assert [m["train/zero_adv_skipped"] for m in m_on] == [6.0, 6.0]  # 2 constant groups of G = 3 per step
    assert "train/zero_adv_skipped" not in m_off[0]
    for a, b in zip(p_on, p_off):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for key in ("loss", "grad_norm"):
        for a, b in zip(m_on, m_off):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    # the throughput counts what was trained
    assert sum(m["perf/train_tokens_per_s"] > 0 for m in m_on) == 2


def test_a_step_with_only_zero_advantages_still_steps_the_optimizer():
    pool = _pool(40)
    informative = [p for p in pool if not constant(p)][:4]
    flat = [p for p in pool if constant(p)][:4]
    p_on, m_on, tok_on, _ = _run(True, [informative, flat])
    p_off, _, tok_off, _ = _run(False, [informative, flat])
    p_first, _, _, _ = _run(True, [informative])
    for a, b in zip(p_on, p_off):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # AdamW's momentum and weight decay moved the parameters in the all-zero step
    assert any(not torch.equal(a, b) for a, b in zip(p_on, p_first))
    assert m_on[1]["grad_norm"] == 0.0 and m_on[1]["loss"] == 0.0 and m_on[1]["train/zero_adv_skipped"] == 12.0
    assert tok_on < tok_off


@pytest.mark.parametrize("why, kw, bundle", [
    ("rl.update.skip_zero_advantage = false", dict(skip_zero_advantage=False), {}),
    ("kl_coef", dict(kl_coef=0.1), {}),
    ("entropy_coef", dict(entropy_coef=0.01), {}),
    ("MoE", {}, {"moe_balancer": NS()}),
])
def test_nothing_is_skipped_where_the_zero_advantage_gradient_is_not_zero(why, kw, bundle):
    grpo, _, _ = _grpo(_rl(**kw), _pool(4))
    for k, v in bundle.items():
        setattr(grpo.policy.bundle, k, v)
    on, reason = grpo.policy.skip_zero_advantage()
    assert not on and why in reason
    grpo.policy.skip_zero_adv = on
    assert grpo.policy.trains(NS(advantage=0.0))


def _old_logprob_counts(monkeypatch) -> list[int]:
    """Records how many samples each old-log-prob forward is given."""
    from megatron_vlm.rl.policy_update import PolicyUpdate

    counts: list[int] = []
    real = PolicyUpdate.recompute_old_logprobs

    def spy(self, samples, dummy):
        counts.append(len(samples))
        return real(self, samples, dummy)

    monkeypatch.setattr(PolicyUpdate, "recompute_old_logprobs", spy)
    return counts


@pytest.mark.parametrize("correction, forwarded", [("none", 6), ("tis", 6), ("mis", 12)])
def test_the_old_logprob_forward_skips_them_unless_mis_reads_them(monkeypatch, correction, forwarded):
    """recompute_logprobs, plain or TIS: zero-advantage samples' old log-probs reach only their zero loss term, so
    that forward leaves them out as well; MIS's drops read every sample's old log-probs, so it forwards all.
    The step is the same as without skipping in each case."""
    counts = _old_logprob_counts(monkeypatch)
    pool = _pool(8)  # 4 prompts x G = 3, 2 of the 4 groups constant
    kw = dict(recompute_logprobs=True, rollout_correction=correction)
    if correction == "mis":
        kw["rollout_correction_cap"] = 1e3  # drops nothing here: the update runs
    p_on, m_on, _, _ = _run(True, [pool[:4]], **kw)
    p_off, m_off, _, _ = _run(False, [pool[:4]], **kw)
    for a, b in zip(p_on, p_off):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert "time/old_logprob_s" in m_on[0]
    assert counts == [forwarded, 12]
    if correction == "mis":  # the mismatch metrics cover every recomputed sample, skipped or not
        for key in ("rollout/mis_dropped_frac", "rollout/mismatch_kl", "rollout/mismatch_ratio_mean"):
            assert m_on[0][key] == m_off[0][key], key


def test_mis_metrics_are_logged_when_every_group_is_constant():
    """Every sample has advantage 0 (nothing to train) and MIS drops them all: the drop fraction and the mismatch
    metrics are still logged, as without skipping."""
    flat = [p for p in _pool(40) if constant(p)][:4]
    kw = dict(recompute_logprobs=True, rollout_correction="mis", rollout_correction_cap=1.5)
    _, m_on, _, _ = _run(True, [flat], **kw)
    _, m_off, _, _ = _run(False, [flat], **kw)
    for key in ("rollout/mis_dropped_frac", "rollout/mismatch_kl"):
        assert key in m_on[0] and m_on[0][key] == m_off[0][key], key
