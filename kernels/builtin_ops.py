"""The built-in ops and their backends, registered in the default registry when the package loads.

Each op has the torch reference (always usable, the fallback) plus faster backends: under `auto`
a third-party backend (priority 20) beats our Triton kernels (10) on CUDA, and the torch_npu
adapters (10) are taken on NPU. Attention also has `sdpa` (torch's scaled_dot_product_attention,
priority 5), so `auto` never runs the reference's fp32 S x S scores: it is what CPU uses. Targets are import paths, imported only when a backend is first
chosen (see registry.py for why). The package calls `register_builtin_ops(DEFAULT_REGISTRY)` once;
the sibling modules are imported inside that function so that no module of the package imports a
sibling at module level (the package's module-level import graph stays acyclic).
"""
import torch

_PKG = __name__.rpartition(".")[0]

# Dense ops: (op, module name under reference/ triton/ npu/, function).
DENSE_OPS = (
    ("attention", "attention", "attention"),
    ("rms_norm", "norms", "rms_norm"),
    ("layer_norm", "norms", "layer_norm"),
    ("apply_rotary", "rotary", "apply_rotary"),
    ("swiglu", "swiglu", "swiglu"),
    ("linear_token_logprobs", "token_logprobs", "linear_token_logprobs"),
)
TRITON_MODULES = {"rms_norm": "rms_norm", "layer_norm": "layer_norm"}  # triton/ splits the two norms
NPU_MODULES = {"attention": "attention", "rms_norm": "rms_norm", "apply_rotary": "rotary", "swiglu": "swiglu"}
# Mamba2, MoE and decode-attention ops (Nemotron-H, Qwen3-VL-MoE, rollout decoding): (op, reference module);
# the function is named as the op.
MAMBA_MOE_OPS = (
    ("causal_conv1d", "causal_conv1d"),
    ("ssd_chunk_scan", "ssd"),
    ("ssd_state_update", "ssd"),
    ("decode_attention", "decode_attention"),
    ("kv_cache_write", "kv_cache_write"),
    ("moe_permute", "moe"),
    ("grouped_mm", "moe"),
    ("moe_unpermute", "moe"),
)
NPU_MOE_OPS = ("moe_permute", "grouped_mm", "moe_unpermute")
# the mamba-ssm module each op's adapter imports (kernels/thirdparty/mamba_ssm.py)
MAMBA_SSM_MODULES = {"ssd_chunk_scan": "mamba_ssm.ops.triton.ssd_combined",
                     "ssd_state_update": "mamba_ssm.ops.triton.selective_state_update"}
TRITON_MOE_OPS = ("grouped_mm", "moe_unpermute")  # kernels/triton/moe.py; moe_permute stays on the reference


def register_builtin_ops(registry) -> None:
    """Register every built-in op's backends in `registry` (a KernelRegistry)."""
    from .availability import cuda_package_check, npu_check, triton_check, triton_package_check
    from .registry import register_backend

    def register(op, name, target, **kwargs):
        register_backend(op, name, f"{_PKG}.{target}", registry=registry, **kwargs)

    everywhere = ("cpu", "cuda", "npu")
    for op, module, fn in DENSE_OPS:
        register(op, "torch", f"reference.{module}:{fn}", auto_devices=everywhere)
        register(op, "triton", f"triton.{TRITON_MODULES.get(op, module)}:{fn}", check=triton_check, auto_devices=("cuda",), priority=10)
        if op in NPU_MODULES:
            register(op, "npu", f"npu.{NPU_MODULES[op]}:{fn}", check=npu_check, auto_devices=("npu",), priority=10)
    # torch SDPA: fused kernels on every device, no fp32 S x S scores; above the reference everywhere,
    # below our Triton kernel and flash-attn on CUDA and the torch_npu adapter on NPU.
    register("attention", "sdpa", "sdpa.attention:attention", auto_devices=everywhere, priority=5)
    register(
        "attention", "flash_attn", "thirdparty.flash_attn:attention",
        check=cuda_package_check("flash_attn", (torch.float16, torch.bfloat16)), auto_devices=("cuda",), priority=20,
    )
    for op, module in MAMBA_MOE_OPS:
        register(op, "torch", f"reference.{module}:{op}", auto_devices=everywhere)
    # AdamW with bf16 moments (optimizer.moments_dtype = "bf16"): the torch reference everywhere, our fused Triton
    # pass on CUDA (one read and write of each tensor; kernels/reference/adamw.py has the contract)
    register("adamw_bf16_moments", "torch", "reference.adamw:adamw_bf16_moments", auto_devices=everywhere)
    register("adamw_bf16_moments", "triton", "triton.adamw:adamw_bf16_moments", check=triton_check,
             auto_devices=("cuda",), priority=10)
    # experimental: not yet run on a GPU (kernels/thirdparty/causal_conv1d.py says what falls back and why)
    register(
        "causal_conv1d", "causal_conv1d", "thirdparty.causal_conv1d:causal_conv1d",
        check=cuda_package_check("causal_conv1d", (torch.float32, torch.float16, torch.bfloat16)),
        auto_devices=("cuda",), priority=20,
    )
    # experimental: not yet run on a GPU (kernels/thirdparty/mamba_ssm.py says what falls back and why)
    for op in MAMBA_SSM_MODULES:
        register(
            op, "mamba_ssm", f"thirdparty.mamba_ssm:{op}",
            check=cuda_package_check("mamba_ssm", (torch.float32, torch.float16, torch.bfloat16), modules=(MAMBA_SSM_MODULES[op],)),
            auto_devices=("cuda",), priority=20,
        )
    # Liger's fused linear cross-entropy: forceable only (no auto device): on an H100 it tied our Triton kernel
    # (0.94-1.03x its time, no gradients; kernels/thirdparty/liger.py has the figures and the gradient caveat)
    register("linear_token_logprobs", "liger", "thirdparty.liger:linear_token_logprobs",
             check=triton_package_check("liger_kernel", modules=("liger_kernel.transformers.functional",)), auto_devices=(), priority=0)
    for op in NPU_MOE_OPS:
        register(op, "npu", f"npu.moe:{op}", check=npu_check, auto_devices=("npu",), priority=10)
    for op in TRITON_MOE_OPS:
        register(op, "triton", f"triton.moe:{op}", check=triton_check, auto_devices=("cuda",), priority=10)
    # torch's grouped GEMM: 2.2-3.0x our Triton grouped_mm on an H200 in bf16 (kernels/torch_fused/grouped_mm.py)
    from .torch_fused.grouped_mm import cuda_check as grouped_mm_check

    register("grouped_mm", "torch_grouped_mm", "torch_fused.grouped_mm:grouped_mm", check=grouped_mm_check,
             auto_devices=("cuda",), priority=15)
    # rollout decoding over the slot / paged cache (kernels/triton/decode_attention.py, split-K flash decoding): auto on
    # CUDA. Decode step of the Qwen2.5-VL-3B shape, 16 sequences x ~1.05k cached keys, bf16, NVIDIA H200
    # (benchmarks/e2e/profile_decode.py, benchmarks/RESULTS.md, 2026-11-27): 5.92 ms median (5.01 min) with CUDA
    # graphs vs 7.61 (7.38) for the torch backend (gather + SDPA); eager steps 33.5 vs 35.9 ms (host-bound both)
    register("decode_attention", "triton", "triton.decode_attention:decode_attention", check=triton_check,
             auto_devices=("cuda",), priority=10)
    # a decode step's keys and values in one launch instead of four: auto on CUDA. With the engine's fused q / k / v
    # (EngineOptions.fuse_projections) the 3B decode step in CUDA graphs on an H200 (profile_decode.py ':fused',
    # 2026-11-28): 32 sequences 5.60 -> 4.73 ms median (1.18x), 64 sequences 5.97 -> 4.99 ms (1.20x)
    register("kv_cache_write", "triton", "triton.kv_cache_write:kv_cache_write", check=triton_check,
             auto_devices=("cuda",), priority=10)
    # torch's fused LayerNorm: our Triton layer_norm ran 0.68x / 0.97x its time (fwd / bwd) on an H100 at the
    # InternViT shape (bench_rms_norm, benchmarks/RESULTS.md, 2026-11-26)
    register("layer_norm", "torch_fused", "torch_fused.norms:layer_norm", auto_devices=("cuda",), priority=15)
    # torch's flash varlen kernel for packed training attention: auto on CUDA above our Triton kernel (what it
    # cannot take runs ours). On an H200 (benchmarks/RESULTS.md, 2026-11-28) it beat ours alone in every case
    # (8 x 16k causal 1.07x fwd / 1.29x bwd, ViT shapes 1.2-1.7x) and in the 3B SFT step with selective
    # checkpointing keeping its output (1.141 vs 1.338 s median, attention kernels 42.5 vs 49.4 ms per step).
    # Below flash-attn and Transformer Engine, which were not timed against it.
    from .torch_fused.varlen_attention import check as torch_varlen_check

    register("attention", "torch_varlen", "torch_fused.varlen_attention:attention", check=torch_varlen_check,
             auto_devices=("cuda",), priority=18)
    # MoE routing (reference/moe_routing.py) and the compiled backends of megatron_vlm._C (csrc/,
    # loaded lazily by megatron_vlm/_ext.py; its check says why it is unavailable when it is)
    register("moe_topk_gating", "torch", "reference.moe_routing:moe_topk_gating", auto_devices=everywhere)
    from megatron_vlm._ext import backend_check as csrc_check

    # auto devices: where it was measured faster than the reference (CPU gating is not: it calls torch's
    # own softmax / sigmoid for bitwise-equal scores and loses on the top-k; docs/extension.md)
    register_backend("moe_permute", "csrc", f"{_PKG}.csrc.moe:moe_permute", registry=registry, check=csrc_check,
                     auto_devices=("cpu", "cuda"), priority=5)
    register_backend("moe_topk_gating", "csrc", f"{_PKG}.csrc.moe:moe_topk_gating", registry=registry,
                     check=csrc_check, auto_devices=("cuda",), priority=5)
    # fused fp32 CPU kernels of the per-token layer ops (csrc/cpu_layer_ops.cpp, cpu_decode_attention.cpp): auto
    # on the CPU, where the references are chains of elementwise calls (benchmarks/kernels/bench_csrc_layer_ops.py)
    from .csrc.layer_ops import check as csrc_layer_check

    for op in ("rms_norm", "swiglu", "apply_rotary", "decode_attention"):
        register(op, "csrc", f"csrc.layer_ops:{op}", check=csrc_layer_check, auto_devices=("cpu",), priority=5)
    register("linear_token_logprobs", "csrc", "csrc.token_logprobs:linear_token_logprobs", check=csrc_layer_check,
             auto_devices=("cpu",), priority=5)
    # packed short samples in place on the CPU (above sdpa there; long samples, windows, padded batches -> sdpa)
    register("attention", "csrc", "csrc.attention:attention", check=csrc_layer_check, auto_devices=("cpu",), priority=6)
    # experimental: not yet run on a GPU. Expert-parallel dispatch / combine (parallel/expert_parallel.py):
    # our all_to_all_single, or DeepEP's Buffer.dispatch / combine (kernels/thirdparty/deep_ep.py)
    register_backend("moe_ep_dispatch", "torch", "megatron_vlm.parallel.expert_parallel:all_to_all_forward",
                     registry=registry, auto_devices=everywhere)
    register("moe_ep_dispatch", "deep_ep", "thirdparty.deep_ep:ep_forward",
             check=cuda_package_check("deep_ep", (torch.bfloat16,)), auto_devices=("cuda",), priority=20)
    # Liger-Kernel (matched our references on an H200 and an H100): forced only (no auto devices), because on
    # the H100 it did not beat our Triton kernels (kernels/thirdparty/liger.py has the figures)
    liger_dtypes = (torch.float32, torch.float16, torch.bfloat16)
    for op in ("rms_norm", "swiglu"):  # linear_token_logprobs: registered above
        register(op, "liger", f"thirdparty.liger:{op}", check=cuda_package_check("liger_kernel", liger_dtypes, modules=("liger_kernel.transformers.functional",)))
    # experimental: not yet run on a GPU. Transformer Engine's fused norms and DotProductAttention
    # (kernels/thirdparty/transformer_engine.py says what falls back and why); attention one below
    # flash-attn so that `auto` keeps flash-attn until bench_transformer_engine.py says otherwise
    half = (torch.float16, torch.bfloat16)
    te_modules = ("transformer_engine.pytorch", "transformer_engine_torch")
    for op in ("rms_norm", "layer_norm"):
        register(op, "transformer_engine", f"thirdparty.transformer_engine:{op}",
                 check=cuda_package_check("transformer_engine", (torch.float32, *half), modules=te_modules), auto_devices=("cuda",), priority=20)
    register("attention", "transformer_engine", "thirdparty.transformer_engine:attention",
             check=cuda_package_check("transformer_engine", half, modules=te_modules), auto_devices=("cuda",), priority=19)
