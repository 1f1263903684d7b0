"""Graph-safe routed experts for decode steps: no host read of routing counts, shapes fixed by the batch.

Why: the training / prefill path (`GroupedExperts.forward`: `kernels.moe_permute` -> `grouped_mm` ->
`moe_unpermute`) sizes its grouped GEMMs from the routed counts on the host, so a decode step of a MoE model
could not be captured as a CUDA graph (a graph replays fixed shapes and must not read tensor values). Inside
`static_routing()` (the rollout engine's static decode step) `MoE` computes its experts here instead, in one
of two forms whose shapes depend only on the number of tokens N, the top-k and the expert count E:

* grouped: the N * k token copies sorted by expert on the device (`argsort`), the group ends as a device
  tensor (`scatter_add` + `cumsum`), `torch._grouped_mm(..., offs=)` (it reads the ends on the device), the
  outputs weighted and summed back per token with `index_add_` (fp32). Taken where torch's grouped GEMM
  takes the operands (its dtype / device / 16-byte stride rules); reads only the experts that got tokens;
* dense: every token through every expert with batched matmuls, the outputs of the chosen experts weighted
  and summed (fp32), the others masked out. E / k times the FLOPs, but at decode batch sizes the step is
  bound by reading the expert weights, which both forms read (every expert is hit once N * k >~ E).

Both give the eager path's result up to the order of the fp32 additions (tested: same greedy tokens).
An experts module that holds only some experts (expert parallelism) computes its static form itself
(`static_forward`: parallel/expert_parallel.py), passing the copies it does not hold as `valid` = False: they
are sorted past the last group (grouped: not computed) or masked out (dense).
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

from megatron_vlm.kernels.static_experts import dense_static, grouped_static, static_mlp

__all__ = ["static_routing", "static_routing_active", "experts_static", "grouped_static", "dense_static", "static_mlp"]

_STATIC = contextvars.ContextVar("megatron_vlm_moe_static_routing", default=False)


@contextlib.contextmanager
def static_routing() -> Iterator[None]:
    """MoE blocks called inside compute their experts graph-safely (this module) instead of the host-sized path."""
    token = _STATIC.set(True)
    try:
        yield
    finally:
        _STATIC.reset(token)


def static_routing_active() -> bool:
    return _STATIC.get()


def experts_static(experts, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   form: str = "auto") -> torch.Tensor:
    """`GroupedExperts` (`experts`) on x without host reads: "grouped" where torch._grouped_mm takes the
    operands ("auto"), else "dense"; returns the combined output `[N, in]` in fp32. An experts module with its
    own static form (`static_forward`: expert parallelism) computes it."""
    own = getattr(experts, "static_forward", None)
    if own is not None:
        return own(x, topk_ids, topk_weights, form=form)
    first = experts.gate_up_proj if experts.gated else experts.up_proj
    return static_mlp(x, topk_ids, topk_weights, first, experts.down_proj, gated=experts.gated, act=experts.act, form=form)
