"""Parallelism: process groups, the device mesh and the shared `apply_*` helpers that each model
family's `parallelize.py` calls in a fixed order (TP -> EP -> CP -> AC -> compile -> FSDP)."""
from megatron_vlm.parallel.apply import apply_ac, apply_compile, apply_fsdp, parallelize_blocks
from megatron_vlm.parallel.dist import DistEnv, destroy_distributed, init_distributed
from megatron_vlm.parallel.expert_parallel import apply_ep, expert_parameters
from megatron_vlm.parallel.grad import clip_grad_norm_
from megatron_vlm.parallel.mesh import ParallelDims, build_mesh

__all__ = [
    "DistEnv", "init_distributed", "destroy_distributed", "ParallelDims", "build_mesh",
    "apply_ac", "apply_compile", "apply_fsdp", "parallelize_blocks", "clip_grad_norm_",
    "apply_ep", "expert_parameters",
]
