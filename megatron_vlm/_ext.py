"""Loader and Python dispatch of the compiled extension `megatron_vlm._C` (csrc/).

The extension registers its ops as `torch.ops.megatron_vlm.*` (C++ CPU kernels, CUDA kernels when
built with them, Meta kernels for torch.compile). This module loads it once, lazily, and wraps
each op in a thin function whose result equals the pure-Python implementation exactly:

* `mrope_position_ids(...)` -> (position_ids, rope_deltas) or None: the C++ twin of
  megatron_vlm/models/common/mrope_index.py get_mrope_position_ids (Qwen2.5-VL and Qwen3-VL).
* `first_fit_pack(...)` -> list of packs or None: the C++ twin of megatron_vlm/data/packing.py.

The `csrc` backends of the kernels registry's MoE ops (`moe_permute`, `moe_topk_gating`) call the ops this
module loads from `kernels/csrc/moe.py`: this loader imports nothing of the op library (which imports it).

The two host-side wrappers return None when the extension is missing, inside `python_only()`, or
for input the C++ code rejects; the caller then runs its Python implementation, which raises the
documented error for invalid input. When the extension cannot be loaded (not built, build failed,
or MEGATRON_VLM_NO_EXT=1) one RuntimeWarning names the reason and everything runs in Python.
"""
from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import Optional

import numpy as np
import torch

from megatron_vlm.host_copies import on_host

__all__ = ["load", "available", "unavailable_reason", "python_only", "backend_check", "mrope_position_ids",
           "first_fit_pack"]

_lock = threading.Lock()
_module = None
_reason: Optional[str] = None
_tried = False
_python_only = 0


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "0").lower() not in ("", "0", "false", "no")


def _import():
    if _env_flag("MEGATRON_VLM_NO_EXT"):
        return None, "MEGATRON_VLM_NO_EXT is set"
    try:
        from megatron_vlm import _C
    except ModuleNotFoundError:
        return None, ("not built (no megatron_vlm/_C*.so; `pip install -e .` builds it, "
                      "see docs/extension.md)")
    except (ImportError, OSError) as err:  # e.g. built against another torch
        return None, f"import failed: {err}"
    _register_python_parts()
    if _env_flag("MEGATRON_VLM_SEGV_BACKTRACE"):
        # diagnostic: native frames on a crash, then Python's faulthandler (csrc/segv_backtrace.cpp)
        try:
            torch.ops.megatron_vlm.install_segv_backtrace()
        except (AttributeError, RuntimeError) as err:  # a _C built before the op existed
            warnings.warn(f"MEGATRON_VLM_SEGV_BACKTRACE: not installed ({err}); rebuild megatron_vlm._C", RuntimeWarning,
                          stacklevel=2)
    return _C, None


def load():
    """The extension module, or None (then one RuntimeWarning has said why)."""
    global _module, _reason, _tried
    if not _tried:
        with _lock:
            if not _tried:
                _module, _reason = _import()
                _tried = True
                if _module is None:
                    warnings.warn(f"megatron_vlm._C is not available ({_reason}); using the pure-Python "
                                  "implementations", RuntimeWarning, stacklevel=2)
    return _module


def available() -> bool:
    """True when the compiled host ops will be used (loaded and not inside `python_only()`)."""
    return not _python_only and load() is not None


def unavailable_reason() -> Optional[str]:
    load()
    return _reason


@contextlib.contextmanager
def python_only() -> Iterator[None]:
    """Run the Python implementations of the host ops inside this block (tests, benchmarks)."""
    global _python_only
    _python_only += 1
    try:
        yield
    finally:
        _python_only -= 1


def backend_check(device_type: str, dtype: torch.dtype) -> Optional[str]:
    """Kernels-registry availability check of the `csrc` backends: None or why not."""
    module = load()
    if module is None:
        return f"megatron_vlm._C is not available ({_reason})"
    if device_type == "cpu":
        return None
    if device_type == "cuda":
        return None if module.with_cuda else "megatron_vlm._C was built without its CUDA sources"
    return f"tensor on {device_type}; the csrc backend runs on cpu or cuda"


# ----- host ops -----------------------------------------------------------------------------------

def _cpu(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """`t` on the host: its host copy when it has one (megatron_vlm/host_copies.py; a device tensor's copy would
    wait for the device's queued work)."""
    return None if t is None else on_host(t).detach().to("cpu")


def mrope_position_ids(
    input_ids: torch.Tensor,
    *,
    image_token_id: int,
    video_token_id: int,
    spatial_merge_size: int,
    tokens_per_second: float,
    image_grid_thw: Optional[torch.Tensor] = None,
    video_grid_thw: Optional[torch.Tensor] = None,
    second_per_grid_ts=None,
    attention_mask: Optional[torch.Tensor] = None,
    mm_token_type_ids: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
):
    """get_mrope_position_ids computed in C++ on the host (results on input_ids' device), or None."""
    if not available() or input_ids.dim() != 2:
        return None
    try:
        intervals = None
        if second_per_grid_ts is not None:
            sec = second_per_grid_ts.tolist() if torch.is_tensor(second_per_grid_ts) else list(second_per_grid_ts)
            intervals = torch.tensor([tokens_per_second * s for s in sec], dtype=torch.float64)
        pos, deltas = torch.ops.megatron_vlm.mrope_position_ids(
            _cpu(input_ids), _cpu(mm_token_type_ids), _cpu(attention_mask), _cpu(cu_seqlens), _cpu(image_grid_thw),
            _cpu(video_grid_thw), intervals, float(tokens_per_second), int(image_token_id), int(video_token_id),
            int(spatial_merge_size),
        )
    except (RuntimeError, ValueError, TypeError, IndexError):
        return None
    return pos.to(input_ids.device, non_blocking=True), deltas.to(input_ids.device, non_blocking=True)


def _int_array(x) -> Optional[np.ndarray]:
    a = x.numpy() if torch.is_tensor(x) else np.asarray(x)
    return a if a.ndim == 1 and a.dtype.kind in "iu" else None


def first_fit_pack(lengths: Sequence[int], order: Sequence[int], capacity: int, max_open: int = 64):
    """packing.first_fit_pack computed in C++ (packs of Python ints), or None."""
    if not available():
        return None
    lens, ords = _int_array(lengths), _int_array(order)
    if lens is None or ords is None or isinstance(capacity, bool):
        return None
    try:
        samples, offsets = torch.ops.megatron_vlm.first_fit_pack(
            torch.from_numpy(np.ascontiguousarray(lens, dtype=np.int64)),
            torch.from_numpy(np.ascontiguousarray(ords, dtype=np.int64)), int(capacity), int(max_open))
    except (RuntimeError, ValueError, TypeError, OverflowError):
        return None
    flat, off = samples.tolist(), offsets.tolist()
    return [flat[a:b] for a, b in zip(off[:-1], off[1:])]


def _register_python_parts() -> None:
    """Fake kernel of the packing op (data-dependent size) and autograd of topk_gating."""
    @torch.library.register_fake("megatron_vlm::first_fit_pack")
    def _pack_fake(lengths, order, capacity, max_open):
        packs = torch.library.get_ctx().new_dynamic_size()
        return order.new_empty(order.shape, dtype=torch.long), order.new_empty((packs + 1,), dtype=torch.long)

    def setup_context(ctx, inputs, output):
        _, _, _, ctx.use_sigmoid, _, _, ctx.renormalize, ctx.scaling = inputs
        scores, _, ids = output
        ctx.save_for_backward(scores, ids)

    def backward(ctx, g_scores, g_weights, g_ids):
        scores, ids = ctx.saved_tensors
        g = torch.zeros_like(scores) if g_scores is None else g_scores.clone()
        if g_weights is not None:
            chosen = scores.gather(1, ids)
            if ctx.renormalize:  # w = c * s / (sum s + 1e-20)
                denom = chosen.sum(-1, keepdim=True) + 1e-20
                g_chosen = ctx.scaling * (g_weights / denom - (g_weights * chosen).sum(-1, keepdim=True) / denom**2)
            else:
                g_chosen = ctx.scaling * g_weights
            g = g.scatter_add(1, ids, g_chosen)
        if ctx.use_sigmoid:
            g_logits = g * scores * (1 - scores)
        else:
            g_logits = scores * (g - (g * scores).sum(-1, keepdim=True))
        return g_logits, None, None, None, None, None, None, None

    torch.library.register_autograd("megatron_vlm::topk_gating", backward, setup_context=setup_context)

