"""`kernels.adamw_bf16_moments`: the Triton kernel (one fused pass per tensor; interpreted on the CPU) updates the
parameters as the torch reference does (to fp32 rounding: the same fp32 moments feed both updates), stores moments
within one bf16 ulp of the reference's (each rounds stochastically from its own random bits), unbiased on average;
and the optimizer runs it when the backend is chosen."""
import pytest
import torch
from kernel_checks import DEVICE

from megatron_vlm.kernels import use_backends
from megatron_vlm.kernels.reference.adamw import adamw_bf16_moments as reference
from megatron_vlm.kernels.triton.adamw import adamw_bf16_moments as triton_step
from megatron_vlm.training.adamw_bf16 import AdamWBf16Moments

HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=3, seed=11)


def _case(shapes, pdtype=torch.float32, gdtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    ps = [torch.randn(s, generator=g).to(pdtype) for s in shapes]
    gs = [torch.randn(s, generator=g).to(gdtype) for s in shapes]
    ms = [(0.1 * torch.randn(s, generator=g)).bfloat16() for s in shapes]
    vs = [(0.1 * torch.rand(s, generator=g)).bfloat16() for s in shapes]
    return [[t.to(DEVICE) for t in ts] for ts in (ps, gs, ms, vs)]


def _run(fn, case, **kw):
    ps, gs, ms, vs = ([t.clone() for t in ts] for ts in case)
    fn(ps, gs, ms, vs, **{**HP, **kw})
    return ps, ms, vs


@pytest.mark.parametrize("pdtype,gdtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                           (torch.bfloat16, torch.bfloat16)])
def test_triton_updates_as_the_reference(pdtype, gdtype):
    case = _case([(7,), (300, 5), (4097,), (0,)], pdtype, gdtype)
    (tp, tm, tv), (rp, rm, rv) = _run(triton_step, case), _run(reference, case)
    tol = dict(rtol=1e-6, atol=1e-7) if pdtype == torch.float32 else dict(rtol=1 / 128, atol=1e-6)
    for a, b in zip(tp, rp):
        assert a.dtype == pdtype
        torch.testing.assert_close(a, b, **tol)
    for a, b in zip(tm + tv, rm + rv):
        assert a.dtype == torch.bfloat16
        ulp = 2.0 ** (torch.floor(torch.log2(b.float().abs().clamp_min(1e-30))) - 7)  # one bf16 ulp of b
        assert bool(((a.float() - b.float()).abs() <= ulp * 1.001).all())


def test_triton_rounding_is_unbiased_and_deterministic():
    n = 16_384
    ps = [torch.zeros(n, device=DEVICE)]
    gs = [torch.zeros(n, device=DEVICE)]
    vs = [torch.ones(n, device=DEVICE).bfloat16()]
    ms = [torch.zeros(n, device=DEVICE).bfloat16()]
    for step in range(1, 61):  # v <- 0.999 v: rounded to nearest it would stay 1
        triton_step(ps, gs, ms, vs, **{**HP, "weight_decay": 0.0, "step": step, "seed": step})
    mean = vs[0].float().mean().item()
    assert abs(mean - 0.999 ** 60) < 2e-3 * 0.999 ** 60, mean
    again = _run(triton_step, _case([(513,)]))
    first = _run(triton_step, _case([(513,)]))
    assert all(torch.equal(a, b) for a, b in zip(again[1] + again[2], first[1] + first[2]))


def test_optimizer_runs_the_chosen_backend(monkeypatch):
    calls = []
    import megatron_vlm.kernels.triton.adamw as mod

    real = mod.adamw_bf16_moments
    monkeypatch.setattr(mod, "adamw_bf16_moments", lambda *a, **k: (calls.append(1), real(*a, **k)))
    from megatron_vlm.kernels.registry import DEFAULT_REGISTRY

    DEFAULT_REGISTRY.clear_cache()
    p = torch.nn.Parameter(torch.randn(10, device=DEVICE))
    p.grad = torch.randn(10, device=DEVICE)
    before = p.detach().clone()
    with use_backends({"adamw_bf16_moments": "triton"}):
        AdamWBf16Moments([p], lr=0.1).step()
    DEFAULT_REGISTRY.clear_cache()
    assert calls and not torch.equal(p.detach(), before)


def test_triton_nan_gradient_gives_nan_moments():
    """A NaN gradient with CUDA's canonical pattern (0x7FFFFFFF, what GPU arithmetic produces) makes NaN moments, as
    the fp32 AdamW's would, not -0.0 (the random bits carrying into the sign bit)."""
    nan = torch.full((64,), 0x7FFFFFFF, dtype=torch.int32).view(torch.float32)
    ps, gs = [torch.zeros(64, device=DEVICE)], [nan.to(DEVICE)]
    ms, vs = [torch.zeros(64, device=DEVICE).bfloat16()], [torch.zeros(64, device=DEVICE).bfloat16()]
    triton_step(ps, gs, ms, vs, **HP)
    assert bool(ms[0].isnan().all()) and bool(vs[0].isnan().all()), (ms[0][:4], vs[0][:4])


@pytest.mark.parametrize("fn", [triton_step, reference], ids=["triton", "torch"])
def test_keys_decide_the_random_bits_not_the_positions(fn):
    """A tensor keyed alike rounds alike wherever it sits in the lists (a tied weight on two pipeline stages)."""
    ps, gs, ms, vs = _case([(300,), (300,)])
    a = [[t.clone() for t in ts] for ts in (ps, gs, ms, vs)]
    b = [[t.clone() for t in reversed(ts)] for ts in (ps, gs, ms, vs)]
    fn(*a, **HP, keys=[5, 9])
    fn(*b, **HP, keys=[9, 5])
    for i in range(4):
        assert torch.equal(a[i][0], b[i][1]) and torch.equal(a[i][1], b[i][0])
    with pytest.raises(ValueError, match="2 keys for 1 tensors"):
        fn(*([t[0].clone()] for t in (ps, gs, ms, vs)), **HP, keys=[1, 2])


def test_a_non_contiguous_tensor_takes_the_reference_path():
    """Transposed (non-contiguous) tensors are updated, not refused: the reference's update, to fp32 rounding."""
    case = [t[0].t() for t in _case([(6, 5)])]  # [5, 6] views of [6, 5] tensors

    def copies():
        return [[x.t().clone().t()] for x in case]  # fresh storage, the same strides

    got, ref = copies(), copies()
    triton_step(*got, **HP)
    reference(*ref, **HP)
    assert not got[0][0].is_contiguous()
    torch.testing.assert_close(got[0][0], ref[0][0], rtol=1e-6, atol=1e-7)
