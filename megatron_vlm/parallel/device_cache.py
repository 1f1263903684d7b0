"""`empty_device_cache`: hand the caching allocator's free blocks back after memory left the device.

Why: an offloaded model (the reference policy, a reward model) moved back to the CPU, or a rollout engine
done with its KV caches, leaves its blocks cached by the device allocator, where the next phase (the
rollout's KV cache, the policy's activations) cannot use them; CUDA and NPU (torch_npu's
`torch.npu.empty_cache`) each have their own allocator."""
from __future__ import annotations

import torch

__all__ = ["empty_device_cache"]


def empty_device_cache(device: torch.device) -> None:
    """Empty the allocator cache of `device`'s kind (CUDA or NPU); a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif device.type == "npu":
        torch.npu.empty_cache()  # type: ignore[attr-defined]
