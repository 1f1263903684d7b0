"""CPU decode attention of megatron_vlm._C (csrc/cpu_decode_attention.cpp) at the rollout shapes: head dims
32 / 64 / 128 (its register-resident kernels, 16-wide where the CPU has AVX-512, 8-wide under
ATEN_CPU_CAPABILITY=avx2 or without it), GQA groups 4:1, 6:1 and 8:1, cached lengths 1 to 1000 in one
batch (blocks of keys and their partial last block), the slot and the paged layout.

Ground truth: `decode_attention_loop` of kernels/reference/ (one sequence at a time, the plain formula)
in float64. A sequence's output must not depend on the batch it is in or on the thread count (tasks
take whole sequences or single kv heads depending on both).
"""
import importlib

import pytest
import torch

ref_decode = importlib.import_module("megatron_vlm.kernels.reference.decode_attention")
LENGTHS = [1, 7, 8, 33, 257, 1000]


@pytest.fixture
def ops(ext):
    return importlib.import_module("megatron_vlm.kernels.csrc.layer_ops")


def _close(a, b, rel=2e-6):
    scale = max(b.abs().max().item(), 1e-6)
    assert (a.double() - b.double()).abs().max().item() <= rel * scale


@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("hq,hkv", [(8, 2), (12, 2), (8, 1)])
def test_decode_attention_matches_the_float64_loop(ops, d, hq, hkv):
    g = torch.Generator().manual_seed(d + hq + hkv)
    batch, length = len(LENGTHS), max(LENGTHS)
    q = torch.randn(batch, hq, d, generator=g)
    kc = torch.randn(batch + 1, length, hkv, d, generator=g)
    vc = torch.randn(batch + 1, length, hkv, d, generator=g)
    seqlens = torch.tensor(LENGTHS)
    slots = torch.randperm(batch + 1, generator=g)[:batch]
    got = ops.decode_attention(q, kc, vc, seqlens, slot_ids=slots, max_seqlen_k=length)
    _close(got, ref_decode.decode_attention_loop(q.double(), kc.double(), vc.double(), seqlens, slot_ids=slots))
    alone = ops.decode_attention(q[4:5], kc, vc, seqlens[4:5], slot_ids=slots[4:5], max_seqlen_k=length)
    assert torch.equal(alone, got[4:5])  # one sequence alone: tasks split by kv head, the same sums


def test_decode_attention_paged_long_sequences_and_threads(ops):
    g = torch.Generator().manual_seed(21)
    hq, hkv, d, block = 12, 2, 64, 16
    seqlens = torch.tensor([1000, 575, 16, 17])
    blocks = -(-1000 // block)
    kp = torch.randn(len(seqlens) * blocks, block, hkv, d, generator=g)
    vp = torch.randn(len(seqlens) * blocks, block, hkv, d, generator=g)
    table = torch.randperm(len(seqlens) * blocks, generator=g).reshape(len(seqlens), blocks).int()
    q = torch.randn(len(seqlens), hq, d, generator=g)
    old = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(ops.decode_attention(q, kp, vp, seqlens, block_table=table))
    finally:
        torch.set_num_threads(old)
    assert torch.equal(outs[0], outs[1])
    _close(outs[0], ref_decode.decode_attention_loop(q.double(), kp.double(), vp.double(), seqlens, block_table=table))


@pytest.mark.parametrize("paged", [False, True])
def test_a_length_beyond_the_capacity_is_an_error(ops, paged):
    """A sequence claiming more cached keys than its cache holds is a caller's bookkeeping error: ValueError naming
    it (the C++ op reads the lengths anyway), not attention over the capacity, silently capped."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 4, 32, generator=g)
    kc, vc = torch.randn(2, 3, 8, 2, 32, generator=g).unbind(0)  # 3 slots of 8 positions, or 3 blocks of 8
    kw = {"block_table": torch.tensor([[0], [1], [2]])} if paged else {"slot_ids": torch.tensor([2, 0, 1])}
    full = torch.tensor([8, 1, 8])
    ops.decode_attention(q, kc, vc, full, **kw)  # the whole capacity is fine
    with pytest.raises(ValueError, match="sequence 2 has cache_seqlens 9 but the cache holds 8 positions"):
        ops.decode_attention(q, kc, vc, torch.tensor([8, 1, 9]), **kw)
    with pytest.raises(ValueError, match="sequence 2 has cache_seqlens 9"):  # also when max_seqlen_k bounds the read
        ops.decode_attention(q, kc, vc, torch.tensor([8, 1, 9]), max_seqlen_k=4, **kw)
