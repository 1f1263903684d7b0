"""Decode attention with a shared prefix (`decode_attention_prefix` of csrc/cpu_decode_attention.cpp, reached through
`kernels.decode_attention(..., shared_prefix=...)`), and the hint the slot caches give it.

Ground truth: `decode_attention_loop` of kernels/reference/ in float64, where every sequence reads its own copy of
the shared keys (the hint is a promise about the cache, not a change of the result). The slot and the paged layout
must give the same bits (the rollout engine's two caches train alike), and a sequence's output must not depend on
the thread count. A hint that does not hold (a root that is not its own, a prefix longer than a sequence) is an
error, not a silent misread; a cache whose copies differ shows that the kernel really reads the root's copy.
"""
import importlib

import pytest
import torch

ref_decode = importlib.import_module("megatron_vlm.kernels.reference.decode_attention")

# 8 sequences: rows 0-3 share 100 keys (root row 1), rows 4-5 share 37 (root 5), row 6 alone, row 7 has no key;
# row 2's keys are exactly its prefix (no key of its own after it)
ROOTS = [1, 1, 1, 1, 5, 5, 6, 7]
PREFIX = [100, 100, 100, 100, 37, 37, 0, 0]
LENS = [130, 101, 100, 250, 37, 60, 200, 0]


@pytest.fixture
def ops(ext):
    return importlib.import_module("megatron_vlm.kernels.csrc.layer_ops")


def _caches(g, hkv, d, slots, length=256):
    kc = torch.randn(int(slots.max()) + 2, length, hkv, d, generator=g)
    vc = torch.randn_like(kc)
    for b, (r, p) in enumerate(zip(ROOTS, PREFIX)):  # the copies the hint promises
        kc[slots[b], :p] = kc[slots[r], :p]
        vc[slots[b], :p] = vc[slots[r], :p]
    return kc, vc


def _paged(cache, slots, block=16):
    """The same keys in a shuffled pool of blocks: (pool, block_table)."""
    n_slots, length = cache.shape[:2]
    per = length // block
    perm = torch.randperm(n_slots * per, generator=torch.Generator().manual_seed(5))
    pool = torch.empty(n_slots * per, block, *cache.shape[2:])
    pool[perm] = cache.reshape(n_slots * per, block, *cache.shape[2:])
    table = perm.reshape(n_slots, per)[slots]
    return pool, table


def _hint():
    return torch.tensor(ROOTS), torch.tensor(PREFIX)


def _close(a, b, rel=2e-6):
    scale = max(b.abs().max().item(), 1e-6)
    assert (a.double() - b.double()).abs().max().item() <= rel * scale


@pytest.mark.parametrize("d,hq,hkv", [(64, 12, 2), (32, 8, 2), (128, 8, 1), (24, 4, 4), (40, 8, 2)])
def test_shared_prefix_matches_each_own_copy(ops, d, hq, hkv):
    g = torch.Generator().manual_seed(d + hq)
    slots = torch.tensor([3, 0, 7, 2, 5, 9, 1, 4])
    kc, vc = _caches(g, hkv, d, slots)
    q = torch.randn(len(LENS), hq, d, generator=g)
    seqlens = torch.tensor(LENS)
    outs = []
    old = torch.get_num_threads()
    try:
        for threads in (1, 2, 6):  # 6: fewer rows than 2 x threads, so tasks take single kv heads
            torch.set_num_threads(threads)
            outs.append(ops.decode_attention(q, kc, vc, seqlens, slot_ids=slots, shared_prefix=_hint()))
    finally:
        torch.set_num_threads(old)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    want = ref_decode.decode_attention_loop(q.double(), kc.double(), vc.double(), seqlens, slot_ids=slots)
    _close(outs[0], want)
    assert torch.equal(outs[0][7], torch.zeros(hq, d))  # no key: zeros
    # the same keys through a block table: the same bits
    kp, table = _paged(kc, slots)
    vp, _ = _paged(vc, slots)
    paged = ops.decode_attention(q, kp, vp, seqlens, block_table=table, shared_prefix=_hint())
    assert torch.equal(paged, outs[0])


def test_the_shared_keys_are_read_from_the_root(ops):
    """Break the promise on purpose (row 0's copy of the prefix differs): the hint makes row 0 read row 1's copy."""
    g = torch.Generator().manual_seed(3)
    slots = torch.arange(8)
    kc, vc = _caches(g, 2, 64, slots)
    kc[0, :100] += 1.0
    q = torch.randn(8, 12, 64, generator=g)
    seqlens = torch.tensor(LENS)
    got = ops.decode_attention(q, kc, vc, seqlens, shared_prefix=_hint())
    own = ref_decode.decode_attention_loop(q.double(), kc.double(), vc.double(), seqlens)
    kc_root = kc.clone()
    kc_root[0, :100] = kc[1, :100]
    via_root = ref_decode.decode_attention_loop(q.double(), kc_root.double(), vc.double(), seqlens)
    _close(got, via_root)
    assert (got[0].double() - own[0]).abs().max() > 1e-3


def test_backends_without_the_kernel_read_each_copy(ops):
    g = torch.Generator().manual_seed(4)
    slots = torch.arange(8)
    kc, vc = _caches(g, 2, 64, slots)
    q = torch.randn(8, 12, 64, generator=g)
    seqlens = torch.tensor(LENS)
    got = ops.decode_attention(q, kc, vc, seqlens, shared_prefix=_hint())
    torch_backend = ref_decode.decode_attention(q, kc, vc, seqlens, shared_prefix=_hint())
    _close(got, torch_backend.double(), rel=5e-6)


@pytest.mark.parametrize("roots,prefix,match", [
    ([1, 0, 2, 3], [4, 4, 0, 0], "its own root"),          # row 1's root is row 0, whose root is row 1
    ([0, 0, 2, 3], [4, 5, 0, 0], "same length"),
    ([0, 0, 2, 3], [9, 9, 0, 0], "fewer"),                 # longer than the rows' keys
    ([0, 7, 2, 3], [4, 4, 0, 0], "not a row"),
])
def test_a_hint_that_does_not_hold_is_refused(ops, roots, prefix, match):
    q = torch.randn(4, 4, 32)
    kc = torch.randn(4, 16, 2, 32)
    with pytest.raises((ValueError, IndexError, RuntimeError), match=match):
        ops.decode_attention(q, kc, kc.clone(), torch.tensor([8, 8, 8, 8]),
                             shared_prefix=(torch.tensor(roots), torch.tensor(prefix)))
    with pytest.raises(ValueError, match="shared_prefix"):
        ops.decode_attention(q, kc, kc.clone(), torch.tensor([8, 8, 8, 8]), shared_prefix=(torch.tensor([0]),) * 2)
