"""The expert-parallel all-to-all on DeepEP (deepseek-ai/DeepEP), normal (not low-latency) mode, chosen
by `auto` on CUDA for bf16 when `deep_ep` imports (experimental: not yet run on a GPU).

Op `moe_ep_dispatch` (`[kernels] moe_ep_dispatch`): the forward of an expert-parallel experts module
(`parallel/expert_parallel.py`, used only when parallel.ep > 1): `fn(experts, x, topk_ids, topk_weights)
-> (combined [N, hidden], tokens_per_expert [E])`. The `torch` backend is our two `all_to_all_single`s
over (token, expert) copies; this one sends each token once per destination rank with DeepEP:

1. `Buffer.get_dispatch_layout(topk_idx [N, k], E)` -> tokens per rank / per expert and
   `is_token_in_rank [N, ep]`, from our router's top-k ids (cast to DeepEP's `topk_idx_t`, int64 by default).
2. `Buffer.dispatch(x, num_tokens_per_rank=, is_token_in_rank=, num_tokens_per_expert=, topk_idx=,
   topk_weights= fp32)` -> the tokens this rank received, their top-k ids already local (expert id
   minus rank * E/ep, -1 where the expert lives elsewhere) and weights, and a handle.
3. The local experts run on the received tokens with our ops: `kernels.moe_permute` over E/ep + 1
   groups (the extra one collects the -1 slots and is dropped), `expert_mlp`, `kernels.moe_unpermute`
   with the received weights (0 on the -1 slots): one weighted partial sum per received token.
4. `Buffer.combine(partial, handle)` sums the partial sums of every destination rank per source token
   (DeepEP's combine adds without weights, so the weights are applied in step 3).
Autograd (DeepEP has none): dispatch's backward is `combine(grad_x, handle, topk_weights=grad_w)`,
combine's backward is `dispatch(grad, handle=handle)`, as megatron-core wraps them.

What DeepEP checks (read in deepseek-ai/DeepEP main, 2.1.0: `deep_ep/buffers/legacy.py` `Buffer`,
`csrc/legacy/buffer.hpp` `get_dispatch_layout` / `intranode_dispatch` / `intranode_combine`, the kernels in
`csrc/kernels/legacy/intranode.cu` and `launch.cuh`; 1.x has the same checks in `deep_ep/buffer.py` and
`csrc/deep_ep.cpp`), and what the adapter does. Every decision depends only on things all EP ranks share
(dtype, sizes, config, the package build), never on a rank's token count, so all ranks take the same path:

- x bf16 (combine's kernel is built for bf16 only) -> other dtypes run the `torch` all-to-all (logged once);
- EP size 2, 4 or 8: the intranode kernels are built for those (`SWITCH_RANKS`); larger groups go internode
  inside `Buffer.dispatch`, which needs an RDMA (NVSHMEM) buffer this adapter does not allocate -> `torch` (logged);
- torch deterministic algorithms together with `fill_uninitialized_memory` (asserted by dispatch / combine) -> `torch`;
- top-k <= 32 (device asserts of the dispatch and combine kernels) -> more runs `torch` (logged);
- at most 128 local experts (`notify_dispatch`: experts per rank <= its 128 threads; E % ep == 0 is `apply_ep`'s) -> `torch`;
- a row of x a multiple of 16 bytes (`hidden * 2 % 16`, host assert) and, on SM90 builds (`Buffer.is_sm90_compiled()`),
  an even number of 16-byte units whose half plus 8 bytes fits the dispatch kernel's 8192-byte TMA buffer: bf16
  hidden a multiple of 16 and <= 8176 (a device trap otherwise, DeepEP issue #722) -> other sizes run `torch` (logged);
- PCIe GPUs: `Buffer` asserts at most 2 ranks -> more run `torch` (logged); the pairwise NVLink check DeepEP then
  makes for 2 PCIe ranks (pynvml) is left to DeepEP's own assert;
- top-k ids in `deep_ep.topk_idx_t` (int64 unless DeepEP was built with `EP_NUM_TOPK_IDX_BITS=32`) -> cast to it;
  top-k weights fp32, x / weights / gradients contiguous -> cast / made contiguous.
One `Buffer(group, num_nvl_bytes, 0)` per process group, sized by DeepEP's own `get_nvl_buffer_size_hint` (it
covers up to 128 top-k slots and 128 scales per token) for the largest hidden size seen, kept for the run.
"""
from __future__ import annotations

import logging

import torch

from .. import moe_permute, moe_unpermute
from ..registry import DEFAULT_REGISTRY

logger = logging.getLogger("megatron_vlm.kernels")
_logged: set = set()
_BUFFERS: dict[object, tuple[object, int]] = {}  # process group -> (Buffer, nvl bytes)
DTYPES = (torch.bfloat16,)  # what DeepEP's normal-mode dispatch / combine take
# Group sizes DeepEP's intranode kernels are built for (csrc/kernels/legacy/launch.cuh SWITCH_RANKS); its tuned
# configs (Buffer.get_dispatch_config) also cover 16-160, but those go internode (RDMA buffer, NVSHMEM)
INTRANODE_SIZES = (2, 4, 8)
MAX_TOPK = 32  # intranode.cu dispatch / combine kernels: EP_DEVICE_ASSERT(num_topk <= 32)
MAX_LOCAL_EXPERTS = 128  # intranode.cu notify_dispatch: num_experts / num_ranks <= kNumThreads (128)
_TMA_BYTES_PER_WARP = 8192  # intranode.cu dispatch: kNumTMABytesPerWarp, holds half a row plus an 8-byte mbarrier


def _log_once(reason: str) -> None:
    if reason not in _logged:
        _logged.add(reason)
        logger.info("moe_ep_dispatch: backend deep_ep falls back to the torch all-to-all: %s", reason)


def _log_start() -> None:
    if "start" not in _logged:
        _logged.add("start")
        logger.info("moe_ep_dispatch: DeepEP dispatch / combine (experimental: not yet run on a GPU)")


def hidden_refusal(hidden: int, element_size: int, sm90: bool = True):
    """Why DeepEP's intranode dispatch / combine would refuse rows of `hidden` elements of `element_size` bytes,
    or None: `intranode_dispatch` / `intranode_combine` assert `hidden * element_size % sizeof(int4) == 0`; on
    SM90 builds the dispatch kernel copies each row as two halves through its per-warp TMA buffer and traps
    unless the row is an even number of int4 and half of it plus the 8-byte mbarrier fits 8192 bytes."""
    row = hidden * element_size
    if row % 16:
        return f"hidden size {hidden}: a row of {row} bytes is not a multiple of 16 (DeepEP asserts it)"
    half = row // 16 // 2 * 16
    if sm90 and ((row // 16) % 2 or half + 8 > _TMA_BYTES_PER_WARP):
        return (f"hidden size {hidden}: DeepEP's SM90 dispatch kernel stages half a row (of {row} bytes) plus 8 bytes in "
                f"{_TMA_BYTES_PER_WARP} bytes and needs an even number of 16-byte units (it traps otherwise)")
    return None


def _device_name(x: torch.Tensor) -> str:
    return torch.cuda.get_device_name(x.device) if x.is_cuda else ""


def dispatch_layout(topk_ids: torch.Tensor, num_experts: int, ep: int):
    """What DeepEP's `get_dispatch_layout` computes, in torch (for checks and the docs): topk_ids
    `[N, k]` (-1 = none) -> (tokens per rank `[ep]` int32, tokens per expert `[E]` int32,
    is_token_in_rank `[N, ep]` bool). A token counts once per rank however many of its experts live there."""
    n_local = num_experts // ep
    valid = topk_ids >= 0
    rank_of = torch.where(valid, topk_ids // n_local, ep)  # ep = a column that is dropped
    in_rank = torch.zeros(topk_ids.shape[0], ep + 1, dtype=torch.bool, device=topk_ids.device)
    in_rank.scatter_(1, rank_of.long(), True)
    in_rank = in_rank[:, :ep]
    per_expert = torch.bincount(topk_ids[valid].long(), minlength=num_experts).to(torch.int32)
    return in_rank.sum(0).to(torch.int32), per_expert, in_rank


def _buffer(group, ep: int, hidden_bytes: int):
    import deep_ep

    nvl = max(deep_ep.Buffer.get_dispatch_config(ep).get_nvl_buffer_size_hint(hidden_bytes, ep),
              deep_ep.Buffer.get_combine_config(ep).get_nvl_buffer_size_hint(hidden_bytes, ep))
    cached = _BUFFERS.get(group)
    if cached is None or cached[1] < nvl:
        _BUFFERS[group] = (deep_ep.Buffer(group, nvl, 0), nvl)
    return _BUFFERS[group][0]


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, topk_idx, per_rank, in_rank, per_expert, buffer):
        recv_x, recv_idx, recv_w, _counts, handle, _ = buffer.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=topk_idx, topk_weights=topk_weights,
        )
        ctx.buffer, ctx.handle = buffer, handle
        ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_w, recv_idx, handle

    @staticmethod
    def backward(ctx, grad_x, grad_w, _grad_idx, _grad_handle):
        weights = None if grad_w is None else grad_w.float().contiguous()
        gx, gw, _ = ctx.buffer.combine(grad_x.contiguous(), ctx.handle, topk_weights=weights)
        return gx, gw, None, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, handle, buffer):
        ctx.buffer, ctx.handle = buffer, handle
        out, _, _ = buffer.combine(y.contiguous(), handle)
        return out

    @staticmethod
    def backward(ctx, grad):
        gy = ctx.buffer.dispatch(grad.contiguous(), handle=ctx.handle)[0]
        return gy, None, None


def _local_experts(experts, recv_x: torch.Tensor, recv_idx: torch.Tensor, recv_w: torch.Tensor) -> torch.Tensor:
    """Received tokens -> one weighted partial sum per token over its experts held here (step 3)."""
    n_local = experts.num_local_experts
    mine = recv_idx >= 0
    ids = torch.where(mine, recv_idx, n_local)  # the -1 slots go to an extra group that is dropped
    weights = torch.where(mine, recv_w, torch.zeros_like(recv_w))
    permuted, row_map, counts = moe_permute(recv_x, ids, num_experts=n_local + 1)
    local_counts = counts[:n_local]
    rows = int(local_counts.sum())
    first = experts._local_weight("gate_up_proj" if experts.gated else "up_proj", recv_x.dtype)
    down = experts._local_weight("down_proj", recv_x.dtype)
    out = experts.expert_mlp(permuted[:rows], local_counts, first, down)
    # tie the weights into the graph even with no rows, so every rank runs the same backward collectives
    out = out + 0.0 * (recv_x.sum() + recv_w.sum() + first.sum() + down.sum()) if rows == 0 else out
    padded = torch.cat([out, out.new_zeros(permuted.shape[0] - rows, out.shape[1])])
    return moe_unpermute(padded, row_map, weights)


def _refusal(experts, x: torch.Tensor, topk_ids: torch.Tensor):
    """Why DeepEP would refuse this call (module docstring), or None. Only what every EP rank shares is looked at
    (a rank with no tokens decides as the others do), so that all ranks take the same path."""
    ep = experts.ep_size
    if x.dtype not in DTYPES:
        return f"{x.dtype} activations (DeepEP dispatches and combines bf16 only)"
    if ep not in INTRANODE_SIZES:
        return (f"expert-parallel size {ep} (DeepEP's intranode kernels are built for {INTRANODE_SIZES}; larger "
                "groups go internode, which needs an RDMA / NVSHMEM buffer this adapter does not set up)")
    if torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory:
        return "torch deterministic algorithms with fill_uninitialized_memory (DeepEP asserts they are not both on)"
    if topk_ids.shape[-1] > MAX_TOPK:
        return f"top-k {topk_ids.shape[-1]} (DeepEP's dispatch / combine kernels take at most {MAX_TOPK})"
    if experts.num_local_experts > MAX_LOCAL_EXPERTS:
        return (f"{experts.num_local_experts} experts per rank (DeepEP's notify_dispatch takes at most "
                f"{MAX_LOCAL_EXPERTS})")
    import deep_ep

    is_sm90 = getattr(deep_ep.Buffer, "is_sm90_compiled", None)
    hidden = hidden_refusal(x.shape[-1], x.element_size(), True if is_sm90 is None else bool(is_sm90()))
    if hidden is not None:
        return hidden
    if ep > 2 and "PCIE" in _device_name(x):
        return f"expert-parallel size {ep} on PCIe GPUs (DeepEP's Buffer asserts at most 2: pairwise NVLink only)"
    return None


def ep_forward(experts, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
    """Public-signature moe_ep_dispatch on DeepEP (contract: the op's `torch` backend,
    `parallel.expert_parallel.all_to_all_forward`, which a refused call falls back to through the registry: the
    op library does not import `parallel/`)."""
    ep = experts.ep_size
    reason = _refusal(experts, x, topk_ids)
    if reason is not None:
        _log_once(reason)
        return DEFAULT_REGISTRY.implementation("moe_ep_dispatch", "torch")(experts, x, topk_ids, topk_weights)
    import deep_ep

    _log_start()
    buffer = _buffer(experts.ep_group, ep, x.shape[1] * x.element_size())
    topk_idx = topk_ids.to(getattr(deep_ep, "topk_idx_t", torch.int64)).contiguous()
    per_rank, _rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, experts.num_experts)
    recv_x, recv_w, recv_idx, handle = _Dispatch.apply(
        x.contiguous(), topk_weights.float().contiguous(), topk_idx, per_rank, in_rank, per_expert, buffer,
    )
    partial = _local_experts(experts, recv_x, recv_idx, recv_w)
    combined = _Combine.apply(partial.to(x.dtype), handle, buffer)
    tokens_per_expert = torch.bincount(topk_idx.reshape(-1), minlength=experts.num_experts)
    return combined, tokens_per_expert


__all__: list[str] = ["dispatch_layout", "ep_forward", "hidden_refusal"]
