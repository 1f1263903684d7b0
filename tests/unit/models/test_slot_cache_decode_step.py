"""One decode step of `attend` on a `SlotCache` (the rollout engine's eager step) against a plain
reconstruction: q and k rotated separately by `kernels.apply_rotary` (the same backend the step uses: the
reference, or the fused CPU kernel under `auto`), the new keys / values written with
ordinary indexing into a copy of the cache, and the loop ground truth of decode attention.

Why: the step rotates q and k in one rotary call (heads side by side) and writes the keys with one
`index_copy_` into the flattened cache; both are per-step shortcuts that must give exactly the same
numbers and the same cache contents, also for slots that are not the first B in order."""
import pytest
import torch

from kernels.reference.decode_attention import decode_attention_loop
from megatron_vlm.kernels import apply_rotary, use_backends
from megatron_vlm.models.common.attention import attend
from megatron_vlm.models.common.kv_cache import KVCache
from megatron_vlm.models.common.rotary import rope_cos_sin
from megatron_vlm.models.common.slot_cache import SlotCache


@pytest.mark.parametrize("ops", ["torch", "auto"])
def test_slot_cache_step_equals_separate_rotary_and_indexed_write(ops):
    with use_backends({"apply_rotary": ops, "decode_attention": ops}):
        _check_step()


def _check_step():
    torch.manual_seed(0)
    layers, slots, max_len, hq, hkv, d = 2, 5, 12, 4, 2, 8
    cache = SlotCache(KVCache(layers, slots + 1, max_len, hkv, d))
    for t in cache.keys + cache.values:
        t.copy_(torch.randn_like(t))
    lengths = [3, 7, 1, 9, 5]
    cache.lengths[:slots] = torch.tensor(lengths)
    cache.host_lengths[:slots] = lengths
    active = [3, 0, 4]  # not the first slots in order: the gathered path
    for _ in range(2):
        cache.set_active(active)
        cache.begin_step(1)
        pos = torch.tensor([cache.host_lengths[s] for s in active])
        cos, sin = rope_cos_sin(pos[:, None], d, 10000.0)  # [B, 1, D]
        for layer in range(layers):
            q, k, v = torch.randn(3, 1, hq, d), torch.randn(3, 1, hkv, d), torch.randn(3, 1, hkv, d)
            keys, values = cache.keys[layer].clone(), cache.values[layer].clone()
            out = attend(q, k, v, cos, sin, causal=True, kv_cache=cache, layer_idx=layer)
            qr, kr = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            for row, slot in enumerate(active):
                keys[slot, pos[row]] = kr[row, 0]
                values[slot, pos[row]] = v[row, 0]
            assert torch.equal(cache.keys[layer], keys) and torch.equal(cache.values[layer], values)
            want = decode_attention_loop(qr[:, 0], keys, values, pos + 1, slot_ids=torch.tensor(active))
            torch.testing.assert_close(out[:, 0], want, atol=1e-6, rtol=0)
        cache.end_step()
        assert cache.lengths[active].tolist() == (pos + 1).tolist()
