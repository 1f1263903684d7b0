"""Routing replay on one MoE block against a pure-torch transcription of the router and expert equations.

Replay forces the recorded experts and recomputes the gate weights from the current router scores with the
router's normalisation: sigmoid (NemotronH / DeepSeek-V3: the correction bias and the group selection only
pick experts) or softmax (Qwen3-MoE), renormalised when `norm_topk_prob`, times `routed_scaling_factor`.
The reference below writes those equations out per token and expert (no kernel, no permutation) and is
differentiated by autograd: outputs and router gradients must agree; a -1 row routes itself.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_vlm.models.common.mlp import MLP
from megatron_vlm.models.common.moe import MoE
from megatron_vlm.models.common.routing_replay import (
    RoutingReplayError,
    recording_routes,
    replaying_routes,
    route_dtype,
    routes_bytes_per_token,
)

HIDDEN = 16


def _block(kind: str) -> MoE:
    g = torch.Generator().manual_seed(0)
    if kind == "sigmoid":
        moe = MoE(HIDDEN, num_experts=8, top_k=2, moe_intermediate_size=12, activation="relu2", gated_experts=False,
                  score_func="sigmoid", n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
                  score_correction_bias=True, shared_experts=MLP(HIDDEN, 20, activation="gelu"))
    else:
        moe = MoE(HIDDEN, num_experts=4, top_k=2, moe_intermediate_size=10, activation="silu", gated_experts=True,
                  score_func="softmax", norm_topk_prob=kind == "softmax_norm", score_correction_bias=False)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        if moe.gate.e_score_correction_bias is not None:
            moe.gate.e_score_correction_bias.copy_(torch.randn(8, generator=g) * 0.05)
    return moe


def _reference(moe: MoE, x: torch.Tensor, ids: torch.Tensor, router_weight: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_j w[t, j] * expert_{ids[t, j]}(x[t]) (+ shared expert), w from the router's scores of ids."""
    gate, ex = moe.gate, moe.experts
    logits = x @ router_weight.t()
    scores = torch.sigmoid(logits) if gate.score_func == "sigmoid" else torch.softmax(logits, dim=-1)
    w = torch.stack([scores[t, ids[t]] for t in range(x.shape[0])])
    if gate.norm_topk_prob:
        w = w / w.sum(-1, keepdim=True)
    w = w * gate.routed_scaling_factor
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(HIDDEN)
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if ex.gated:
                gate_up = ex.gate_up_proj[e] @ x[t]
                a, b = gate_up.chunk(2)
                mid = F.silu(a) * b
            else:
                mid = torch.square(F.relu(ex.up_proj[e] @ x[t]))
            acc = acc + w[t, j] * (ex.down_proj[e] @ mid)
        rows.append(acc)
    out = torch.stack(rows)
    return out + moe.shared_experts(x) if moe.shared_experts is not None else out


@pytest.mark.parametrize("kind", ["sigmoid", "softmax", "softmax_norm"])
def test_replayed_block_equals_the_equations(kind):
    moe = _block(kind)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, HIDDEN, generator=g)
    with torch.no_grad(), recording_routes() as rec:
        moe(x)
    natural = rec.stacked()[:, 0].long()
    # recorded experts: a random distinct pair per token (not the natural choice), the last token unrecorded
    recorded = torch.stack([torch.randperm(moe.num_experts, generator=g)[:2] for _ in range(9)])
    recorded[-1] = -1
    routes = recorded[:, None, :].to(route_dtype(moe.num_experts))
    moe.zero_grad()
    with replaying_routes(moe, routes) as plan, recording_routes() as used:
        out = moe(x)
        out.pow(2).sum().backward()
    used_ids = used.stacked()[:, 0].long()
    assert torch.equal(used_ids[:-1], recorded[:-1]) and torch.equal(used_ids[-1], natural[-1])
    expect_ids = torch.cat([recorded[:-1], natural[-1:]])
    got_grad = moe.gate.weight.grad
    assert got_grad.abs().sum() > 0  # the router keeps its gradient under replay
    w = moe.gate.weight.detach().clone().requires_grad_(True)
    ref = _reference(moe, x, expect_ids, w)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    ref.pow(2).sum().backward()
    torch.testing.assert_close(got_grad, w.grad, atol=1e-5, rtol=1e-4)
    # the mismatch counts: recorded sets that differ from the natural ones, over the recorded tokens
    differ = (natural[:-1].sort(-1).values != recorded[:-1].sort(-1).values).any(-1).sum()
    assert plan.mismatch() == (int(differ), 8) and differ > 0
    assert moe.route_plan is None  # detached after the block


def test_compare_only_leaves_routing_and_counts():
    moe = _block("softmax")
    x = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), recording_routes() as rec:
        base = moe(x)
    routes = rec.stacked()
    flipped = routes.clone()
    flipped[:2, 0] = torch.tensor([[0, 1], [2, 3]], dtype=routes.dtype)  # maybe equal to natural: counted below
    with torch.no_grad(), replaying_routes(moe, flipped, force=False) as plan:
        out = moe(x)
    torch.testing.assert_close(out, base, atol=0, rtol=0)
    nat = routes[:2, 0].long().sort(-1).values
    expect = int((nat != flipped[:2, 0].long().sort(-1).values).any(-1).sum())
    assert plan.mismatch() == (expect, 6)


def test_layout_errors_and_sizes():
    moe = _block("softmax")
    x = torch.randn(5, HIDDEN)
    with pytest.raises(RoutingReplayError, match="runs 5 tokens"), torch.no_grad(), \
            replaying_routes(moe, torch.tensor([[[0, 1]]] * 4, dtype=torch.int8)):
        moe(x)
    with pytest.raises(RoutingReplayError, match="routes for 2 MoE layers, the model has 1"), \
            replaying_routes(moe, torch.zeros(5, 2, 2, dtype=torch.int8)):
        pass
    assert route_dtype(128) == torch.int8 and route_dtype(129) == torch.int16
    # Qwen3-VL-30B-A3B: 48 MoE layers, top 8 of 128 experts: 384 bytes per token
    assert routes_bytes_per_token(48, 8, 128) == 384 and routes_bytes_per_token(2, 2, 256) == 8


@pytest.mark.parametrize("row,why", [([1, 4], "an expert the layer does not have"), ([2, -1], "a row partly unrecorded"),
                                     ([3, 3], "one expert twice"), ([-2, 1], "a negative id other than -1")])
def test_recorded_ids_that_no_router_could_have_chosen_are_refused(row, why):
    """A record is k distinct experts of the layer per token, or a row of -1 (no route); anything else is a record
    of another model or a corrupted one: a clear error naming the token and layer, never a silent misroute (two
    copies of one expert, a -2 read as "no route") nor an index error deep in the experts."""
    moe = _block("softmax")  # 4 experts, top 2
    routes = torch.tensor([[[0, 1]], [[2, 3]], [[-1, -1]]], dtype=torch.int8)
    routes[1, 0] = torch.tensor(row, dtype=torch.int8)
    x = torch.randn(3, HIDDEN)
    for force in (True, False):
        with pytest.raises(RoutingReplayError, match=rf"recorded experts \[{row[0]}, {row[1]}\] of token 1, MoE layer 0"), torch.no_grad(), \
                replaying_routes(moe, routes, force=force):
            moe(x)
    routes[1, 0] = torch.tensor([3, 2], dtype=torch.int8)  # fixed: accepted, the -1 row routes itself
    with torch.no_grad(), replaying_routes(moe, routes) as plan:
        moe(x)
    assert plan.mismatch()[1] == 2, why
