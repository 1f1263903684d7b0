"""bf16 model weights with their fp32 master copies held beside them, for one process without FSDP2 units.

Why: on one GPU, FSDP2 has nothing to shard, yet its mixed precision (fp32 parameters, cast to bf16 for each unit's
forward, gradients cast back to fp32) costs a copy and a cast of every parameter per forward (again in the backward
when resharded), a reduce-scatter copy of every gradient, and per-unit hooks on the host: 66 ms of the compiled 16k
Qwen2.5-VL-3B step's kernels (benchmarks/RESULTS.md, "Fifth GPU run") and ~20 ms of its host time. With
`parallel.fsdp = false` the model holds its weights in bf16 and this module keeps the fp32 masters the optimizer
updates (as Megatron's mixed-precision optimizer does): per step, one fp32 accumulation of each bf16 gradient (a hook
as the gradient is made) and one multi-tensor copy of the updated masters into the bf16 weights.

The arithmetic is FSDP2's mixed precision on one rank, bit for bit: the forward sees the bf16 rounding of the
masters, the bf16 gradient is cast to fp32 and summed in fp32 over micro-batches, clipping and AdamW run on the fp32
masters and gradients (tests/integration/test_no_fsdp_job.py compares whole jobs). `fp32_view` shows the model with
its masters in place of the bf16 weights (the same parameter objects, their `.data` swapped), so the optimizer's
state, distributed checkpoints and exports see fp32 parameters under the usual names: a checkpoint of either layout
loads into the other. Parameters already in bf16 (`model.dtype = "bfloat16"`) have no master, as under FSDP2 (they
train in bf16); fp32-by-design weights (`fp32_weight` modules: Nemotron-H's routers) stay fp32.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch import nn

__all__ = ["MasterWeights", "fp32_view", "master_weights_of", "with_master_weights"]

ATTR = "_mvlm_master_weights"
"""The attribute of the root module that holds its `MasterWeights`."""


class MasterWeights:
    """The fp32 masters of `root`'s trainable parameters; `root`'s floating-point parameters become `dtype` (those of
    `fp32_weight` modules excepted). Each trainable parameter's gradient is moved, as autograd makes it, into its
    master's fp32 `.grad` (summed over micro-batches), so `params` (the masters) are what clipping reads. `keep`
    False (a job that does not train: evaluation): the weights become `dtype` and nothing fp32 is kept."""

    def __init__(self, root: nn.Module, dtype: torch.dtype = torch.bfloat16, device: Optional[torch.device] = None,
                 *, keep: bool = True):
        """`device`: where the weights and masters go (None: where the parameters are). Given for a model still in
        host memory, a frozen parameter's fp32 weight never reaches the device: only its bf16 one does."""
        fp32_by_design = {id(p) for m in root.modules() if getattr(m, "fp32_weight", False) for p in m.parameters()}
        self.pairs: list[tuple[nn.Parameter, torch.Tensor]] = []
        self.frozen: list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]] = []
        """Frozen parameters: (parameter, its fp32 weight in host memory, its bf16 weight)."""
        self._low: list[torch.Tensor] = []
        self._hooks = []
        seen: set[int] = set()
        for p in root.parameters():
            if id(p) in seen or id(p) in fp32_by_design or not p.is_floating_point() or p.dtype == dtype:
                continue
            seen.add(id(p))
            full = p.data
            place = full.device if device is None else device
            low = full.to(device=place, dtype=dtype)
            p.data = low
            if not keep:
                continue
            if p.requires_grad:
                master = full.detach().to(place)
                self.pairs.append((p, master))
                self._low.append(low)
                self._hooks.append(p.register_post_accumulate_grad_hook(self._accumulate_hook(master)))
            else:  # never updated: kept in host memory for checkpoints and exports only
                self.frozen.append((p, full.detach().cpu(), low))
        self._by_param = {id(p): m for p, m in self.pairs}
        self._viewing = False
        setattr(root, ATTR, self)

    @property
    def params(self) -> list[torch.Tensor]:
        """The masters (fp32, `.grad` the summed fp32 gradients): what clipping and the non-finite guard read."""
        return [m for _, m in self.pairs]

    def params_or(self, p: torch.Tensor) -> torch.Tensor:
        """`p`'s master, or `p` itself when it has none (fp32 by design, or trained in bf16)."""
        m = self._by_param.get(id(p))
        return p if m is None else m

    @staticmethod
    def _accumulate_hook(master: torch.Tensor):
        def hook(p: torch.Tensor) -> None:
            g = p.grad
            if g is None:
                return
            with torch.no_grad():
                if master.grad is None:
                    master.grad = g.float()
                else:
                    master.grad.add_(g)
            p.grad = None
        return hook

    def zero_grad(self) -> None:
        for p, m in self.pairs:
            m.grad = None
            p.grad = None

    @contextlib.contextmanager
    def fp32_view(self, frozen: bool = True, writes: bool = True) -> Iterator[None]:
        """The parameters hold their masters (and gradients) for the block; after it the bf16 weights are the
        masters' rounding (one multi-tensor copy) and the gradients are back on the masters. `frozen`: the frozen
        parameters too (their fp32 weights, in host memory: for checkpoints and exports; the optimizer's step
        leaves them). `writes` False (a save or an export, which change no weight): the bf16 weights are not
        copied again after the block."""
        if self._viewing:  # nested (a checkpoint saved from inside the optimizer's step): already in place
            yield
            return
        self._viewing = True
        for p, m in self.pairs:
            g = m.grad
            if p.grad is not None:  # put there outside autograd (torch's optimizer-state set-up: zeros): kept
                g = p.grad.float() if g is None else g + p.grad
                p.grad = None
            p.data = m
            p.grad = g
        for p, full, _ in self.frozen if frozen else ():
            p.data = full
        try:
            yield
        finally:
            for (p, m), low in zip(self.pairs, self._low):
                m.grad = p.grad if p.grad is None or p.grad.dtype == m.dtype else p.grad.float()
                p.grad = None
                p.data = low
            with torch.no_grad():
                if self._low and writes:
                    torch._foreach_copy_(self._low, self.params)
                for p, full, low in self.frozen if frozen else ():
                    p.data = low
                    if writes:  # a load may have changed them
                        low.copy_(full)
            self._viewing = False


def master_weights_of(module: Any) -> Optional[MasterWeights]:
    return getattr(module, ATTR, None)


@contextlib.contextmanager
def fp32_view(module: Any, *, writes: bool = True) -> Iterator[None]:
    """`MasterWeights.fp32_view` of `module`'s masters, the frozen parameters' fp32 weights included (`writes`: False
    where the block changes no weight); nothing for a module without them."""
    masters = master_weights_of(module)
    if masters is None:
        yield
        return
    with masters.fp32_view(writes=writes):
        yield


class _MasterWeightsStep:
    """Mixed into the optimizer's class: its step, state loading and gradient reset on the masters."""

    _mvlm_masters: MasterWeights

    def step(self, closure=None):  # type: ignore[no-untyped-def]
        with self._mvlm_masters.fp32_view(frozen=False):
            return super().step(closure)  # type: ignore[misc]

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)  # type: ignore[misc]
        self._mvlm_masters.zero_grad()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torch casts floating-point states to their parameter's dtype: the masters' (fp32), not the weights' bf16
        with self._mvlm_masters.fp32_view(frozen=False):
            super().load_state_dict(state_dict)  # type: ignore[misc]


def with_master_weights(optimizer: torch.optim.Optimizer, masters: MasterWeights) -> torch.optim.Optimizer:
    """`optimizer` (built over the model's parameters, so its state is keyed by their names as usual) updating the
    fp32 masters: its class becomes a subclass whose `step`, `zero_grad` and `load_state_dict` run on them."""
    cls = type(optimizer)
    optimizer.__class__ = type(f"{cls.__name__}WithMasterWeights", (_MasterWeightsStep, cls), {})
    optimizer._mvlm_masters = masters  # type: ignore[attr-defined]
    return optimizer
