"""The expert-parallel rollout copy (`rl.rollout.weights = "expert_parallel"`): dense weights whole, experts sharded.

Why: a 30B-A3B MoE policy (Qwen3-VL-30B-A3B, Nemotron-3-Nano-30B-A3B) does not fit as a whole copy on
one 80 GB device next to its optimizer ("copy"), and generating through the FSDP-sharded trainer
("shared") all-gathers every block for every decoded token. Most of such a model is routed experts
(~29 of 31 B parameters), and the trainer already holds them sharded over the expert-parallel group
(`parallel.ep`, parallel/expert_parallel.py). So the rollout copy of a rank holds:

* every dense (non-expert) weight unsharded (attention, norms, routers, shared experts, embeddings,
  the vision tower), in the compute dtype: ~2 B parameters, ~4 GiB in bf16;
* only this rank's routed experts, exactly the slice the trainer holds under the same ep layout:
  E / ep of every MoE block (~3.6 B parameters per rank at ep = 8, ~7 GiB in bf16).

Decoding then all-gathers no weights: a MoE block sends its tokens to the ranks that hold their
experts and back (in the prefill the same two all-to-alls as the training forward; in static decode steps,
CUDA graphs, an all-gather of the step's rows and a reduce-scatter of the expert outputs, fixed in size:
`ExpertParallelExperts.static_forward`). Every rank of an ep group must therefore make the same forward
calls: the engine runs in lock-step as with "shared" (a rank whose samples are done steps one dummy
row until all ranks are done; `all_ranks_active`), its static steps all of one batch size (the slot count).

Refresh (`ExpertParallelRolloutEngine.load_weights(None, version)`, once per optimizer step): for each
tensor of the copy, in the same order on every rank, the dense ones are gathered from the trainer's
FSDP shards one tensor at a time (`full_tensor()`; never more than one full tensor in flight) and the
expert slices are copied from the trainer's local expert shard (no communication). The copy is built
on the meta device from the model folder's config.json and filled from the trainer, so no rank ever
reads or holds the whole checkpoint.

Not measured yet (no GPU here): the decode step time of a 30B-A3B policy in this mode against
"shared"; to be measured on a GPU at the largest slice that fits one device.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine
from megatron_vlm.models.common.moe import moe_layers
from megatron_vlm.parallel.expert_parallel import ExpertParallelExperts, apply_ep

__all__ = ["ExpertParallelRolloutEngine", "build_ep_rollout_copy", "expert_parallel_group", "refresh_ep_rollout_copy"]

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def expert_parallel_group(model: nn.Module) -> Optional[Any]:
    """The process group the trainer's experts are sharded over (`apply_ep`), or None (no expert parallelism)."""
    for m in model.modules():
        if isinstance(m, ExpertParallelExperts):
            return m.ep_group
    return None


def _clean(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _expert_names(model: nn.Module) -> set[str]:
    """Names of the sharded expert weights of `model` (its `ExpertParallelExperts` modules)."""
    out = set()
    for mod_name, m in model.named_modules():
        if isinstance(m, ExpertParallelExperts):
            for p_name, _ in m.named_parameters(recurse=False):
                out.add(_clean(f"{mod_name}.{p_name}" if mod_name else p_name))
    return out


@torch.no_grad()
def refresh_ep_rollout_copy(copy: nn.Module, trainer: nn.Module) -> None:
    """Copy the trainer's current weights into the rollout copy (module docstring: dense tensors gathered one at a
    time, experts from the local shard). A collective over the trainer's FSDP mesh: every rank calls it together."""
    source: dict[str, torch.Tensor] = {_clean(n): t for n, t in trainer.named_parameters()}
    source.update({_clean(n): t for n, t in trainer.named_buffers()})
    experts_here, experts_there = _expert_names(copy), _expert_names(trainer)
    if experts_here != experts_there:
        raise ValueError("expert-parallel rollout copy: the copy's and the trainer's sharded expert weights differ "
                         f"({sorted(experts_here ^ experts_there)[:4]})")
    targets = {**dict(copy.named_parameters()), **dict(copy.named_buffers())}
    missing = sorted(set(targets) - set(source))
    if missing:
        raise KeyError(f"expert-parallel rollout copy: the trainer has no tensors {missing[:5]}")
    for name, target in targets.items():  # the same order on every rank: the collectives line up
        src = source[name]
        if name in experts_here:
            src = src.to_local() if hasattr(src, "to_local") else src  # this rank's experts: no communication
        elif hasattr(src, "full_tensor"):
            src = src.full_tensor()  # one dense tensor gathered at a time
        if tuple(src.shape) != tuple(target.shape):
            raise ValueError(f"expert-parallel rollout copy: {name} has shape {tuple(src.shape)} in the trainer, "
                             f"{tuple(target.shape)} in the copy (another ep layout?)")
        target.copy_(src.detach().to(device=target.device, dtype=target.dtype))


def build_ep_rollout_copy(trainer: nn.Module, model_path: Union[str, Path], *, dtype: torch.dtype,
                          device: Union[torch.device, str], ep_group: Any) -> nn.Module:
    """The family model of `model_path`'s config.json, its routed experts sharded over `ep_group` as the trainer's
    are (`apply_ep` with the ProcessGroup: plain local slices), materialised on `device` in `dtype` and filled
    from `trainer` (`refresh_ep_rollout_copy`; a collective)."""
    from megatron_vlm.checkpoint.hf import read_hf_config
    from megatron_vlm.models.registry import get_family

    path = Path(model_path)
    hf_config = read_hf_config(path)
    family = get_family(str(hf_config.get("model_type")))
    args = family.args_cls.from_hf_config(hf_config)  # type: ignore[attr-defined]
    with torch.device("meta"):
        model = family.model_cls(args, hf_config=hf_config)
    layers = moe_layers(model)
    if not layers:
        raise ValueError("rl.rollout.weights: 'expert_parallel' needs a MoE policy; this model has no MoE blocks")
    apply_ep(layers, ep_group)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.tie_weights()
    gen = path / "generation_config.json"
    if gen.is_file():
        model.hf_generation_config = json.loads(gen.read_text())
    refresh_ep_rollout_copy(model, trainer)
    return model.eval().requires_grad_(False)


class ExpertParallelRolloutEngine(PolicyRolloutEngine):
    """`PolicyRolloutEngine` over an expert-parallel rollout copy: lock-step (the token exchanges of the MoE
    blocks need every rank of the ep group in step), refreshed from the trainer at `load_weights(None, ...)`."""

    def __init__(self, model: nn.Module, tokenizer: Any, options: EngineOptions, *, trainer: nn.Module,
                 all_ranks_active: Callable[[int], Any]):
        super().__init__(model, tokenizer, options, all_ranks_active=all_ranks_active)
        self.trainer = trainer

    def load_weights(self, weights: Optional[Mapping[str, torch.Tensor]] = None, *, version: int) -> None:
        """None: refresh the copy from the trainer (a collective: every rank calls it together). Full tensors by
        name are refused: the copy holds only this rank's experts (the asynchronous loop's push is not wired)."""
        if weights is not None:
            raise ValueError("expert-parallel rollout copy: load_weights takes no full tensors; it refreshes from "
                             "the trainer (load_weights(None, version=...))")
        t0 = time.perf_counter()
        with self._step_lock:
            refresh_ep_rollout_copy(self.model, self.trainer)
        self.weight_sync_s += time.perf_counter() - t0
        super().load_weights(None, version=version)

    @property
    def refreshes_from_trainer(self) -> bool:
        """`load_weights(None, ...)` refreshes the copy from the trainer (`refresh_ep_rollout_copy`)."""
        return True
