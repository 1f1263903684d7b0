"""megatron_vlm.kernels: the public functional API of the op library.

Every op is backed by a pure-torch reference (`kernels/reference/`, the `torch` backend) and by
faster backends (Triton, torch_npu, third-party) that `kernels/registry.py` chooses per op from
the `[kernels]` config, the tensor's device and what is installed. Model code calls only these
functions; the layout and numerics contract of each op is documented in its reference module.
`configure(...)` sets the process default (the job applies its `[kernels]` section once);
`with use_backends({...}):` overrides it for one block of code in one thread / asyncio task (e.g.
a reference model on the torch backend next to a policy on Triton). Configure (or enter the scope)
before `torch.compile`: a compiled graph keeps the backend chosen while tracing (the dispatch is
traced with fullgraph=True, the choice is a constant of the graph).
"""
from typing import Optional, Union

import torch

from .builtin_ops import register_builtin_ops
from .config import KernelsConfig
from .registry import DEFAULT_REGISTRY, BackendUnavailableError, configure, register_backend, use_backends

register_builtin_ops(DEFAULT_REGISTRY)

__all__ = [
    "attention",
    "rms_norm",
    "layer_norm",
    "apply_rotary",
    "swiglu",
    "linear_token_logprobs",
    "causal_conv1d",
    "ssd_chunk_scan",
    "ssd_state_update",
    "decode_attention",
    "kv_cache_write",
    "moe_permute",
    "grouped_mm",
    "moe_unpermute",
    "moe_topk_gating",
    "adamw_bf16_moments",
    "configure",
    "use_backends",
    "register_backend",
    "KernelsConfig",
    "BackendUnavailableError",
]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    window: Optional[tuple[int, int]] = None,
    softmax_scale: Optional[float] = None,
    key_padding_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Scaled-dot-product attention, packed `[T, H, D]` + cu_seqlens or batched `[B, S, H, D]`.

    GQA / MQA (Hkv divides Hq), causal with bottom-right alignment, `window=(left, right)` (-1 =
    unbounded), `key_padding_mask` `[B, Sk]` (True = keep) for padded batches. Returns q's layout.
    Conventions: `kernels/reference/attention.py`.
    """
    fn = DEFAULT_REGISTRY.resolve("attention", q)
    return fn(
        q, k, v, causal=causal, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, window=window, softmax_scale=softmax_scale, key_padding_mask=key_padding_mask,
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, residual: Optional[torch.Tensor] = None
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """RMSNorm over the last dim; with `residual`, returns (rms_norm(x + residual), x + residual)."""
    return DEFAULT_REGISTRY.resolve("rms_norm", x)(x, weight, eps, residual=residual)


def layer_norm(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """LayerNorm over the last dim (weight / bias may be None)."""
    return DEFAULT_REGISTRY.resolve("layer_norm", x)(x, weight, bias, eps)


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False, rotary_dim: Optional[int] = None
) -> torch.Tensor:
    """Rotary embedding of x `[..., T, H, D]` with per-token cos / sin `[..., T, D_rot]` (or half width with
    `rotary_dim`); the tail beyond D_rot passes through. Contract: `kernels/reference/rotary.py`."""
    return DEFAULT_REGISTRY.resolve("apply_rotary", x)(x, cos, sin, interleaved=interleaved, rotary_dim=rotary_dim)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up."""
    return DEFAULT_REGISTRY.resolve("swiglu", gate)(gate, up)


def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    chunk_size: Optional[int] = None,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """log p(labels) `[N]` (and entropy `[N]`) of softmax(hidden @ weight^T / temperature), fp32 outputs,
    without materialising the `[N, V]` logits; labels == -100 give 0 and no gradient."""
    fn = DEFAULT_REGISTRY.resolve("linear_token_logprobs", hidden)
    return fn(hidden, weight, labels, temperature=temperature, return_entropy=return_entropy, chunk_size=chunk_size)


# Mamba2 / MoE ops: signatures, layouts and numerics in kernels/reference/{causal_conv1d,ssd,moe}.py.
def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, **kwargs):
    """Causal depthwise conv1d, x `[B, D, T]`, weight `[D, W]`; kwargs: activation, initial_state,
    return_final_state, cu_seqlens."""
    return DEFAULT_REGISTRY.resolve("causal_conv1d", x)(x, weight, bias, **kwargs)


def ssd_chunk_scan(x, dt, A, B, C, *, chunk_size: int, **kwargs):
    """Mamba2 chunked SSD scan, x `[B, T, H, P]`; kwargs: D, z, dt_bias, dt_softplus, dt_limit,
    initial_states, return_final_states, cu_seqlens."""
    return DEFAULT_REGISTRY.resolve("ssd_chunk_scan", x)(x, dt, A, B, C, chunk_size=chunk_size, **kwargs)


def ssd_state_update(state, x, dt, A, B, C, **kwargs):
    """One Mamba2 decoding step; updates `state` `[B, H, P, N]` in place, returns y `[B, H, P]`."""
    return DEFAULT_REGISTRY.resolve("ssd_state_update", x)(state, x, dt, A, B, C, **kwargs)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor, **kwargs):
    """One query per sequence q `[B, H, D]` against its cached keys: slot cache `[slots, L, Hkv, D]` (+ slot_ids)
    or paged cache `[blocks, block_size, Hkv, D]` + block_table; kwargs: slot_ids, block_table, max_seqlen_k,
    softmax_scale, shared_prefix (which sequences hold copies of one prompt). Contract:
    `kernels/reference/decode_attention.py`."""
    return DEFAULT_REGISTRY.resolve("decode_attention", q)(q, k_cache, v_cache, cache_seqlens, **kwargs)


def kv_cache_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, index0: torch.Tensor,
                   index1: torch.Tensor) -> None:
    """Row i of k / v `[N, Hkv, D]` into `k_cache` / `v_cache[index0[i], index1[i]]` (the caches `[A, B, Hkv, D]`,
    cast to their dtype): a decode step's cache write. Contract: `kernels/reference/kv_cache_write.py`."""
    DEFAULT_REGISTRY.resolve("kv_cache_write", k)(k, v, k_cache, v_cache, index0, index1)


def moe_permute(hidden: torch.Tensor, topk_ids: torch.Tensor, *, num_experts: Optional[int] = None):
    """Token copies grouped by expert: (permuted `[N*k, H]`, row_map `[N*k]`, tokens_per_expert `[E]`)."""
    return DEFAULT_REGISTRY.resolve("moe_permute", hidden)(hidden, topk_ids, num_experts=num_experts)


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, **kwargs) -> torch.Tensor:
    """Per-expert matmul over contiguous row groups; kwargs: tokens_per_expert | offsets, weight_layout."""
    return DEFAULT_REGISTRY.resolve("grouped_mm", x)(x, weight, **kwargs)


def moe_unpermute(permuted_out: torch.Tensor, row_map: torch.Tensor, topk_weights: Optional[torch.Tensor] = None, **kwargs):
    """Gather each token's expert outputs and combine with topk_weights `[N, k]` -> `[N, H]`."""
    return DEFAULT_REGISTRY.resolve("moe_unpermute", permuted_out)(permuted_out, row_map, topk_weights, **kwargs)


def moe_topk_gating(logits: torch.Tensor, top_k: int, **kwargs):
    """Router logits `[N, E]` -> (scores `[N, E]`, topk_weights `[N, k]`, topk_ids `[N, k]`), fp32; kwargs:
    score_func, bias, n_group, topk_group, norm_topk_prob, routed_scaling_factor (reference/moe_routing.py)."""
    return DEFAULT_REGISTRY.resolve("moe_topk_gating", logits)(logits, top_k, **kwargs)


def adamw_bf16_moments(params: list, grads: list, exp_avgs: list, exp_avg_sqs: list, *, lr: float, beta1: float,
                       beta2: float, eps: float, weight_decay: float, step: int, seed: int,
                       keys: Optional[list] = None) -> None:
    """One AdamW update in place of fp32 `params` with bf16 moments, rounded stochastically (contract:
    `kernels/reference/adamw.py`; `keys`: the tensors' rounding keys, None: their positions); the backend is chosen
    by the first parameter's device."""
    if params:
        fn = DEFAULT_REGISTRY.resolve("adamw_bf16_moments", params[0])
        fn(params, grads, exp_avgs, exp_avg_sqs, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
           step=step, seed=seed, keys=keys)
