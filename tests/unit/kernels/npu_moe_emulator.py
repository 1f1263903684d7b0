"""Torch emulation of torch_npu's MoE ops, written from their documented semantics (CANN aclnn docs).

- `npu_moe_token_permute(tokens, indices, num_out_tokens=None, padded_mode=False)`:
  sortedIndicesFirst = argSort(flatten(indices)) (stable); sortedIndicesOut = argSort(sortedIndicesFirst);
  permuteTokensOut[sortedIndicesOut[i]] = tokens[i // topK]; a positive num_out_tokens keeps the first
  rows only. Returns (permuted_tokens, sorted_indices int32).
- `npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None)`:
  T[k] = permuted[S[k]]; T[k] *= probs[i][j] (k = i*topK + j); out[i] = sum_j T[i*topK + j];
  without probs topK = 1.
- `npu_grouped_matmul(x, weight, *, bias=None, group_list=None, split_item=0, group_type=None,
  group_list_type=0, ...)`: x a list holding one `[M, K]` tensor split along M by group_list
  (group_type=0), weight a list of E `[K, N]` tensors; group_list_type 0 = cumulative ends,
  1 = per-group counts; split_item 2/3 = one output tensor `[M, N]`. Rows past the last group are
  not written by the device op; the emulator leaves them zero. It has no derivative (no entry in op-plugin's
  derivatives.yaml; users wrap it in their own autograd.Function): torch's default autograd fallback warns at
  backward and gives its inputs no gradient, which the emulator reproduces.

Install with `install(monkeypatch)`: a fake `torch_npu` module in sys.modules.
"""
import sys
import types
import warnings

import torch


def npu_moe_token_permute(tokens, indices, num_out_tokens=None, padded_mode=False):
    if padded_mode:
        raise NotImplementedError("padded_mode is not supported by the emulator (nor used by the adapters)")
    topk = 1 if indices.dim() == 1 else indices.shape[1]
    first = torch.argsort(indices.reshape(-1), stable=True)
    sorted_indices = torch.argsort(first, stable=True)
    out = tokens.new_zeros(indices.numel(), tokens.shape[1])
    for i in range(indices.numel()):
        out[sorted_indices[i]] = tokens[i // topk]
    if num_out_tokens:
        out = out[:num_out_tokens]
    return out, sorted_indices.to(torch.int32)


def npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
    if padded_mode:
        raise NotImplementedError("padded_mode is not supported by the emulator")
    if sorted_indices.dtype != torch.int32:
        raise TypeError(f"npu_moe_token_unpermute: sorted_indices must be int32, got {sorted_indices.dtype}")
    topk = 1 if probs is None else probs.shape[1]
    num_tokens = sorted_indices.numel() // topk
    out = torch.zeros(num_tokens, permuted_tokens.shape[1], dtype=permuted_tokens.dtype)
    for i in range(num_tokens):
        for j in range(topk):
            row = permuted_tokens[sorted_indices[i * topk + j]]
            out[i] += row * (1 if probs is None else probs[i, j])
    return out


class _WarnNotImplemented(torch.autograd.Function):
    """torch's autograd fallback ("warn" mode) for an op without a derivative: the backward warns and the
    inputs get no gradient."""

    @staticmethod
    def forward(ctx, out, *inputs):
        ctx.num_inputs = len(inputs)
        return out.clone()

    @staticmethod
    def backward(ctx, grad):
        warnings.warn("npu_grouped_matmul: an autograd kernel was not registered to the Autograd key(s)", stacklevel=2)
        return (None,) * (1 + ctx.num_inputs)


def npu_grouped_matmul(x, weight, *, bias=None, group_list=None, split_item=0, group_type=None,
                       group_list_type=0, **unused):
    inputs = [t for t in (*x, *weight) if t.requires_grad]
    with torch.no_grad():
        (out,) = _grouped_matmul(x, weight, bias, group_list, split_item, group_type, group_list_type)
    if torch.is_grad_enabled() and inputs:
        out = _WarnNotImplemented.apply(out, *inputs)
    return [out]


def _grouped_matmul(x, weight, bias, group_list, split_item, group_type, group_list_type):
    if len(x) != 1 or group_type != 0 or split_item not in (2, 3):
        raise NotImplementedError("emulator covers one x tensor split along M with one output tensor")
    (inp,) = x
    values = [int(v) for v in (group_list.tolist() if torch.is_tensor(group_list) else group_list)]
    if len(values) != len(weight):
        raise ValueError(f"group_list has {len(values)} groups for {len(weight)} weights")
    if group_list_type == 0:
        ends = values
    elif group_list_type == 1:
        ends, total = [], 0
        for v in values:
            total += v
            ends.append(total)
    else:
        raise ValueError(f"group_list_type must be 0 or 1, got {group_list_type}")
    out = inp.new_zeros(inp.shape[0], weight[0].shape[1])
    start = 0
    for e, end in enumerate(ends):
        for r in range(start, end):
            out[r] = inp[r] @ weight[e] + (0 if bias is None else bias[e])
        start = end
    return [out]


def install(monkeypatch):
    fake = types.ModuleType("torch_npu")
    fake.npu_moe_token_permute = npu_moe_token_permute
    fake.npu_moe_token_unpermute = npu_moe_token_unpermute
    fake.npu_grouped_matmul = npu_grouped_matmul
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    return fake
