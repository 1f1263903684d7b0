"""PPO's critic on an MoE backbone is balanced by the run's `[moe]` policy, as the policy is: its auxiliary loss
reaches the critic's routers (checked against the Switch Transformer loss written out here) and the step's
expert loads move its score-correction biases (DeepSeek-V3's sign update, written out here)."""
from __future__ import annotations

import torch

from megatron_vlm.models.common.moe import MoE
from megatron_vlm.rl.batching import TrainSample
from megatron_vlm.rl.critic.ppo_critic import Critic
from megatron_vlm.rl.data_shards import DataShards
from megatron_vlm.training.moe_balancing import MoEConfig, MoELoadBalancer
from tests.fixtures.rl_config import rl_config

HIDDEN, EXPERTS, TOP_K = 8, 4, 2
SHARDS = DataShards(rank=0, world=1, copies=1, device=torch.device("cpu"))


class _MoEValues(torch.nn.Module):
    """Values = a head on one MoE block over per-token features carried by the samples."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.moe = MoE(HIDDEN, num_experts=EXPERTS, top_k=TOP_K, moe_intermediate_size=6, activation="silu",
                       gated_experts=True)
        self.moe.reset_parameters(0.5)
        self.head = torch.nn.Linear(HIDDEN, 1)

    def forward(self, batch):
        return self.head(self.moe(torch.cat([s._x for s in batch["group"]]))).squeeze(-1)


def _samples() -> list[TrainSample]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i, n in enumerate((5, 7, 3, 6)):
        s = TrainSample(prompt=None, response_ids=torch.zeros(n, dtype=torch.long), behav_logp=torch.zeros(n),  # type: ignore[arg-type]
                        advantage=0.0, old_logp=torch.zeros(n), score=float(i % 2))
        s._x = torch.randn(n, HIDDEN, generator=g)  # type: ignore[attr-defined]
        out.append(s)
    return out


def _critic(model, moe_cfg, lr):
    rl = rl_config(advantage="gae", loss_agg="token-mean", ppo_epochs=1)
    balancer = MoELoadBalancer(model, moe_cfg)
    return Critic(model, torch.optim.SGD(model.parameters(), lr=lr), rl, shards=SHARDS,  # type: ignore[arg-type]
                  max_grad_norm=0.0, seed=0, balancer=balancer)


def _pack(ss):
    return [list(ss)] if ss else []


def _to_batch(group):
    return {"group": group}


def test_the_critics_step_loads_move_its_correction_biases():
    model = _MoEValues()
    routed = []
    model.moe.gate.register_forward_hook(lambda mod, args, out: routed.append(out[2]) if model.training else None)
    rate = 0.01
    critic = _critic(model, MoEConfig(bias_update_rate=rate, n_step_per_workload_report=1), lr=0.0)
    samples = _samples()
    critic.prepare(samples, _pack, _to_batch)
    out = critic.update(0, samples, _pack, _to_batch)
    load = torch.bincount(torch.cat(routed).reshape(-1), minlength=EXPERTS).double()
    assert load.sum() == sum(len(s.response_ids) for s in samples) * TOP_K
    delta = rate * torch.sign(load.mean() - load)
    expect = (delta - delta.mean()).float()
    assert expect.abs().sum() > 0
    torch.testing.assert_close(model.moe.gate.e_score_correction_bias, expect)
    assert out["critic/moe/max_fraction_max"] > 0


def test_the_aux_loss_reaches_the_critics_router():
    model = _MoEValues()
    torch.nn.init.zeros_(model.head.weight)  # values do not depend on the router: its gradient is the aux loss's
    torch.nn.init.zeros_(model.head.bias)
    before = model.moe.gate.weight.detach().clone()
    coef = 0.5
    critic = _critic(model, MoEConfig(enable_moe_load_balancing_training=False, aux_loss_coef=coef), lr=1.0)
    samples = _samples()
    critic.prepare(samples, _pack, _to_batch)
    x = torch.cat([s._x for s in samples])
    critic.update(0, samples, _pack, _to_batch)
    # the Switch Transformer loss of that forward: E * sum_e f_e * P_e, f_e the share of the N * k assignments
    w = before.clone().requires_grad_(True)
    scores = torch.sigmoid(x @ w.T)
    ids = scores.topk(TOP_K, dim=-1).indices
    f = torch.bincount(ids.reshape(-1), minlength=EXPERTS).float() / (x.shape[0] * TOP_K)
    p = (scores / scores.sum(-1, keepdim=True)).mean(0)
    (coef * EXPERTS * (f * p).sum()).backward()
    assert w.grad is not None and w.grad.abs().sum() > 0
    torch.testing.assert_close(before - model.moe.gate.weight.detach(), w.grad)
