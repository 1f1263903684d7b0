"""`train.precision = "fp8"` on a CUDA GPU with float8 matmuls (compute capability >= 8.9): the converted layers
run `torch._scaled_mm` (not the emulation) and agree with the emulated path that the CPU tests check against a
pure-torch transcription of the scaled float8 matmuls (tests/unit/training/test_fp8.py); token counts that are
not multiples of 16 (packing makes them arbitrary) go through torchao's padding.

Skipped without CUDA or below sm89. Tolerance: the hardware kernels accumulate in their own order (and the
tensorwise output matmul uses cuBLAS's fast accumulation), so results differ from the emulation's fp32 matmuls
in the last bf16 bits, and now and then a cast rounds to the neighbouring float8 value.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from megatron_vlm.training import fp8

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def sm89():
    if torch.cuda.get_device_capability() < fp8.FP8_MIN_CAPABILITY:
        pytest.skip(f"{torch.cuda.get_device_name()}: no float8 matmuls (compute capability < 8.9)")


def _decoder_with(lin: nn.Module) -> nn.Module:
    parent = nn.Module()
    parent.language_model = nn.Module()
    parent.language_model.proj = lin
    return parent


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("tokens", [1024, 1000])
def test_hardware_float8_linear_matches_emulation(sm89, recipe, tokens):
    from torchao.float8.float8_linear import Float8Linear

    g = torch.Generator(device="cuda").manual_seed(0)
    lin = nn.Linear(512, 768, bias=True, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(768, 512, device="cuda", generator=g) * 0.03)
        lin.bias.copy_(torch.randn(768, device="cuda", generator=g) * 0.1)
    hw = _decoder_with(lin)
    assert fp8.convert_to_fp8(hw, recipe, torch.device("cuda")) == 1
    layer = hw.language_model.proj
    assert layer.config.emulate is False
    emu = Float8Linear.from_float(copy.deepcopy(lin), config=fp8.fp8_linear_config(recipe, emulate=True))
    x = (torch.randn(tokens, 512, device="cuda", generator=g) * torch.logspace(-2, 1, tokens, device="cuda")[:, None])
    x = x.to(torch.bfloat16)
    grad = (torch.randn(tokens, 768, device="cuda", generator=g) * 1e-3).to(torch.bfloat16)
    outs = []
    for m in (layer, emu):
        xi = x.clone().requires_grad_()
        y = m(xi)
        y.backward(grad)
        outs.append((y.detach().float(), xi.grad.float(), m.weight.grad.float()))
    for a, b in zip(*outs):
        err = (a - b).abs().max().item()
        assert err <= 0.03 * b.abs().max().item(), (err, b.abs().max().item())
        assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item() > 0.999


def test_tiny_model_fp8_loss_close_to_bf16_on_gpu(sm89):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
    from tiny_qwen2_5_vl import tiny_qwen2_5_vl_config_dict

    from megatron_vlm.models import build_model
    from megatron_vlm.training.lm_loss import TokenLogprobModel

    torch.manual_seed(0)
    ref = build_model(tiny_qwen2_5_vl_config_dict(), dtype=torch.bfloat16, device="cuda")
    model = copy.deepcopy(ref)
    assert fp8.convert_to_fp8(model, "tensorwise", torch.device("cuda")) == 14
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 290, (1, 200), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    batch = {"input_ids": ids.cuda(), "labels": labels.cuda(), "cu_seqlens": torch.tensor([0, 120, 200], dtype=torch.int32).cuda()}
    batch["labels"][0, 119] = -100
    losses = []
    for m in (ref, model):
        logp = TokenLogprobModel(m).train()(batch)
        loss = -logp.float().mean()
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) < 0.02, losses
