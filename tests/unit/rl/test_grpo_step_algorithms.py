"""The GRPO step (`GRPOStep.run`) with the DAPO sampling / shaping keys and the rollout correction,
on a tiny stand-in policy, a scripted rollout engine and a scripted reward (no model, no workers):

- dynamic sampling with a reward that is constant for half the groups still trains
  prompts_per_step groups (extra rounds drawn from the prompt pool, the surplus of the last round
  dropped, all logged), and stops at max_sampling_rounds when the pool has too few informative prompts;
- the overlong penalty enters the advantages; mask_truncated keeps cut completions out of the update
  but in their group's advantages;
- MIS drops the sequences whose geometric-mean rollout ratio is outside [1/C, C] before the update;
  the mismatch KL / ratio metrics are logged with recompute_logprobs;
- the decoupled (asynchronous) loss with a single update per step takes its proximal log-probs from
  the update's own forward: the same step as with the separate proximal forward.
"""
from __future__ import annotations

import math
from types import SimpleNamespace as NS

import pytest
import torch
from torch import nn

from megatron_vlm.inference.engine import RolloutPrompt, RolloutResult, RolloutSample
from megatron_vlm.rl.config import RLConfig
from megatron_vlm.rl.grpo_step import GRPOStep
from megatron_vlm.rl.prompts.dataset import PromptSample
from megatron_vlm.rl.rewards.config import ExactMatchRewardConfig
from megatron_vlm.training.optim import OptimState
from tests.fixtures.rl_config import rl_config

VOCAB = 11


class TinyPolicy(nn.Module):
    """Log-probs (and entropies) of the pre-shifted labels: the `TokenLogprobModel` contract."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 4)
        self.head = nn.Linear(4, VOCAB)

    def forward(self, batch, *, temperature: float = 1.0, return_entropy: bool = False):
        labels = batch["labels"].reshape(-1)
        sel = labels != -100
        lp = torch.log_softmax(self.head(self.embed(batch["input_ids"].reshape(-1)))[sel] / temperature, -1)
        logp = lp.gather(-1, labels[sel][:, None]).squeeze(-1)
        ent = -(lp.exp() * lp).sum(-1)
        return (logp, ent) if return_entropy else logp


def constant(p: PromptSample) -> bool:
    """Half the prompts (even ids) get the same reward for every completion."""
    return int(p.prompt_id[1:]) % 2 == 0


class Encoder:
    skipped = 0

    def encode(self, s: PromptSample) -> RolloutPrompt:
        i = int(s.prompt_id[1:])  # distinct token ids for the first 100 prompts
        return RolloutPrompt(input_ids=torch.tensor([1 + i % (VOCAB - 1), 1 + (i // (VOCAB - 1)) % (VOCAB - 1)]))


class Engine:
    """Completion j of a prompt has 1 + j tokens (j = G - 1 is cut at max_new_tokens); behaviour
    log-probs are `shift` (per prompt) below 0."""

    def __init__(self, G: int, max_new: int, shift=lambda p: 0.0):
        self.G, self.max_new, self.shift, self.calls = G, max_new, shift, []

    def load_weights(self, weights, version):
        pass

    def release_memory(self):
        pass

    def generate(self, prompts, params, generator=None):
        self.calls.append(len(prompts))
        out = []
        for pi, p in enumerate(prompts):
            for j in range(self.G):
                n = min(1 + j, self.max_new) if j < self.G - 1 else self.max_new
                ids = torch.arange(n) % VOCAB
                out.append(RolloutSample(prompt_index=pi, sample_index=j, token_ids=ids,
                                         logprobs=torch.full((n,), -1.0 - self.shift(p)), text="w" * n,
                                         finish_reason="length" if n == self.max_new else "eos",
                                         prompt_length=int(p.input_ids.numel())))
        return RolloutResult(samples=out)


class Manager:
    labels = ["exact_match"]

    def __init__(self, pool):
        self.by_problem = {p.problem: p for p in pool}

    def metrics(self):
        return {}

    def score(self, texts, answers, prompts, metadata):
        total = []
        for t, q in zip(texts, prompts):
            total.append(0.5 if constant(self.by_problem[q]) else len(t) / 10)
        return NS(total=total, per_reward={"exact_match": total})


def _pool(n: int) -> list[PromptSample]:
    return [PromptSample(f"p{i}", [], "a", f"q{i}") for i in range(n)]


def _grpo(rl: RLConfig, pool, engine=None, recompute_shift=None, multiturn=None, manager=None):
    torch.manual_seed(0)
    policy = TinyPolicy()
    opt = torch.optim.SGD(policy.parameters(), lr=0.1)
    ctx = NS(env=NS(device=torch.device("cpu"), rank=0, world_size=1),
             cfg=NS(data=NS(max_tokens_per_pack=64), train=NS(seed=3, max_grad_norm=0.0)), to_device=lambda b: b)
    bundle = NS(dims=NS(dp_size=1), wrapper=policy, trainable_params=list(policy.parameters()), moe_balancer=None)
    optim = OptimState(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    engine = engine or Engine(rl.batch.group_size, rl.rollout.max_new_tokens)
    grpo = GRPOStep(ctx, bundle, optim, rl, engine, Encoder(), manager or Manager(pool), multiturn=multiturn)
    seen = {}
    update = grpo.policy.update

    def spy(step, samples, dummy, **kw):
        seen["samples"] = list(samples)
        return update(step, samples, dummy, **kw)

    grpo.policy.update = spy  # the policy update's public method, wrapped on this instance
    return grpo, engine, seen


def _rl(**kw) -> RLConfig:
    base = dict(group_size=3, max_new_tokens=4, prompts_per_step=4, rewards=[ExactMatchRewardConfig()])
    base.update(kw)
    return rl_config(validate=True, **base)


def test_dynamic_sampling_trains_prompts_per_step_groups_when_half_are_constant():
    pool = _pool(40)
    batch = pool[:4]
    assert sum(constant(p) for p in batch) == 2  # half the step's groups carry no signal
    rl = _rl(dynamic_sampling=True, max_sampling_rounds=5)
    grpo, engine, seen = _grpo(rl, pool)
    m = grpo.run(0, batch, prompt_pool=pool)
    G = rl.batch.group_size
    assert len(seen["samples"]) == rl.batch.prompts_per_step * G  # exactly prompts_per_step groups trained
    assert m["sampling/kept_groups"] == rl.batch.prompts_per_step
    assert m["sampling/rounds"] >= 2 and m["sampling/extra_rounds"] == m["sampling/rounds"] - 1
    assert len(engine.calls) == m["sampling/rounds"]
    generated = 4 * m["sampling/rounds"]
    assert m["sampling/dropped_groups"] + m["sampling/kept_groups"] + m["sampling/surplus_groups"] == generated
    assert m["reward/zero_var_group_frac"] == m["sampling/dropped_groups"] / generated
    # every trained group has non-zero reward variance: none of its advantages is 0 here
    assert all(s.advantage != 0 for s in seen["samples"])
    # the same step without dynamic sampling trains the 2 informative groups only when dropping, all 4 otherwise
    grpo2, engine2, seen2 = _grpo(_rl(drop_equal_reward_groups=True), pool)
    m2 = grpo2.run(0, batch, prompt_pool=pool)
    assert len(seen2["samples"]) == 2 * G and len(engine2.calls) == 1 and "sampling/rounds" not in m2
    assert m2["reward/zero_var_group_frac"] == 0.5


def test_dynamic_sampling_stops_at_max_rounds():
    pool = [p for p in _pool(40) if constant(p)][:6] + [p for p in _pool(40) if not constant(p)][:1]
    batch = pool[:4]
    grpo, engine, seen = _grpo(_rl(dynamic_sampling=True, max_sampling_rounds=2), pool)
    m = grpo.run(0, batch, prompt_pool=pool)
    assert m["sampling/rounds"] == 2 and len(engine.calls) == 2
    assert m["sampling/kept_groups"] < 4 and len(seen["samples"]) == 3 * m["sampling/kept_groups"]


def test_dynamic_sampling_rounds_are_a_function_of_seed_and_step():
    pool = _pool(40)
    a = _grpo(_rl(dynamic_sampling=True), pool)
    b = _grpo(_rl(dynamic_sampling=True), pool)
    ma, mb = a[0].run(5, pool[:4], prompt_pool=pool), b[0].run(5, pool[:4], prompt_pool=pool)
    assert [s.prompt.input_ids.tolist() for s in a[2]["samples"]] == [s.prompt.input_ids.tolist() for s in b[2]["samples"]]
    assert ma["loss"] == mb["loss"]


def test_overlong_penalty_and_mask_truncated():
    pool = [p for p in _pool(40) if not constant(p)][:4]
    rl = _rl(max_new_tokens=4, overlong_buffer=2, overlong_penalty=1.0, mask_truncated=True)
    grpo, _, seen = _grpo(rl, pool)
    m = grpo.run(0, pool, prompt_pool=pool)
    # lengths 1, 2, 4 (cut): penalties 0, 0, -1 (buffer [2, 4]: (2 - 4) / 2 = -1)
    assert m["reward/overlong_penalty"] == pytest.approx(-1 / 3)
    assert m["train/masked_truncated"] == 4 and m["response_length/truncated_frac"] == pytest.approx(1 / 3)
    assert len(seen["samples"]) == 8 and all(s.response_length < 4 for s in seen["samples"])
    # advantages from shaped rewards 0.1, 0.2, 0.4 - 1 = -0.6 over the whole group (cut sample included)
    r = [0.1, 0.2, -0.6]
    mean = sum(r) / 3
    std = math.sqrt(sum((x - mean) ** 2 for x in r) / 2)
    got = sorted(s.advantage for s in seen["samples"][:2])
    assert got == pytest.approx(sorted((x - mean) / (std + 1e-6) for x in r[:2]), rel=1e-5)


def test_mis_drops_mismatched_sequences_and_metrics_are_logged():
    pool = [p for p in _pool(40) if not constant(p)][:4]
    # the rollout engine's log-probs: the policy's own (recomputed below) minus a per-prompt shift,
    # so the geometric-mean ratio pi_old / pi_rollout of prompt i's sequences is exp(shift_i)
    shifts = {pool[0].prompt_id: 0.0, pool[1].prompt_id: 0.5, pool[2].prompt_id: 1.0, pool[3].prompt_id: -1.0}
    rl = _rl(recompute_logprobs=True, rollout_correction="mis", rollout_correction_cap=2.0)
    grpo, engine, seen = _grpo(rl, pool)
    enc = Encoder()
    by_ids = {tuple(enc.encode(p).input_ids.tolist()): shifts[p.prompt_id] for p in pool}
    real_generate = engine.generate

    def generate(prompts, params, generator=None):
        res = real_generate(prompts, params, generator)
        from megatron_vlm.rl.batching import TrainSample, pack_samples
        for s in res.samples:
            ts = TrainSample(prompt=prompts[s.prompt_index], response_ids=s.token_ids, behav_logp=s.logprobs, advantage=0.0)
            with torch.no_grad():
                own = grpo.policy.bundle.wrapper(pack_samples([ts]))
            s.logprobs = own.float() - by_ids[tuple(prompts[s.prompt_index].input_ids.tolist())]
        return res

    engine.generate = generate
    m = grpo.run(0, pool, prompt_pool=pool)
    # |shift| = 1 > log 2 is dropped (prompts 2 and 3), 0 and 0.5 < log 2 kept
    kept = {tuple(s.prompt.input_ids.tolist()) for s in seen["samples"]}
    assert kept == {tuple(enc.encode(p).input_ids.tolist()) for p in pool[:2]}
    assert m["rollout/mis_dropped_frac"] == pytest.approx(0.5)
    assert m["rollout/mismatch_ratio_min"] == pytest.approx(math.exp(-1.0), rel=1e-5)
    assert m["rollout/mismatch_ratio_max"] == pytest.approx(math.exp(1.0), rel=1e-5)
    # KL(pi_rollout || pi_old) from rollout samples, k3 = rho - 1 - log rho with rho = pi_old / pi_rollout = e^d
    k3 = lambda d: math.exp(d) - 1 - d  # noqa: E731
    assert m["rollout/mismatch_kl"] == pytest.approx(sum(k3(d) for d in shifts.values()) / 4, rel=1e-4)


def test_config_refuses_incompatible_combinations():
    with pytest.raises(ValueError, match="rollout_correction.*recompute_logprobs"):
        _rl(rollout_correction="tis")
    with pytest.raises(ValueError, match="advantages.normalize_std"):
        _rl(advantage="rloo", normalize_adv_std=True)
    with pytest.raises(ValueError, match="overlong_buffer"):
        _rl(overlong_buffer=4, overlong_penalty=1.0)  # = max_new_tokens
    with pytest.raises(ValueError, match="overlong_penalty"):
        _rl(overlong_buffer=2)
    with pytest.raises(ValueError, match="rollout_correction_cap"):
        _rl(recompute_logprobs=True, rollout_correction="mis", rollout_correction_cap=1.0)
    with pytest.raises(ValueError, match="max_sampling_rounds"):
        _rl(dynamic_sampling=True, max_sampling_rounds=0)
    with pytest.raises(ValueError, match="entropy_coef"):
        _rl(entropy_coef=-0.1)
    assert _rl(advantage="dr_grpo").adv_normalize_std() is False and _rl().adv_normalize_std() is True
    assert _rl(normalize_adv_std=False).adv_normalize_std() is False


@pytest.mark.parametrize("minis", [1, 2])
def test_decoupled_single_update_takes_proximal_logprobs_from_the_update_forward(minis):
    """Asynchronous GRPO (decoupled loss) with one optimizer update per step: the proximal policy is the
    weights of that update's forward, so the separate proximal forward is skipped (no `old_logprob`
    phase) and the step equals the one with the proximal log-probs recomputed first (recompute_logprobs);
    with two mini-batches the proximal forward stays."""
    pool = _pool(4)
    shift = lambda p: 0.3 * (int(p.input_ids[0]) % 3)  # noqa: E731 - stale behaviour log-probs per prompt
    runs = {}
    for recompute in (False, True):
        rl = _rl(recompute_logprobs=recompute, behav_imp_weight_cap=50.0, mini_batches_per_step=minis,
                 allocation="rollout:1+train:1", max_head_offpolicyness=2)
        grpo, _, _ = _grpo(rl, pool, engine=Engine(rl.batch.group_size, rl.rollout.max_new_tokens, shift=shift))
        assert grpo.policy.decoupled
        m = grpo.run(0, pool, prompt_pool=pool)
        runs[recompute] = (m, [p.detach().clone() for p in grpo.policy.bundle.wrapper.parameters()])
    (fast, p_fast), (slow, p_slow) = runs[False], runs[True]
    assert ("time/old_logprob_s" in fast) == (minis > 1)
    assert "time/old_logprob_s" in slow
    for key in ("loss", "grad_norm", "actor/behav_imp_weight", "rollout/mismatch_kl", "rollout/mismatch_ratio_mean"):
        assert fast[key] == pytest.approx(slow[key], rel=1e-5, abs=1e-7), key
    assert fast["actor/behav_imp_weight"] != pytest.approx(1.0, abs=1e-3)  # the behaviour policy differs
    for a, b in zip(p_fast, p_slow):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
