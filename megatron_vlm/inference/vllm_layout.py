"""Which ranks of a GRPO job run vLLM engines, and with which vLLM executor.

Why its own module: the job (`vllm_engine_for_run`) and `--check` (plan/check.py) refuse the same
layouts with the same key, and neither may import vllm to decide.

Synchronous GRPO with `rollout_backend = "vllm"`: every rank runs its own in-process engine on its share
of the step's prompts (rl/rounds.py deals them by data-parallel rank). In a job of one process that is
vLLM's "uni" executor; with several processes it is vLLM's "external_launcher" executor (the one made for
torchrun): vLLM then builds its groups inside the job's torch.distributed world instead of starting a
process group of its own on a free port, and lays the ranks out as (independent engines) x
`rl.vllm.tensor_parallel_size`, the tensor-parallel ranks innermost: consecutive ranks, as the trainer's
`parallel.tp` groups. Every rank of a vLLM tensor-parallel group must send the same requests in the same
order; the trainer's tp groups hold the same prompts and the same sampling generator, so the engine's
tensor-parallel size is the trainer's (`parallel.tp`). Context, expert and pipeline parallel layouts give
the ranks of a group other shares of the work than vLLM's groups expect: refused (exit 2) for now.
"""
from __future__ import annotations

from typing import Any, Optional

__all__ = ["vllm_layout_refusal", "vllm_executor"]


def vllm_executor(world_size: int) -> str:
    """vLLM's `distributed_executor_backend` for a synchronous job of `world_size` processes."""
    return "uni" if world_size <= 1 else "external_launcher"


def vllm_layout_refusal(cfg: Any, world_size: int) -> Optional[tuple[str, str]]:
    """(config key, why) when the vLLM back end cannot run this job's layout; None when it can (or when
    the job does not use vLLM)."""
    rl = getattr(cfg, "rl", None)
    if rl is None or rl.rollout_backend != "vllm":
        return None
    tp = rl.vllm.tensor_parallel_size
    if rl.allocation is not None:  # asynchronous: each rollout rank runs its own engine (rl/asynchronous)
        if tp > 1:
            return ("rl.vllm.tensor_parallel_size", f"{tp}: the asynchronous loop's rollout ranks each run their own "
                    "engine (one worker each); only 1 is supported with rl.allocation")
        return None
    par = cfg.parallel
    for key in ("cp", "ep", "pp"):
        if getattr(par, key) > 1:
            return (f"parallel.{key}", f"{getattr(par, key)} with rollout_backend = 'vllm': each rank runs its own vLLM "
                    "engine on its data shard, and this layout's groups share work in ways the engines do not follow yet; "
                    f"set parallel.{key} = 1 or use rollout_backend = 'builtin'")
    if tp != par.tp:
        return ("rl.vllm.tensor_parallel_size", f"{tp}: the vLLM engine shards over the trainer's tensor-parallel group "
                f"(its ranks hold the same prompts), so it must equal parallel.tp = {par.tp}")
    if world_size % tp:
        return ("rl.vllm.tensor_parallel_size", f"{tp} does not divide the job's {world_size} processes")
    return None
