"""Lazy access to torch_npu for the adapters (absent on CPU / CUDA machines; tests install an emulator)."""


def torch_npu_module(op: str):
    try:
        import torch_npu  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(f"npu backend for {op} needs torch_npu, which is not installed") from exc
    return torch_npu
