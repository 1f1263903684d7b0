"""A bigram policy trained by the real GRPOStep, in-process: the smallest RL loop in which a policy can learn.

The policy's next-token distribution depends on the current token only (the `TokenLogprobModel` contract); the
engine samples from that same distribution and returns its log-probs; the reward is the share of a target token in
the completion. Tests of an estimator or a loss run a few steps and check what the update saw and that the policy
moved towards the target (`target_prob`)."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace as NS

import torch
from torch import nn

from megatron_vlm.inference.engine import RolloutPrompt, RolloutResult, RolloutSample
from megatron_vlm.rl.grpo_step import GRPOStep
from megatron_vlm.rl.prompts.dataset import PromptSample
from megatron_vlm.training.optim import OptimState

VOCAB, TARGET, NEW = 7, 3, 3


class BigramPolicy(nn.Module):
    """Each position's next-token distribution is a function of its token alone (the `TokenLogprobModel` contract:
    log-probs of the pre-shifted labels); the engine below samples from the same distribution."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, VOCAB)

    def dist(self, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        return torch.log_softmax(self.head(self.embed(ids)) / temperature, -1)

    def forward(self, batch, *, temperature: float = 1.0, return_entropy: bool = False, prefix_segments=None):
        """`prefix_segments`: taken (a bigram reads a shared prompt's pack as a plain one), so that prompt sharing
        would be on if the step had two completions of a prompt to share it."""
        labels = batch["labels"].reshape(-1)
        sel = labels != -100
        lp = self.dist(batch["input_ids"].reshape(-1), temperature)[sel]
        logp = lp.gather(-1, labels[sel][:, None]).squeeze(-1)
        return (logp, -(lp.exp() * lp).sum(-1)) if return_entropy else logp


class SamplingEngine:
    """Draws `params.n` completions of NEW tokens per prompt from the policy, with its log-probs."""

    def __init__(self, policy: BigramPolicy):
        self.policy, self.calls = policy, []

    def load_weights(self, weights, version):
        pass

    def release_memory(self):
        pass

    @torch.no_grad()
    def generate(self, prompts, params, generator=None):
        self.calls.append(params.n)
        out = []
        for pi, p in enumerate(prompts):
            for j in range(params.n):
                prev, ids, lps = p.input_ids[-1:], [], []
                for _ in range(params.max_new_tokens):
                    lp = self.policy.dist(prev, params.temperature)[0]
                    tok = torch.multinomial(lp.exp(), 1, generator=generator)
                    ids.append(int(tok))
                    lps.append(float(lp[tok]))
                    prev = tok
                out.append(RolloutSample(prompt_index=pi, sample_index=j, token_ids=torch.tensor(ids),
                                         logprobs=torch.tensor(lps), text=" ".join(map(str, ids)), finish_reason="length",
                                         prompt_length=int(p.input_ids.numel())))
        return RolloutResult(samples=out)


class Encoder:
    skipped = 0

    def encode(self, s: PromptSample) -> RolloutPrompt:
        i = int(s.prompt_id[1:])
        return RolloutPrompt(input_ids=torch.tensor([1 + i % (VOCAB - 1), 1 + (i + 1) % (VOCAB - 1)]))


class TargetReward:
    """The fraction of the completion's tokens that are TARGET."""
    labels = ["exact_match"]

    def metrics(self):
        return {}

    def score(self, texts, answers, prompts, metadata):
        total = [sum(int(t) == TARGET for t in text.split()) / NEW for text in texts]
        return NS(total=total, per_reward={"exact_match": total})


def prompts(n: int) -> list[PromptSample]:
    return [PromptSample(f"p{i}", [], "a", f"q{i}") for i in range(n)]


def target_prob(policy: BigramPolicy) -> float:
    with torch.no_grad():
        return float(policy.dist(torch.arange(VOCAB)).exp()[:, TARGET].mean())


class FrozenReference:
    """The reference policy: a frozen copy of the starting bigram (the `ReferencePolicy` calls the update makes)."""
    collective = False

    def __init__(self, policy: BigramPolicy):
        self.model = BigramPolicy()
        self.model.load_state_dict(policy.state_dict())
        self.model.requires_grad_(False)

    @contextlib.contextmanager
    def on_device(self):
        yield self

    @torch.no_grad()
    def token_logprobs(self, batch):
        return self.model(batch)


def bigram_grpo_step(rl, policy: BigramPolicy, **kwargs) -> GRPOStep:
    """A GRPOStep on one CPU process training `policy` with Adam (lr 0.05, no clipping) under `rl`, sampling with
    `SamplingEngine(policy)` (or `kwargs["engine"]`), rewarded by `TargetReward`; other `kwargs` (reference=,
    critic=) go to GRPOStep."""
    opt = torch.optim.Adam(policy.parameters(), lr=0.05)
    ctx = NS(env=NS(device=torch.device("cpu"), rank=0, world_size=1),
             cfg=NS(data=NS(max_tokens_per_pack=64), train=NS(seed=3, max_grad_norm=0.0)), to_device=lambda b: b)
    bundle = NS(dims=NS(dp_size=1), wrapper=policy, trainable_params=list(policy.parameters()), moe_balancer=None,
                model=policy)
    engine = kwargs.pop("engine", None) or SamplingEngine(policy)
    return GRPOStep(ctx, bundle, OptimState(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)), rl, engine,
                    Encoder(), TargetReward(), **kwargs)


def spy_on_update(grpo: GRPOStep) -> dict:
    """The samples of the latest policy update, under "samples" of the returned dict."""
    seen: dict = {}
    update = grpo.policy.update

    def spy(step, samples, dummy, **kw):
        seen["samples"] = list(samples)
        return update(step, samples, dummy, **kw)

    grpo.policy.update = spy
    return seen
