"""Suite-wide test settings: where Triton kernels run, and skipping of device-only tests.

Triton kernels run compiled on a CUDA device; without one they can only run in the Triton
interpreter, and `triton.jit` decides interpreter vs compiled at decoration time (when a
`megatron_vlm.kernels.triton.*` module is imported). This root conftest is imported before every
test module of the suite (and before `import torch` has imported triton), so it is the one place
that decides for the whole process: TRITON_INTERPRET=1 exactly when CUDA is absent (an explicit
TRITON_INTERPRET in the environment wins).

Tests marked `gpu` need a CUDA device and `npu` an Ascend NPU; without one they are skipped with
that reason. Only tests that cannot run at all without the device carry the marker, so a skip
never hides a failure that the CPU run could have shown.

Under pytest-xdist (the README's test command runs two workers, one per core of the 2-core CI machine) each
worker keeps torch to one thread: two workers with a thread per core each would oversubscribe the cores, and
OpenMP's spinning barriers make that far slower than one thread each. Tests that measure threading set their own
count; multi-process tests already give each rank one thread.
"""
import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def _npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers torch.npu)

    return torch.npu.is_available()


def pytest_collection_modifyitems(config, items):
    has_gpu, has_npu = None, None
    for item in items:
        if "gpu" in item.keywords:
            has_gpu = torch.cuda.is_available() if has_gpu is None else has_gpu
            if not has_gpu:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "npu" in item.keywords:
            has_npu = _npu_available() if has_npu is None else has_npu
            if not has_npu:
                item.add_marker(pytest.mark.skip(reason="needs an Ascend NPU"))


@pytest.fixture
def gloo_world_of_one(tmp_path):
    """A one-process gloo default group for a test (FSDP2 / DTensor on one CPU rank), torn down after it; an
    already initialised group is used as it is."""
    import torch.distributed as dist

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    if own:
        dist.destroy_process_group()
