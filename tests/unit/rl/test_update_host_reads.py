"""Host reads of device values in the GRPO / PPO update (`PolicyUpdate`, the PPO `Critic`), one process.

On CUDA each read of a device tensor's value is a stream sync (tests/unit/training/test_step_host_reads.py says how
they are counted on the CPU). An optimizer update needs one read, before its optimizer step (its loss sum for the
non-finite guard, the gradient norm, the running metric sums), and a pass of reference / old log-probs or of the
critic's values one, after its last pack; the losses' per-token inputs are made on the host and moved without
waiting. The stand-in models read nothing themselves (the labels' positions come from the host copies, as in
`TokenLogprobModel`); the samples' tensors are host tensors (the rollout's). The logged losses and gradient norms
are those of the plain token-mean clipped objective and torch's clip_grad_norm_.
"""
from __future__ import annotations

import contextlib
import copy
import random
from types import SimpleNamespace as NS

import pytest
import torch
from torch import nn

from megatron_vlm.data.batch import label_positions
from megatron_vlm.host_copies import moved_to
from megatron_vlm.inference.engine import RolloutPrompt
from megatron_vlm.rl.batching import TrainSample, pack_samples
from megatron_vlm.rl.critic.ppo_critic import Critic
from megatron_vlm.rl.critic.value_model import ValueModel
from megatron_vlm.rl.data_shards import DataShards
from megatron_vlm.rl.policy_update import PolicyUpdate
from megatron_vlm.testing.host_reads import HostReads
from megatron_vlm.training.optim import OptimState
from tests.fixtures.rl_config import rl_config

VOCAB, DIM = 13, 6


class Policy(nn.Module):
    """Log-probs (and entropies) of the pre-shifted labels (the `TokenLogprobModel` contract), the positions read
    from the labels' host copy."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, batch, *, temperature: float = 1.0, return_entropy: bool = False):
        pos = label_positions(batch["labels"])
        logits = self.head(self.embed(batch["input_ids"].reshape(-1))).index_select(0, pos) / temperature
        lp = torch.log_softmax(logits, -1)
        logp = lp.gather(-1, batch["labels"].reshape(-1).index_select(0, pos)[:, None]).squeeze(-1)
        ent = -(lp.exp() * lp).sum(-1)
        return (logp, ent) if return_entropy else logp


class Backbone(nn.Module):
    """A family model's surface as `ValueModel` uses it: `lm_head`, the hidden states of `return_hidden`."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids, return_hidden=False, **_):
        return torch.tanh(self.embed(input_ids))


class Reference:
    """The frozen reference's surface: `token_logprobs(batch)` of a packed batch, `on_device()`."""

    collective = False

    def __init__(self, policy: Policy):
        self.model = copy.deepcopy(policy).requires_grad_(False)

    def on_device(self):
        return contextlib.nullcontext()

    def token_logprobs(self, batch):
        return self.model(batch)


def _samples(n: int, seed: int = 0) -> list[TrainSample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = RolloutPrompt(input_ids=torch.randint(0, VOCAB, (2 + i % 3,), generator=g))
        resp = torch.randint(0, VOCAB, (1 + (3 * i) % 5,), generator=g)
        behav = -torch.rand(resp.numel(), generator=g)
        out.append(TrainSample(prompt=prompt, response_ids=resp, behav_logp=behav, advantage=float(torch.randn((), generator=g)),
                               old_logp=behav.clone(), score=float(i % 2)))
    return out


def _host(samples) -> list[torch.Tensor]:
    """The samples' tensors: host tensors in a GPU job too (the rollout's)."""
    return [t for s in samples for t in (s.prompt.input_ids, s.response_ids, s.behav_logp, s.old_logp, s.ref_logp,
                                         s.token_advantages, s.old_values, s.returns) if t is not None]


def _update(rl, policy, *, reference=None, critic=None, max_grad_norm=0.5) -> PolicyUpdate:
    cpu = torch.device("cpu")
    ctx = NS(env=NS(device=cpu, rank=0, world_size=1),
             cfg=NS(data=NS(max_tokens_per_pack=12), train=NS(seed=5, max_grad_norm=max_grad_norm)),
             to_device=lambda b: moved_to(b, cpu, copy=True))
    bundle = NS(dims=NS(dp_size=1), wrapper=policy, trainable_params=list(policy.parameters()), moe_balancer=None)
    opt = torch.optim.SGD(policy.parameters(), lr=0.3)
    optim = OptimState(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    shards = DataShards(rank=0, world=1, copies=1, device=cpu)
    return PolicyUpdate(ctx, bundle, optim, rl, shards=shards, reference=reference, critic=critic)


def _rl(**kw):
    return rl_config(**{"group_size": 2, "max_new_tokens": 8, "mini_batches_per_step": 2, **kw})


def _counted(samples, fn):
    reads = HostReads(host=_host(samples))
    with reads:
        out = fn()
    return out, reads


def test_grpo_update_reads_the_device_once_per_optimizer_update():
    samples = _samples(7)
    upd = _update(_rl(), Policy())
    result, reads = _counted(samples, lambda: upd.update(0, samples, samples[0]))
    assert result.updates == 2
    assert reads.total == 2, f"{reads.total} host reads for 2 updates:\n{reads.report()}"


@pytest.mark.parametrize("loss", [{"loss__loss_agg": "seq-mean"}, {"policy_loss": "gspo", "loss__loss_agg": "seq-mean"},
                                  {"policy_loss": "gspo_token"},
                                  {"loss__rollout_correction": "mis", "loss__rollout_correction_cap": 2.0},
                                  {"loss__rollout_correction": "tis", "loss__rollout_correction_cap": 2.0}],
                         ids=["seq-mean", "gspo", "gspo_token", "mis", "tis"])
def test_sequence_losses_read_the_device_once_per_optimizer_update(loss):
    """The segment count of seq-mean / GSPO / MIS comes from the sequence ids' host copy, GSPO's check of one
    advantage per sequence and the mismatch metrics' presence from the host copies too (each micro-batch read the
    device 2-10 times)."""
    samples = _samples(7)
    upd = _update(_rl(**loss), Policy())
    result, reads = _counted(samples, lambda: upd.update(0, samples, samples[0]))
    assert result.updates == 2
    assert reads.total == 2, f"{reads.total} host reads for 2 updates:\n{reads.report()}"


def test_proximal_update_reads_the_device_once():
    """Asynchronous GRPO with stale samples, one update: the proximal log-probs are the update forward's own, on the
    host with the update's read (the rollout / training mismatch is measured on them after the step)."""
    rl = _rl(mini_batches_per_step=1)
    rl.allocation, rl.asynchronous.max_head_offpolicyness = object(), 1
    samples = _samples(5)
    upd = _update(rl, Policy())
    assert upd.decoupled
    result, reads = _counted(samples, lambda: upd.update(0, samples, samples[0], proximal_from_forward=True))
    assert result.updates == 1
    assert reads.total == 1, reads.report()
    with torch.no_grad():
        for s in samples:
            torch.testing.assert_close(s.old_logp, upd.bundle.wrapper(pack_samples([s])), rtol=0.5, atol=1.0)
            assert s.old_logp.dtype == torch.float32 and s.old_logp.shape == s.behav_logp.shape


def test_reference_and_old_log_prob_passes_read_the_device_once_each():
    samples = _samples(9)
    policy = Policy()
    upd = _update(_rl(loss__kl_coef=0.1), policy, reference=Reference(policy))
    _, reads = _counted(samples, lambda: upd.reference_logprobs(samples, samples[0]))
    assert len(upd.packs(samples)) > 1 and reads.total == 1, reads.report()
    _, reads = _counted(samples, lambda: upd.recompute_old_logprobs(samples, samples[0]))
    assert reads.total == 1, reads.report()
    with torch.no_grad():
        for s in samples:  # the pieces each sample got are its own log-probs
            assert torch.equal(s.ref_logp, s.old_logp)
            torch.testing.assert_close(s.old_logp, policy(pack_samples([s])), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("value_clip,agg", [(0.0, "token-mean"), (0.2, "token-mean"), (0.2, "seq-mean")])
def test_critic_values_pass_and_updates_read_the_device_once_each(value_clip, agg):
    rl = _rl(advantage="gae", critic__value_clip=value_clip, ppo_epochs=2, loss__loss_agg=agg)
    torch.manual_seed(0)
    model = ValueModel(Backbone())
    critic = Critic(model, torch.optim.SGD(model.parameters(), lr=0.1), rl,
                    shards=DataShards(rank=0, world=1, copies=1, device=torch.device("cpu")), max_grad_norm=0.5, seed=0)
    samples = _samples(7)
    upd = _update(rl, Policy(), critic=critic)
    _, reads = _counted(samples, lambda: critic.values(samples, upd.packs, upd._pack))
    assert reads.total == 1, reads.report()
    critic.prepare(samples, upd.packs, upd._pack)
    metrics, reads = _counted(samples, lambda: critic.update(0, samples, upd.packs, upd._pack))
    assert reads.total == 4, f"{reads.total} host reads for 2 epochs x 2 mini-batches:\n{reads.report()}"
    assert metrics["critic/value_loss"] > 0 and metrics["critic/grad_norm"] > 0


def test_logged_losses_and_norms_are_plain_torchs():
    """Each update of the step: the token-mean clipped objective of its mini-batch (ratio 1 at the first update),
    its clipped-to-0.5 gradient norm and SGD step, as plain torch computes them."""
    samples = _samples(7)
    policy = Policy()
    with torch.no_grad():
        for s in samples:
            s.old_logp = policy(pack_samples([s]))
    ref = copy.deepcopy(policy)
    result = _update(_rl(), policy).update(0, samples, samples[0])
    order = list(range(len(samples)))
    random.Random(((5 * 1_000_003 + 0) * 131 + 0) * 8191 + 0).shuffle(order)
    opt = torch.optim.SGD(ref.parameters(), lr=0.3)
    for m in range(2):
        mb = [samples[i] for i in order[m::2]]
        lp = [ref(pack_samples([s])) for s in mb]
        n = sum(x.numel() for x in lp)
        ratio = [torch.exp(x - s.old_logp) for s, x in zip(mb, lp)]
        loss = sum(torch.maximum(-s.advantage * r, -s.advantage * r.clamp(0.8, 1.2)).sum() for s, r in zip(mb, ratio)) / n
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        assert result.losses[m] == pytest.approx(float(loss), rel=1e-5)
        assert result.grad_norms[m] == pytest.approx(float(norm), rel=1e-5)
    assert result.grad_norms[0] > 0.5  # clipping took part
    for a, b in zip(policy.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
