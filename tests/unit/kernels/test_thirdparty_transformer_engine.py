"""The Transformer Engine adapter (`kernels/thirdparty/transformer_engine.py`), on the CPU.

The adapter runs against stand-ins written here from TE's documented interfaces (TE 2.1+):
`transformer_engine_torch.rmsnorm_fwd(input, weight, eps, ln_out, quantizer, otype, sm_margin,
zero_centered_gamma)` -> (y, None, rsigma fp32 [N]) with 2-D contiguous input and a weight of the input's
dtype, `rmsnorm_bwd(dz, x, rsigma, gamma, sm_margin, zero_centered_gamma)` -> (dx, dgamma) (dz of gamma's
dtype), the `layernorm_*` pair with bias and means; `transformer_engine.pytorch.DotProductAttention(heads,
kv_channels, num_gqa_groups, attention_dropout, qkv_format, softmax_scale)` whose forward takes
`qkv_format` "thd" (needs a "padding" mask type and int32 `cu_seqlens_q` / `cu_seqlens_kv`) or "bshd",
`attn_mask_type` with top-left causal unless "bottom_right" is named, `window_size` as in TE's
`check_set_window_size` table, and returns `[T, H * D]` / `[B, S, H * D]`. The stand-ins compute in float64
the plain way (per sequence, per head; norms through autograd) and the adapter must give our references'
values and gradients; unsupported calls must fall back (logged, the stand-in never called). The real
package against the references: tests/gpu/test_gpu_thirdparty_transformer_engine.py.
"""
from __future__ import annotations

import importlib.util
import logging
import sys
import types

import pytest
import torch

from megatron_vlm import kernels as K
from megatron_vlm.kernels.reference import norms as ref_norms
from megatron_vlm.kernels.reference.attention import attention as ref_attention
from megatron_vlm.kernels.registry import DEFAULT_REGISTRY
from megatron_vlm.kernels.thirdparty import transformer_engine as adapter

_TE_DTYPE = {torch.float32: "kFloat32", torch.float16: "kFloat16", torch.bfloat16: "kBFloat16", torch.float64: "kFloat64"}
_WINDOW_OK = {"causal": lambda w: w[1] == 0 and w[0] >= -1, "none": lambda w: w == (-1, -1) or min(w) >= 0}


def _norm_forward(x, w, b, eps, kind):
    if kind == "rms":
        rsigma = torch.rsqrt(x.pow(2).mean(-1) + eps)
        return x * rsigma[:, None] * w, None, rsigma
    mu = x.mean(-1)
    rsigma = torch.rsqrt((x - mu[:, None]).pow(2).mean(-1) + eps)
    y = (x - mu[:, None]) * rsigma[:, None] * w
    return (y if b is None else y + b), mu, rsigma


def _fake_tex(calls):
    tex = types.ModuleType("transformer_engine_torch")

    def check_fwd(x, w, ln_out, quantizer, otype, sm_margin, zcg):
        assert x.dim() == 2 and x.is_contiguous() and w.shape == (x.shape[1],)
        assert w.dtype == x.dtype and otype == _TE_DTYPE[x.dtype]
        assert ln_out is None and quantizer is None and sm_margin == 0 and zcg is False

    def fwd(kind, x, w, b, eps):
        y, mu, rsigma = _norm_forward(x.double(), w.double(), None if b is None else b.double(), eps, kind)
        return y.to(x.dtype), None if mu is None else mu.float(), rsigma.float()

    def bwd(kind, dz, x, mu, rsigma, gamma, sm_margin, zcg):
        assert dz.dtype == gamma.dtype and rsigma.dtype == torch.float32 and dz.shape == x.shape
        assert sm_margin == 0 and zcg is False
        with torch.enable_grad():  # called from an autograd backward, where grad mode is off
            xd = x.double().requires_grad_()
            wd = gamma.double().requires_grad_()
            bd = torch.zeros_like(wd, requires_grad=True)
            y, _, rs2 = _norm_forward(xd, wd, bd if kind == "ln" else None, _eps[0], kind)
            grads = torch.autograd.grad(y, (xd, wd, bd) if kind == "ln" else (xd, wd), dz.double())
        torch.testing.assert_close(rs2.float(), rsigma)  # the saved statistics are the forward's
        return [g.to(x.dtype) for g in grads]

    _eps = [None]

    def rmsnorm_fwd(input, weight, eps, ln_out, quantizer, otype, sm_margin, zero_centered_gamma):
        check_fwd(input, weight, ln_out, quantizer, otype, sm_margin, zero_centered_gamma)
        calls.append("rmsnorm_fwd")
        _eps[0] = eps
        return list(fwd("rms", input, weight, None, eps))

    def rmsnorm_bwd(dz, x, rsigma, gamma, sm_margin, zero_centered_gamma):
        calls.append("rmsnorm_bwd")
        return bwd("rms", dz, x, None, rsigma, gamma, sm_margin, zero_centered_gamma)

    def layernorm_fwd(input, weight, bias, eps, ln_out, quantizer, otype, sm_margin, zero_centered_gamma):
        check_fwd(input, weight, ln_out, quantizer, otype, sm_margin, zero_centered_gamma)
        assert bias is None or (bias.dtype == input.dtype and bias.shape == weight.shape)
        calls.append("layernorm_fwd")
        _eps[0] = eps
        return list(fwd("ln", input, weight, bias, eps))

    def layernorm_bwd(dz, x, mu, rsigma, gamma, sm_margin, zero_centered_gamma):
        assert mu.dtype == torch.float32
        calls.append("layernorm_bwd")
        return bwd("ln", dz, x, mu, rsigma, gamma, sm_margin, zero_centered_gamma)

    tex.rmsnorm_fwd, tex.rmsnorm_bwd = rmsnorm_fwd, rmsnorm_bwd
    tex.layernorm_fwd, tex.layernorm_bwd = layernorm_fwd, layernorm_bwd
    return tex


def _attend_one(q, k, v, scale, mask_type, window):
    """q [Sq, Hq, D], k / v [Sk, Hkv, D] -> [Sq, Hq * D]: TE's documented masking, computed plainly."""
    sq, hq, d = q.shape
    sk, hkv = k.shape[0], k.shape[1]
    shift = sk - sq if ("bottom_right" in mask_type or "causal" not in mask_type) else 0
    left, right = window
    out = torch.zeros(sq, hq, d, dtype=torch.float64)
    for h in range(hq):
        kh, vh = k[:, h // (hq // hkv)].double(), v[:, h // (hq // hkv)].double()
        for i in range(sq):
            c = i + shift
            keys = [j for j in range(sk) if (left < 0 or j >= c - left) and (right < 0 or j <= c + right)]
            if keys:
                p = torch.softmax(torch.stack([(q[i, h].double() @ kh[j]) * scale for j in keys]), 0)
                out[i, h] = (p[:, None] * vh[keys]).sum(0)
    return out.reshape(sq, hq * d)


def _fake_te(calls, version="2.9.0"):
    te = types.ModuleType("transformer_engine")
    te.__version__ = version
    pt = types.ModuleType("transformer_engine.pytorch")
    constants = types.ModuleType("transformer_engine.pytorch.constants")
    constants.TE_DType = dict(_TE_DTYPE)

    class DotProductAttention:
        def __init__(self, num_attention_heads, kv_channels, num_gqa_groups=None, attention_dropout=0.0,
                     qkv_format="sbhd", attn_mask_type="causal", window_size=None, attention_type="self",
                     softmax_scale=None):
            assert attention_dropout == 0.0 and num_attention_heads % num_gqa_groups == 0
            assert attention_type in ("self", "cross")
            self.cross = attention_type == "cross"
            self.heads, self.head_dim, self.groups, self.qkv_format = num_attention_heads, kv_channels, num_gqa_groups, qkv_format
            self.scale = kv_channels ** -0.5 if softmax_scale is None else softmax_scale
            calls.append(("init", num_attention_heads, num_gqa_groups, qkv_format, attention_type))

        def __call__(self, query_layer, key_layer, value_layer, attention_mask=None, qkv_format=None, cu_seqlens_q=None,
                     cu_seqlens_kv=None, max_seqlen_q=None, max_seqlen_kv=None, attn_mask_type=None, window_size=None):
            q, k, v = query_layer, key_layer, value_layer
            if not self.cross:  # self-attention: one set of lengths
                assert q.shape[:-2] == k.shape[:-2] and (cu_seqlens_q is None or torch.equal(cu_seqlens_q, cu_seqlens_kv))
            assert attention_mask is None and q.shape[-2] == self.heads and k.shape[-2] == self.groups
            assert q.shape[-1] == self.head_dim
            window = tuple(window_size) if window_size is not None else None
            assert window is not None and _WINDOW_OK["causal" if "causal" in attn_mask_type else "none"](window), window
            calls.append((qkv_format, attn_mask_type, window))
            if qkv_format == "bshd":
                assert q.dim() == 4 and "padding" not in attn_mask_type
                return torch.stack([_attend_one(q[b], k[b], v[b], self.scale, attn_mask_type, window)
                                    for b in range(q.shape[0])]).to(q.dtype)
            assert qkv_format == "thd" and q.dim() == 3 and "padding" in attn_mask_type
            assert cu_seqlens_q.dtype == cu_seqlens_kv.dtype == torch.int32 and cu_seqlens_q.shape == cu_seqlens_kv.shape
            parts = []
            for s in range(cu_seqlens_q.numel() - 1):
                a, b = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1])
                c, e = int(cu_seqlens_kv[s]), int(cu_seqlens_kv[s + 1])
                assert b - a <= max_seqlen_q and e - c <= max_seqlen_kv
                parts.append(_attend_one(q[a:b], k[c:e], v[c:e], self.scale, attn_mask_type, window))
            return torch.cat(parts).to(q.dtype)

    pt.DotProductAttention = DotProductAttention
    pt.constants = constants
    te.pytorch = pt
    return {"transformer_engine": te, "transformer_engine.pytorch": pt, "transformer_engine.pytorch.constants": constants}


def _install(monkeypatch, version="2.9.0"):
    calls: list = []
    for name, mod in {**_fake_te(calls, version), "transformer_engine_torch": _fake_tex(calls)}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    adapter._logged.clear()
    adapter._modules.clear()
    DEFAULT_REGISTRY.clear_cache()
    return calls


@pytest.fixture
def fake(monkeypatch):
    yield _install(monkeypatch)
    adapter._modules.clear()
    DEFAULT_REGISTRY.clear_cache()


def _r(*shape, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_(grad)


# the norm references compute in fp32 even for fp64 inputs; the stand-ins in fp64
_NORM_TOL = dict(rtol=1e-5, atol=1e-5)


def _grads(out, inputs):
    outs = out if isinstance(out, tuple) else (out,)
    loss = sum((o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view(o.shape)).sum() for o in outs)
    return torch.autograd.grad(loss, [t for t in inputs if t is not None])


def test_rms_norm_values_and_gradients_match_the_reference(fake):
    x, r, w = _r(2, 3, 16, seed=1), _r(2, 3, 16, seed=2), _r(16, seed=3)
    for kwargs, inputs in (({}, (x, w)), ({"residual": r}, (x, r, w))):
        ours = adapter.rms_norm(x, w, 1e-5, **kwargs)
        ref = ref_norms.rms_norm(x, w, 1e-5, **kwargs)
        torch.testing.assert_close(ours, ref, **_NORM_TOL)
        for a, b in zip(_grads(ours, inputs), _grads(ref, inputs)):
            torch.testing.assert_close(a, b, **_NORM_TOL)
    assert fake.count("rmsnorm_fwd") == 2 and fake.count("rmsnorm_bwd") == 2


def test_rms_norm_weight_of_another_dtype_is_cast_and_gets_its_gradient(fake):
    x, w = _r(5, 8, seed=4), _r(8, seed=5).float().detach().requires_grad_()
    ours = adapter.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(ours, ref_norms.rms_norm(x, w, 1e-6), **_NORM_TOL)
    (gw,) = torch.autograd.grad(ours.sum(), w)
    assert gw.dtype == torch.float32 and gw.abs().sum() > 0


@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_values_and_gradients_match_the_reference(fake, affine):
    x = _r(4, 24, seed=6)
    w, b = (_r(24, seed=7), _r(24, seed=8)) if affine else (None, None)
    ours, ref = adapter.layer_norm(x, w, b, 1e-5), ref_norms.layer_norm(x, w, b, 1e-5)
    torch.testing.assert_close(ours, ref, **_NORM_TOL)
    for a, c in zip(_grads(ours, (x, w, b)), _grads(ref, (x, w, b))):
        torch.testing.assert_close(a, c, **_NORM_TOL)
    assert fake == ["layernorm_fwd", "layernorm_bwd"]


def test_norm_fallbacks_are_logged_and_skip_the_package(monkeypatch, caplog):
    calls = _install(monkeypatch)
    x, w = _r(3, 12, seed=9), _r(12, seed=10)
    with caplog.at_level(logging.INFO, logger="megatron_vlm.kernels"):
        torch.testing.assert_close(adapter.rms_norm(x, w, 1e-5), ref_norms.rms_norm(x, w, 1e-5))
        old = _install(monkeypatch, version="2.0.1")
        x16 = _r(3, 16, seed=11)
        torch.testing.assert_close(adapter.layer_norm(x16, None, None, 1e-5), ref_norms.layer_norm(x16, None, None, 1e-5))
    assert calls == [] and old == []
    assert "hidden size 12" in caplog.text and "transformer_engine 2.0.1" in caplog.text
    DEFAULT_REGISTRY.clear_cache()


def _packed(lengths_q, lengths_k, hq=4, hkv=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(lengths_q), sum(lengths_k)
    q = torch.randn(tq, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(tk, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(tk, hkv, d, generator=g, dtype=torch.float64)
    cu = [torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32) for lens in (lengths_q, lengths_k)]
    return q, k, v, cu[0], cu[1]


@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, (3, -1)), (False, (2, 1))])
def test_packed_thd_translation_matches_the_reference(fake, causal, window):
    q, k, v, cu, _ = _packed([1, 6, 9], [1, 6, 9])
    got = adapter.attention(q, k, v, causal=causal, cu_seqlens_q=cu, window=window, softmax_scale=0.3)
    want = ref_attention(q, k, v, causal=causal, cu_seqlens_q=cu, window=window, softmax_scale=0.3)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    assert fake[0] == ("init", 4, 2, "thd", "self")
    assert fake[-1][:2] == ("thd", "padding_causal_bottom_right" if causal else "padding")


def test_packed_queries_behind_a_longer_key_sequence_are_bottom_right_aligned(fake):
    """Prompt-sharing style: each sequence's queries are its last tokens, keys cover the whole sequence."""
    q, k, v, cu_q, cu_k = _packed([2, 3], [5, 7], seed=1)
    got = adapter.attention(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    want = ref_attention(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    assert fake[0] == ("init", 4, 2, "thd", "cross")


def test_batched_bshd_decoding_shape_matches_the_reference(fake):
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 3, 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 7, 1, 8, generator=g, dtype=torch.float64) for _ in range(2))
    for causal in (True, False):
        got = adapter.attention(q, k, v, causal=causal)
        torch.testing.assert_close(got, ref_attention(q, k, v, causal=causal), atol=1e-10, rtol=1e-10)
    assert [c[:2] for c in fake if c[0] == "bshd"] == [("bshd", "causal_bottom_right"), ("bshd", "no_mask")]
    assert fake[0] == ("init", 4, 1, "bshd", "cross")


def test_attention_fallbacks_run_sdpa_and_say_why(fake, caplog):
    q, k, v, cu, _ = _packed([3, 5], [3, 5], d=12)
    q8, k8, v8, cu8, _ = _packed([3, 5], [3, 5])
    qb, kb, vb = q8[None], k8[None], v8[None]
    mask = torch.ones(1, 8, dtype=torch.bool)
    mask[0, :2] = False
    qx, kx, vx, cu_q, cu_k = _packed([4, 2], [3, 2])
    qw, kw_, vw, cu_wq, cu_wk = _packed([3, 2], [4, 2])
    with caplog.at_level(logging.INFO, logger="megatron_vlm.kernels"):
        cases = [
            (dict(q=q, k=k, v=v, causal=True, cu_seqlens_q=cu)),
            (dict(q=qb, k=kb, v=vb, causal=False, key_padding_mask=mask)),
            (dict(q=q8, k=k8, v=v8, causal=False, cu_seqlens_q=cu8, window=(2, -1))),
            (dict(q=qx, k=kx, v=vx, causal=False, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)),
            (dict(q=qw, k=kw_, v=vw, causal=False, cu_seqlens_q=cu_wq, cu_seqlens_k=cu_wk, window=(1, 1))),
            (dict(q=qb, k=kb[:, :5], v=vb[:, :5], causal=True)),
        ]
        for kw in cases:
            args = (kw.pop("q"), kw.pop("k"), kw.pop("v"))
            torch.testing.assert_close(adapter.attention(*args, **kw), ref_attention(*args, **kw), atol=1e-10, rtol=1e-10)
    assert fake == []
    for reason in ("head dim 12", "key_padding_mask", "window (2, -1)", "longer than its key sequence",
                   "non-causal window with query and key lengths that differ"):
        assert reason in caplog.text, reason
    assert "falls back to torch SDPA" in caplog.text


def test_auto_takes_it_on_cuda_for_its_dtypes_only(fake):
    for op in ("rms_norm", "layer_norm", "attention"):
        assert DEFAULT_REGISTRY.choose(op, "cuda", torch.bfloat16) == "transformer_engine"
        assert DEFAULT_REGISTRY.choose(op, "cpu", torch.float32) != "transformer_engine"
    assert DEFAULT_REGISTRY.choose("rms_norm", "cuda", torch.float32) == "transformer_engine"
    why = DEFAULT_REGISTRY._probe("attention", DEFAULT_REGISTRY.backends["attention"]["transformer_engine"], "cuda", torch.float32)
    assert why and "float32" in why


def test_forced_without_the_package_names_the_reason():
    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("transformer_engine is installed here")
    DEFAULT_REGISTRY.clear_cache()
    x = torch.randn(2, 8)
    with K.use_backends({"rms_norm": "transformer_engine"}):
        with pytest.raises(K.BackendUnavailableError, match=r"'rms_norm'.*'transformer_engine'.*transformer_engine is not installed"):
            K.rms_norm(x, torch.ones(8), 1e-6)


def test_a_job_with_a_forced_backend_that_cannot_run_exits_2(tmp_path, monkeypatch, capsys):
    """`[kernels] rms_norm = "transformer_engine"` on a machine without it: the job stops with exit 2 and the
    registry's reason on stderr (the runner's config-error path), not a traceback."""
    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("transformer_engine is installed here")
    from megatron_vlm import runner
    from megatron_vlm.config import load_config

    repo = __import__("pathlib").Path(__file__).resolve().parents[3]
    cfg = load_config(repo / "launch" / "configs" / "demo_sft.toml",
                      [f'train.output_dir="{tmp_path}"', 'kernels.rms_norm="transformer_engine"'])

    def run_kind(ctx, before_step=None):  # what the job's first forward does: configure, then call the op
        previous = K.configure(ctx.cfg.kernels)
        try:
            K.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6)
        finally:
            DEFAULT_REGISTRY.restore(previous)
        return 0

    monkeypatch.setattr(runner, "run_kind", run_kind)
    monkeypatch.setattr(runner, "_prepare_model_folder", lambda cfg, env: None)
    DEFAULT_REGISTRY.clear_cache()
    assert runner.run_job(cfg) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: kernels: op 'rms_norm' is configured to backend 'transformer_engine'"), err
    assert "transformer_engine is not installed" in err
