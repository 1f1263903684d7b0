"""Host copies of a batch's small tensors, kept next to their device copies: reading a pack's counts, grids or
sequence bounds from the host copy costs no device sync.

Why: on CUDA every read of a device tensor's value (`int()`, `tolist()`, a bool-mask index, `nonzero`) makes the
host wait for every kernel queued before it. The model and the steps need a few such values per pack (the image
grids for the vision tower's index bookkeeping, the longest sequence of `cu_seqlens` for the attention kernels, the
positions of the trained labels, a pack's pair count); the loader built them on the host, so `to_device` keeps
the host tensor it copied from on the device tensor it made (`HOST_COPY_KEYS` only), and `on_host(t)` gives it
back. A tensor without one (a CPU job's, or one the model derived) is its own host copy: reading it is then what
it was before (on CUDA, a sync). The copy is the loader's tensor itself, so no batch tensor may be changed in place
after `to_device` (none is: the steps and models build new tensors).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["HOST_COPY_KEYS", "moved_to", "on_host", "keep_host_copy", "host_int", "move", "all_on_host"]

HOST_COPY_KEYS = frozenset({"input_ids", "labels", "cu_seqlens", "image_grid_thw", "video_grid_thw", "image_grid_hw",
                            "num_pairs", "pair_index", "response_segments", "prefix_segments", "attention_mask",
                            "mm_token_type_ids", "second_per_grid_ts"})
"""The batch entries whose host tensor stays reachable from the device copy (small; pixels are not kept)."""

_ATTR = "_megatron_vlm_host_copy"


def keep_host_copy(device_tensor: torch.Tensor, host_tensor: torch.Tensor) -> torch.Tensor:
    """`device_tensor`, now answering `on_host` with `host_tensor` (a CPU tensor of the same values)."""
    if device_tensor is not host_tensor and host_tensor.device.type == "cpu":
        setattr(device_tensor, _ATTR, on_host(host_tensor))
    return device_tensor


def on_host(t: torch.Tensor) -> torch.Tensor:
    """`t`'s host copy when `to_device` kept one, else `t` itself."""
    return getattr(t, _ATTR, t)


def move(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`, copied without waiting for the device (a pageable host tensor is staged before the call
    returns), keeping its host copy (`t` itself when it is on the host)."""
    return keep_host_copy(t.to(device, non_blocking=True), on_host(t))


def all_on_host(*tensors: Optional[torch.Tensor]) -> Optional[list[Optional[torch.Tensor]]]:
    """The host copies of `tensors` (None entries stay None) when every one has one (or is a CPU tensor), else None:
    a computation either runs wholly on the host copies or, as before, on the tensors themselves."""
    out = [None if t is None else on_host(t) for t in tensors]
    return out if all(t is None or t.device.type == "cpu" for t in out) else None


def host_int(t: Any) -> int:
    """`int(t)` read from the host copy (a Python int passes through)."""
    return int(on_host(t)) if torch.is_tensor(t) else int(t)


def moved_to(batch: dict, device: torch.device, *, copy: bool = False) -> dict:
    """The tensors of `batch` on `device` (copied without waiting for the device: `non_blocking`; a pageable host
    tensor is staged before the call returns), other entries as they are; the `HOST_COPY_KEYS` entries keep their
    host tensor. `copy`: new tensors even on the same device (the tests and the CPU benchmark stand for a GPU job's
    copies this way)."""
    out = {}
    for k, v in batch.items():
        if torch.is_tensor(v):
            d = v.to(device, non_blocking=True, copy=copy)
            out[k] = keep_host_copy(d, v) if k in HOST_COPY_KEYS else d
        else:
            out[k] = v
    return out
