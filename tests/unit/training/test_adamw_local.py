"""The job's fp32-moments AdamW (`build_optimizer`: `LocalShardAdamW`) against torch.optim.AdamW itself: bitwise the
same weights and states over several steps (fused and foreach, plain tensors here; FSDP2 DTensors on two ranks in
tests/unit/parallel/test_adamw_local_fsdp.py), its state dict loading into torch's AdamW and back, no host read."""
from __future__ import annotations

import copy
import inspect
from types import SimpleNamespace

import pytest
import torch

from megatron_vlm.testing.host_reads import HostReads
from megatron_vlm.training.adamw_local import LocalShardAdamW
from megatron_vlm.training.optim import adamw_implementation, build_optimizer

CFG = SimpleNamespace(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
IMPLEMENTATIONS = pytest.mark.parametrize("device_type", ["cpu", "npu"], ids=["fused", "foreach"])


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))


def _reference(model: torch.nn.Module, device_type: str, **extra) -> torch.optim.AdamW:
    """torch.optim.AdamW over build_optimizer's groups (decayed: the matrices), with its implementation flags."""
    decay = [p for n, p in model.named_parameters() if p.ndim > 1 and not n.endswith(".bias")]
    rest = [p for n, p in model.named_parameters() if not (p.ndim > 1 and not n.endswith(".bias"))]
    return torch.optim.AdamW([{"params": decay, "weight_decay": CFG.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                             lr=CFG.lr, betas=CFG.betas, eps=CFG.eps, **adamw_implementation(device_type), **extra)


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(100 + step))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _assert_same(model_a, opt_a, model_b, opt_b) -> None:
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(p, q)
        sa, sb = opt_a.state[p], opt_b.state[q]
        assert sa.keys() == sb.keys()
        for key in sa:
            assert torch.equal(sa[key], sb[key]), key
            assert sa[key].device == sb[key].device and sa[key].dtype == sb[key].dtype, key


@IMPLEMENTATIONS
def test_bitwise_torch_adamw(device_type):
    ours, ref = _model(), _model()
    opt = build_optimizer(ours, CFG, device_type)
    assert isinstance(opt, LocalShardAdamW) and isinstance(opt, torch.optim.AdamW)
    ref_opt = _reference(ref, device_type)
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == \
        [{k: v for k, v in g.items() if k != "params"} for g in ref_opt.param_groups]
    start = [p.detach().clone() for p in ref.parameters()]
    _steps(ours, opt, range(5))
    _steps(ref, ref_opt, range(5))
    assert min((p - s).abs().max().item() for p, s in zip(ref.parameters(), start)) > 1e-3  # all moved
    _assert_same(ours, opt, ref, ref_opt)


@pytest.mark.parametrize("flags", [dict(amsgrad=True), dict(maximize=True), dict(amsgrad=True, foreach=False)])
def test_bitwise_torch_adamw_other_flags(flags):
    """amsgrad (a third state), maximize, the per-tensor loop: passed through to torch's functional as torch does."""
    ours, ref = _model(), _model()
    kw = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, **flags)
    if "foreach" not in flags:
        kw["fused"] = True
    opt, ref_opt = LocalShardAdamW(ours.parameters(), **kw), torch.optim.AdamW(ref.parameters(), **kw)
    _steps(ours, opt, range(4))
    _steps(ref, ref_opt, range(4))
    _assert_same(ours, opt, ref, ref_opt)


@IMPLEMENTATIONS
def test_state_dict_loads_into_torch_adamw_and_back(device_type):
    """A checkpoint of either optimizer loads into the other (same state names, group keys) and the runs go on as
    one run of torch's AdamW."""
    ref, ours, back = _model(), _model(), _model()
    ref_opt = _reference(ref, device_type)
    _steps(ref, ref_opt, range(3))
    ours.load_state_dict(ref.state_dict())
    opt = build_optimizer(ours, CFG, device_type)
    opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    _steps(ours, opt, range(3, 5))
    _steps(ref, ref_opt, range(3, 5))
    _assert_same(ours, opt, ref, ref_opt)
    back.load_state_dict(ours.state_dict())
    back_opt = _reference(back, device_type)
    back_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    _steps(back, back_opt, range(5, 7))
    _steps(ref, ref_opt, range(5, 7))
    _assert_same(back, back_opt, ref, ref_opt)


def test_step_reads_no_tensor_value_on_the_host():
    """Fused (CUDA's path): the step counts live on the parameters' device and are never read. (torch's foreach path
    keeps them on the host and reads them there, free, but the counter cannot tell them from device tensors.)"""
    model = _model()
    opt = build_optimizer(model, CFG, "cpu")
    _steps(model, opt, range(1))
    model(torch.randn(6, 8)).square().mean().backward()
    with HostReads() as reads:
        opt.step()
    assert reads.total == 0, reads.report()


def test_a_closure_and_a_group_without_gradients():
    """The closure's loss is returned; a group none of whose parameters has a gradient is skipped (no state)."""
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    opt = LocalShardAdamW([{"params": [a]}, {"params": [b]}], lr=0.1, fused=True)

    def closure():
        loss = a.square().sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == 3.0
    assert b not in opt.state and float(opt.state[a]["step"]) == 1.0
    assert torch.all(a < 1)


def test_a_torch_without_the_followed_step_takes_torch_s_own(monkeypatch):
    """Where this torch's private Adam functional or capture check differ (LOCAL_STEP false), the step is torch's."""
    import megatron_vlm.training.adamw_local as local

    monkeypatch.setattr(local, "LOCAL_STEP", False)
    monkeypatch.setattr(local, "adam", lambda *a, **k: (_ for _ in ()).throw(AssertionError("local step taken")))
    ours, ref = _model(), _model()
    opt, ref_opt = build_optimizer(ours, CFG, "cpu"), _reference(ref, "cpu")
    _steps(ours, opt, range(2))
    _steps(ref, ref_opt, range(2))
    _assert_same(ours, opt, ref, ref_opt)


def test_a_torch_whose_functional_takes_another_argument_takes_torch_s_own(monkeypatch):
    """A newer torch whose Adam functional takes an argument `_step` does not give (an option it would leave out, or a
    required one: a TypeError at the first step) is not followed: LOCAL_STEP is false and the step is torch's."""
    import importlib

    import torch.optim.adam as torch_adam

    import megatron_vlm.training.adamw_local as local

    real = torch_adam.adam

    def newer(*args, new_option: bool = False, **kwargs):
        return real(*args, **kwargs)

    newer.__signature__ = inspect.Signature([*inspect.signature(real).parameters.values(),  # type: ignore[attr-defined]
                                             inspect.Parameter("new_option", inspect.Parameter.KEYWORD_ONLY, default=False)])
    saved = dict(vars(local))  # the module as every other test imported it (its class, LOCAL_STEP)
    try:
        monkeypatch.setattr(torch_adam, "adam", newer)
        importlib.reload(local)
        assert not local.LOCAL_STEP
        ours, ref = _model(), _model()
        opt, ref_opt = local.LocalShardAdamW(ours.parameters(), lr=0.1, fused=True), \
            torch.optim.AdamW(ref.parameters(), lr=0.1, fused=True)
        _steps(ours, opt, range(2))
        _steps(ref, ref_opt, range(2))
        _assert_same(ours, opt, ref, ref_opt)
    finally:
        monkeypatch.undo()
        vars(local).update(saved)
    assert local.LOCAL_STEP and local.follows(real, torch.optim.AdamW._init_group)
    assert not local.follows(real, lambda self, group, params, grads: None)  # another _init_group
