"""The pure-torch references (the `torch` backend and the ground truth of the kernel tests) against
implementations nobody here wrote: torch SDPA with explicit masks built by loops, transformers'
Qwen2 RMSNorm / rotary helpers, F.layer_norm, F.silu, complex-number rotation, naive log_softmax."""
import pytest
import torch
import torch.nn.functional as F
from kernel_checks import cu_seqlens
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm, apply_rotary_pos_emb
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb_vision

from megatron_vlm.kernels.reference import apply_rotary, attention, layer_norm, linear_token_logprobs, rms_norm, swiglu


def loop_mask(sq, sk, causal, window, keep=None):
    """Visibility by the flash-attn rule, written as loops: query i sits at key position i + sk - sq."""
    left, right = window if window is not None else (-1, -1)
    m = torch.zeros(sq, sk, dtype=torch.bool)
    for i in range(sq):
        pos = i + sk - sq
        for j in range(sk):
            ok = (not causal or j <= pos) and (left < 0 or j >= pos - left) and (right < 0 or j <= pos + right)
            m[i, j] = ok and (keep is None or bool(keep[j]))
    return m


def sdpa(q, k, v, mask, scale=None):
    """q [S, H, D], k/v [S, Hkv, D] via torch SDPA (GQA expanded); rows without keys -> zeros."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).double(), k.transpose(0, 1).double(), v.transpose(0, 1).double(), attn_mask=mask, scale=scale
    ).transpose(0, 1)
    return torch.where(mask.any(1)[:, None, None], out, 0.0)


@pytest.mark.parametrize(
    "lens_q,lens_k,causal,window",
    [
        ([1, 7, 19], None, True, None),
        ([5, 9], None, False, None),
        ([9, 4], None, False, (3, 2)),
        ([9], None, True, (4, -1)),
        ([2, 3], [6, 2], True, None),  # decode-like Sq < Sk and Sq > Sk (row without keys)
    ],
)
def test_attention_reference_packed_matches_sdpa(lens_q, lens_k, causal, window):
    lens_k = lens_k or lens_q
    torch.manual_seed(0)
    q = torch.randn(sum(lens_q), 4, 16)
    k, v = torch.randn(sum(lens_k), 2, 16), torch.randn(sum(lens_k), 2, 16)
    out = attention(q, k, v, causal=causal, cu_seqlens_q=cu_seqlens(lens_q), cu_seqlens_k=cu_seqlens(lens_k), window=window)
    qs, ks = 0, 0
    for lq, lk in zip(lens_q, lens_k):
        exp = sdpa(q[qs : qs + lq], k[ks : ks + lk], v[ks : ks + lk], loop_mask(lq, lk, causal, window))
        torch.testing.assert_close(out[qs : qs + lq].double(), exp, atol=1e-5, rtol=1e-5)
        qs, ks = qs + lq, ks + lk


def test_attention_reference_batched_padding_and_scale():
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 5, 2, 8), torch.randn(2, 5, 1, 8), torch.randn(2, 5, 1, 8)
    keep = torch.tensor([[False, False, True, True, True], [True] * 5])  # left-padded first row
    out = attention(q, k, v, causal=True, key_padding_mask=keep, softmax_scale=0.3)
    for b in range(2):
        exp = sdpa(q[b], k[b], v[b], loop_mask(5, 5, True, None, keep[b]), scale=0.3)
        torch.testing.assert_close(out[b].double(), exp, atol=1e-5, rtol=1e-5)


def test_attention_reference_rejects_bad_inputs():
    q, k = torch.randn(4, 3, 8), torch.randn(4, 2, 8)
    with pytest.raises(ValueError, match="kv heads"):
        attention(q, k, k, causal=True, cu_seqlens_q=cu_seqlens([4]))
    with pytest.raises(ValueError, match="needs cu_seqlens_q"):
        attention(q, q, q, causal=True)
    with pytest.raises(ValueError, match="int32"):
        attention(q, q, q, causal=True, cu_seqlens_q=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="window"):
        attention(q, q, q, causal=True, cu_seqlens_q=cu_seqlens([4]), window=(-2, 0))


def test_rms_norm_reference_matches_transformers_and_fused_add():
    torch.manual_seed(0)
    norm = Qwen2RMSNorm(24, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(24))  # transformers inits to ones: randomise
    x, r = torch.randn(3, 5, 24), torch.randn(3, 5, 24)
    torch.testing.assert_close(rms_norm(x, norm.weight, 1e-5), norm(x))
    out, summed = rms_norm(x, norm.weight, 1e-5, residual=r)
    torch.testing.assert_close(summed, x + r)
    torch.testing.assert_close(out, norm(x + r))


def test_layer_norm_reference_matches_torch():
    torch.manual_seed(0)
    x, w, b = torch.randn(4, 33), torch.randn(33), torch.randn(33)
    torch.testing.assert_close(layer_norm(x, w, b, 1e-6), F.layer_norm(x, (33,), w, b, 1e-6))
    torch.testing.assert_close(layer_norm(x, None, None, 1e-6), F.layer_norm(x, (33,), None, None, 1e-6))


def _freqs(t, half):
    inv = 1.0 / (10000 ** (torch.arange(half).float() / half))
    return torch.arange(t).float()[:, None] * inv[None]


def test_rotary_reference_matches_transformers_text_and_vision():
    torch.manual_seed(0)
    b, s, h, d = 2, 6, 3, 16
    f = _freqs(s, d // 2)
    emb = torch.cat([f, f], -1)
    cos, sin = emb.cos()[None].expand(b, s, d), emb.sin()[None].expand(b, s, d)
    q, k = torch.randn(b, s, h, d), torch.randn(b, s, h, d)
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # [B, H, S, D]
    torch.testing.assert_close(apply_rotary(q, cos, sin), q_ref.transpose(1, 2))
    torch.testing.assert_close(apply_rotary(k, cos[0], sin[0]), k_ref.transpose(1, 2))  # [S, D] broadcast
    # half-width cos (flash-attn layout) gives the same result
    torch.testing.assert_close(apply_rotary(q, f.cos(), f.sin(), rotary_dim=d), q_ref.transpose(1, 2))
    qv, kv = torch.randn(s, h, d), torch.randn(s, h, d)  # vision: packed [T, H, D]
    qv_ref, _ = apply_rotary_pos_emb_vision(qv, kv, emb.cos(), emb.sin())
    torch.testing.assert_close(apply_rotary(qv, emb.cos(), emb.sin()), qv_ref)


def test_rotary_reference_interleaved_is_complex_rotation_and_partial_passes_tail():
    torch.manual_seed(0)
    t, h, d, d_rot = 5, 2, 12, 8
    f = _freqs(t, d_rot // 2)
    x = torch.randn(t, h, d)
    out = apply_rotary(x, f.cos(), f.sin(), interleaved=True, rotary_dim=d_rot)
    z = torch.view_as_complex(x[..., :d_rot].reshape(t, h, d_rot // 2, 2).contiguous())
    exp = torch.view_as_real(z * torch.polar(torch.ones_like(f), f)[:, None, :]).reshape(t, h, d_rot)
    torch.testing.assert_close(out[..., :d_rot], exp)
    torch.testing.assert_close(out[..., d_rot:], x[..., d_rot:])
    with pytest.raises(ValueError, match="does not fit head dim"):
        apply_rotary(x, torch.ones(t, 14), torch.ones(t, 14))


def test_swiglu_reference():
    g, u = torch.randn(3, 10), torch.randn(3, 10)
    torch.testing.assert_close(swiglu(g, u), F.silu(g) * u)


@pytest.mark.parametrize("chunk_size", [1, 3, None])
def test_linear_token_logprobs_reference_matches_naive(chunk_size):
    torch.manual_seed(0)
    h = torch.randn(7, 12, dtype=torch.float64, requires_grad=True)
    w = torch.randn(40, 12, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 39, -100, 5, 5, -100, 17])
    lp, ent = linear_token_logprobs(h, w, labels, temperature=0.8, return_entropy=True, chunk_size=chunk_size)
    logp_all = torch.log_softmax(h @ w.t() / 0.8, -1)
    valid = labels != -100
    exp_lp = torch.where(valid, logp_all.gather(1, labels.clamp(min=0)[:, None])[:, 0], 0.0)
    exp_ent = torch.where(valid, -(logp_all.exp() * logp_all).sum(-1), 0.0)
    # the op computes in fp32 whatever the input dtype: compare to the fp64 truth at fp32 accuracy
    torch.testing.assert_close(lp.double(), exp_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), exp_ent, atol=1e-5, rtol=1e-5)
    a, b = torch.randn(7, dtype=torch.float64), torch.randn(7, dtype=torch.float64)
    got = torch.autograd.grad((lp * a).sum() + (ent * b).sum(), (h, w))
    exp = torch.autograd.grad((exp_lp * a).sum() + (exp_ent * b).sum(), (h, w))
    for g, e in zip(got, exp):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


def test_linear_token_logprobs_reference_rejects_bad_label():
    with pytest.raises(ValueError, match="label 40 outside"):
        linear_token_logprobs(torch.randn(2, 4), torch.randn(40, 4), torch.tensor([1, 40]))


@pytest.mark.parametrize("kwargs", [
    dict(top_k=4, n_group=4, topk_group=1),  # 2 experts kept, 4 asked: masked (-inf) experts would be picked
    dict(top_k=2, n_group=3, topk_group=1),  # 3 does not divide 8 experts
    dict(top_k=2, n_group=2, topk_group=3),  # more kept groups than groups
    dict(top_k=9, n_group=1, topk_group=1),  # more than the experts
    dict(top_k=0, n_group=1, topk_group=1),
])
def test_moe_topk_gating_refuses_impossible_group_selection(kwargs):
    """The reference gating raises ValueError, as the compiled csrc op does, for a top-k its group selection cannot
    give; before, top_k > topk_group x group size silently routed tokens to experts of dropped groups."""
    from megatron_vlm.kernels.reference.moe_routing import moe_topk_gating

    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="top_k|n_group"):
        moe_topk_gating(logits, kwargs.pop("top_k"), score_func="sigmoid", **kwargs)
