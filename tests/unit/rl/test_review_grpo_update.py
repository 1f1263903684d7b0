"""Review tests of the GRPO update (`PolicyUpdate.update` / `step_metrics`) on a tiny stand-in policy,
against plain torch:

- with mini-batches, each optimizer update equals one SGD step on the token-mean clipped objective
  of that mini-batch's samples (ratio 1 at the first update: loss = -sum(A_t log p_t) / tokens);
- the "lr" metric of a step is the learning rate its updates used (torch optimizer step pre-hook),
  not the next step's.
"""
from __future__ import annotations

import copy
import random
from types import SimpleNamespace as NS

import torch
from torch import nn

from megatron_vlm.inference.engine import RolloutPrompt
from megatron_vlm.rl.batching import TrainSample
from megatron_vlm.rl.grpo_step import GRPOStep
from megatron_vlm.rl.metrics import PhaseTimer
from megatron_vlm.rl.step_metrics import StepCounts, step_metrics
from megatron_vlm.training.optim import OptimState


class TinyPolicy(nn.Module):
    """Log-probs (and entropies) of the pre-shifted labels: the `TokenLogprobModel` contract."""

    def __init__(self, vocab: int = 13, dim: int = 6):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, batch, *, temperature: float = 1.0, return_entropy: bool = False):
        labels = batch["labels"].reshape(-1)
        sel = labels != -100
        logits = self.head(self.embed(batch["input_ids"].reshape(-1)))[sel] / temperature
        lp = torch.log_softmax(logits, -1)
        logp = lp.gather(-1, labels[sel][:, None]).squeeze(-1)
        ent = -(lp.exp() * lp).sum(-1)
        return (logp, ent) if return_entropy else logp


def _samples(g: torch.Generator, n: int) -> list[TrainSample]:
    out = []
    for i in range(n):
        prompt = RolloutPrompt(input_ids=torch.randint(0, 13, (2 + i % 3,), generator=g))
        resp = torch.randint(0, 13, (1 + (3 * i) % 5,), generator=g)
        s = TrainSample(prompt=prompt, response_ids=resp, behav_logp=torch.zeros(resp.numel()),
                        advantage=float(torch.randn((), generator=g)))
        out.append(s)
    return out


def _step(policy, lr_lambda, mini_batches: int) -> GRPOStep:
    opt = torch.optim.SGD(policy.parameters(), lr=0.3)
    ctx = NS(env=NS(device=torch.device("cpu"), rank=0, world_size=1),
             cfg=NS(data=NS(max_tokens_per_pack=12), train=NS(seed=5, max_grad_norm=0.0)), to_device=lambda b: b)
    bundle = NS(dims=NS(dp_size=1), wrapper=policy, trainable_params=list(policy.parameters()), moe_balancer=None)
    optim = OptimState(opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda))
    rl = NS(accuracy_label=lambda: "acc", policy_loss="clip", advantage="grpo", allocation=None, recompute_logprobs=False,
            batch=NS(ppo_epochs=1, mini_batches_per_step=mini_batches, group_size=2),
            rollout=NS(temperature=1.0, max_new_tokens=8),
            loss=NS(loss_agg="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.2, kl_coef=0.0, kl_estimator="k3",
                    entropy_coef=0.0, rollout_correction="none", rollout_correction_cap=2.0),
            advantages=NS(overlong_buffer=0, dynamic_sampling=False, normalize_std=None, drop_equal_reward_groups=False,
                          kl_in_reward=None),
            update=NS(mask_truncated=False, prompt_sharing="auto", skip_zero_advantage=True),
            asynchronous=NS(max_head_offpolicyness=0),
            eval=NS(correct_threshold=1.0))
    return GRPOStep(ctx, bundle, optim, rl, engine=None, encoder=NS(skipped=0), manager=NS(labels=["acc"], metrics=lambda: {}))


def _logp(policy, s: TrainSample) -> torch.Tensor:
    from megatron_vlm.rl.batching import pack_samples
    return policy(pack_samples([s]))


def test_mini_batch_update_equals_token_mean_sgd_step():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    policy = TinyPolicy()
    samples = _samples(g, 5)
    with torch.no_grad():
        for s in samples:
            s.old_logp = _logp(policy, s)  # on-policy: ratio 1 at the first update
    ref = copy.deepcopy(policy)
    grpo = _step(policy, lambda s: 1.0, mini_batches=2)
    upd = grpo.policy.update(0, samples, samples[0])
    assert upd.updates == 2

    # plain torch: the same mini-batches (the step's documented shuffle), one SGD step each
    order = list(range(len(samples)))
    random.Random(((5 * 1_000_003 + 0) * 131 + 0) * 8191 + 0).shuffle(order)
    for m in range(2):
        mb = [samples[i] for i in order[m::2]]
        ref.zero_grad()
        lp = [_logp(ref, s) for s in mb]
        n = sum(x.numel() for x in lp)
        ratio = [torch.exp(x - s.old_logp) for s, x in zip(mb, lp)]  # 1 at the first update
        loss = sum(torch.maximum(-s.advantage * r, -s.advantage * r.clamp(0.8, 1.2)).sum()
                   for s, r in zip(mb, ratio)) / n
        loss.backward()
        with torch.no_grad():
            for p in ref.parameters():
                p -= 0.3 * p.grad
    for (name, a), b in zip(policy.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_logged_lr_is_the_lr_of_the_step_updates():
    g = torch.Generator().manual_seed(1)
    policy = TinyPolicy()
    samples = _samples(g, 3)
    with torch.no_grad():
        for s in samples:
            s.old_logp = _logp(policy, s)
    grpo = _step(policy, lambda s: 0.5 ** s, mini_batches=1)
    used = []
    grpo.policy.optim.optimizer.register_step_pre_hook(lambda opt, args, kwargs: used.append(opt.param_groups[0]["lr"]))
    logged = []
    for step in range(2):
        upd = grpo.policy.update(step, samples, samples[0])
        counts = StepCounts(rounds=1, surplus=0, masked_truncated=0, skipped_prompts=0, reward_failures={}, skipped_steps=0)
        out = step_metrics(grpo.rl, grpo.shards, step, PhaseTimer(), [], upd, counts, reward_labels=["acc"],
                           zero_adv_on=False)
        logged.append(out["lr"])
    assert len(used) == 2
    assert logged == used
