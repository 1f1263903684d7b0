"""AdamW with bf16 moments (`optimizer.moments_dtype = "bf16"`) against torch.optim.AdamW in fp32, the stochastic
rounding's unbiasedness where rounding to nearest stalls, and its state through `state_dict` / `load_state_dict`."""
from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch

from megatron_vlm.kernels.reference.adamw import round_bf16_stochastic
from megatron_vlm.training.adamw_bf16 import AdamWBf16Moments
from megatron_vlm.training.optim import build_optimizer

HP = dict(lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in ((64, 48), (48,), (3, 5, 7))]


def _grads(params, step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * (0.5 + 0.1 * step)


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.9, 0.95)])
def test_tracks_torch_adamw_fp32_within_bf16_rounding(betas):
    ours, ref = _params(), _params()
    start = [p.detach().clone() for p in ref]
    o = AdamWBf16Moments(ours, **{**HP, "betas": betas}, seed=3)
    r = torch.optim.AdamW(ref, **{**HP, "betas": betas}, foreach=False)
    for step in range(30):
        _grads(ours, step)
        _grads(ref, step)
        o.step()
        r.step()
    for p, q, s in zip(ours, ref, start):
        moved = (q.detach() - s).norm()
        assert moved > 0.05
        # the moments differ by bf16 rounding (< 2^-8 relative each step, unbiased): the paths stay within ~1 %
        assert (p.detach() - q.detach()).norm() < 0.01 * moved, ((p - q).norm(), moved)
    for p, q in zip(ours, ref):
        st = o.state[p]
        assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.bfloat16
        assert float(st["step"]) == 30.0 and st["step"].device.type == "cpu"
        torch.testing.assert_close(st["exp_avg_sq"].float(), r.state[q]["exp_avg_sq"],
                                   rtol=0.03, atol=1e-6)


def test_second_moment_decays_under_beta2_0999():
    """v <- 0.999 v (zero gradients): 0.1 % a step is under half a bf16 ulp (0.39 %), so round-to-nearest would keep
    v = 1 forever; stochastic rounding follows 0.999^n on average."""
    p = torch.nn.Parameter(torch.zeros(20_000))
    o = AdamWBf16Moments([p], lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, seed=1)
    p.grad = torch.zeros_like(p)
    o.step()
    o.state[p]["exp_avg_sq"].fill_(1.0)
    for _ in range(300):
        o.step()
    mean = o.state[p]["exp_avg_sq"].float().mean().item()
    assert math.isclose(mean, 0.999 ** 300, rel_tol=5e-3), mean


def test_stochastic_rounding_is_unbiased_and_within_one_ulp():
    x = torch.full((50_000,), 1.0 + 2 ** -9 + 2 ** -11)  # between two bf16 neighbours 1 and 1 + 2^-7
    rand = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    y = round_bf16_stochastic(x, rand).float()
    assert set(y.unique().tolist()) == {1.0, 1.0 + 2 ** -7}
    assert math.isclose(y.mean().item(), x[0].item(), rel_tol=2e-4)
    neg = round_bf16_stochastic(-x, rand).float()
    torch.testing.assert_close(neg, -y)


def test_state_dict_round_trip_keeps_bf16_and_continues_exactly():
    a, b = _params(), _params()
    oa = AdamWBf16Moments(a, **HP, seed=7)
    for step in range(3):
        _grads(a, step)
        oa.step()
    sd = copy.deepcopy(oa.state_dict())  # state_dict() returns the live state tensors
    with torch.no_grad():
        for p, q in zip(b, a):
            p.copy_(q)
    ob = AdamWBf16Moments(b, **HP, seed=7)
    ob.load_state_dict(sd)
    for p in b:
        assert ob.state[p]["exp_avg"].dtype == torch.bfloat16 and ob.state[p]["step"].dtype == torch.float32
    for step in range(3, 6):
        _grads(a, step)
        _grads(b, step)
        oa.step()
        ob.step()
    for p, q in zip(a, b):
        assert torch.equal(p, q)


def test_build_optimizer_honours_moments_dtype():
    model = torch.nn.Linear(4, 3)
    cfg = SimpleNamespace(lr=1e-3, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8, moments_dtype="bf16")
    opt = build_optimizer(model, cfg, "cpu", seed=5)
    assert isinstance(opt, AdamWBf16Moments) and opt.seed == 5
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]
    fp32 = build_optimizer(model, SimpleNamespace(**{**vars(cfg), "moments_dtype": "fp32"}), "cpu")
    assert isinstance(fp32, torch.optim.AdamW) and not isinstance(fp32, AdamWBf16Moments)


def test_loads_a_torch_adamw_checkpoint_as_bf16():
    a, b = _params(), _params()
    r = torch.optim.AdamW(a, **HP, foreach=False)
    _grads(a, 0)
    r.step()
    o = AdamWBf16Moments(b, **HP)
    o.load_state_dict(copy.deepcopy(r.state_dict()))
    for p, q in zip(b, a):
        assert o.state[p]["exp_avg"].dtype == torch.bfloat16 and float(o.state[p]["step"]) == 1.0
        torch.testing.assert_close(o.state[p]["exp_avg"].float(), r.state[q]["exp_avg"], rtol=1 / 128, atol=0.0)


def test_torch_adamw_loads_a_bf16_moments_checkpoint():
    """Resuming with optimizer.moments_dtype back at fp32: torch's AdamW takes the state (its group keys included)."""
    a, b = _params(), _params()
    o = AdamWBf16Moments(a, **HP)
    _grads(a, 0)
    o.step()
    r = torch.optim.AdamW(b, **HP, fused=True)
    r.load_state_dict(copy.deepcopy(o.state_dict()))
    for p, q in zip(b, a):
        assert r.state[p]["exp_avg"].dtype == torch.float32
        assert torch.equal(r.state[p]["exp_avg_sq"], o.state[q]["exp_avg_sq"].float())
    _grads(b, 1)
    r.step()


def test_step_reads_no_tensor_value_on_the_host():
    """The step count is mirrored as a Python int: a step launches its kernels without waiting for the device."""
    from megatron_vlm.testing.host_reads import HostReads

    ps = _params()
    o = AdamWBf16Moments(ps, **HP)
    for step in range(2):
        _grads(ps, step)
        with HostReads() as reads:  # the second step's state was made outside the counter: looks like device tensors
            o.step()
        assert reads.total == 0, reads.report()


def test_stochastic_rounding_keeps_nan_nan():
    """A NaN stays NaN whatever its payload: CUDA's canonical NaN (0x7FFFFFFF) plus the random bits would carry into
    the sign bit (-0.0), and a NaN with only low mantissa bits set would truncate to inf; both silently turn a NaN
    moment into a finite or infinite one."""
    x = torch.tensor([0x7FFFFFFF, 0x7F800001, -1, 0x7FC00000], dtype=torch.int32).view(torch.float32)
    assert bool(x.isnan().all())
    for r in (1, 5, 0xFFFF):
        y = round_bf16_stochastic(x, torch.full(x.shape, r, dtype=torch.int32))
        assert bool(y.isnan().all()), (r, y)
    inf = torch.tensor([float("inf"), float("-inf"), -0.0])
    y = round_bf16_stochastic(inf, torch.full(inf.shape, 0xFFFF, dtype=torch.int32)).float()
    assert y.tolist() == [float("inf"), float("-inf"), 0.0] and y[2].signbit()


class _TiedVLM(torch.nn.Module):
    """The parts of a family model the pipeline split reads, with a tied embedding / lm_head and a vision module
    registered first: on the first stage the embedding is not the optimizer's first parameter, on the last it is."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.visual = torch.nn.Linear(8, 8)
        self.language_model = torch.nn.Module()
        self.language_model.embed_tokens = torch.nn.Embedding(32, 8)
        self.language_model.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.language_model.norm = torch.nn.LayerNorm(8)
        self.lm_head = torch.nn.Linear(8, 32, bias=False)
        self.lm_head.weight = self.language_model.embed_tokens.weight
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))

    def _input_embeddings(self):
        return self.language_model.embed_tokens


@pytest.mark.parametrize("moments_dtype", ["fp32", "bf16"])
def test_a_tied_weight_on_two_pipeline_stages_stays_equal(moments_dtype):
    """parallel.pp > 1 with a tied embedding / lm_head: the first and the last stage each hold a copy, given the same
    (summed) gradient, so that both take the same optimizer step (parallel/pipeline.py). With bf16 moments that takes
    the same random bits for both copies' rounding, wherever each sits in its stage's optimizer."""
    from megatron_vlm.parallel.pipeline import split_model_for_stage
    from megatron_vlm.training.lm_loss import TokenLogprobModel

    cfg = SimpleNamespace(lr=1e-2, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8, moments_dtype=moments_dtype)
    stages = [split_model_for_stage(_TiedVLM(), TokenLogprobModel, stage=s, pp=2, max_tokens=8,
                                    act_dtype=torch.float32) for s in range(2)]
    opts = [build_optimizer(st, cfg, "cpu", seed=3) for st in stages]
    tied = [stages[0].model._input_embeddings().weight, stages[1].model.lm_head.weight]
    assert tied[0] is not tied[1] and torch.equal(tied[0], tied[1])
    start = tied[0].detach().clone()
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        grad = torch.randn(tied[0].shape, generator=gen)
        for st, o, t in zip(stages, opts, tied):
            for p in st.parameters():
                p.grad = grad.clone() if p is t else torch.randn(p.shape, generator=gen)
            o.step()
    assert (tied[0] - start).abs().max() > 1e-3
    assert torch.equal(tied[0], tied[1]), (tied[0] - tied[1]).abs().max()


def test_a_partial_gradient_is_refused_not_applied_unsummed(tmp_path):
    """A DTensor gradient with a pending sum (Partial) cannot be updated on its local tensor: a clear error naming the
    parameter, never the unsummed piece applied (FSDP2 redistributes such gradients first, so a job never meets it)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        p = torch.nn.Parameter(DTensor.from_local(torch.ones(4), mesh, [Replicate()]))
        p.grad = DTensor.from_local(torch.ones(4), mesh, [Partial()])
        o = AdamWBf16Moments([p], lr=0.1, names={p: "w"})
        with pytest.raises(RuntimeError, match="parameter w has a Partial"):
            o.step()
        assert torch.equal(p.to_local(), torch.ones(4))
    finally:
        if owned:
            dist.destroy_process_group()
