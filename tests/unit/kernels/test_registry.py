"""Backend registry: forced backends, clear errors for unavailable ones, `auto` choice and its single
log line, KernelsConfig, and registration of new ops from another module."""
import logging

import pytest
import torch

import megatron_vlm.kernels as K
from megatron_vlm.kernels import reference
from megatron_vlm.kernels.registry import DEFAULT_REGISTRY, KernelRegistry, register_backend


@pytest.fixture(autouse=True)
def _restore_registry():
    previous = dict(DEFAULT_REGISTRY.forced)
    yield
    DEFAULT_REGISTRY.restore(previous)


def test_forced_triton_without_interpreter_names_op_backend_and_reason(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    K.configure({"rms_norm": "triton"})
    with pytest.raises(K.BackendUnavailableError, match=r"'rms_norm'.*'triton'.*tensor on cpu and TRITON_INTERPRET is not set"):
        K.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6)


def test_forced_npu_without_torch_npu_is_a_clear_error():
    K.configure({"swiglu": "npu"})
    with pytest.raises(K.BackendUnavailableError, match=r"'swiglu'.*'npu'.*torch_npu is not installed"):
        K.swiglu(torch.randn(4), torch.randn(4))


def test_forced_triton_runs_interpreted_and_matches_reference():
    x, w = torch.randn(5, 80), torch.randn(80)
    K.configure({"rms_norm": "triton", "swiglu": "triton"})
    assert DEFAULT_REGISTRY.choose("rms_norm", x.device.type, x.dtype) == "triton"
    torch.testing.assert_close(K.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
    torch.testing.assert_close(K.swiglu(x, x), reference.swiglu(x, x))


def test_auto_on_cpu_picks_torch_and_logs_once(caplog):
    registry = KernelRegistry()
    for name, prio in (("torch", 0), ("triton", 10)):
        register_backend("op", name, "megatron_vlm.kernels.reference.swiglu:swiglu", auto_devices=("cpu",) if name == "torch" else ("cuda",), priority=prio, registry=registry)
    x = torch.randn(3)
    with caplog.at_level(logging.INFO, logger="megatron_vlm.kernels"):
        assert registry.choose("op", "cpu", x.dtype) == "torch"
        registry.resolve("op", x)(x, x)
        registry.resolve("op", x)(x, x)
    lines = [r.getMessage() for r in caplog.records if r.name == "megatron_vlm.kernels"]
    assert lines == ["kernels: op on cpu uses backend torch (auto)"]


def test_auto_takes_highest_priority_usable_backend():
    registry = KernelRegistry()
    target = "megatron_vlm.kernels.reference.swiglu:swiglu"
    register_backend("op", "torch", target, auto_devices=("cpu",), registry=registry)
    register_backend("op", "fast", target, auto_devices=("cpu",), priority=10, registry=registry)
    register_backend("op", "fastest", target, check=lambda device, dtype: "not installed", auto_devices=("cpu",), priority=20, registry=registry)
    register_backend("op", "bf16_only", target, check=lambda device, dtype: None if dtype == torch.bfloat16 else "bf16 only", auto_devices=("cpu",), priority=15, registry=registry)
    assert registry.choose("op", "cpu", torch.float32) == "fast"
    assert registry.choose("op", "cpu", torch.bfloat16) == "bf16_only"
    assert registry.availability("op", torch.randn(2))["fastest"] == "not installed"


def test_configure_rejects_unknown_op_and_backend():
    with pytest.raises(KeyError, match="unknown op 'attn'"):
        K.configure({"attn": "torch"})
    with pytest.raises(KeyError, match="unknown backend 'tritn' for op 'attention'"):
        K.configure({"attention": "tritn"})


def test_kernels_config_applies_and_validates():
    cfg = K.KernelsConfig(attention="torch", swiglu="triton")
    cfg.validate()
    previous = K.configure(cfg)
    assert DEFAULT_REGISTRY.forced["attention"] == "torch" and DEFAULT_REGISTRY.forced["swiglu"] == "triton"
    assert "rms_norm" not in DEFAULT_REGISTRY.forced  # "auto"
    K.configure({"swiglu": "auto"})
    assert "swiglu" not in DEFAULT_REGISTRY.forced
    DEFAULT_REGISTRY.restore(previous)
    with pytest.raises(ValueError, match=r"kernels.rms_norm: unknown backend 'cuda'"):
        K.KernelsConfig(rms_norm="cuda").validate()
    with pytest.raises(TypeError):
        K.KernelsConfig("torch")  # kw_only


def test_every_builtin_op_has_torch_and_triton_backends():
    for op in ("attention", "rms_norm", "layer_norm", "apply_rotary", "swiglu", "linear_token_logprobs"):
        assert {"torch", "triton"} <= set(DEFAULT_REGISTRY.backends[op]), op
        assert op in K.KernelsConfig().as_dict()


def test_kernels_config_has_a_field_per_registered_op():
    assert set(K.KernelsConfig().as_dict()) == set(DEFAULT_REGISTRY.ops())


def test_public_api_compiles_fullgraph_through_the_dispatcher():
    torch._dynamo.reset()
    x, w = torch.randn(4, 8), torch.randn(8)
    q = torch.randn(2, 5, 2, 16)

    def block(x, w, q):
        return K.rms_norm(x, w, 1e-6), K.attention(q, q, q, causal=True), K.swiglu(x, x)

    got = torch.compile(block, backend="eager", fullgraph=True)(x, w, q)
    for g, e in zip(got, block(x, w, q)):
        torch.testing.assert_close(g, e)
