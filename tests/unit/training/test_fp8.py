"""`train.precision = "fp8"` (megatron_vlm/training/fp8.py) on the CPU, through torchao's emulation mode:

- one converted Linear against a pure-torch transcription of dynamically scaled float8 matmuls
  (Micikevicius et al. 2022, "FP8 Formats for Deep Learning": x_q = cast(clamp(x * s)), s = fp8_max / amax(x);
  tensorwise: one scale per tensor, e4m3 forward / e5m2 output gradient; rowwise: one power-of-two scale per
  row of each matmul operand along its reduction dimension, e4m3 throughout): output, input and weight gradients;
- which layers are converted: the language decoder's Linears only (vision tower, projector, lm_head stay);
- a tiny Qwen2.5-VL's loss and gradients in fp8 against the same model in bf16, within stated tolerances
  (and not equal: the float8 path runs);
- the device rules (pre-sm89 CUDA, other devices: exit-2 errors naming the key) and the config rules.
"""
from __future__ import annotations

import copy
import logging
import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "fixtures"))

from tiny_qwen2_5_vl import build_sample, tiny_qwen2_5_vl_config_dict  # noqa: E402

from megatron_vlm.config import ConfigError, load_config_dict  # noqa: E402
from megatron_vlm.data.batch import shifted_labels  # noqa: E402
from megatron_vlm.errors import ConfigError as BaseConfigError  # noqa: E402
from megatron_vlm.models import build_model  # noqa: E402
from megatron_vlm.parallel.precision import compute_dtype, resolve_precision  # noqa: E402
from megatron_vlm.training import fp8  # noqa: E402
from megatron_vlm.training.lm_loss import TokenLogprobModel  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _quant(x: torch.Tensor, dtype: torch.dtype, dim=None, pow2: bool = False) -> torch.Tensor:
    """Quantise-dequantise `x` to `dtype` with a scale from amax over everything (dim None) or along `dim`."""
    amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    scale = (torch.finfo(dtype).max / amax.double().clamp(min=1e-12)).float()
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    q = (x.float() * scale).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype)
    return q.float() / scale


def _reference_linear(x, w, b, g, recipe):
    """out, grad_x, grad_w of y = x @ w.T + b with every matmul operand float8-quantised as the recipe says."""
    if recipe == "tensorwise":
        xq, wq = _quant(x, E4M3), _quant(w, E4M3)
        out = (xq @ wq.T).to(x.dtype) + b
        gq = _quant(g, E5M2)
        grad_x = (gq @ wq).to(x.dtype)
        grad_w = (gq.T @ xq).to(x.dtype)
    else:  # rowwise: scales along each matmul's reduction dimension, powers of two, e4m3 everywhere
        out = (_quant(x, E4M3, -1, True) @ _quant(w, E4M3, -1, True).T).to(x.dtype) + b
        grad_x = (_quant(g, E4M3, -1, True) @ _quant(w, E4M3, 0, True)).to(x.dtype)
        grad_w = (_quant(g, E4M3, 0, True).T @ _quant(x, E4M3, 0, True)).to(x.dtype)
    return out, grad_x, grad_w


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_converted_linear_matches_scaled_float8_equations(recipe):
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(64, 48, bias=True).to(torch.bfloat16)
    parent = nn.Module()
    parent.language_model = nn.Module()
    parent.language_model.proj = lin
    with torch.no_grad():
        lin.weight.copy_(torch.randn(48, 64, generator=g) * 0.05)
        lin.bias.copy_(torch.randn(48, generator=g) * 0.1)
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    assert fp8.convert_to_fp8(parent, recipe, torch.device("cpu")) == 1
    layer = parent.language_model.proj
    assert type(layer).__name__ == "Float8Linear"
    # rows of very different magnitude: rowwise and tensorwise scaling then give different results
    x = (torch.randn(40, 64, generator=g) * torch.logspace(-2, 1, 40)[:, None]).to(torch.bfloat16).requires_grad_()
    grad_out = (torch.randn(40, 48, generator=g) * 1e-3).to(torch.bfloat16)
    out = layer(x)
    out.backward(grad_out)
    ref_out, ref_gx, ref_gw = _reference_linear(x.detach(), w, b, grad_out, recipe)
    for got, ref in ((out.detach(), ref_out), (x.grad, ref_gx), (layer.weight.grad, ref_gw)):
        assert got.dtype == torch.bfloat16
        # equal up to bf16 rounding of the fp32 matmul results (accumulation order differs)
        torch.testing.assert_close(got.float(), ref.float(), rtol=1.6e-2, atol=1e-5 * ref.abs().max().item())
    # and the float8 path really ran: a bf16 matmul gives a visibly different output
    plain = x.detach() @ w.T + b
    assert (out.detach().float() - plain.float()).abs().max() > 1e-3 * plain.abs().max()


def _tiny_model():
    torch.manual_seed(0)
    return build_model(tiny_qwen2_5_vl_config_dict(), dtype=torch.bfloat16, device="cpu")


def _packed_batch(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    samples = [build_sample([5, ("image", (1, 4, 4)), 40], gen), build_sample([30, ("image", (1, 4, 8)), 25], gen)]
    ids = torch.tensor(samples[0]["input_ids"] + samples[1]["input_ids"])
    n0 = len(samples[0]["input_ids"])
    cu = torch.tensor([0, n0, ids.numel()], dtype=torch.int32)
    train = torch.zeros_like(ids, dtype=torch.bool)
    train[n0 - 30:n0] = True
    train[-20:] = True
    return {"input_ids": ids[None], "labels": shifted_labels(ids, train, cu)[None], "cu_seqlens": cu,
            "pixel_values": torch.cat([s["pixel_values"] for s in samples]).to(torch.bfloat16),
            "image_grid_thw": torch.cat([s["image_grid_thw"] for s in samples])}


def test_only_the_language_decoder_linears_are_converted():
    model = _tiny_model()
    before = {n: type(m) for n, m in model.named_modules()}
    n = fp8.convert_to_fp8(model, None, torch.device("cpu"))
    converted = {name for name, m in model.named_modules() if type(m).__name__ == "Float8Linear"}
    expected = {name for name, m in before.items() if m is nn.Linear and name.startswith("language_model.")}
    assert converted == expected and n == len(expected) == 2 * 7  # q k v o gate up down per decoder layer
    assert type(model.lm_head) is nn.Linear
    assert not any(name.startswith(("visual.", "lm_head")) for name in converted)
    assert all(type(m) is nn.Linear for name, m in model.named_modules() if name.startswith("visual.") and isinstance(m, nn.Linear))
    # the parameters are the same plain tensors under the same names (checkpoints and exports unchanged)
    assert all(p.dtype == torch.bfloat16 and type(p) is nn.Parameter for p in model.parameters())


def test_sizes_not_multiple_of_16_stay_bf16():
    assert fp8.fp8_module_filter(nn.Linear(64, 48), "language_model.layers.0.mlp.up_proj")
    assert not fp8.fp8_module_filter(nn.Linear(64, 40), "language_model.layers.0.mlp.up_proj")
    assert not fp8.fp8_module_filter(nn.Linear(64, 48), "visual.blocks.0.mlp.up_proj")
    assert not fp8.fp8_module_filter(nn.Linear(64, 48), "lm_head")
    parent = nn.Module()
    parent.language_model = nn.Linear(8, 8)  # nothing eligible: refused, not a silent bf16 run
    with pytest.raises(BaseConfigError, match="train.precision"):
        fp8.convert_to_fp8(parent, None, torch.device("cpu"))


# Measured on this tiny model (same bf16 weights and batch; torch 2.13 CPU, torchao 0.18.0): loss 5.80896 in bf16,
# |fp8 - bf16| = 6.7e-4 (tensorwise) / 9.0e-4 (rowwise); smallest cosine between the fp8 and bf16 gradients of a
# weight matrix 0.9938 / 0.9966 in the decoder, 0.9900 / 0.9943 in the vision tower (whose gradients pass back
# through the float8 decoder). For scale, fp32 vs bf16: |dloss| 8e-5, cosines >= 0.99992. The bounds leave ~10x
# (loss) and ~3x (1 - cosine) margin.
LOSS_TOL = 0.01
GRAD_COSINE_MIN = 0.97


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_tiny_vlm_fp8_loss_and_grads_close_to_bf16(recipe):
    ref = _tiny_model()
    model = copy.deepcopy(ref)
    fp8.convert_to_fp8(model, recipe, torch.device("cpu"))
    batch = _packed_batch()
    n = int((batch["labels"] != -100).sum())
    losses, grads = [], []
    for m in (ref, model):
        wrapper = TokenLogprobModel(m).train()
        loss = -wrapper(batch).float().sum() / n
        loss.backward()
        losses.append(loss.item())
        grads.append({k: p.grad.float() for k, p in m.named_parameters() if p.grad is not None})
    assert math.isfinite(losses[1])
    assert abs(losses[0] - losses[1]) < LOSS_TOL, losses
    assert losses[0] != losses[1]  # the float8 path ran
    assert grads[0].keys() == grads[1].keys()
    for k, g0 in grads[0].items():
        if g0.dim() == 2 and g0.abs().sum() > 0:
            cos = torch.nn.functional.cosine_similarity(g0.flatten(), grads[1][k].flatten(), dim=0).item()
            assert cos > GRAD_COSINE_MIN, (k, cos)


def test_device_rules(monkeypatch, caplog):
    with caplog.at_level("WARNING", logger="megatron_vlm"):
        assert fp8.fp8_emulated(torch.device("cpu")) is True
    assert "emulation" in caplog.text
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(BaseConfigError, match=r"train.precision.*8\.9.*A100 is 8\.0"):
        fp8.fp8_emulated(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fp8.fp8_emulated(torch.device("cuda")) is False
    with pytest.raises(BaseConfigError, match="train.precision.*mps"):  # an NPU is refused the same way
        fp8.fp8_emulated(torch.device("mps"))


def test_fp8_computes_in_bf16():
    for dev in ("cpu", "cuda"):
        assert resolve_precision("fp8", torch.device(dev)) == "bf16"
        assert compute_dtype("fp8", torch.float32, torch.device(dev)) == torch.bfloat16


def _cfg(tmp_path, train=None, **sections):
    d = {"model": {"path": str(tmp_path / "m")}, "data": {"type": "synthetic_vqa"},
         "train": {"mode": "sft", "max_steps": 1, **(train or {})}, **sections}
    return load_config_dict(d)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_config_accepts_fp8_with_a_recipe(tmp_path, recipe):
    cfg = _cfg(tmp_path, {"precision": "fp8", "fp8_recipe": recipe})
    assert cfg.train.precision == "fp8" and cfg.train.fp8_recipe == recipe
    assert _cfg(tmp_path, {"precision": "fp8"}).train.fp8_recipe is None


@pytest.mark.parametrize("train, sections, key", [
    ({"precision": "bf16", "fp8_recipe": "rowwise"}, {}, "train.fp8_recipe"),
    ({"fp8_recipe": "tensorwise"}, {}, "train.fp8_recipe"),
    ({"precision": "fp8", "fp8_recipe": "blockwise"}, {}, "train.fp8_recipe"),
    ({"precision": "fp8"}, {"lora": {}}, "train.precision"),
    ({"precision": "fp8"}, {"parallel": {"backend": "mcore"}}, "train.precision"),
    ({"precision": "fp8"}, {"parallel": {"tp": 2}}, "train.precision"),
])
def test_config_refuses_fp8_where_it_cannot_run(tmp_path, train, sections, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        _cfg(tmp_path, train, **sections)


@pytest.mark.parametrize("mode, sections", [("grpo", {"rl": {}}), ("dpo", {}), ("reward", {})])
def test_config_refuses_fp8_outside_sft(tmp_path, mode, sections):
    """docs/training.md ("FP8 training") and docs/dpo.md: GRPO, DPO and reward-model jobs exit 2 naming the key."""
    with pytest.raises(ConfigError, match=rf"train\.precision.*{mode}"):
        _cfg(tmp_path, {"precision": "fp8", "mode": mode}, **sections)


def test_unset_recipe_is_logged_as_tensorwise(caplog):
    """`train.fp8_recipe` unset runs tensorwise scaling, and the startup line says so (it said "None scaling")."""
    parent = nn.Module()
    parent.language_model = nn.Module()
    parent.language_model.proj = nn.Linear(32, 16).to(torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="megatron_vlm"):
        fp8.convert_to_fp8(parent, None, torch.device("cpu"))
    line = next(r.getMessage() for r in caplog.records if "train.precision = fp8" in r.getMessage())
    assert "(tensorwise scaling" in line and "None" not in line, line
