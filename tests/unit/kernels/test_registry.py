"""Backend registry: forced backends, clear errors for unavailable ones, `auto` choice and its single
log line, KernelsConfig, registration of new ops from another module, scoped choices
(`use_backends`: nesting, restore, per thread / asyncio task, next to the process default) and the
caches (one availability check per key however many eager calls)."""
import asyncio
import dataclasses
import logging
import sys
import threading

import pytest
import torch
from kernel_checks import DEVICE

import megatron_vlm.kernels as K
from megatron_vlm.kernels import reference
from megatron_vlm.kernels.registry import DEFAULT_REGISTRY, KernelRegistry, register_backend

SWIGLU = "megatron_vlm.kernels.reference.swiglu:swiglu"


@pytest.fixture
def fresh_decisions():
    """Forget cached decisions before and after a test that changes what a check sees."""
    DEFAULT_REGISTRY.clear_cache()
    yield
    DEFAULT_REGISTRY.clear_cache()


@pytest.fixture
def default_restored():
    """For the tests of `configure` itself: the process default comes back afterwards."""
    previous = dict(DEFAULT_REGISTRY.forced)
    yield
    DEFAULT_REGISTRY.restore(previous)


def _counting(check=None):
    """A check (usable unless `check` says otherwise) that counts its calls."""
    calls = []

    def probe(device_type, dtype):
        calls.append((device_type, dtype))
        return None if check is None else check(device_type, dtype)

    return probe, calls


def test_forced_triton_without_interpreter_names_op_backend_and_reason(monkeypatch, fresh_decisions):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with K.use_backends({"rms_norm": "triton"}):
        for _ in range(2):  # the cached decision raises the same error again
            with pytest.raises(K.BackendUnavailableError, match=r"'rms_norm'.*'triton'.*tensor on cpu and TRITON_INTERPRET is not set"):
                K.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6)


def test_forced_npu_without_torch_npu_is_a_clear_error():
    with K.use_backends({"swiglu": "npu"}), \
            pytest.raises(K.BackendUnavailableError, match=r"'swiglu'.*'npu'.*torch_npu is not installed"):
        K.swiglu(torch.randn(4), torch.randn(4))


def test_forced_triton_matches_reference():
    """Interpreted on CPU, compiled on CUDA."""
    x, w = torch.randn(5, 80, device=DEVICE), torch.randn(80, device=DEVICE)
    with K.use_backends({"rms_norm": "triton", "swiglu": "triton"}):
        assert DEFAULT_REGISTRY.choose("rms_norm", x.device.type, x.dtype) == "triton"
        torch.testing.assert_close(K.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
        torch.testing.assert_close(K.swiglu(x, x), reference.swiglu(x, x))


def test_auto_on_cpu_picks_torch_and_logs_once(caplog):
    registry = KernelRegistry()
    for name, prio in (("torch", 0), ("triton", 10)):
        register_backend("op", name, SWIGLU, auto_devices=("cpu",) if name == "torch" else ("cuda",), priority=prio, registry=registry)
    x = torch.randn(3)
    with caplog.at_level(logging.INFO, logger="megatron_vlm.kernels"):
        assert registry.choose("op", "cpu", x.dtype) == "torch"
        registry.resolve("op", x)(x, x)
        registry.resolve("op", x)(x, x)
        registry.clear_cache()
        registry.resolve("op", x)(x, x)  # decided again, not logged again
    lines = [r.getMessage() for r in caplog.records if r.name == "megatron_vlm.kernels"]
    assert lines == ["kernels: op on cpu uses backend torch (auto)"]


def test_auto_takes_highest_priority_usable_backend():
    registry = KernelRegistry()
    register_backend("op", "torch", SWIGLU, auto_devices=("cpu",), registry=registry)
    register_backend("op", "fast", SWIGLU, auto_devices=("cpu",), priority=10, registry=registry)
    register_backend("op", "fastest", SWIGLU, check=lambda device, dtype: "not installed", auto_devices=("cpu",), priority=20, registry=registry)
    register_backend("op", "bf16_only", SWIGLU, check=lambda device, dtype: None if dtype == torch.bfloat16 else "bf16 only", auto_devices=("cpu",), priority=15, registry=registry)
    assert registry.choose("op", "cpu", torch.float32) == "fast"
    assert registry.choose("op", "cpu", torch.bfloat16) == "bf16_only"
    assert registry.availability("op", torch.randn(2))["fastest"] == "not installed"


def test_configure_and_use_backends_reject_unknown_op_and_backend():
    for apply in (K.configure, lambda choices: K.use_backends(choices).__enter__()):
        with pytest.raises(KeyError, match="unknown op 'attn'"):
            apply({"attn": "torch"})
        with pytest.raises(KeyError, match="unknown backend 'tritn' for op 'attention'"):
            apply({"attention": "tritn"})
    assert DEFAULT_REGISTRY.choice("attention") == K.DEFAULT_REGISTRY.forced.get("attention", "auto")


def test_kernels_config_applies_and_validates(default_restored):
    cfg = K.KernelsConfig(attention="torch", swiglu="triton")
    cfg.validate()
    previous = K.configure(cfg)
    assert DEFAULT_REGISTRY.forced["attention"] == "torch" and DEFAULT_REGISTRY.forced["swiglu"] == "triton"
    assert "rms_norm" not in DEFAULT_REGISTRY.forced  # "auto"
    K.configure({"swiglu": "auto"})
    assert "swiglu" not in DEFAULT_REGISTRY.forced
    DEFAULT_REGISTRY.restore(previous)
    with K.use_backends(K.KernelsConfig(rms_norm="torch")):
        assert DEFAULT_REGISTRY.choice("rms_norm") == "torch" and DEFAULT_REGISTRY.choice("swiglu") == "auto"
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


# -- scopes ----------------------------------------------------------------------------------


def test_scopes_nest_and_restore_on_exit_and_on_error():
    assert DEFAULT_REGISTRY.choice("rms_norm") == "auto"
    with K.use_backends({"rms_norm": "torch", "swiglu": "triton"}):
        with K.use_backends({"rms_norm": "triton"}):
            assert DEFAULT_REGISTRY.choice("rms_norm") == "triton"
            assert DEFAULT_REGISTRY.choice("swiglu") == "triton"  # inherited from the outer scope
            with K.use_backends({"swiglu": "auto"}):  # "auto" overrides an outer forced choice
                assert DEFAULT_REGISTRY.choice("swiglu") == "auto"
        assert DEFAULT_REGISTRY.choice("rms_norm") == "torch"
        with pytest.raises(RuntimeError, match="boom"), K.use_backends({"rms_norm": "triton"}):
            raise RuntimeError("boom")
        assert DEFAULT_REGISTRY.choice("rms_norm") == "torch"
    assert DEFAULT_REGISTRY.choice("rms_norm") == "auto" and DEFAULT_REGISTRY.choice("swiglu") == "auto"


def test_reference_model_under_torch_scope_while_default_is_triton(monkeypatch, default_restored):
    """One process, one op, two backends: the policy runs the configured default (Triton), the
    reference model's forward runs inside a torch scope; the default is the same afterwards."""
    ran = []
    for name in ("torch", "triton"):
        backend = DEFAULT_REGISTRY.backends["rms_norm"][name]
        real = DEFAULT_REGISTRY._load(backend)
        monkeypatch.setattr(backend.slot, "fn", lambda *a, _real=real, _name=name, **kw: ran.append(_name) or _real(*a, **kw))

    x, w = torch.randn(3, 64, device=DEVICE), torch.randn(64, device=DEVICE)
    K.configure({"rms_norm": "triton"})

    def model(x):
        return K.rms_norm(x, w, 1e-6)

    @K.use_backends({"rms_norm": "torch"})  # a scope also decorates a function
    def reference_model(x):
        return K.rms_norm(x, w, 1e-6)

    policy_out = model(x)
    with K.use_backends({"rms_norm": "torch"}):
        ref_out = model(x)
    ref_out_2 = reference_model(x)
    policy_again = model(x)
    assert ran == ["triton", "torch", "torch", "triton"]
    torch.testing.assert_close(policy_out, ref_out)
    torch.testing.assert_close(ref_out_2, policy_again)
    assert DEFAULT_REGISTRY.forced["rms_norm"] == "triton" and DEFAULT_REGISTRY.choice("rms_norm") == "triton"


def _two_backend_registry():
    registry = KernelRegistry()
    register_backend("op", "torch", SWIGLU, auto_devices=("cpu",), registry=registry)
    register_backend("op", "other", SWIGLU, registry=registry)
    return registry


def test_scopes_are_per_thread():
    registry = _two_backend_registry()
    barrier, seen = threading.Barrier(3), {}

    def worker(label, choices):
        with registry.use_backends(choices):
            barrier.wait()  # all three threads are inside their scopes at once
            seen[label] = registry.choose("op", "cpu", torch.float32)
            barrier.wait()

    def unscoped():
        barrier.wait()
        seen["unscoped"] = registry.choose("op", "cpu", torch.float32)
        barrier.wait()

    threads = [threading.Thread(target=worker, args=("a", {"op": "other"})), threading.Thread(target=worker, args=("b", {"op": "torch"})),
               threading.Thread(target=unscoped)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert seen == {"a": "other", "b": "torch", "unscoped": "torch"}


def test_scopes_are_per_asyncio_task():
    registry = _two_backend_registry()

    async def task(choices):
        with registry.use_backends(choices):
            await asyncio.sleep(0)  # let the other task enter its scope
            first = registry.choose("op", "cpu", torch.float32)
            await asyncio.sleep(0)
            return first, registry.choose("op", "cpu", torch.float32)

    async def main():
        return await asyncio.gather(task({"op": "other"}), task({"op": "torch"}))

    assert asyncio.run(main()) == [("other", "other"), ("torch", "torch")]
    assert registry.choice("op") == "auto"


# -- caches ----------------------------------------------------------------------------------


def test_availability_is_checked_once_per_key_over_repeated_calls():
    registry = KernelRegistry()
    probe, calls = _counting(lambda device, dtype: None if dtype == torch.float32 else "fp32 only")
    register_backend("op", "torch", SWIGLU, auto_devices=("cpu",), registry=registry)
    register_backend("op", "fast", SWIGLU, check=probe, auto_devices=("cpu",), priority=10, registry=registry)
    x = torch.randn(4)
    for _ in range(5):
        registry.resolve("op", x)(x, x)
    assert calls == [("cpu", torch.float32)] and registry.choose("op", "cpu", torch.float32) == "fast"
    for _ in range(3):  # a new dtype: one more check, then cached; the fallback is taken
        assert registry.choose("op", "cpu", torch.bfloat16) == "torch"
    with registry.use_backends({"op": "fast"}):  # a scope forcing the backend reuses the cached check
        registry.resolve("op", x)(x, x)
        with pytest.raises(K.BackendUnavailableError, match="fp32 only"):
            registry.choose("op", "cpu", torch.bfloat16)
    assert len(calls) == 2
    registry.clear_cache()
    registry.resolve("op", x)
    assert len(calls) == 3


def test_default_registry_probes_once_over_eager_calls(monkeypatch, fresh_decisions):
    probe, calls = _counting()
    triton = DEFAULT_REGISTRY.backends["swiglu"]["triton"]
    monkeypatch.setitem(DEFAULT_REGISTRY.backends["swiglu"], "triton", dataclasses.replace(triton, check=probe))
    x = torch.randn(8, device=DEVICE)
    with K.use_backends({"swiglu": "triton"}):
        for _ in range(4):
            K.swiglu(x, x)
    with K.use_backends({"swiglu": "triton"}):  # another scope with the same choice: same cached decision
        K.swiglu(x, x)
    assert calls == [(x.device.type, torch.float32)]


def test_a_package_that_is_installed_but_does_not_import_is_passed_over_with_its_error(tmp_path, monkeypatch):
    """A compiled package built against another torch is installed (find_spec sees it) but fails to load;
    `auto` on CUDA must not pick it (it would fail at the model's first call) and forcing it names the error.
    The package here is real, on disk: its __init__ raises what a mismatched build raises."""
    from megatron_vlm.kernels.availability import cuda_package_check, triton_package_check
    from megatron_vlm.kernels.builtin_ops import register_builtin_ops

    for name in ("flash_attn", "liger_kernel"):
        pkg = tmp_path / name
        pkg.mkdir()
        (pkg / "__init__.py").write_text('raise ImportError("flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi")')
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))

    check = cuda_package_check("flash_attn", (torch.float16, torch.bfloat16))
    assert check("cpu", torch.bfloat16) == "tensor on cpu; flash_attn needs a cuda tensor"  # not imported on the CPU
    assert "flash_attn" not in sys.modules
    reason = check("cuda", torch.bfloat16)
    assert reason.startswith("flash_attn is installed but flash_attn does not import (ImportError: ")
    assert "undefined symbol" in reason
    assert check("cuda", torch.float32).startswith("flash_attn does not support torch.float32")  # dtype first

    registry = KernelRegistry()
    register_builtin_ops(registry)
    assert registry.choose("attention", "cuda", torch.bfloat16) != "flash_attn"
    with registry.use_backends({"attention": "flash_attn"}), \
            pytest.raises(K.BackendUnavailableError, match="flash_attn does not import .*undefined symbol"):
        registry.choose("attention", "cuda", torch.bfloat16)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "liger_kernel does not import" in triton_package_check("liger_kernel")("cpu", torch.float32)


def test_an_importable_package_passes_the_import_check(tmp_path, monkeypatch):
    from megatron_vlm.kernels.availability import cuda_package_check

    pkg = tmp_path / "fake_cuda_pkg"
    (pkg / "ops").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "ops" / "__init__.py").write_text("")
    (pkg / "ops" / "broken.py").write_text("raise OSError('libcudart.so.13: cannot open shared object file')")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cuda_package_check("fake_cuda_pkg", modules=("fake_cuda_pkg.ops",))("cuda", torch.float32) is None
    reason = cuda_package_check("fake_cuda_pkg", modules=("fake_cuda_pkg.ops", "fake_cuda_pkg.ops.broken"))("cuda", torch.float32)
    assert reason == ("fake_cuda_pkg is installed but fake_cuda_pkg.ops.broken does not import "
                      "(OSError: libcudart.so.13: cannot open shared object file)")
