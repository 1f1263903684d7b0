"""megatron_vlm.kernels: the public functional API of the op library.

Every op is backed by a pure-torch reference (`kernels/reference/`, the `torch` backend) and by
faster backends (Triton, torch_npu, third-party) that `kernels/registry.py` chooses per op from
the `[kernels]` config, the tensor's device and what is installed. Model code calls only these
functions; the layout and numerics contract of each op is documented in its reference module.
"""
from typing import Optional, Tuple, Union

import torch

from .config import KernelsConfig
from .registry import BackendUnavailableError, DEFAULT_REGISTRY, configure, register_backend

__all__ = [
    "attention",
    "rms_norm",
    "layer_norm",
    "apply_rotary",
    "swiglu",
    "linear_token_logprobs",
    "configure",
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
    window: Optional[Tuple[int, int]] = None,
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
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
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
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """log p(labels) `[N]` (and entropy `[N]`) of softmax(hidden @ weight^T / temperature), fp32 outputs,
    without materialising the `[N, V]` logits; labels == -100 give 0 and no gradient."""
    fn = DEFAULT_REGISTRY.resolve("linear_token_logprobs", hidden)
    return fn(hidden, weight, labels, temperature=temperature, return_entropy=return_entropy, chunk_size=chunk_size)
