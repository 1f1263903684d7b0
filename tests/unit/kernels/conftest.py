"""Kernel tests: Triton kernels compiled on CUDA, interpreted on CPU; no test leaves a backend choice behind.

Whether the Triton kernels are interpreted is decided once for the process by tests/conftest.py
(TRITON_INTERPRET=1 only without CUDA; it must be set before any `megatron_vlm.kernels.triton.*`
module is imported, since `triton.jit` reads it at decoration time). `kernel_checks.DEVICE` is
where the tests put their inputs accordingly, and `test_triton_kernels_compiled_iff_cuda` checks
that the decision took effect. Tests pick backends with `megatron_vlm.kernels.use_backends(...)`
(a scope), never by changing the process default for good; the fixture below fails a test that
leaves the default or a scope changed. Helper modules of this folder (kernel_checks,
npu_emulator) are imported by name.
"""
import pytest

from megatron_vlm.kernels.registry import DEFAULT_REGISTRY


@pytest.fixture(autouse=True)
def _backend_choice_untouched():
    before = DEFAULT_REGISTRY.choices()
    yield
    after = DEFAULT_REGISTRY.choices()
    assert after == before, f"the test changed the kernel backend choice: {before} -> {after}"
