"""MKL-packed weights for the `nn.Linear` layers of the built-in engine's CPU decode step.

Why: a decode step multiplies a few dozen rows (one per running sequence) by every weight matrix; at
that shape `F.linear` on the plain weight spends much of its time re-laying-out the weight for its
kernel on every call. torch's MKL ops can lay a weight out once (`torch.ops.mkl._mkl_reorder_linear_weight`,
for a fixed row count) and multiply by the packed copy (`torch.ops.mkl._mkl_linear`): 1.4-1.9x faster
at the ~110M rollout row's shapes (32 rows, hidden 768, MLP 2560, vocabulary 32768; one thread), the
result bitwise `F.linear`'s on most shapes and within fp32 rounding on the others (a different
summation order). vLLM's CPU build does the same with oneDNN at load time.

How it is used: `PackedLinears(model, rows)` replaces the `forward` of every plain `nn.Linear` of the
model (instance attribute, removed again by `restore()`: the engine installs it for one `generate`
batch only, since the model may be the trainer's own). The replacement runs `F.linear` unchanged
unless the calling thread is inside `decoding()` (the engine's eager decode step, under inference mode,
fp32 on the CPU) and the input has between rows / 2 and `rows` rows; such an input is zero-padded to
`rows` rows (the count the weight was packed for; the padding rows are dropped from the output), so
every decode step of a batch takes the same path whichever rows are still running.

Staleness: a packed copy is keyed on the weight's storage address, shape and version counter (bumped
by every in-place write: `load_state_dict`, an optimizer step), and the engine drops every copy when
it is told of new weights (`load_weights`, the end of `paused()`), so a decode step never multiplies
by an old copy of a weight that has changed.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DecodePatches", "PackedLinears", "packing_available"]


def packing_available() -> bool:
    """Whether this torch has the MKL packed-GEMM ops (x86 builds with MKL)."""
    try:
        return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear") \
            and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")
    except (AttributeError, RuntimeError):
        return False


def _weight_key(w: torch.Tensor) -> tuple:
    """What identifies the values of `w`: storage address, shape, and the version counter (an inference tensor
    has none; it cannot be written in place outside inference mode, and the engine drops copies on every
    weight load)."""
    version = -1 if w.is_inference() else w._version
    return (w.data_ptr(), tuple(w.shape), version)


class DecodePatches:
    """Forwards patched onto some of a model's modules (an instance `forward`, removed by `restore()`) that take
    their fast path only in this thread's decode steps (`decoding()`), with packed weight copies kept in `packs`
    (the engine's dict, shared by every patcher of its calls: keys are module ids)."""

    def __init__(self, packs: Optional[dict] = None) -> None:
        self._local = threading.local()
        self._packs: dict[int, tuple] = packs if packs is not None else {}
        self._modules: list[nn.Module] = []

    def _patch(self, mod: nn.Module, forward) -> None:
        mod.forward = forward
        self._modules.append(mod)

    def restore(self) -> None:
        """Give every patched module its own forward back (the packed copies stay in `packs`)."""
        for mod in self._modules:
            mod.__dict__.pop("forward", None)
        self._modules.clear()

    @contextlib.contextmanager
    def decoding(self) -> Iterator[None]:
        """This thread's calls of the patched modules inside the block are decode-step calls."""
        prev = getattr(self._local, "on", False)
        self._local.on = True
        try:
            yield
        finally:
            self._local.on = prev

    def _decoding_now(self) -> bool:
        return getattr(self._local, "on", False) and torch.is_inference_mode_enabled()


class PackedLinears(DecodePatches):
    """The model's plain `nn.Linear` layers on MKL-packed weights inside `decoding()` (module docstring)."""

    def __init__(self, model: nn.Module, rows: int, packs: Optional[dict] = None) -> None:
        """`packs`: where the packed copies live (the engine passes one dict for all its calls, so unchanged
        weights are not packed again per call; each entry is checked against its weight at every use)."""
        if rows < 1:
            raise ValueError(f"PackedLinears: rows must be >= 1, got {rows}")
        super().__init__(packs)
        self.rows = rows
        self.min_rows = max(1, (rows + 1) // 2)
        for mod in model.modules():
            if type(mod) is nn.Linear and "forward" not in mod.__dict__:
                self._patch(mod, self._forward_of(mod))

    def invalidate(self) -> None:
        """Drop every packed copy (new weights: they are packed again at their next use)."""
        self._packs.clear()

    @property
    def num_layers(self) -> int:
        return len(self._modules)

    def _packed(self, mod: nn.Linear) -> torch.Tensor:
        w = mod.weight
        key = (self.rows,) + _weight_key(w)
        hit = self._packs.get(id(mod))
        if hit is not None and hit[0] == key and hit[1] is w:
            return hit[2]
        packed = torch.ops.mkl._mkl_reorder_linear_weight(w.detach(), self.rows)
        self._packs[id(mod)] = (key, w, packed)
        return packed

    def _usable(self, x: torch.Tensor, w: torch.Tensor) -> Optional[int]:
        """The row count of x when this call may take the packed path, else None."""
        if not self._decoding_now():
            return None
        if x.device.type != "cpu" or x.dtype != torch.float32 or w.dtype != torch.float32 or w.device.type != "cpu":
            return None
        m = x.numel() // max(x.shape[-1], 1) if x.dim() else 0
        return m if self.min_rows <= m <= self.rows else None

    def _forward_of(self, mod: nn.Linear):
        def forward(x: torch.Tensor) -> torch.Tensor:
            w, b = mod.weight, mod.bias
            m = self._usable(x, w)
            if m is None:
                return F.linear(x, w, b)
            x2 = x.reshape(m, x.shape[-1])
            if m < self.rows:  # padded to the packed row count: the same kernel for every step of the batch
                x2 = torch.cat([x2, x2.new_zeros(self.rows - m, x2.shape[1])])
            out = torch.ops.mkl._mkl_linear(x2, self._packed(mod), w, b, self.rows)
            if m < self.rows:
                out = out[:m]
            return out.view(*x.shape[:-1], w.shape[0])
        return forward
