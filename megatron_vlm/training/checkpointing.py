"""Checkpoints of a training run, as the loop uses them: resume (`checkpoint.resume`), save at a
step with the loop's data state, and the final Hugging Face export.

A checkpoint holds the model and optimizer (DCP, sharded), and per rank an extra file with the
scheduler state, the data state of the job kind (SFT: the loader position; GRPO: the next step,
seed and prompt count), the RNG states and the step (`checkpoint.manager.CheckpointManager`).
A resume takes the optimizer moments and the schedule position from the checkpoint, but the settings
from the current config (the lr schedule, `optimizer.betas` / `eps` / `weight_decay`, the critic's lr);
a changed one is logged (training/optim.py).

Failures end the job with one clear line on every rank (`error: ...` on stderr), never silently:
- at start (exit 2): a `checkpoint.resume` folder that is not a complete checkpoint or not owned by
  the current user; a checkpoint written with other layout-defining settings (`parallel.backend`,
  `[lora]`, `lora.r`, the adapted layers, the model and its sizes, the megatron-core tp / ep: checkpoint/layout.py),
  refused before any shard is read with the key, both values and what to do (no fallback to an older
  checkpoint: the settings are the problem, not the file); or no complete checkpoint that loads. With
  `resume = "auto"` a checkpoint that
  fails to load (corrupt, truncated, missing shards) is logged and the previous complete one is
  tried; with none at all the run logs that it starts fresh;
- saving a checkpoint or the Hugging Face export (exit 1): a failure on any rank (a full disk
  included) is agreed by all ranks, and the previous checkpoint / export is left intact.
"""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict
from torch.distributed.tensor import DTensor

from megatron_vlm.checkpoint.export import data_pixel_limits, export_dtype, export_hf_from_state_dict
from megatron_vlm.checkpoint.hf import read_hf_config
from megatron_vlm.checkpoint.layout import (
    LAYOUT_FILE,
    PREDATES,
    adapter_refusal,
    checkpoint_adapters,
    checkpoint_shapes,
    checkpoint_trained,
    layout_refusals,
    read_layout,
    run_adapters,
    run_layout,
    shape_refusal,
    trained_refusal,
)
from megatron_vlm.checkpoint.manager import (
    FAILURES,
    CheckpointError,
    CheckpointManager,
    describe_error,
    first_error,
    full_model_state_dict,
    gather_errors,
    undo_state_init_step,
)
from megatron_vlm.models.common.lora import merged_state_dict
from megatron_vlm.models.mcore.ep_shard import check_saved_mcore_ep, mcore_ep_of
from megatron_vlm.models.mcore.layer import native_state_dict
from megatron_vlm.models.mcore.tp_shard import check_saved_mcore_tp, mcore_tp_of
from megatron_vlm.training.context import RunContext
from megatron_vlm.training.lora import scaling_of, write_adapter
from megatron_vlm.training.optim import OptimState, group_settings, keep_group_settings, load_scheduler_state

__all__ = ["Checkpointer", "ResumePoint", "EXIT_RESUME_FAILED", "EXIT_SAVE_FAILED"]

log = logging.getLogger("megatron_vlm")

EXIT_RESUME_FAILED = 2
"""Exit code when the run cannot start from the checkpoint it is told to (or any, for "auto")."""
EXIT_SAVE_FAILED = 1
"""Exit code when a checkpoint or the Hugging Face export could not be written (e.g. disk full)."""


def _fail(e: CheckpointError, code: int) -> NoReturn:
    """End the job on this rank with one clear line (every rank gets here with the same error)."""
    print(f"error: {e}", file=sys.stderr, flush=True)
    raise SystemExit(code) from e


def _model_type(model_path: str | Path) -> Optional[str]:
    """`model_type` of the model folder's config.json (None when it cannot be read)."""
    try:
        return read_hf_config(model_path).get("model_type")
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class ResumePoint:
    step: int
    """Optimizer steps already taken."""
    data: dict
    """The data state saved with the checkpoint (empty when it has none)."""


class Checkpointer:
    """`modules`: (module, optimizer) pairs trained beside the model, saved and resumed with it under their name
    (PPO's critic: {"critic": (value model, its optimizer)}); a checkpoint without one of them is refused at resume
    (exit 2, naming `rl.<name>`)."""

    def __init__(self, ctx: RunContext, wrapper, optim: OptimState,
                 modules: Optional[dict[str, tuple[Any, Any]]] = None):
        self.modules = dict(modules or {})
        self.cfg = ctx.cfg.checkpoint
        self.model_path = ctx.cfg.model.path
        self.pixel_limits = data_pixel_limits(getattr(ctx.cfg, "data", None))  # the export holds what training used
        self.lora = getattr(ctx.cfg, "lora", None)  # [lora] section, None for full fine-tuning
        self.is_main = ctx.env.is_main
        self.wrapper, self.optim = wrapper, optim
        self.manager = CheckpointManager(ctx.run_dir, self.cfg.keep_last, ctx.env.rank)
        self.mcore_tp = mcore_tp_of(getattr(wrapper, "model", wrapper))  # None: no megatron-core layers
        self.mcore_ep = mcore_ep_of(getattr(wrapper, "model", wrapper))
        self.layout = run_layout(ctx.cfg, model_type=_model_type(self.model_path),
                                 world_size=getattr(ctx.env, "world_size", 1), mcore_tp=self.mcore_tp, mcore_ep=self.mcore_ep)
        """The record saved with each checkpoint and compared at resume (checkpoint/layout.py)."""

    @property
    def enabled(self) -> bool:
        return bool(self.cfg.enable)

    @property
    def export_at_end(self) -> bool:
        """`checkpoint.export_hf`: write `<run>/hf` when the run finishes; a LoRA run always writes its
        adapter (`<run>/adapter`)."""
        return bool(self.cfg.export_hf) or self.lora is not None

    def periodic_due(self, step: int) -> bool:
        """`checkpoint.every_steps` says to save after `step` (the loop skips the final step: saved once at the end)."""
        return self.enabled and bool(self.cfg.every_steps) and step % self.cfg.every_steps == 0

    def resume(self) -> Optional[ResumePoint]:
        """Load the checkpoint `checkpoint.resume` names (auto: the newest complete one that loads)
        into the model, optimizer and scheduler, and restore the RNG states; None when starting fresh.
        Tidies what interrupted saves left first. Exits 2 (`EXIT_RESUME_FAILED`) when it cannot.
        `checkpoint.enable = false` stops writes only: `checkpoint.resume` still reads (a run in a folder with
        checkpoints used to start at step 0 over them, its metrics rows of the earlier run dropped)."""
        try:
            self.manager.cleanup()
            candidates = self.manager.resume_candidates(self.cfg.resume)
        except CheckpointError as e:
            _fail(e, EXIT_RESUME_FAILED)
        if not candidates:
            if self.cfg.resume == "auto":
                aside = sorted(p.name for p in self.manager.root.glob(".abandoned_step_*")) if self.manager.root.is_dir() else []
                if aside:  # set aside by an explicit resume (CheckpointManager.set_aside_newer): never loaded by "auto"
                    log.warning("checkpoint.resume = auto: no complete checkpoint in %s (set aside: %s; move one back as "
                                "step_<N> to continue it); starting fresh at step 0", self.manager.root, ", ".join(aside))
                else:
                    log.info("checkpoint.resume = auto: no complete checkpoint in %s; starting fresh at step 0",
                             self.manager.root)
            return None
        # what this run holds, computed on every rank before any checkpoint is looked at (may be collective)
        lora = self.layout["lora"] is not None
        adapters, trained = (self._adapters(), set()) if lora else (set(), self._trained())
        shapes = self._shapes()
        settings = {name: group_settings(opt) for name, opt in self._optimizers().items()}  # as the config built them
        tried = []
        for i, path in enumerate(candidates):
            err, refused = None, None
            extra: Optional[dict] = None
            try:
                refused = self._layout_refusal(path, adapters, trained, shapes)
            except FAILURES as e:  # an unreadable record or DCP metadata: like a corrupt checkpoint
                err = describe_error(e)
            refusals = [r for r in gather_errors(refused) if r]  # a rank's own adapters may differ (pp)
            if refusals:
                _fail(CheckpointError(refusals[0]), EXIT_RESUME_FAILED)
            if err is None:
                try:
                    extra = self.manager.load(path, self.wrapper, self.optim.optimizer, modules=self.modules)
                    for name, opt in self._optimizers().items():  # the config's betas / eps / weight decay win
                        keep_group_settings(opt, settings[name], name=f"the {name} optimizer's",
                                            scheduled=name == "model")
                    check_saved_mcore_tp(extra, self.mcore_tp)
                    check_saved_mcore_ep(extra, self.mcore_ep)
                    load_scheduler_state(self.optim.scheduler, extra["scheduler"])
                except FAILURES as e:  # a corrupt checkpoint can raise anything
                    err = describe_error(e)
            failed = first_error(gather_errors(err))  # every rank takes the same branch
            if failed is None:
                assert extra is not None  # loaded: no error on any rank
                log.info("Resumed from checkpoint: step=%d (%s)", extra["step"], path)
                self._warn_unloaded_modules(path)
                if self.cfg.resume != "auto":  # a rewind inside this run: its later checkpoints are not this run's
                    self.manager.set_aside_newer(path, int(extra["step"]))
                elif i > 0:  # fell back past newer ones that did not load
                    self.manager.set_aside_unloadable(list(candidates[:i]), path)
                return ResumePoint(step=int(extra["step"]), data=extra.get("data", {}))
            if not (path / LAYOUT_FILE).is_file():
                failed += f" ({PREDATES})"
            tried.append(f"{path}: {failed}")
            nxt = candidates[i + 1] if i + 1 < len(candidates) else None
            log.error("cannot load checkpoint %s (%s)%s", path, failed,
                      f"; falling back to the previous complete checkpoint {nxt}" if nxt else "")
        _fail(CheckpointError(
            "no checkpoint could be loaded (not starting from step 0 over them): " + "; ".join(tried)
            + '. Remove or repair them, or set checkpoint.resume = "none" to start fresh'), EXIT_RESUME_FAILED)

    def _warn_unloaded_modules(self, path: Path) -> None:
        """A checkpoint holding the state of a module this run does not train (a PPO run's critic resumed with
        `rl.advantage = "grpo"`) loads without it; switching may be intended, but the state is then gone from the
        run's next checkpoints, so say so (the reverse, a module without state, is refused in _layout_refusal)."""
        if not self.is_main:
            return
        try:
            keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        except FAILURES:
            return
        left = sorted({k.split(".", 1)[0] for k in keys if k.count(".") >= 2 and k.split(".", 2)[1] in ("model", "optim")}
                      - {"model", "optim"} - set(self.modules))
        if left:
            log.warning("checkpoint %s holds the state of %s, which this run does not train: not loaded, and not in "
                        "this run's checkpoints (resume with the settings that trained it to keep it, e.g. PPO's "
                        "rl.critic)", path, ", ".join(left))

    def _layout_refusal(self, path: Path, adapters: set[str], trained: set[str],
                        shapes: dict[str, tuple[int, ...]]) -> Optional[str]:
        """Why this run (adapted layers `adapters`, or with full fine-tuning the parameters `trained` with optimizer
        state on this rank; its model tensors' global `shapes`) cannot load checkpoint `path` with its settings (None:
        it may try; also for a checkpoint without the layout record). Reads only the record and the DCP metadata."""
        saved = read_layout(path)
        if saved is None:
            log.info("checkpoint %s has no layout record (%s; written before it existed): loading it as it is",
                     path, LAYOUT_FILE)
            return None
        problems = layout_refusals(saved, self.layout, path)
        if not problems and saved.get("parallel.backend") == "mcore" and self.mcore_tp is not None:
            for check, size in ((check_saved_mcore_tp, self.mcore_tp), (check_saved_mcore_ep, self.mcore_ep)):
                try:
                    check(saved, size)
                except ValueError as e:
                    problems.append(f"{e} ({path})")
        if not problems:
            keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
            sized = shape_refusal(saved, self.layout, checkpoint_shapes(keys), shapes, path)
            if sized:
                return sized
            for name in self.modules:  # e.g. a GRPO checkpoint resumed as PPO: no critic to load
                if not any(k.startswith(f"{name}.model.") for k in keys):
                    problems.append(f"rl.{name}: {path} holds no {name} state (written by a run without one); resume "
                                    f"it with the settings it was written with, or start fresh (checkpoint.resume = "
                                    f"'none' or another train.output_dir)")
            if problems:
                return "; ".join(problems)
            refused = (adapter_refusal(saved, self.layout, checkpoint_adapters(keys), adapters, path)
                       if saved.get("lora") is not None
                       else trained_refusal(saved, self.layout, checkpoint_trained(keys), trained, path))
            problems += [refused] if refused else []
        return "; ".join(problems) or None

    def _optimizers(self) -> dict[str, Any]:
        """The optimizers a checkpoint holds state for: the model's, and each of `modules`'."""
        return {"model": self.optim.optimizer, **{name: opt for name, (_, opt) in self.modules.items()}}

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        """This rank's model tensors and their global shapes, under the names a load asks the checkpoint for (a
        DTensor's shape is the global one; a plain tensor is whole only in a one-process run, e.g. a local expert
        slice is not)."""
        whole = not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1
        return {k: tuple(v.shape) for k, v in get_model_state_dict(self.wrapper).items()
                if isinstance(v, torch.Tensor) and (whole or isinstance(v, DTensor))}

    def _trained(self) -> set[str]:
        """The parameters this rank's optimizer holds state for, under the names a load asks the checkpoint for."""
        unstepped = not self.optim.optimizer.state
        optim_state: Any = get_state_dict(self.wrapper, self.optim.optimizer)[1]  # a dict (one optimizer)
        if unstepped:  # the state torch made for the question is a fresh optimizer's (no step counted)
            undo_state_init_step([self.optim.optimizer])
        return set(optim_state.get("state", {}))

    def _adapters(self) -> set[str]:
        """The adapted layers of the whole model (every pipeline stage's): a collective, on every rank."""
        local = sorted(run_adapters(get_model_state_dict(self.wrapper).keys()))
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return set(local)
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, local)
        return {n for names in every for n in names}

    def save(self, step: int, data_state: dict) -> None:
        """Save a checkpoint after `step` steps; exits 1 (`EXIT_SAVE_FAILED`) on every rank when any
        rank could not write it (the previous checkpoint stays intact)."""
        try:
            extra: dict[str, Any] = {"data": data_state, "scheduler": self.optim.scheduler.state_dict()}
            if self.mcore_tp is not None:  # the layout of the megatron-core layers' fc1 rows (tp_shard.py)
                extra["mcore_tp"] = self.mcore_tp
                extra["mcore_ep"] = self.mcore_ep  # and of their expert rows (ep_shard.py)
            self.manager.save(step, self.wrapper, self.optim.optimizer, extra, layout=self.layout, modules=self.modules)
        except CheckpointError as e:
            _fail(e, EXIT_SAVE_FAILED)

    def _stage_native(self, sd: dict) -> dict:
        """One pipeline stage's wrapper state dict with its megatron-core layers under native names."""
        inner = native_state_dict({k[len("model."):]: v for k, v in sd.items() if k.startswith("model.")},
                                  self.wrapper.model)
        return {**{k: v for k, v in sd.items() if not k.startswith("model.")}, **{"model." + k: v for k, v in inner.items()}}

    def export_hf(self, out_dir: Path) -> None:
        """Gather the full weights and write a Hugging Face folder (rank 0; a temporary folder put in
        place when complete). Exits 1 on every rank when it fails (the previous export stays intact)."""
        stages = getattr(self.wrapper, "full_state_dict", None)  # parallel.pp > 1: gathered over the stages
        # each stage converts its own megatron-core layers (the others hold stubs for them) before the gather
        sd = stages(self._stage_native) if stages is not None else full_model_state_dict(self.wrapper)
        err = None
        if self.is_main:
            sd = {k[len("model."):]: v for k, v in sd.items() if k.startswith("model.")}
            sd = native_state_dict(sd, self.wrapper.model)  # parallel.backend = "mcore": back to native names
            try:
                if self.lora is not None:  # the PEFT adapter beside hf/, and hf/ = base + adapter merged
                    hf_config = read_hf_config(self.model_path)
                    adapter_dir = write_adapter(out_dir.parent / "adapter", sd, hf_config, self.lora,
                                                base_model_name_or_path=str(self.model_path))
                    log.info("wrote the LoRA adapter (PEFT format) to %s", adapter_dir)
                    sd = merged_state_dict(sd, scaling_of(self.lora))
                if self.cfg.export_hf:
                    export_hf_from_state_dict(sd, self.model_path, out_dir, dtype=export_dtype(self.cfg),
                                              pixel_limits=self.pixel_limits)
            except FAILURES as e:  # reported to every rank below
                err = describe_error(e)
        failed = first_error(gather_errors(err))  # instead of a barrier: no rank waits on a failed one
        if failed is not None:
            _fail(CheckpointError(f"the Hugging Face export to {out_dir} failed on {failed}; "
                                  "a previous export there (if any) is intact"), EXIT_SAVE_FAILED)
        if self.is_main and self.cfg.export_hf:
            log.info("exported Hugging Face model to %s", out_dir)
