"""Decode attention: one new query token per sequence against that sequence's cached keys / values.

This is the attention of a decoding step in the rollout engine. The cache is pre-allocated and
addressed per sequence, so no padded `[B, S]` batch is built and no padding mask is read:

* slot layout: `k_cache` / `v_cache` `[num_slots, max_len, Hkv, D]`; sequence b reads slot
  `slot_ids[b]` (default b), keys `0 ... cache_seqlens[b] - 1` (the new token's key already written);
* paged layout: `k_cache` / `v_cache` `[num_blocks, block_size, Hkv, D]` and `block_table`
  `[B, max_blocks]` (int): key position j of sequence b is `k_cache[block_table[b, j // block_size],
  j % block_size]`. The slot layout is the paged layout with one block per sequence.

q is `[B, Hq, D]` (the single query of each sequence), GQA as in `kernels.attention` (query head h
reads kv head h // (Hq // Hkv)); the output is `[B, Hq, D]` in q's dtype. No causal mask is needed:
the query is the last position and sees every cached key. A sequence with no cached key outputs
zeros. `max_seqlen_k` (an int the caller knows without a device sync) bounds the keys read; default
the whole cache. A length beyond the cache's capacity (`max_len`, or `max_blocks * block_size`) is a
ValueError where a backend has the lengths on the host (CPU lengths: the torch and C++ backends); lengths on
an accelerator are trusted (reading them would add a device sync per step).

`shared_prefix=(prefix_rows, prefix_lens)` (both `[B]` integer tensors, optional) is a promise about the
cache, not a change of the result: the first `prefix_lens[b]` keys and values of sequence b equal those of
sequence `prefix_rows[b]`, a sequence that is its own row there (`prefix_rows[r] = r`) with the same length
(0: nothing shared). The G samples of one prompt in a GRPO rollout each hold a copy of the prompt's cache;
a backend may read such a prefix once for all the sequences that share it (the CPU kernel of
`megatron_vlm._C` does: the same attention up to fp32 rounding), the others attend to each sequence's own
copy.

Numerics: the loop computes in fp32; the vectorised backend runs torch's fused SDPA (fp32 for fp32
inputs, fp32 accumulation for bf16 / fp16), so a decoding step equals the batched masked attention over
the same keys up to summation order.

`decode_attention_loop` is the ground truth of the tests (one sequence at a time, the plain formula);
`decode_attention` is the vectorised torch backend (one fused SDPA call for all sequences).
"""
from typing import Optional

import torch

__all__ = ["decode_attention", "decode_attention_loop", "check_decode_attention_inputs", "check_cache_seqlens"]


def check_decode_attention_inputs(q, k_cache, v_cache, cache_seqlens, slot_ids, block_table, shared_prefix=None) -> None:
    if q.dim() != 3:
        raise ValueError(f"decode_attention: q must be [B, H, D], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"decode_attention: k_cache / v_cache must be equal [slots or blocks, len, Hkv, D], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if q.shape[-1] != k_cache.shape[-1]:
        raise ValueError(f"decode_attention: head dim of q ({q.shape[-1]}) != head dim of the cache ({k_cache.shape[-1]})")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"decode_attention: kv heads {k_cache.shape[2]} must divide query heads {q.shape[1]}")
    if cache_seqlens.shape != (q.shape[0],):
        raise ValueError(f"decode_attention: cache_seqlens must be [{q.shape[0]}], got {tuple(cache_seqlens.shape)}")
    if slot_ids is not None and block_table is not None:
        raise ValueError("decode_attention: pass slot_ids (slot layout) or block_table (paged layout), not both")
    if slot_ids is not None and slot_ids.shape != (q.shape[0],):
        raise ValueError(f"decode_attention: slot_ids must be [{q.shape[0]}], got {tuple(slot_ids.shape)}")
    if block_table is not None and (block_table.dim() != 2 or block_table.shape[0] != q.shape[0]):
        raise ValueError(f"decode_attention: block_table must be [{q.shape[0]}, max_blocks], got {tuple(block_table.shape)}")
    if slot_ids is None and block_table is None and k_cache.shape[0] < q.shape[0]:
        raise ValueError(f"decode_attention: {q.shape[0]} queries but only {k_cache.shape[0]} cache slots")
    if shared_prefix is not None and (len(shared_prefix) != 2 or any(t.shape != (q.shape[0],) for t in shared_prefix)):
        raise ValueError(f"decode_attention: shared_prefix must be (prefix_rows, prefix_lens), each [{q.shape[0]}]")


def check_cache_seqlens(cache_seqlens: torch.Tensor, capacity: int) -> None:
    """ValueError when a sequence claims more cached keys than the cache holds (a caller's bookkeeping error, which
    the mask would otherwise cap silently). Reads the lengths on the host: call it only where they are there (CPU)."""
    if cache_seqlens.numel() and int(cache_seqlens.max()) > capacity:
        b = int((cache_seqlens > capacity).nonzero()[0, 0])
        raise ValueError(f"decode_attention: sequence {b} has cache_seqlens {int(cache_seqlens[b])} but the cache "
                         f"holds {capacity} positions per sequence")


def _gather_keys(cache: torch.Tensor, slot_ids, block_table, length: int) -> torch.Tensor:
    """[B, length, Hkv, D] keys (or values) of every sequence, in position order."""
    if block_table is not None:
        block = cache.shape[1]
        n_blocks = -(-length // block)
        blocks = cache.index_select(0, block_table[:, :n_blocks].reshape(-1).long())
        return blocks.view(block_table.shape[0], n_blocks * block, *cache.shape[2:])[:, :length]
    if slot_ids is not None:
        return cache[:, :length].index_select(0, slot_ids.long())
    return cache[:, :length]


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    slot_ids: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    max_seqlen_k: Optional[int] = None,
    softmax_scale: Optional[float] = None,
    shared_prefix: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> torch.Tensor:
    """Vectorised: the keys of all sequences gathered to `[B, max_seqlen_k, Hkv, D]` (a view when the
    sequences are the first B slots in order), scores masked beyond each sequence's length; every sequence
    reads its own copy of a `shared_prefix` (module docstring)."""
    check_decode_attention_inputs(q, k_cache, v_cache, cache_seqlens, slot_ids, block_table, shared_prefix)
    batch, hq, dim = q.shape
    if block_table is not None:
        capacity = block_table.shape[1] * k_cache.shape[1]
    else:
        capacity = k_cache.shape[1]
    if cache_seqlens.device.type == "cpu":  # lengths on an accelerator stay there: no sync to check them
        check_cache_seqlens(cache_seqlens, capacity)
    length = capacity if max_seqlen_k is None else min(int(max_seqlen_k), capacity)
    scale = dim ** -0.5 if softmax_scale is None else softmax_scale
    if length <= 0:
        return torch.zeros_like(q)
    k = _gather_keys(k_cache, slot_ids, block_table, length)[:batch]
    v = _gather_keys(v_cache, slot_ids, block_table, length)[:batch]
    # torch's fused SDPA on the cache's own layout: [B, S, Hkv, D] -> [B, Hkv, S, D] is a strided view
    # (no copy into a head-major layout; decoding is bound by reading the cache), GQA as query rows (below), fp32
    # accumulation inside the kernel for low-precision inputs.
    # GQA as queries: the Hq / Hkv query heads that read one kv head are that head's `group` query rows
    # ([B, Hkv, group, D]; no causal mask, every query sees every key), so the kernel runs B x Hkv tasks of
    # `group` queries each instead of B x Hq tasks of one query (CPU flash SDPA at decode shapes: ~0.45
    # instead of ~0.65 ms per call for B = 64, 4 / 2 heads; the same sums in another blocking order)
    hkv = k.shape[2]
    seqlens = cache_seqlens.to(q.device)
    visible = torch.arange(length, device=q.device)[None, :] < seqlens[:, None]  # [B, S]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.reshape(batch, hkv, hq // hkv, dim), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=visible[:, None, None, :], scale=scale,
    ).reshape(batch, hq, dim)
    # a sequence without keys (seqlen <= 0; length > 0 here): the softmax over no key is 0/0 (NaN rows, and
    # only those rows); the convention is zeros, written over the whole row
    return out.masked_fill((seqlens <= 0)[:, None, None], 0.0)


def decode_attention_loop(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    slot_ids: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    max_seqlen_k: Optional[int] = None,
    softmax_scale: Optional[float] = None,
) -> torch.Tensor:
    """The plain formula, one sequence and one head at a time (tests' ground truth; slow)."""
    check_decode_attention_inputs(q, k_cache, v_cache, cache_seqlens, slot_ids, block_table)
    check_cache_seqlens(cache_seqlens.cpu(), k_cache.shape[1] * (1 if block_table is None else block_table.shape[1]))
    batch, hq, dim = q.shape
    hkv = k_cache.shape[2]
    scale = dim ** -0.5 if softmax_scale is None else softmax_scale
    out = torch.zeros(batch, hq, dim, dtype=torch.float32, device=q.device)
    for b in range(batch):
        n = int(cache_seqlens[b])
        if max_seqlen_k is not None:
            n = min(n, int(max_seqlen_k))
        if n <= 0:
            continue
        if block_table is not None:
            bs = k_cache.shape[1]
            pos = torch.arange(n)
            blocks = block_table[b].long().cpu()[pos // bs]
            k = k_cache[blocks.to(k_cache.device), (pos % bs).to(k_cache.device)]
            v = v_cache[blocks.to(k_cache.device), (pos % bs).to(k_cache.device)]
        else:
            slot = int(slot_ids[b]) if slot_ids is not None else b
            k, v = k_cache[slot, :n], v_cache[slot, :n]
        for h in range(hq):
            kh = h // (hq // hkv)
            s = (k[:, kh].float() @ q[b, h].float()) * scale
            out[b, h] = torch.softmax(s, dim=0) @ v[:, kh].float()
    return out.to(q.dtype)
