"""The job's AdamW (fused on CPU / CUDA, foreach elsewhere) follows torch's per-parameter AdamW:
same decay groups, same trajectory up to float rounding."""
import pytest
import torch
from torch import nn

from megatron_vlm.config.sections import OptimizerConfig
from megatron_vlm.training.optim import adamw_implementation, build_optimizer


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))


def _trajectory(model, opt, steps=5):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(6, 8, generator=g)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("device_type", ["cpu", "npu"], ids=["fused", "foreach"])  # foreach: run on CPU tensors
def test_matches_per_parameter_adamw(device_type):
    cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1, betas=[0.9, 0.95], eps=1e-8)
    ours = _model()
    opt = build_optimizer(ours, cfg, device_type)
    assert all(opt.defaults.get(k) == v for k, v in adamw_implementation(device_type).items())
    assert opt.defaults.get("fused") is (True if device_type == "cpu" else None)
    ref = _model()
    decay = [p for n, p in ref.named_parameters() if p.ndim > 1 and not n.endswith(".bias")]
    no_decay = [p for n, p in ref.named_parameters() if not (p.ndim > 1 and not n.endswith(".bias"))]
    ref_opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False, fused=False)
    got, want = _trajectory(ours, opt), _trajectory(ref, ref_opt)
    moved = max((w - p0).abs().max().item() for w, p0 in zip(want, _model().parameters()))
    assert moved > 1e-3  # the trajectory is not trivially equal
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
