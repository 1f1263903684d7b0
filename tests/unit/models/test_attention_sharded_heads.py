"""Attention whose q/k/v/o projections hold a shard of the heads (the layout tensor parallelism leaves:
q/k/v split by output rows = heads, o_proj by input columns). The module is built with the global
head counts, as a TP plan finds it, and its projections are swapped for the shard's slices; the
forward must take the head counts from the weights. Each shard's output is the row-parallel partial
sum, so the shards' outputs add up to the full module's output."""
import copy

import pytest
import torch
from torch import nn

from megatron_vlm.models.common.attention import Attention
from megatron_vlm.models.common.kv_cache import KVCache
from megatron_vlm.models.common.rotary import rope_cos_sin

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 32, 4, 2, 8


def _slice_linear(lin: nn.Linear, rows=None, cols=None) -> nn.Linear:
    w = lin.weight.detach()
    w = w[rows] if rows is not None else w
    w = w[:, cols] if cols is not None else w
    out = nn.Linear(w.shape[1], w.shape[0], bias=lin.bias is not None)
    with torch.no_grad():
        out.weight.copy_(w)
        if lin.bias is not None:
            out.bias.copy_(lin.bias.detach()[rows] if rows is not None else lin.bias.detach())
    return out


def shard(full: Attention, rank: int, world: int) -> Attention:
    """`full` with the heads of `rank` out of `world` (kv heads split the same way, so GQA groups stay whole)."""
    q_per, kv_per = HEADS // world, KV_HEADS // world
    qs = slice(rank * q_per * HEAD_DIM, (rank + 1) * q_per * HEAD_DIM)
    kvs = slice(rank * kv_per * HEAD_DIM, (rank + 1) * kv_per * HEAD_DIM)
    part = copy.deepcopy(full)
    part.q_proj = _slice_linear(full.q_proj, rows=qs)
    part.k_proj = _slice_linear(full.k_proj, rows=kvs)
    part.v_proj = _slice_linear(full.v_proj, rows=kvs)
    part.o_proj = _slice_linear(full.o_proj, cols=qs)
    if full.o_proj.bias is not None:  # row-parallel: the bias is added once, by rank 0
        with torch.no_grad():
            part.o_proj.bias.mul_(1.0 if rank == 0 else 0.0)
    return part


def make_full(qk_norm: bool) -> Attention:
    torch.manual_seed(0)
    attn = Attention(HIDDEN, HEADS, KV_HEADS, HEAD_DIM, qkv_bias=True, o_bias=True, causal=True,
                     qk_norm_eps=1e-6 if qk_norm else None)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return attn


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("world", [2])
def test_sharded_heads_sum_to_full_batched_and_packed(qk_norm, world):
    full = make_full(qk_norm)
    parts = [shard(full, r, world) for r in range(world)]
    assert parts[0].num_heads == HEADS  # built with the global counts, as a TP plan finds it
    assert parts[0].local_heads() == (HEADS // world, KV_HEADS // world)

    x = torch.randn(2, 6, HIDDEN)
    cos, sin = rope_cos_sin(torch.arange(6).expand(2, 6), HEAD_DIM, 10000.0)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, :2] = False
    with torch.no_grad():
        ref = full(x, cos, sin, key_padding_mask=mask)
        got = sum(p(x, cos, sin, key_padding_mask=mask) for p in parts)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)

    cu = torch.tensor([0, 4, 12], dtype=torch.int32)
    xp = torch.randn(12, HIDDEN)
    cp, sp = rope_cos_sin(torch.cat([torch.arange(4), torch.arange(8)]), HEAD_DIM, 10000.0)
    with torch.no_grad():
        ref = full(xp, cp, sp, cu_seqlens=cu, max_seqlen=8)
        got = sum(p(xp, cp, sp, cu_seqlens=cu, max_seqlen=8) for p in parts)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_sharded_heads_with_their_own_kv_cache():
    full = make_full(qk_norm=True)
    parts = [shard(full, r, 2) for r in range(2)]
    x = torch.randn(1, 5, HIDDEN)
    cos, sin = rope_cos_sin(torch.arange(5)[None], HEAD_DIM, 10000.0)
    with torch.no_grad():
        ref = full(x, cos, sin)[:, -1]
        caches = [KVCache(1, 1, 5, p.local_heads()[1], HEAD_DIM) for p in parts]
        outs = []
        for p, c in zip(parts, caches):
            for lo, hi in ((0, 4), (4, 5)):  # prefill 4 tokens, then decode one
                c.begin_step(hi - lo)
                out = p(x[:, lo:hi], cos[:, lo:hi], sin[:, lo:hi], kv_cache=c, layer_idx=0)
                c.end_step()
            outs.append(out[:, -1])
    assert caches[0].keys[0].shape[2] == KV_HEADS // 2
    torch.testing.assert_close(sum(outs), ref, rtol=1e-5, atol=1e-5)
