"""Triton fused LM head + token log-probs / entropy, chunked over tokens (forward + backward).

For each chunk of `chunk_size` tokens the logits block z = h_c @ W^T is produced by the vendor
matmul (cuBLAS; fp32 output where torch supports `out_dtype`), then one Triton program per row
streams over the vocabulary once: online max / sum-exp / sum(exp * z) give logsumexp, the label's
log-prob and the entropy without a second pass. Only hidden, weight, labels and per-row lse /
entropy are kept for backward, which recomputes the chunk's logits; the backward kernel turns
them into dz in one pass,
  dz_v = [g (onehot_v - p_v) - g_H p_v (log p_v + H)] / temperature,
and two matmuls give dh_c = dz @ W and dW += dz^T @ h_c. Peak extra memory: one [chunk, V] fp32
logits block plus one [chunk, V] dz block (input dtype). Labels == -100 give 0 and no gradient.
"""
from typing import Optional, Union

import torch
import triton
import triton.language as tl

from ..reference.token_logprobs import IGNORE_INDEX, check_token_logprobs_inputs
from .common import check_device, to_dtype


@triton.jit
def _token_logprobs_fwd_kernel(
    LOGITS, LABELS, LOGP, LSE, ENT, n_vocab, stride_l, inv_temp, ignore_index,
    BLOCK_V: tl.constexpr, WITH_ENTROPY: tl.constexpr,
):
    row = tl.program_id(0)
    base = LOGITS + row.to(tl.int64) * stride_l
    m_vec = tl.full([BLOCK_V], float("-inf"), dtype=tl.float32)
    s_vec = tl.zeros([BLOCK_V], dtype=tl.float32)
    t_vec = tl.zeros([BLOCK_V], dtype=tl.float32)
    for v0 in range(0, n_vocab, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        mask = cols < n_vocab
        z = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32) * inv_temp
        m_new = tl.maximum(m_vec, z)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_vec - m_safe)
        e = tl.exp(z - m_safe)
        s_vec = s_vec * alpha + e
        if WITH_ENTROPY:
            t_vec = t_vec * alpha + e * tl.where(mask, z, 0.0)  # e == 0 on masked lanes
        m_vec = m_new
    m = tl.max(m_vec, 0)
    scale = tl.exp(m_vec - m)
    s = tl.sum(s_vec * scale, 0)
    lse = m + tl.log(s)
    label = tl.load(LABELS + row)
    valid = label != ignore_index
    z_label = tl.load(base + tl.where(valid, label, 0)).to(tl.float32) * inv_temp
    tl.store(LSE + row, lse)
    tl.store(LOGP + row, tl.where(valid, z_label - lse, 0.0))
    if WITH_ENTROPY:
        t = tl.sum(t_vec * scale, 0)
        tl.store(ENT + row, tl.where(valid, lse - t / s, 0.0))
    else:
        tl.store(ENT + row, 0.0)


@triton.jit
def _token_logprobs_bwd_kernel(
    LOGITS, LABELS, LSE, ENT, GLOGP, GENT, DZ, n_vocab, stride_l, stride_dz, inv_temp, ignore_index,
    BLOCK_V: tl.constexpr, WITH_ENTROPY: tl.constexpr,
):
    row = tl.program_id(0)
    base = LOGITS + row.to(tl.int64) * stride_l
    dz_base = DZ + row.to(tl.int64) * stride_dz
    label = tl.load(LABELS + row)
    valid = label != ignore_index
    g = tl.where(valid, tl.load(GLOGP + row), 0.0)
    lse = tl.load(LSE + row)
    if WITH_ENTROPY:
        g_ent = tl.where(valid, tl.load(GENT + row), 0.0)
        ent = tl.load(ENT + row)
    for v0 in range(0, n_vocab, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        mask = cols < n_vocab
        logp = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32) * inv_temp - lse
        p = tl.exp(logp)
        dz = -p * g
        if WITH_ENTROPY:
            dz -= p * (logp + ent) * g_ent
        dz = tl.where(cols == label, dz + g, dz) * inv_temp
        tl.store(dz_base + cols, to_dtype(dz, DZ.dtype.element_ty), mask=mask)


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """h @ W^T as fp32: matmul with fp32 output on CUDA when torch has `out_dtype`, else upcast."""
    if h.dtype == torch.float32:
        return torch.mm(h, weight.t())
    if h.device.type == "cuda":
        try:
            return torch.mm(h, weight.t(), out_dtype=torch.float32)
        except (TypeError, RuntimeError):
            pass
    return torch.mm(h, weight.t()).float()


def _block_v(t: torch.Tensor) -> int:
    return 1024 if t.device.type == "cpu" else 4096


def _chunk_size(n: int, vocab: int, t: torch.Tensor) -> int:
    """Rows per chunk: logits (fp32) + dz (input dtype) blocks of about 1 GiB on GPU, 64 MiB in the interpreter."""
    budget = 2**30 if t.device.type == "cuda" else 2**26
    return max(1, min(n, budget // (vocab * (4 + t.element_size()))))


@torch.library.custom_op("megatron_vlm::triton_linear_token_logprobs_fwd", mutates_args=())
def token_logprobs_fwd_op(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float, chunk_size: int,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, vocab = hidden.shape[0], weight.shape[0]
    logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
    ent = torch.empty_like(logp)
    lse = torch.empty_like(logp)
    for s in range(0, n, chunk_size):
        e = min(n, s + chunk_size)
        z = _chunk_logits(hidden[s:e], weight)
        _token_logprobs_fwd_kernel[(e - s,)](
            z, labels[s:e], logp[s:e], lse[s:e], ent[s:e], vocab, z.stride(0), 1.0 / temperature, IGNORE_INDEX,
            BLOCK_V=_block_v(z), WITH_ENTROPY=with_entropy, num_warps=8,
        )
    return logp, ent, lse


@token_logprobs_fwd_op.register_fake
def _(hidden, weight, labels, temperature, chunk_size, with_entropy):
    out = hidden.new_empty((hidden.shape[0],), dtype=torch.float32)
    return out, torch.empty_like(out), torch.empty_like(out)


@torch.library.custom_op("megatron_vlm::triton_linear_token_logprobs_bwd", mutates_args=())
def token_logprobs_bwd_op(
    grad_logp: torch.Tensor, grad_ent: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
    lse: torch.Tensor, ent: torch.Tensor, temperature: float, chunk_size: int, with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    n, vocab = hidden.shape[0], weight.shape[0]
    grad_logp, grad_ent = grad_logp.float().contiguous(), grad_ent.float().contiguous()
    grad_h = torch.empty_like(hidden)
    # fp32 accumulation of dW when the weight is fp32 (CPU / tests); in bf16 the matmul epilogue
    # accumulates into the bf16 buffer once per chunk (as Liger's fused linear cross-entropy).
    grad_w = torch.zeros_like(weight)
    for s in range(0, n, chunk_size):
        e = min(n, s + chunk_size)
        h = hidden[s:e]
        z = _chunk_logits(h, weight)
        dz = torch.empty((e - s, vocab), dtype=hidden.dtype, device=hidden.device)
        _token_logprobs_bwd_kernel[(e - s,)](
            z, labels[s:e], lse[s:e], ent[s:e], grad_logp[s:e], grad_ent[s:e], dz, vocab, z.stride(0), dz.stride(0),
            1.0 / temperature, IGNORE_INDEX, BLOCK_V=_block_v(z), WITH_ENTROPY=with_entropy, num_warps=8,
        )
        del z
        torch.mm(dz, weight, out=grad_h[s:e])
        grad_w.addmm_(dz.t(), h)
    return grad_h, grad_w


@token_logprobs_bwd_op.register_fake
def _(grad_logp, grad_ent, hidden, weight, labels, lse, ent, temperature, chunk_size, with_entropy):
    return torch.empty_like(hidden), torch.empty_like(weight)


def _setup(ctx, inputs, output):
    hidden, weight, labels, temperature, chunk_size, with_entropy = inputs
    _, ent, lse = output
    ctx.save_for_backward(hidden, weight, labels, lse, ent)
    ctx.args = (temperature, chunk_size, with_entropy)
    ctx.mark_non_differentiable(lse)
    if not with_entropy:
        ctx.mark_non_differentiable(ent)


def _backward(ctx, grad_logp, grad_ent, _grad_lse):
    hidden, weight, labels, lse, ent = ctx.saved_tensors
    if grad_logp is None:
        grad_logp = torch.zeros_like(lse)
    if grad_ent is None:
        grad_ent = torch.zeros_like(lse)
    grad_h, grad_w = token_logprobs_bwd_op(grad_logp, grad_ent, hidden, weight, labels, lse, ent, *ctx.args)
    return grad_h, grad_w, None, None, None, None


token_logprobs_fwd_op.register_autograd(_backward, setup_context=_setup)


def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    chunk_size: Optional[int] = None,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Public-signature fused token log-probs on the Triton kernels (contract: reference/token_logprobs.py)."""
    check_token_logprobs_inputs(hidden, weight, labels, temperature)
    check_device("linear_token_logprobs", hidden, weight)
    vocab = weight.shape[0]
    bad = ((labels < 0) & (labels != IGNORE_INDEX)) | (labels >= vocab)
    if bool(bad.any()):
        raise ValueError(f"linear_token_logprobs: label {labels[bad][0].item()} outside [0, {vocab}) and not {IGNORE_INDEX}")
    chunk = _chunk_size(hidden.shape[0], vocab, hidden) if chunk_size is None else int(chunk_size)
    if chunk < 1:
        raise ValueError(f"linear_token_logprobs: chunk_size must be >= 1, got {chunk_size}")
    logp, ent, _ = token_logprobs_fwd_op(
        hidden.contiguous(), weight.contiguous(), labels.to(torch.int64).contiguous(), float(temperature), chunk,
        bool(return_entropy),
    )
    return (logp, ent) if return_entropy else logp
