"""kernels.decode_attention (one query token per sequence against a slot or paged KV cache).

Ground truths: the per-sequence, per-head loop of the reference module, and — independent of the
op's own code — `kernels.attention` (batched, GQA, bottom-right causal alignment) over the same keys
laid out as a left-padded batch with a key padding mask, the way decoding ran before slots existed.
"""
import pytest
import torch

from megatron_vlm import kernels
from megatron_vlm.kernels.reference.attention import attention as reference_attention
from megatron_vlm.kernels.reference.decode_attention import decode_attention as torch_decode_attention
from megatron_vlm.kernels.reference.decode_attention import decode_attention_loop

SHAPES = [  # (sequences, slots, max_len, Hq, Hkv, D)
    (1, 1, 1, 1, 1, 8),
    (3, 5, 7, 4, 2, 16),
    (7, 9, 19, 6, 1, 32),
]


def _case(shape, dtype, seed):
    b, slots, length, hq, hkv, d = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, d, generator=g).to(dtype)
    k = torch.randn(slots, length, hkv, d, generator=g).to(dtype)
    v = torch.randn(slots, length, hkv, d, generator=g).to(dtype)
    slot_ids = torch.randperm(slots, generator=g)[:b]
    seqlens = torch.randint(1, length + 1, (b,), generator=g)
    return q, k, v, slot_ids, seqlens


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_slot_layout_matches_loop_and_padded_attention(shape, dtype, tol):
    q, k, v, slot_ids, seqlens = _case(shape, dtype, seed=sum(shape))
    out = kernels.decode_attention(q, k, v, seqlens, slot_ids=slot_ids)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out, decode_attention_loop(q, k, v, seqlens, slot_ids=slot_ids), atol=tol, rtol=tol)
    # the same keys left-padded into a [B, S] batch with a padding mask, through the batched attention op
    b, width = q.shape[0], int(seqlens.max())
    kp = torch.zeros(b, width, *k.shape[2:], dtype=dtype)
    vp = torch.zeros_like(kp)
    mask = torch.zeros(b, width, dtype=torch.bool)
    for i in range(b):
        n = int(seqlens[i])
        kp[i, width - n:], vp[i, width - n:] = k[slot_ids[i], :n], v[slot_ids[i], :n]
        mask[i, width - n:] = True
    ref = reference_attention(q[:, None].float(), kp.float(), vp.float(), causal=True, key_padding_mask=mask)[:, 0]
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    # max_seqlen_k bounds the keys read: with the longest length it changes nothing
    torch.testing.assert_close(kernels.decode_attention(q, k, v, seqlens, slot_ids=slot_ids, max_seqlen_k=width), out)


def test_first_slots_in_order_and_paged_layout():
    q, k, v, _, seqlens = _case((3, 5, 7, 4, 2, 16), torch.float32, seed=1)
    ordered = torch.arange(3)
    torch.testing.assert_close(kernels.decode_attention(q, k, v, seqlens),
                               kernels.decode_attention(q, k, v, seqlens, slot_ids=ordered))
    # page the slot cache into blocks of 3 positions, scattered over a shuffled pool
    block, nblk = 3, 3  # 7 positions -> 3 blocks per sequence
    pool_k = torch.zeros(3 * nblk + 2, block, 2, 16)
    pool_v = torch.zeros_like(pool_k)
    order = torch.randperm(pool_k.shape[0], generator=torch.Generator().manual_seed(0))
    table = order[: 3 * nblk].view(3, nblk)
    for s in range(3):
        padded_k = torch.nn.functional.pad(k[s], (0, 0, 0, 0, 0, nblk * block - 7))
        padded_v = torch.nn.functional.pad(v[s], (0, 0, 0, 0, 0, nblk * block - 7))
        pool_k[table[s]] = padded_k.view(nblk, block, 2, 16)
        pool_v[table[s]] = padded_v.view(nblk, block, 2, 16)
    paged = kernels.decode_attention(q, pool_k, pool_v, seqlens, block_table=table)
    torch.testing.assert_close(paged, kernels.decode_attention(q, k, v, seqlens), atol=1e-6, rtol=0)
    torch.testing.assert_close(paged, decode_attention_loop(q, pool_k, pool_v, seqlens, block_table=table), atol=1e-6, rtol=0)


def test_empty_sequence_gives_zeros_and_bad_shapes_raise():
    q, k, v, slot_ids, _ = _case((3, 5, 7, 4, 2, 16), torch.float32, seed=2)
    out = kernels.decode_attention(q, k, v, torch.tensor([0, 3, 0]), slot_ids=slot_ids)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and out[1].abs().sum() > 0
    with pytest.raises(ValueError, match="must divide"):
        kernels.decode_attention(q[:, :3], k, v, torch.ones(3, dtype=torch.long))
    with pytest.raises(ValueError, match="cache_seqlens"):
        kernels.decode_attention(q, k, v, torch.ones(2, dtype=torch.long))
    with pytest.raises(ValueError, match="not both"):
        kernels.decode_attention(q, k, v, torch.ones(3, dtype=torch.long), slot_ids=slot_ids, block_table=slot_ids[:, None])


@pytest.mark.parametrize("op", [torch_decode_attention, decode_attention_loop, kernels.decode_attention],
                         ids=["torch", "loop", "dispatched"])
@pytest.mark.parametrize("paged", [False, True])
def test_a_length_beyond_the_capacity_is_an_error(op, paged):
    """More cached keys claimed than the cache holds (CPU lengths, read on the host at no sync): ValueError naming
    the sequence, not attention over the capacity, silently capped."""
    q, k, v, slot_ids, _ = _case((3, 5, 7, 4, 2, 16), torch.float32, seed=4)
    kw = {"block_table": slot_ids[:, None]} if paged else {"slot_ids": slot_ids}  # a slot is one block of 7
    op(q, k, v, torch.tensor([7, 1, 7]), **kw)  # the whole capacity is fine
    with pytest.raises(ValueError, match="sequence 1 has cache_seqlens 8 but the cache holds 7 positions"):
        op(q, k, v, torch.tensor([7, 8, 2]), **kw)
