"""The routed MoE experts of the built-in engine's CPU decode step in one C++ call, on MKL-packed weights.

Why: a decode step of a MoE model runs, per layer, `GroupedExperts`' module path: moe_permute, two grouped GEMMs
(a loop of small per-expert `aten::mm`, e.g. [16, 256] x [256, 512], each re-laying-out the plain weight),
the activation and moe_unpermute: ~30 ATen calls. `kernels/csrc/moe_experts.py` (csrc/cpu_moe_experts.cpp)
does the same in one call with each expert's weights packed once by MKL (a packed matrix serves any row
count, so the variable per-expert row counts of routing need no padding): 2.2x faster per layer at the tiny
Qwen3-MoE rollout row's decode shape (benchmarks/RESULTS.md). vLLM's CPU build runs one fused MoE op too.

How it is used: `PackedExperts(model, packs)` replaces the `forward` of every plain `GroupedExperts` of the model
(instance attribute, removed by `restore()`: the engine installs it for one `generate` batch, as it does
`PackedLinears`). The replacement runs the module's own forward unless the calling thread is inside
`decoding()` (the engine's eager decode step) under inference mode with fp32 CPU operands and a known
activation. Routing (and routing replay's recording) happens in `MoE.forward` before the experts are called,
so it sees every token as before.

Staleness: packed copies are keyed on each weight's storage address, shape and version counter, and the
engine drops them all when told of new weights (`load_weights`, the end of `paused()`), as for the Linear
layers. Memory: MKL's packed buffer is reserved at a fixed, generous size per matrix (~9 MB for a
[512, 256] one, most of it never written, so never resident); past `max_packed_bytes` reserved in all, the
remaining experts multiply by their plain weights (the same op, unpacked).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megatron_vlm.inference.cpu_packed_linear import DecodePatches, _weight_key
from megatron_vlm.kernels.csrc import moe_experts as fused
from megatron_vlm.models.common.moe import GroupedExperts, activation_fn

__all__ = ["PackedExperts", "fused_experts_available"]


def fused_experts_available() -> bool:
    """Whether the compiled extension has the fused expert op."""
    return fused.available()


def _activation_name(mod: GroupedExperts) -> Optional[str]:
    return next((name for name in fused.ACTIVATIONS if activation_fn(name) is mod.act), None)


class PackedExperts(DecodePatches):
    """The model's `GroupedExperts` on the fused C++ op inside `decoding()` (module docstring)."""

    def __init__(self, model: nn.Module, packs: Optional[dict] = None, *, max_packed_bytes: int = 8 << 30) -> None:
        """`packs`: where the packed copies live (the engine's dict, shared with its packed Linear layers: keys are
        module ids); `max_packed_bytes`: the address space packed copies may reserve in all."""
        super().__init__(packs)
        self.max_packed_bytes = max_packed_bytes
        for mod in model.modules():
            # the exact class: a subclass (expert parallelism's ExpertParallelGroupedExperts) has its own forward
            if type(mod) is GroupedExperts and "forward" not in mod.__dict__:
                name = _activation_name(mod)
                if name is None:
                    continue
                self._patch(mod, self._forward_of(mod, name))

    @property
    def num_modules(self) -> int:
        return len(self._modules)

    def _reserved(self) -> int:
        return sum(p.numel() for entry in self._packs.values() if entry[0] == "experts" for p in entry[3])

    def _packed(self, mod: GroupedExperts, w1: torch.Tensor, w2: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        key = (_weight_key(w1), _weight_key(w2))
        hit = self._packs.get(id(mod))
        if hit is not None and hit[0] == "experts" and hit[1] == key and hit[2][0] is w1 and hit[2][1] is w2:
            return hit[3] if hit[3] else (None, None)
        self._packs.pop(id(mod), None)
        p1 = fused.pack_expert_weights(w1)
        p2 = fused.pack_expert_weights(w2)
        if p1.numel() == 0 or p2.numel() == 0 or self._reserved() + p1.numel() + p2.numel() > self.max_packed_bytes:
            packed: tuple[Optional[torch.Tensor], ...] = (None, None)  # no MKL, or past the budget: plain weights
            stored: tuple[torch.Tensor, ...] = ()
        else:
            packed = stored = (p1, p2)
        self._packs[id(mod)] = ("experts", key, (w1, w2), stored)
        return packed if stored else (None, None)

    def _usable(self, x: torch.Tensor, *weights: torch.Tensor) -> bool:
        if not self._decoding_now():
            return False
        return all(type(t) in (torch.Tensor, nn.Parameter) and t.device.type == "cpu" and t.dtype == torch.float32
                   for t in (x, *weights))

    def _forward_of(self, mod: GroupedExperts, activation: str):
        def forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
            w1 = mod.gate_up_proj if mod.gated else mod.up_proj
            w2 = mod.down_proj
            if not self._usable(x, w1, w2):
                return GroupedExperts.forward(mod, x, topk_ids, topk_weights)
            p1, p2 = self._packed(mod, w1, w2)
            return fused.moe_experts(x, topk_ids, topk_weights, w1, w2, gated=mod.gated, activation=activation,
                                     w1_packed=p1, w2_packed=p2)
        return forward
