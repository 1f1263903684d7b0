"""`[kernels]` config section: which backend runs each op ("auto" lets the registry choose).

The TOML loader builds this dataclass; `megatron_vlm.kernels.configure(KernelsConfig(...))`
applies it. Values: "auto" or a backend name registered for the op ("torch", "triton", "npu",
"flash_attn" ...); `validate()` checks them against the registry so a typo fails at load time.
"""
from dataclasses import asdict, dataclass


@dataclass(kw_only=True)
class KernelsConfig:
    """Backend per op; "auto" = fastest available for the tensor's device (logged once)."""

    attention: str = "auto"
    """Attention (varlen / batched, GQA, causal, windows): auto | torch | sdpa | csrc (C++ packed short samples on CPU, in place; auto on CPU, others go to sdpa) | triton | torch_varlen (torch's flash varlen kernel, torch >= 2.10: auto on CUDA, packed self-attention; other calls run triton) | flash_attn (the flash-attn package's kernels, fp16 / bf16: auto on CUDA where installed, ahead of torch_varlen) | npu | transformer_engine (Transformer Engine's DotProductAttention on CUDA; experimental: not yet run on a GPU)."""
    rms_norm: str = "auto"
    """RMSNorm with optional fused residual add: auto | torch | triton | npu | csrc (fused fp32 C++ kernel of megatron_vlm._C; auto on CPU) | liger (Liger-Kernel on CUDA; forced only: it matched our references on an H200 and did not beat our Triton kernels on an H100) | transformer_engine (Transformer Engine's fused RMSNorm on CUDA; experimental: not yet run on a GPU)."""
    layer_norm: str = "auto"
    """LayerNorm (vision towers, projectors): auto | torch | torch_fused (torch's fused F.layer_norm; auto on CUDA, where it beat our Triton kernel) | triton | transformer_engine (Transformer Engine's fused LayerNorm on CUDA; experimental: not yet run on a GPU)."""
    apply_rotary: str = "auto"
    """Rotary embedding with per-token cos/sin (RoPE, M-RoPE, 2-D vision): auto | torch | triton | npu | csrc (fused fp32 C++ kernel, rotate-half over the whole head dim; auto on CPU)."""
    swiglu: str = "auto"
    """silu(gate) * up of the gated MLPs: auto | torch | triton | npu | csrc (fused fp32 C++ kernel; auto on CPU) | liger (Liger-Kernel on CUDA; forced only: it matched our references on an H200 and did not beat our Triton kernels on an H100)."""
    linear_token_logprobs: str = "auto"
    """Fused LM head + token log-probs / entropy (GRPO, chunked): auto | torch | csrc (C++ row algebra, fp32; auto on CPU) | triton | liger (Liger-Kernel's fused linear cross-entropy; entropy runs the reference; forced only: it matched our reference on an H200 and tied our Triton kernel on an H100)."""
    causal_conv1d: str = "auto"
    """Mamba2 depthwise causal conv1d (Nemotron-H): auto | torch | causal_conv1d (the causal-conv1d package on CUDA; experimental: not yet run on a GPU)."""
    ssd_chunk_scan: str = "auto"
    """Mamba2 chunked SSD scan (Nemotron-H training / prefill): auto | torch | mamba_ssm (mamba-ssm's Triton kernels on CUDA; experimental: not yet run on a GPU)."""
    ssd_state_update: str = "auto"
    """Mamba2 single-step state update (decoding): auto | torch | mamba_ssm (mamba-ssm's selective_state_update on CUDA; experimental: not yet run on a GPU)."""
    decode_attention: str = "auto"
    """One query token per sequence against a slot / paged KV cache (rollout decoding): auto | torch (gather + masked SDPA) | triton (split-K Triton kernel; auto on CUDA: 1.29x the torch backend per CUDA-graph decode step at the 3B shape on an H200) | csrc (C++, one task per sequence, its cache walked in address order; auto on CPU)."""
    kv_cache_write: str = "auto"
    """A decode step's new keys / values into the slot / paged KV cache: auto | torch (two index_put) | triton (one
    launch for keys and values; forced only: not yet timed in a decode step on a GPU)."""
    moe_permute: str = "auto"
    """MoE token permutation grouped by expert: auto | torch | npu | csrc."""
    grouped_mm: str = "auto"
    """Per-expert grouped matmul: auto | torch | triton | npu | torch_grouped_mm (torch._grouped_mm; auto on CUDA in
    bf16 on sm90+, where it ran 2.2-3.0x our Triton kernel on an H200)."""
    moe_unpermute: str = "auto"
    """MoE un-permutation with routing-weight combine: auto | torch | triton | npu."""
    moe_topk_gating: str = "auto"
    """MoE router gating (softmax / sigmoid + bias, grouped top-k): auto | torch | csrc."""
    adamw_bf16_moments: str = "auto"
    """The AdamW step with bf16 moments (`optimizer.moments_dtype = "bf16"`): auto | torch (torch ops, any device;
    auto off CUDA) | triton (one fused pass per parameter tensor; auto on CUDA)."""
    moe_ep_dispatch: str = "auto"
    """Expert-parallel token dispatch / combine (parallel.ep > 1): auto | torch (all_to_all_single) | deep_ep (DeepEP's Buffer.dispatch / combine on CUDA, bf16; experimental: not yet run on a GPU)."""

    def as_dict(self) -> dict[str, str]:
        return asdict(self)

    def validate(self) -> None:
        from .registry import AUTO, DEFAULT_REGISTRY

        for op, name in self.as_dict().items():
            if not isinstance(name, str):
                raise TypeError(f"kernels.{op}: expected a backend name string, got {type(name).__name__}")
            known = DEFAULT_REGISTRY.backends.get(op, {})
            if name != AUTO and name not in known:
                raise ValueError(f"kernels.{op}: unknown backend {name!r}; known: {AUTO}, {', '.join(sorted(known))}")
