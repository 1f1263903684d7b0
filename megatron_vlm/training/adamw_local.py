"""`LocalShardAdamW`: torch.optim.AdamW whose update runs on the local tensors of DTensor parameters.

Why: under FSDP2 the parameters, gradients and AdamW states are DTensors, and torch's AdamW hands them to its
fused (or foreach) functional as they are: DTensor then dispatches each multi-tensor call in Python (sharding
propagation over every tensor of the list), 12.5 ms of host time a step at the Qwen2.5-VL-3B structure's 952
parameter tensors (benchmarks/RESULTS.md, "Host overhead of the SFT step"), during which a GPU that has finished
the step's kernels idles. The update is elementwise: where a parameter, its gradient and its states lie on one mesh
with the same placements (FSDP's Shard(0), HSDP's Replicate + Shard(0), a replicated tensor), DTensor runs the very
same kernel on their local tensors, without communication. This optimizer calls torch's own functional AdamW
(`torch.optim.adam.adam`: `_fused_adamw_` with `fused=True`, else the foreach or per-tensor path, as the group says)
on those local tensors itself, so the update is torch's bit for bit, without the dispatch.

Everything else is torch.optim.AdamW's: the state is made by its `_init_group` (the moments stay DTensors, so
distributed checkpoints save and reshard them as before), the state names and group keys are its own (a checkpoint
of either class loads into the other), and tensors it cannot update locally keep torch's DTensor path: a Partial
placement (pending sums: the update is not linear, DTensor reduces first), a gradient or state whose mesh or
placements differ from its parameter's (DTensor redistributes), a DTensor mixed with plain tensors. A
`differentiable` optimizer keeps torch's step entirely.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Optional

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam

__all__ = ["LocalShardAdamW", "follows", "local_pieces"]

_HEALTH_CHECK = next((name for name in ("_accelerator_graph_capture_health_check", "_cuda_graph_capture_health_check")
                      if hasattr(torch.optim.Optimizer, name)), None)
"""The optimizer's CUDA-graph capture check under this torch's name (renamed in 2026: the GPU images run older torch)."""
_FOLLOWED = frozenset({"params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "state_steps", "amsgrad",
                       "has_complex", "beta1", "beta2", "lr", "weight_decay", "eps", "maximize", "foreach", "capturable",
                       "differentiable", "fused", "grad_scale", "found_inf", "decoupled_weight_decay"})
"""The arguments `LocalShardAdamW._step` gives torch's functional `adam`: all that torch 2.13's takes."""
_INIT_GROUP = ["self", "group", "params_with_grad", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "state_steps"]


def follows(functional: Callable, init_group: Callable) -> bool:
    """Whether `_step` is this torch's Adam step: its functional takes exactly the arguments `_step` gives (one
    missing: an older torch; one more: a newer torch's option `_step` would leave out, or a required argument it would
    not give) and `_init_group` the six lists `_split` takes."""
    try:
        return (set(inspect.signature(functional).parameters) == _FOLLOWED
                and list(inspect.signature(init_group).parameters) == _INIT_GROUP)
    except (TypeError, ValueError):  # no signature to read
        return False


LOCAL_STEP = _HEALTH_CHECK is not None and follows(adam, torch.optim.AdamW._init_group)
"""Whether this torch's Adam step can be followed here; where not (an older or newer torch whose private functional
differs), `LocalShardAdamW.step` is torch's own, with its DTensor dispatch."""


def local_pieces(tensors: Sequence[torch.Tensor]) -> Optional[list[torch.Tensor]]:
    """The tensors an elementwise update of `tensors` (a parameter, its gradient, its states) can run on in place of
    them: the tensors themselves when none is a DTensor, their local tensors when all are DTensors on one mesh with
    the same placements and none Partial; None otherwise (the update needs DTensor's dispatch)."""
    first = tensors[0]
    if not isinstance(first, DTensor):
        return None if any(isinstance(t, DTensor) for t in tensors) else list(tensors)
    spec = first._spec
    mesh, placements = spec.mesh, spec.placements
    if any(p.is_partial() for p in placements):
        return None
    out = [first._local_tensor]
    for t in tensors[1:]:
        if not isinstance(t, DTensor):
            return None
        other = t._spec
        if other.placements != placements or (other.mesh is not mesh and other.mesh != mesh):
            return None
        out.append(t._local_tensor)
    return out


def _split(params: list, grads: list, exp_avgs: list, exp_avg_sqs: list, max_exp_avg_sqs: list,
           state_steps: list) -> tuple[list[list], list[list]]:
    """`_init_group`'s lists as two sets of the functional's six lists: the local pieces, and the tensors that keep
    DTensor's path (`max_exp_avg_sqs` is empty without amsgrad)."""
    local: list[list] = [[], [], [], [], [], []]
    kept: list[list] = [[], [], [], [], [], []]
    amsgrad = bool(max_exp_avg_sqs)
    for i, p in enumerate(params):
        row = [p, grads[i], exp_avgs[i], exp_avg_sqs[i]]
        if amsgrad:
            row.append(max_exp_avg_sqs[i])
        pieces = local_pieces(row)
        dst = kept if pieces is None else local
        for j, t in enumerate(row if pieces is None else pieces):
            dst[j].append(t)
        dst[5].append(state_steps[i])  # a plain tensor: torch makes it on the parameter's local device (or the host)
    return local, kept


class LocalShardAdamW(torch.optim.AdamW):
    """torch.optim.AdamW (same arguments, state and update, bitwise) with the update run on the local tensors of
    DTensor parameters, gradients and states (see the module's docstring)."""

    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:  # type: ignore[override]
        if self.defaults.get("differentiable") or not LOCAL_STEP:
            return super().step(closure)
        with torch.no_grad():
            return self._step(closure)

    def _step(self, closure: Optional[Callable[[], float]]) -> Optional[float]:
        """Adam.step's body (where `follows`: AdamW a subclass of Adam, torch 2.7+): the same checks, state
        initialisation and functional call, the call given the local tensors."""
        getattr(self, _HEALTH_CHECK or "")()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lists: tuple[list, ...] = ([], [], [], [], [], [])
            has_complex = self._init_group(group, *lists)
            beta1, beta2 = group["betas"]
            for ps, gs, ms, vs, max_vs, steps in _split(*lists):
                if not ps:
                    continue
                adam(ps, gs, ms, vs, max_vs, steps, amsgrad=group["amsgrad"], has_complex=has_complex, beta1=beta1, beta2=beta2,
                     lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                     foreach=group["foreach"], capturable=group["capturable"], differentiable=group["differentiable"],
                     fused=group["fused"], grad_scale=getattr(self, "grad_scale", None),
                     found_inf=getattr(self, "found_inf", None),
                     decoupled_weight_decay=group["decoupled_weight_decay"])
        return loss
