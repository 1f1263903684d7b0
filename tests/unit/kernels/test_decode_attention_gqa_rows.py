"""The vectorised `decode_attention` runs GQA as `Hq / Hkv` query rows per kv head (one SDPA task per
sequence and kv head): it must equal torch's SDPA with `enable_gqa` (one query per head, the previous
formulation) and the per-head loop within fp32 rounding (1e-6), also for a q that is a strided view (the
decode step's q is split off a joint q / k rotary output) and with an empty sequence (zeros)."""
import pytest
import torch

from kernels.reference.decode_attention import decode_attention, decode_attention_loop


@pytest.mark.parametrize("hq,hkv", [(4, 2), (8, 1), (3, 3)])
def test_gqa_rows_equal_enable_gqa_sdpa_and_loop(hq, hkv):
    g = torch.Generator().manual_seed(hq * 10 + hkv)
    b, slots, length, d = 6, 8, 13, 16
    qk = torch.randn(b, hq + hkv, d, generator=g)
    q = qk[:, :hq]  # a strided view, as in the decode step
    kc, vc = torch.randn(slots, length, hkv, d, generator=g), torch.randn(slots, length, hkv, d, generator=g)
    slot_ids = torch.randperm(slots, generator=g)[:b]
    seqlens = torch.tensor([3, 13, 1, 0, 7, 9])
    out = decode_attention(q, kc, vc, seqlens, slot_ids=slot_ids, max_seqlen_k=13)
    k, v = kc[slot_ids].transpose(1, 2), vc[slot_ids].transpose(1, 2)
    visible = torch.arange(length)[None, :] < seqlens[:, None]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None], k, v, attn_mask=visible[:, None, None, :], enable_gqa=hq != hkv)[:, :, 0]
    ref[3] = 0.0  # the empty sequence: zeros by convention (SDPA gives NaN there)
    assert torch.equal(out[3], torch.zeros_like(out[3]))
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(out, decode_attention_loop(q, kc, vc, seqlens, slot_ids=slot_ids), atol=1e-6, rtol=0)
