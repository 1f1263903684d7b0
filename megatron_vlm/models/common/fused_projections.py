"""One GEMM for an attention layer's q / k / v projections in the rollout engine's decode steps.

Why: a decode step multiplies a few dozen rows by every weight matrix, so its time goes to kernel
launches and skinny GEMMs rather than to FLOPs. On an H200 the 3B decode step in CUDA graphs ran ~730
kernels (about 20 per layer) and its GEMMs reached 58 % of the copy bandwidth; q, k and v are three
launches with k and v only 256 columns wide, and the rotary then concatenates q and k again to rotate
them in one call (a fourth kernel). One [q | k | v] weight makes that one GEMM whose output already
holds q and k side by side.

How, without a second copy of the weights: `fuse_qkv(model)` moves each eligible layer's three weights
(and biases) into one new tensor and re-makes `q_proj.weight`, `k_proj.weight`, `v_proj.weight` as
Parameters viewing its rows. The checkpoint names and shapes do not change, and `load_state_dict`
(the engine's weight refresh) copies into the views, that is into the fused tensor. The fused path is
taken only inside `fused_projections()` (the engine that asked for it), and only while the views still
share the fused tensor's storage (`intact`: a `.to()` or an assigning load re-makes the Parameters,
and the layer falls back to its three projections, the same numbers).

Only for a model that no optimizer holds (the engine's own copy): an optimizer keeps the Parameter
objects that `fuse_qkv` replaces. Eligible layers: `Attention` modules whose three projections are plain
`nn.Linear` on plain tensors of one dtype and device (not LoRA-wrapped, not DTensor shards).
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

__all__ = ["FusedQKV", "fuse_qkv", "fused_projections", "fused_enabled"]

_state = threading.local()


@dataclass
class FusedQKV:
    """The [q | k | v] weight `[nq + nk + nv, hidden]`, its bias (or None) and the three output widths."""
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    sizes: tuple[int, int, int]

    def intact(self, q: nn.Linear, k: nn.Linear, v: nn.Linear) -> bool:
        """Whether the three projections still view this tensor's rows (host pointers only: no sync)."""
        row = self.weight.stride(0) * self.weight.element_size()
        base, offsets = self.weight.data_ptr(), (0, self.sizes[0], self.sizes[0] + self.sizes[1])
        if any(lin.weight.data_ptr() != base + off * row for lin, off in zip((q, k, v), offsets)):
            return False
        if self.bias is None:
            return q.bias is None and k.bias is None and v.bias is None
        b0, size = self.bias.data_ptr(), self.bias.element_size()
        return all(lin.bias is not None and lin.bias.data_ptr() == b0 + off * size for lin, off in zip((q, k, v), offsets))


@contextlib.contextmanager
def fused_projections(enabled: bool = True) -> Iterator[None]:
    """Within the block (this thread), fused layers run one GEMM for q / k / v."""
    before = getattr(_state, "on", False)
    _state.on = enabled
    try:
        yield
    finally:
        _state.on = before


def fused_enabled() -> bool:
    return getattr(_state, "on", False)


def _plain(t: Optional[torch.Tensor]) -> bool:
    return t is None or type(t) in (torch.Tensor, nn.Parameter)


def fuse_qkv(model: nn.Module) -> int:
    """Fuse every eligible attention layer's q / k / v weights (module docstring); returns how many it fused now
    (a layer already fused and intact is left as it is: 0 on a second call). Fusing re-makes Parameters (new
    addresses): CUDA graphs captured on this model before must be captured again (an engine created after the
    fusion, or told through `weights_loaded`)."""
    fused = 0
    for m in model.modules():
        # the models' Attention (models/common/attention.py declares `_fused_qkv`; not imported here: it imports us)
        if not all(hasattr(m, name) for name in ("_fused_qkv", "q_proj", "k_proj", "v_proj")):
            continue
        lins = (m.q_proj, m.k_proj, m.v_proj)
        if any(type(lin) is not nn.Linear for lin in lins):
            continue
        if m._fused_qkv is not None and m._fused_qkv.intact(*lins):
            continue
        ws, bs = [lin.weight for lin in lins], [lin.bias for lin in lins]
        if not all(_plain(t) for t in ws + bs) or len({(w.dtype, w.device, w.shape[1], w.dim()) for w in ws}) != 1:
            continue
        if len({b is None for b in bs}) != 1 or ws[0].device.type == "meta":
            continue
        # plain tensors even when called from a generate under inference mode: inference tensors could not take
        # the in-place copies of a later weight refresh
        with torch.inference_mode(False), torch.no_grad():
            weight = torch.cat([w.detach() for w in ws])
            bias = None if bs[0] is None else torch.cat([b.detach() for b in bs])  # type: ignore[union-attr]
        sizes = (ws[0].shape[0], ws[1].shape[0], ws[2].shape[0])
        start = 0
        for lin, w, b, n in zip(lins, ws, bs, sizes):
            lin.weight = nn.Parameter(weight[start:start + n], requires_grad=w.requires_grad)
            if bias is not None:
                lin.bias = nn.Parameter(bias[start:start + n], requires_grad=b.requires_grad)  # type: ignore[union-attr]
            start += n
        m._fused_qkv = FusedQKV(weight, bias, sizes)
        fused += 1
    return fused
