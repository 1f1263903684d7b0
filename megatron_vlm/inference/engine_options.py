"""How the built-in rollout engine decodes (`EngineOptions`), and where an option cannot apply.

The blockers are functions of the model alone (a model on the meta device is enough), shared by the engine and
`--check` (plan/check.py), so that the check refuses an option exactly where the job would.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_vlm.errors import ConfigError
from megatron_vlm.models.common.kv_cache import KVCache
from megatron_vlm.models.common.moe import MoE, moe_layers

__all__ = ["EngineOptions", "CUDA_GRAPH_MODES", "CudaGraphsConfigError", "cuda_graphs_blocker", "PagedKVConfigError",
           "paged_kv_blocker"]

CUDA_GRAPH_MODES = ("auto", "on", "off")


def cuda_graphs_blocker(model, *, trainer_forward: bool = False) -> Optional[str]:
    """Why the decode step of `model` cannot be captured as a CUDA graph, or None. One function for the
    engine and `--check` (plan/check.py), so that the check refuses rl.rollout.cuda_graphs = "on" exactly
    where the job would (a model on the meta device is enough: only its layer kinds are read)."""
    if trainer_forward:
        return "the engine calls the trainer's model (forward=: rl.rollout.weights = 'shared'), not its own copy"
    foreign = [m for m in moe_layers(model) if not isinstance(m, MoE)]
    if foreign:  # native MoE blocks route graph-safely in static steps (models/common/moe_static.py)
        return (f"MoE layers of another backend ({type(foreign[0]).__name__}): their routing sizes the grouped GEMMs "
                "from the routed counts on the host, which a CUDA graph cannot replay")
    return None


class CudaGraphsConfigError(ConfigError):
    """`rl.rollout.cuda_graphs = "on"` where the decode step cannot be captured (a config error: exit 2)."""


def paged_kv_blocker(model) -> Optional[str]:
    """Why `model` cannot decode on the paged KV cache (`kv_block_size` > 0), or None. One function for the
    engine and `--check` (plan/check.py), like `cuda_graphs_blocker`: the pool holds keys / values only, so a
    decoder whose cache is more than a `KVCache` (the Mamba2 hybrid's per-sequence recurrent states) keeps
    the slot layout. Asks the model for a one-position cache on the meta device (no memory; a meta-device
    model is enough)."""
    probe = model.new_cache(1, 1, device="meta")
    if isinstance(probe, KVCache):
        return None
    return (f"{type(model).__name__}'s decoder keeps per-sequence recurrent (Mamba2) states besides its keys / values "
            f"({type(probe).__name__}), which stay in the slot layout; the paged cache is for attention-only decoders")


class PagedKVConfigError(ConfigError):
    """`rl.rollout.kv_block_size` > 0 with a model that cannot decode on the paged KV cache (a config error: exit 2)."""


@dataclass(frozen=True)
class EngineOptions:
    """How the built-in engine decodes, as one value (`PolicyRolloutEngine(model, tokenizer, options, ...)`): built
    once from `[rl.rollout]` by the GRPO job (`rl/trainer.py`), the asynchronous rollout ranks and the
    evaluations, or by tests and benchmarks with the fields they vary."""
    eos_token_ids: Optional[Iterable[int]] = None
    """Tokens that end a completion (default: the tokenizer's / generation config's)."""
    pad_token_id: Optional[int] = None
    cache_dtype: Optional[torch.dtype] = None
    """Compute dtype of keys / values (bf16 under FSDP mixed precision; default the model's weight dtype)."""
    device: Optional[torch.device | str] = None
    max_prompts_per_batch: int = 0
    """Lock-step: slots for this many prompts' samples (x n) decoding at once, refilled as completions end (0 = all)."""
    max_num_seqs: int = 0
    """Slots of continuous batching (0 = max_prompts_per_batch * n, or every sample of the call)."""
    share_prefix: bool = True
    suppress_token_ids: Optional[Iterable[int]] = None
    """Tokens never generated (default: the model's vision placeholder / start / end tokens)."""
    kv_block_size: int = 0
    """> 0: a paged KV cache of blocks of this many positions (attention-only models)."""
    kv_cache_blocks: int = 0
    """Blocks of the paged KV cache (0 = enough for every slot at full length and the admission headroom)."""
    cuda_graphs: str = "off"
    """"auto" | "on" | "off": decode steps on static buffers, captured as CUDA graphs (inference/policy_engine.py's
    module docstring). "off" here (tests and benchmarks opt in); the GRPO jobs pass `rl.rollout.cuda_graphs`."""
    record_routes: bool = False
    """MoE models: record the top-k experts of every prompt and generated token (`RolloutSample.routes`, routing
    replay: models/common/routing_replay.py); ignored for a model without MoE layers."""
    cpu_packed_gemm: bool = True
    """CPU, fp32, the engine's own weights: eager decode steps run the Linear layers on MKL-packed copies of the
    weights (inference/cpu_packed_linear.py; packed again whenever the weights change)."""
    cpu_fused_experts: bool = True
    """CPU, fp32, the engine's own weights: eager decode steps run each MoE layer's routed experts as one C++ call
    on MKL-packed expert weights (inference/cpu_packed_experts.py); routing is unchanged."""
    fuse_projections: Optional[bool] = None
    """The engine's own copy of the weights: each attention layer's q / k / v run as one GEMM over one fused weight
    that the three layers view (models/common/fused_projections.py: fewer, wider GEMMs and no q / k concatenation
    per decode step; checkpoint names unchanged). True is refused for the trainer's model (an optimizer holds its
    Parameters) and for lock-step engines. None: on for an engine that decodes its own copy on CUDA (with the
    one-launch KV write, an H200's 3B decode step in CUDA graphs ran 1.18x / 1.20x faster at 32 / 64 sequences:
    benchmarks/e2e/profile_decode.py `:fused`), off elsewhere (on the CPU, MKL-packed weights; not measured to pay)."""
    share_prefix_reads: Optional[bool] = None
    """Decode attention reads a GRPO group's shared prompt through one copy (`SlotCache.share_prefix_reads`: the CPU
    kernel reads it once per group, the Triton kernel from one copy for L2 reuse). None: the cache's default, on
    on the CPU (measured faster), off on CUDA (an H200's 3B decode step in CUDA graphs: within noise of per-row
    reads, 1.01x / 1.02x median at 16 / 32 sequences; benchmarks/e2e/profile_decode.py)."""
