"""The slot caches' `shared_prefix` hint (models/common/slot_cache.py): which active rows it groups, that it forgets a
slot loaded again, and that a step with it gives the attention of every slot's own keys.

Why: the hint promises that the grouped rows hold the same prompt keys; a stale group (a slot reloaded with another
prompt, e.g. the next sample of a rollout or a multi-turn observation) would make the CPU kernel read the wrong
keys, silently. The step's output is compared with the loop ground truth over each slot's own cache."""
import pytest
import torch

from kernels.reference.decode_attention import decode_attention_loop
from megatron_vlm.models.common.kv_cache import KVCache
from megatron_vlm.models.common.slot_cache import PagedSlotCache, SlotCache

LAYERS, HKV, D, HQ = 1, 2, 32, 8


def _prefill(lengths, max_len=16, seed=0):
    """A left-padded prefilled cache with one random prompt per row."""
    g = torch.Generator().manual_seed(seed)
    src = KVCache(LAYERS, len(lengths), max_len, HKV, D)
    src.seq_len = max(lengths)
    for row, n in enumerate(lengths):
        src.mask[row, src.seq_len - n:src.seq_len] = True
        for t in src.keys + src.values:
            t[row, src.seq_len - n:src.seq_len] = torch.randn(n, HKV, D, generator=g)
    return src


def _new(kind):
    if kind == "slot":
        return SlotCache(KVCache(LAYERS, 7, 24, HKV, D))
    return PagedSlotCache(KVCache(LAYERS, 40, 4, HKV, D), num_slots=6, max_len=24)


def _load(cache, slots, src, row):
    if isinstance(cache, PagedSlotCache):
        for s in slots:
            if cache.slot_capacity[s] == 0:
                cache.reserve(s, 24)
    cache.load_prefix(slots, src, row)


@pytest.mark.parametrize("kind", ["slot", "paged"])
def test_hint_groups_the_slots_of_one_prompt_and_forgets_a_reloaded_slot(kind):
    cache = _new(kind)
    src = _prefill([5, 9, 3])
    _load(cache, [0, 1, 2], src, 0)  # prompt A (5 tokens) x 3
    _load(cache, [3, 4], src, 1)  # prompt B (9 tokens) x 2
    _load(cache, [5], src, 2)  # a lone prompt
    cache.set_active([4, 0, 5, 2, 3, 1])
    cache.begin_step(1)
    rows, lens = cache._share_hint
    assert rows.tolist() == [0, 1, 2, 1, 0, 1] and lens.tolist() == [9, 5, 0, 5, 9, 5]
    cache.end_step()
    _load(cache, [1], src, 2)  # slot 1 now holds another prompt: out of A's group
    cache.set_active([0, 1, 2])
    cache.begin_step(1)
    rows, lens = cache._share_hint
    assert rows.tolist() == [0, 1, 0] and lens.tolist() == [5, 0, 5]
    cache.end_step()
    cache.set_active([0, 1])  # A's only active row: nothing to share
    cache.begin_step(1)
    assert cache._share_hint is None
    cache.end_step()


@pytest.mark.parametrize("kind", ["slot", "paged"])
def test_a_step_with_the_hint_is_the_attention_over_each_slots_own_keys(kind):
    cache = _new(kind)
    src = _prefill([6, 4])
    _load(cache, [0, 2, 3], src, 0)
    _load(cache, [1, 4], src, 1)
    g = torch.Generator().manual_seed(1)
    active = [3, 1, 0, 4, 2]
    for step in range(3):
        cache.set_active(active)
        cache.begin_step(1)
        assert cache._share_hint is not None
        q = torch.randn(len(active), 1, HQ, D, generator=g)
        k, v = torch.randn(len(active), 1, HKV, D, generator=g), torch.randn(len(active), 1, HKV, D, generator=g)
        out = cache.attend(0, q, k, v)
        # ground truth: each slot's own keys, gathered position by position
        lens = torch.tensor([cache.host_lengths[s] + 1 for s in active])
        keys = torch.zeros(len(active), 24, HKV, D)
        values = torch.zeros_like(keys)
        for row, s in enumerate(active):
            for j in range(int(lens[row])):
                if isinstance(cache, PagedSlotCache):
                    blk = int(cache.table[s, j // cache.block_size])
                    keys[row, j] = cache.keys[0][blk, j % cache.block_size]
                    values[row, j] = cache.values[0][blk, j % cache.block_size]
                else:
                    keys[row, j], values[row, j] = cache.keys[0][s, j], cache.values[0][s, j]
        want = decode_attention_loop(q[:, 0].double(), keys.double(), values.double(), lens)
        torch.testing.assert_close(out[:, 0].double(), want, atol=2e-6, rtol=0)
        cache.end_step()
        assert cache.host_lengths[active[0]] == 6 + step + 1
