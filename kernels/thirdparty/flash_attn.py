"""`attention` on the flash-attn package (Dao-AILab, 2.x), chosen by `auto` on CUDA for fp16 / bf16 when installed.

Our conventions are flash-attn's (bottom-right causal, window=(left, right) with -1 unbounded, Hkv dividing
Hq, query head h reading kv head h // (Hq // Hkv), softmax_scale defaulting to D ** -0.5, zeros for a query
that sees no key), so the mapping is direct: packed -> `flash_attn_varlen_func(q, k, v, cu_seqlens_q,
cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=, causal=, window_size=)`, batched ->
`flash_attn_func`. What the package checks (read in 2.8.4, the same in 2.7.4 to 2.8.3: the Python wrapper
`flash_attn/flash_attn_interface.py` `flash_attn_func` / `flash_attn_varlen_func` -> `FlashAttn(Varlen)Func`
-> `_flash_attn_(varlen_)forward`; the C++ `csrc/flash_attn/flash_api.cpp` `mha_fwd` / `mha_varlen_fwd` and,
for the backward, `mha_bwd` / `mha_varlen_bwd`, which repeat the forward's checks), and what the adapter does:

- q, k, v, cu_seqlens on CUDA, on a GPU of compute capability 8.0 or newer ("FlashAttention only supports
  Ampere GPUs or newer") -> the registry picks this backend on CUDA only; other devices and older GPUs run
  torch SDPA (our `sdpa` backend, same contract; logged once per reason); cu_seqlens are moved to q's device;
- fp16 / bf16 only, q / k / v of one dtype -> the registry sends only those (our contract checks that the
  dtypes agree); other dtypes (direct calls) run SDPA (logged once);
- head dim: the wrapper pads it to a multiple of 8 (and slices the output; the default scale is taken from
  the unpadded dim, as ours), the C++ takes at most 256 -> larger head dims run SDPA (logged once);
- stride 1 over the head dim: the wrapper copies a tensor that lacks it (`maybe_contiguous`) -> as given;
- Hkv divides Hq, k / v of one shape, q's head dim: our contract's checks (`check_attention_inputs`);
- cu_seqlens int32 (our contract checks it too), 1-D, as many entries each, contiguous (`CHECK_CONTIGUOUS`)
  -> made contiguous (no copy when they are);
- max_seqlen_q / max_seqlen_k are `int` in the wrapper's custom-op schema (a float is refused) -> computed
  from cu_seqlens when not given (one device sync), given ones passed through `int()`. They must be at least
  the real lengths (the kernels size their grid and clamp the window from them; flash-attn does not check
  it, and neither do we);
- a batch of at least one sequence ("batch size must be positive") and at least one query: the forward
  launches ceil(Sq / block) x B x H blocks, an empty grid fails to launch -> calls without any query element
  run SDPA (logged once; there is nothing to compute);
- causal: the C++ sets the window's right side to 0 itself (we send (left, -1)) and drops causal when
  (max_)seqlen_q == 1 (the same result, bottom-right aligned);
- windows: the C++ turns a side >= seqlen_k (packed: max_seqlen_k) into -1, and a window bounded on one side
  only into seqlen_k on the other (`set_params_fprop`). For the left side that is exact; on the right it is
  not always: a non-causal right side r that it changes to r' (-1 -> seqlen_k, or >= seqlen_k -> -1)
  bounds other rows than ours when a query sequence is longer than min(r, r') + 1 (row i of Sq is bounded
  iff i < Sq - 1 - r) -> such calls run SDPA (logged once);
- packed decoding with GQA (max_seqlen_q == 1, Hq > Hkv, no window): `mha_varlen_fwd` reshapes q to
  [B, Hkv, Hq / Hkv, D], one query per sequence, which fails when a sequence has no query -> such packs run
  SDPA (logged once);
- no key padding mask in the batched layout -> such calls go to our Triton kernel, which has one.

Not covered: ROCm builds of flash-attn (the CK `csrc/flash_attn_ck` and Triton-AMD backends check other
things).
"""
import logging
from typing import Optional

import torch

from ..reference.attention import check_attention_inputs, normalize_window, packed_max_seqlens

logger = logging.getLogger("megatron_vlm.kernels")
_logged: set = set()
_DTYPES = (torch.float16, torch.bfloat16)  # flash_api.cpp: "FlashAttention only support fp16 and bf16 data type"
_MAX_HEAD_DIM = 256  # flash_api.cpp, after the wrapper pads the head dim to a multiple of 8
_MIN_CAPABILITY = 8  # flash_api.cpp: "FlashAttention only supports Ampere GPUs or newer."
_capabilities: dict[int, tuple[int, int]] = {}


@torch.compiler.assume_constant_result
def _gpu_capability(device_type: str, index: Optional[int]) -> Optional[tuple[int, int]]:
    """(major, minor) of the CUDA device that holds q (read once per device); None off CUDA."""
    if device_type != "cuda":
        return None
    index = torch.cuda.current_device() if index is None else index
    if index not in _capabilities:
        _capabilities[index] = tuple(torch.cuda.get_device_capability(index))
    return _capabilities[index]


@torch.compiler.assume_constant_result
def _log_fallback(reason: str) -> bool:
    """Log once per reason. Run eagerly while dynamo traces a compiled block (a constant of its graph): a log call
    inside the trace would break the graph at every attention layer that falls back."""
    if reason not in _logged:
        _logged.add(reason)
        logger.info("attention: backend flash_attn falls back to torch SDPA (the sdpa backend): %s", reason)
    return True


def _fallback(reason: str, q, k, v, **kwargs) -> torch.Tensor:
    _log_fallback(reason)
    from ..sdpa.attention import attention as sdpa_attention

    return sdpa_attention(q, k, v, **kwargs)


def _call_reason(q: torch.Tensor) -> Optional[str]:
    """Why flash-attn would refuse q (device, GPU, dtype, head dim, nothing to compute), or None."""
    capability = _gpu_capability(q.device.type, q.device.index)
    if capability is None:
        return f"tensor on {q.device.type} (flash-attn's kernels run on CUDA only)"
    if capability[0] < _MIN_CAPABILITY:
        return f"compute capability {capability[0]}.{capability[1]} (flash-attn needs {_MIN_CAPABILITY}.0 or newer)"
    if q.dtype not in _DTYPES:
        return f"dtype {q.dtype} (flash-attn takes float16 / bfloat16)"
    if q.shape[-1] > _MAX_HEAD_DIM:
        return f"head dim {q.shape[-1]} (flash-attn takes up to {_MAX_HEAD_DIM})"
    if q.numel() == 0:
        return "no query element (flash-attn's forward would launch an empty grid)"
    return None


def _window_reason(causal: bool, left: int, right: int, max_q: int, max_k: int) -> Optional[str]:
    """flash_api.cpp turns a side >= seqlen_k (packed: max_seqlen_k) into -1, then set_params_fprop a right side
    of -1 with a bounded left one into seqlen_k. Where that changes the right side (r -> r'), the first rows of
    a query sequence longer than min(r, r') + 1 see other keys (row i of Sq is bounded on the right iff
    i < Sq - 1 - r); the left side's rewrite never changes a row."""
    if causal:  # the right side is 0 there, kept as is
        return None
    flash_right = right if 0 <= right < max_k else (max_k if 0 <= left < max_k else -1)
    if flash_right == right:
        return None
    bound = min(r for r in (right, flash_right) if r >= 0)
    if max_q >= bound + 2:
        return (f"a non-causal window ({left}, {right}) with query sequences longer than the key length + 1 "
                "(flash-attn rewrites the window's right side from the key length)")
    return None


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
    """Public-signature attention on flash-attn (contract: kernels/reference/attention.py)."""
    if key_padding_mask is not None:
        from ..triton.attention import attention as triton_attention

        return triton_attention(q, k, v, causal=causal, window=window, softmax_scale=softmax_scale, key_padding_mask=key_padding_mask)
    args = dict(causal=causal, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k, window=window, softmax_scale=softmax_scale)
    cu_q, cu_k = check_attention_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, None)
    left, right = normalize_window(window, causal)
    window_size = (left, -1 if causal else right)  # flash-attn caps the right side itself when causal
    reason = _call_reason(q)
    if reason is not None:
        return _fallback(reason, q, k, v, **args)
    if q.dim() == 4:
        reason = _window_reason(causal, left, right, q.shape[1], k.shape[1])
        if reason is not None:
            return _fallback(reason, q, k, v, **args)
        from flash_attn import flash_attn_func

        return flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size)
    same = cu_k is cu_q
    cu_q = cu_q.to(q.device).contiguous()  # flash_api.cpp: CHECK_DEVICE, CHECK_CONTIGUOUS
    cu_k = cu_q if same else cu_k.to(q.device).contiguous()
    # hints given: trusted (no host sync per layer); else one sync that also checks cu_seqlens (flash-attn does not)
    max_q, max_k = packed_max_seqlens(cu_q, cu_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k, check_hints=False)
    reason = _window_reason(causal, left, right, max_q, max_k)
    if (reason is None and max_q == 1 and q.shape[1] > k.shape[1] and window_size[0] < 0 and window_size[1] < 0
            and q.shape[0] != cu_q.numel() - 1):
        reason = ("packed GQA decoding with a sequence that has no query (flash-attn reshapes q to one query per "
                  "sequence when max_seqlen_q == 1)")
    if reason is not None:
        return _fallback(reason, q, k, v, **args)
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
    )
