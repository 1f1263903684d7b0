"""The Liger-Kernel adapter (`kernels/thirdparty/liger.py`) for `linear_token_logprobs`.

On the CPU: (1) against a stand-in of `liger_kernel.transformers.functional.liger_fused_linear_cross_entropy`
written from its documented interface (reduction "none": -log p per token, 0 at `ignore_index`); (2) when
liger-kernel is installed (the dev extra installs it), against the real package, whose Triton kernels run
on the CPU through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA). Both
must give our reference's log-probs; calls with entropy or with gradients run the reference (logged),
and `auto` never picks it."""
from __future__ import annotations

import importlib.util
import logging
import sys
import types

import pytest
import torch

from megatron_vlm import kernels
from megatron_vlm.kernels.reference.token_logprobs import linear_token_logprobs as reference
from megatron_vlm.kernels.thirdparty import liger as adapter


def _inputs(n=12, h=16, v=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * 0.5
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::5] = -100
    return hidden, weight, labels


@pytest.fixture
def fake(monkeypatch):
    calls = []

    def liger_fused_linear_cross_entropy(input, weight, target, bias=None, ce_weight=None, ignore_index=-100,
                                         lse_square_scale=0.0, label_smoothing=0.0, reduction="mean", softcap=None,
                                         return_z_loss=False, **kw):
        assert reduction == "none" and not input.requires_grad and not weight.requires_grad
        calls.append(ignore_index)
        logits = (input.double() @ weight.double().t())
        loss = torch.nn.functional.cross_entropy(logits, target, ignore_index=ignore_index, reduction="none")
        return loss.to(input.dtype)

    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    functional = types.ModuleType("liger_kernel.transformers.functional")
    functional.liger_fused_linear_cross_entropy = liger_fused_linear_cross_entropy
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", functional)
    adapter._logged.clear()
    return calls


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_no_grad_logprobs_match_the_reference(fake, temperature):
    hidden, weight, labels = _inputs()
    weight.requires_grad_()  # a trainer's parameter under no_grad: detached before Liger sees it
    with torch.no_grad():
        ours = adapter.linear_token_logprobs(hidden, weight, labels, temperature=temperature)
        ref = reference(hidden, weight, labels, temperature=temperature)
    torch.testing.assert_close(ours, ref)
    assert ours.dtype == torch.float32 and bool((ours[labels == -100] == 0).all())
    assert fake == [-100]


def test_entropy_and_gradients_fall_back_and_say_why(fake, caplog):
    hidden, weight, labels = _inputs()
    hidden.requires_grad_()
    with caplog.at_level(logging.INFO, logger="megatron_vlm.kernels"):
        with torch.no_grad():
            logp, ent = adapter.linear_token_logprobs(hidden, weight, labels, return_entropy=True)
        with_grad = adapter.linear_token_logprobs(hidden, weight, labels)
    ref_logp, ref_ent = reference(hidden.detach(), weight, labels, return_entropy=True)
    torch.testing.assert_close(logp, ref_logp)
    torch.testing.assert_close(ent, ref_ent)
    assert with_grad.requires_grad  # the reference's autograd path
    assert fake == []
    assert "entropy" in caplog.text and "one scalar" in caplog.text


def test_auto_never_picks_it(fake):
    from megatron_vlm.kernels.registry import DEFAULT_REGISTRY

    DEFAULT_REGISTRY.clear_cache()
    try:
        for device in ("cpu", "cuda"):
            assert DEFAULT_REGISTRY.choose("linear_token_logprobs", device, torch.bfloat16) != "liger"
    finally:
        DEFAULT_REGISTRY.clear_cache()


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="liger-kernel not installed (dev extra)")
def test_real_package_through_the_registry_matches_the_reference():
    hidden, weight, labels = _inputs(n=10, h=32, v=50, seed=1)
    adapter._logged.clear()
    with torch.no_grad(), kernels.use_backends({"linear_token_logprobs": "liger"}):
        ours = kernels.linear_token_logprobs(hidden, weight, labels, temperature=0.9)
    torch.testing.assert_close(ours, reference(hidden, weight, labels, temperature=0.9), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_real_package_on_gpu_bf16():
    pytest.importorskip("liger_kernel")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    hidden, weight, labels = (t.cuda() for t in _inputs(n=4096, h=1024, v=32000))
    hidden, weight = hidden.bfloat16(), weight.bfloat16()
    with torch.no_grad():
        torch.testing.assert_close(adapter.linear_token_logprobs(hidden, weight, labels),
                                   reference(hidden, weight, labels), atol=5e-2, rtol=2e-2)
