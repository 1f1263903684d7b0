"""Torch emulation of the torch_npu fused ops our adapters call, written from their documented
semantics (Ascend "torch_npu" API reference pages and the CANN sparse_mode introduction), not
from our reference code. Install with `install(monkeypatch)`: a fake `torch_npu` module.

- `npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None,
  atten_mask=None, scale=1., keep_prob=1., pre_tockens=2147483647, next_tockens=2147483647,
  inner_precise=0, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
  gen_mask_parallel=True, sync=False)` -> (attention_out, softmax_max, softmax_sum, softmax_in,
  seed, offset, numels). Layouts "BSND" and "TND" (TND needs the cumulative-end lists
  actual_seq_qlen / actual_seq_kvlen, e.g. lengths 2 2 2 -> [2, 4, 6]). atten_mask True = the
  position does not take part. sparse_mode: 0 defaultMask (no mask -> no masking, pre/next
  ignored; with a mask, also the band j - i in [-pre_tockens, next_tockens] from the top-left);
  1 allMask (full mask, pre/next ignored); 2 leftUpCausal, 3 rightDownCausal and 4 band (pre /
  next counted from the bottom-right corner) take the compressed 2048 x 2048 upper-triangular
  mask. D must be a multiple of 16; N1 a multiple of N2. Rows with nothing to attend output 0
  (the op's invalid-row handling).
- `npu_rms_norm(self, gamma, epsilon=1e-6)` -> (y, rstd); gamma has self's dtype.
- `npu_add_rms_norm(x1, x2, gamma, epsilon=1e-6)` -> (y, rstd, x1 + x2); no derivative: op-plugin registers
  torch's `autogradNotImplementedFallback` for it (AutogradErrorFallback.cpp), so the forward runs and a backward
  through its outputs raises "derivative for ... is not implemented".
- `npu_rotary_mul(input, r1, r2, rotary_mode="half")`: 4-D input; output = r1 * input + r2 *
  rotate(input), rotate = cat(-x2, x1) of the halves ("half") or stack(-x[1::2], x[::2])
  interleaved ("interleave"); D even.
- `npu_swiglu(input, dim=-1)`: A, B = the halves of input along dim; silu(A) * B; contiguous only.
"""
import sys
import types

import torch
import torch.nn.functional as F

UNBOUNDED = 2147483647


def _check_compressed(atten_mask, sparse_mode):
    expect = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
    if atten_mask is None or atten_mask.dtype not in (torch.bool, torch.uint8) or tuple(atten_mask.shape) != (2048, 2048):
        raise RuntimeError(f"sparse_mode {sparse_mode} needs the compressed 2048x2048 bool atten_mask")
    if not torch.equal(atten_mask.bool().cpu(), expect):
        raise RuntimeError(f"sparse_mode {sparse_mode}: atten_mask is not the compressed upper-triangular mask")


def _masked_out(sq, sk, atten_mask, sparse_mode, pre, nxt):
    """[sq, sk] or broadcastable mask, True = does not take part."""
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    if sparse_mode == 0:
        if atten_mask is None:
            return torch.zeros(sq, sk, dtype=torch.bool)
        return atten_mask.bool() | (j < i - pre) | (j > i + nxt)
    if sparse_mode == 1:
        if atten_mask is None:
            raise RuntimeError("sparse_mode 1 (allMask) needs atten_mask")
        return atten_mask.bool()
    _check_compressed(atten_mask, sparse_mode)
    if sparse_mode == 2:
        return j > i
    shift = sk - sq  # bottom-right anchoring
    if sparse_mode == 3:
        return j > i + shift
    if sparse_mode == 4:
        return (j < i + shift - pre) | (j > i + shift + nxt)
    raise NotImplementedError(f"sparse_mode {sparse_mode} is not emulated")


def _attend(q, k, v, masked, scale):
    """q [N1, Sq, D], k / v [N2, Sk, D], masked broadcastable to [N1, Sq, Sk] (True = out)."""
    rep = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(rep, 0).float(), v.repeat_interleave(rep, 0).float()
    scores = scale * (q.float() @ k.transpose(-1, -2))
    scores = scores.masked_fill(masked, float("-inf"))
    probs = torch.nan_to_num(torch.softmax(scores, -1), nan=0.0)
    return probs @ v


def npu_fusion_attention(
    query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None, scale=1.0,
    keep_prob=1.0, pre_tockens=UNBOUNDED, next_tockens=UNBOUNDED, inner_precise=0, prefix=None,
    actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False,
):
    if pse is not None or padding_mask is not None or keep_prob != 1.0 or prefix is not None:
        raise NotImplementedError("the emulator covers no pse / padding_mask / dropout / prefix")
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"npu_fusion_attention: unsupported dtype {query.dtype}")
    d = query.shape[-1]
    if d % 16 or d > 512:
        raise RuntimeError(f"npu_fusion_attention: head dim {d} must be a multiple of 16, at most 512")
    n1, n2 = query.shape[-2], key.shape[-2]
    if head_num != n1 or n1 % n2:
        raise RuntimeError(f"npu_fusion_attention: head_num {head_num}, query heads {n1}, kv heads {n2}")
    if input_layout == "BSND":
        if actual_seq_qlen is not None:
            raise RuntimeError("actual_seq_qlen is for the TND layout")
        b, sq, sk = query.shape[0], query.shape[1], key.shape[1]
        out = torch.empty(b, sq, n1, d, dtype=torch.float32)
        for bi in range(b):
            mask = atten_mask
            if mask is not None and sparse_mode in (0, 1) and mask.dim() == 4:
                mask = mask[bi if mask.shape[0] > 1 else 0]
            masked = _masked_out(sq, sk, mask, sparse_mode, pre_tockens, next_tockens)
            out[bi] = _attend(query[bi].transpose(0, 1), key[bi].transpose(0, 1), value[bi].transpose(0, 1), masked, scale).transpose(0, 1)
    elif input_layout == "TND":
        if actual_seq_qlen is None or actual_seq_kvlen is None or len(actual_seq_qlen) != len(actual_seq_kvlen):
            raise RuntimeError("TND needs actual_seq_qlen and actual_seq_kvlen of equal length")
        if not all(isinstance(x, int) for x in list(actual_seq_qlen) + list(actual_seq_kvlen)):
            raise TypeError("actual_seq_qlen / actual_seq_kvlen are host int lists")
        if actual_seq_qlen[-1] != query.shape[0] or actual_seq_kvlen[-1] != key.shape[0]:
            raise RuntimeError("TND: the last cumulative length must equal the token count")
        if sparse_mode in (0, 1) and atten_mask is not None:
            raise NotImplementedError("the emulator covers TND with sparse modes 2-4 or no mask")
        out = torch.empty(query.shape[0], n1, d, dtype=torch.float32)
        q0 = k0 = 0
        for q1, k1 in zip(actual_seq_qlen, actual_seq_kvlen):
            masked = _masked_out(q1 - q0, k1 - k0, atten_mask, sparse_mode, pre_tockens, next_tockens)
            out[q0:q1] = _attend(query[q0:q1].transpose(0, 1), key[k0:k1].transpose(0, 1), value[k0:k1].transpose(0, 1), masked, scale).transpose(0, 1)
            q0, k0 = q1, k1
    else:
        raise NotImplementedError(f"input_layout {input_layout} is not emulated")
    empty = torch.empty(0)
    return out.to(query.dtype), empty, empty, empty, 0, 0, 0


def npu_rms_norm(self, gamma, epsilon=1e-6):
    if gamma.dtype != self.dtype:
        raise TypeError(f"npu_rms_norm: gamma dtype {gamma.dtype} != input dtype {self.dtype}")
    x = self.float()
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + epsilon)
    return (x * rstd * gamma.float()).to(self.dtype), rstd


class _NotImplementedBackward(torch.autograd.Function):
    """Identity forward whose backward raises, as torch's autogradNotImplementedFallback does."""

    @staticmethod
    def forward(ctx, name, *outputs):
        ctx.name = name
        return tuple(o.clone() for o in outputs)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(f"derivative for npu::{ctx.name} is not implemented")


def npu_add_rms_norm(x1, x2, gamma, epsilon=1e-6):
    with torch.no_grad():
        x = x1 + x2
        y, rstd = npu_rms_norm(x, gamma, epsilon)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x1, x2, gamma)):
        anchor = (x1.sum() + x2.sum() + gamma.sum()) * 0  # ties the outputs to the inputs in the graph
        y, rstd, x = _NotImplementedBackward.apply("npu_add_rms_norm", y + anchor, rstd, x + anchor)
    return y, rstd, x


def npu_rotary_mul(input, r1, r2, rotary_mode="half"):
    if input.dim() != 4 or r1.dim() != 4 or r2.dim() != 4:
        raise RuntimeError("npu_rotary_mul: input, r1 and r2 must be 4-D")
    if input.shape[-1] % 2:
        raise RuntimeError("npu_rotary_mul: D must be even")
    if rotary_mode == "half":
        x1, x2 = torch.chunk(input, 2, -1)
        rotated = torch.cat((-x2, x1), dim=-1)
    elif rotary_mode == "interleave":
        rotated = torch.stack((-input[..., 1::2], input[..., 0::2]), dim=-1).flatten(-2)
    else:
        raise ValueError(f"npu_rotary_mul: unknown rotary_mode {rotary_mode!r}")
    out = r1.float() * input.float() + r2.float() * rotated.float()
    if out.shape != input.shape:
        raise RuntimeError(f"npu_rotary_mul: r1 / r2 {tuple(r1.shape)} do not broadcast to input {tuple(input.shape)}")
    return out.to(input.dtype)


def npu_swiglu(input, dim=-1):
    if not input.is_contiguous():
        raise RuntimeError("npu_swiglu: non-contiguous input is not supported")
    if input.shape[dim] % 2:
        raise RuntimeError("npu_swiglu: the split dim must be even")
    a, b = torch.chunk(input, 2, dim=dim)
    return (F.silu(a.float()) * b.float()).to(input.dtype)


def install(monkeypatch):
    fake = types.ModuleType("torch_npu")
    for fn in (npu_fusion_attention, npu_rms_norm, npu_add_rms_norm, npu_rotary_mul, npu_swiglu):
        setattr(fake, fn.__name__, fn)
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    return fake
