"""Distributed checkpoints for exact resume, safe against crashes, full disks and corrupt files.

Layout: `<output_dir>/checkpoints/step_<N>/` holding a torch.distributed.checkpoint (DCP) of the
sharded model + optimizer state, `extra_rank<R>.pt` per rank (scheduler, data-loader position, RNG
states, step), `layout.json` (the settings that decide the parameter names and shapes, checked before a
resume: checkpoint/layout.py) and a `COMPLETE` marker. Only folders with the marker are ever loaded.

Saving step N (`CheckpointManager.save`), every rank in the same order:
1. rank 0 creates `.tmp_step_<N>`; 2. every rank writes its DCP shards and its extra file into it
(fsynced); 3. rank 0 fsyncs the folder, moves an existing complete `step_<N>` to `.trash_step_<N>`,
renames the temporary folder to `step_<N>`, writes the marker (fsynced), deletes the trash and
prunes to `keep_last` (marker first, then the files). After each phase all ranks exchange whether
it worked (an all-gather, not a bare barrier): a failure on any rank — a full disk included — makes
every rank raise the same `CheckpointError` at once, the temporary folder is removed and the
previous checkpoint is left as it was; no rank waits in a collective for the one that failed.
A step this manager already saved is not saved again (the stop signal on a periodic-save step).

At start (`cleanup`, rank 0): leftover `.tmp_step_*` folders and marker-less `step_*` folders of a
crashed save or prune are deleted, and a `.trash_step_<N>` whose replacement never got its marker
is put back as `step_<N>`.

Model and optimizer tensors are checked for NaN / inf when saved (refused: the save fails, the previous
checkpoint stays) and when loaded (a checkpoint with them counts as corrupt: the caller falls back).

Loading unpickles the DCP metadata and the extra files: checkpoints are trusted input. A
`checkpoint.resume` folder (and its files) must be owned by the current user (`check_owned`).
"""
from __future__ import annotations

import logging
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from megatron_vlm.checkpoint.hf import describe_error, replace_dir
from megatron_vlm.checkpoint.layout import write_layout
from megatron_vlm.durable import fsync_dir
from megatron_vlm.finite import check_finite
from megatron_vlm.parallel.master_weights import fp32_view

log = logging.getLogger(__name__)

_STEP_RE = re.compile(r"^step_(\d+)$")
_TMP_RE = re.compile(r"^\.tmp_step_(\d+)$")
_TRASH_RE = re.compile(r"^\.trash_step_(\d+)$")
MARKER = "COMPLETE"


def rng_state() -> dict:
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    npu = _npu_module()
    if npu is not None:
        state["npu"] = npu.get_rng_state()
    return state


def _npu_module():
    """`torch.npu` (registered by torch_npu) when an NPU is usable, else None: its generator drives the LoRA /
    model dropout of an NPU run, so a resume must restore it as the CUDA one is."""
    npu = getattr(torch, "npu", None)
    return npu if npu is not None and npu.is_available() else None


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n[0], n[1].numpy(), *n[2:]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    npu = _npu_module()
    if "npu" in state and npu is not None:
        npu.set_rng_state(state["npu"])


def list_complete(ckpt_root: Path) -> list[tuple[int, Path]]:
    out = []
    if ckpt_root.is_dir():
        for p in ckpt_root.iterdir():
            m = _STEP_RE.match(p.name)
            if m and (p / MARKER).is_file():
                out.append((int(m.group(1)), p))
    return sorted(out)


def _why_not(path: Path) -> str:
    """Why `path` is not a checkpoint, naming the one meant when it is a run or checkpoints folder."""
    if not path.exists():
        return "it does not exist"
    for root in (path, path / "checkpoints"):
        newest = latest_complete(root)
        if newest is not None:
            return f"no {MARKER} marker; it holds checkpoints: name one, e.g. {newest}, or set checkpoint.resume = \"auto\""
    return f"no {MARKER} marker"


def latest_complete(ckpt_root: Path) -> Optional[Path]:
    done = list_complete(ckpt_root)
    return done[-1][1] if done else None


FAILURES = (Exception, CheckpointException)
"""What a save / load step may raise that the ranks report to each other (DCP's CheckpointException,
which carries every rank's error, derives from BaseException, not Exception)."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, or none could be loaded / may be loaded; the message says
    why, on which rank, and what is still intact."""


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def gather_errors(err: Optional[str]) -> list[Optional[str]]:
    """Every rank's error (None: fine), on every rank: how the ranks agree that a phase worked."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [err]
    out: list[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(out, err)
    return out


def first_error(errors: list[Optional[str]]) -> Optional[str]:
    """"rank R: <error>" of the first rank that failed (and how many did), None when none did."""
    bad = [(r, e) for r, e in enumerate(errors) if e]
    if not bad:
        return None
    r, e = bad[0]
    more = f" (and {len(bad) - 1} more rank(s))" if len(bad) > 1 else ""
    return f"rank {r}: {e}{more}"


def check_owned(path: Path) -> None:
    """Refuse a checkpoint folder, or a file directly in it, that the current user does not own:
    loading a checkpoint unpickles its metadata and extra files, so it must be trusted input."""
    getuid = getattr(os, "getuid", None)
    if getuid is None:  # no uids on this platform
        return
    uid = getuid()
    for p in [path, *sorted(path.iterdir())] if path.is_dir() else [path]:
        owner = p.stat().st_uid
        if owner != uid:
            raise CheckpointError(
                f"checkpoint.resume: {p} is owned by uid {owner}, not by the current user (uid {uid}); loading a "
                "checkpoint unpickles its metadata, so only checkpoints you own are loaded (copy it if you trust it)")


def _saved_param_group_count(path: Path) -> int:
    """How many optimizer param groups the checkpoint at `path` holds (from its DCP metadata, no tensor read)."""
    keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    found = [int(m.group(1)) for k in keys if (m := re.match(r"optim\.param_groups\.(\d+)\.", k))]
    return max(found) + 1 if found else 0


def restore_param_groups_by_name(optim_sd: dict, local_groups: list) -> None:
    """After a load: back to this optimizer's own groups (`local_groups`: each group's parameter names), each with
    the hyperparameters of the saved group that holds its parameters. DCP fills a template's groups by position,
    which is wrong whenever the saved groups are not this optimizer's: a pipeline stage's (the saved lists name every
    stage's, merged by hyperparameters), or a one-stage run resuming a pipeline checkpoint whose decayed and
    undecayed groups merged into one (`optimizer.weight_decay = 0`: the same hyperparameters)."""
    saved = optim_sd["param_groups"]
    owner = {n: g for g in saved for n in g["params"]}
    restored = []
    for i, names in enumerate(local_groups):
        # by name only: a group matched by position could take another group's weight decay (a stage holding only
        # the non-decayed group would load the first saved group, the decayed one)
        src = next((owner[n] for n in names if n in owner), None)
        if src is None:
            raise ValueError(f"the checkpoint's optimizer param groups name none of this run's group {i} "
                             f"({names[0] if names else 'empty'}); was it written with other train.train_layers?")
        restored.append({**src, "params": list(names)})
    optim_sd["param_groups"] = restored


class CheckpointManager:
    def __init__(self, output_dir: str | Path, keep_last: int, rank: int):
        self.root = Path(output_dir) / "checkpoints"
        self.keep_last = keep_last
        self.rank = rank
        self.last_saved: Optional[int] = None
        """The step this manager saved last (a second save of it is skipped)."""

    # ---- saving -------------------------------------------------------------------------------

    def save(self, step: int, model: torch.nn.Module, optimizer, extra: dict[str, Any],
             layout: Optional[dict] = None, modules: Optional[dict[str, tuple[torch.nn.Module, Any]]] = None) -> Path:
        """Write `step_<step>` (see the module docstring), with the `layout` record (checkpoint/layout.py)
        when given; raises `CheckpointError` on every rank when any rank failed, with the previous
        checkpoint untouched. `modules`: further (module, optimizer) pairs trained beside the model (PPO's
        critic), saved in the same DCP checkpoint under their name (`<name>.model.*`, `<name>.optim.*`)."""
        final = self.root / f"step_{step}"
        if self.last_saved == step:
            log.info("checkpoint %s was already saved by this run: not saving it again", final)
            return final
        tmp = self.root / f".tmp_step_{step}"
        err = None
        if self.rank == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                if tmp.exists():
                    shutil.rmtree(tmp)
                tmp.mkdir()
            except FAILURES as e:  # reported to every rank below
                err = describe_error(e)
        self._agree(step, "creating the temporary folder", err, tmp)
        err = None
        try:
            with fp32_view(model, writes=False):  # parallel.fsdp = false: the fp32 masters under the parameters' names
                self._save_state(tmp, step, model, optimizer, extra, layout, modules)
        except FAILURES as e:
            err = describe_error(e, folder=tmp)
        self._agree(step, "writing shards", err, tmp)
        err = None
        if self.rank == 0:
            try:
                replace_dir(tmp, final, self.root / f".trash_step_{step}", marker=MARKER, marker_text=f"step={step}\n",
                            is_complete=lambda p: (p / MARKER).is_file())
            except FAILURES as e:
                err = describe_error(e)
            else:
                self._prune(final)
        self._agree(step, "committing", err, tmp)
        self.last_saved = step
        log.info("saved checkpoint %s", final)
        return final

    def _save_state(self, tmp: Path, step: int, model: torch.nn.Module, optimizer, extra: dict[str, Any],
                    layout: Optional[dict], modules: Optional[dict[str, tuple[torch.nn.Module, Any]]]) -> None:
        """`save`'s writing: the DCP shards, this rank's extra file, the layout record."""
        unstepped = [o for o in (optimizer, *(o for _, o in (modules or {}).values())) if o is not None and not o.state]
        model_sd, optim_sd = get_state_dict(model, optimizer)
        if hasattr(model, "optim_state_dict_for_save"):  # parallel.pp > 1 (parallel/pipeline.py)
            optim_sd = model.optim_state_dict_for_save(optim_sd)
        # a non-finite tensor is never saved: the previous (good) checkpoint must not be pruned for it
        check_finite({"model": model_sd, "optim": optim_sd.get("state", {})}, f"refusing to save step_{step}")
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        for name, (module, module_optim) in (modules or {}).items():
            m_sd, o_sd = get_state_dict(module, module_optim)
            check_finite({name: m_sd, f"{name} optimizer": o_sd.get("state", {})}, f"refusing to save step_{step}")
            state[name] = {"model": m_sd, "optim": o_sd}
        undo_state_init_step(unstepped)
        dcp.save(state, checkpoint_id=str(tmp))
        extra_file = tmp / f"extra_rank{self.rank}.pt"
        with open(extra_file, "wb") as f:
            torch.save({**extra, "rng": rng_state(), "step": step}, f)
            f.flush()
            os.fsync(f.fileno())
        if layout is not None and self.rank == 0:
            write_layout(tmp, layout)

    def _agree(self, step: int, phase: str, err: Optional[str], tmp: Path) -> None:
        """All ranks learn whether `phase` worked everywhere; if not, every rank raises the same error."""
        failed = first_error(gather_errors(err))
        if failed is None:
            return
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        prev = latest_complete(self.root)
        intact = (f"the previous checkpoint {prev} is intact" if prev is not None
                  else "there is no earlier complete checkpoint")
        raise CheckpointError(f"saving checkpoint step_{step} failed while {phase} on {failed}; {intact}")

    def _prune(self, just_saved: Path) -> None:
        """Keep the `keep_last` newest complete checkpoints (and the one just saved): each older one
        loses its marker first (so a crash mid-delete leaves nothing that looks complete)."""
        if self.keep_last <= 0:
            return
        done = list_complete(self.root)
        for _, p in done[: -self.keep_last]:
            if p == just_saved:
                continue
            try:
                (p / MARKER).unlink(missing_ok=True)
                fsync_dir(p)
            except OSError as e:
                log.warning("could not prune %s: %s", p, describe_error(e))
                continue
            shutil.rmtree(p, ignore_errors=True)

    # ---- start of a run -----------------------------------------------------------------------

    def cleanup(self) -> None:
        """At start, on rank 0 (all ranks call it): delete what crashed saves / prunes left behind and
        put back a complete checkpoint that a crash left under its trash name. Never raises."""
        if self.rank == 0 and self.root.is_dir():
            for p in sorted(self.root.iterdir()):
                try:
                    self._cleanup_one(p)
                except OSError as e:
                    log.warning("checkpoint cleanup: could not tidy %s: %s", p, describe_error(e))
        _barrier()

    def _cleanup_one(self, p: Path) -> None:
        m = _TRASH_RE.match(p.name)
        if m:
            final = self.root / f"step_{m.group(1)}"
            if (p / MARKER).is_file() and not (final / MARKER).is_file():
                if final.exists():
                    shutil.rmtree(final)
                os.replace(p, final)
                fsync_dir(self.root)
                log.warning("checkpoint cleanup: restored %s (a crash interrupted its replacement)", final)
            else:
                shutil.rmtree(p)
            return
        if _TMP_RE.match(p.name) or (_STEP_RE.match(p.name) and p.is_dir() and not (p / MARKER).is_file()):
            shutil.rmtree(p)
            log.warning("checkpoint cleanup: removed %s (left by an interrupted save)", p)

    # ---- resume -------------------------------------------------------------------------------

    def resume_candidates(self, resume: str) -> list[Path]:
        """The checkpoints to try, in order: none for "none"; for "auto" every complete one under
        `checkpoints/`, newest first; else the named folder, which must be complete. Each must be
        owned by the current user (`check_owned`). Raises `CheckpointError`."""
        if resume == "none":
            return []
        if resume == "auto":
            paths = [p for _, p in reversed(list_complete(self.root))]
        else:
            p = Path(resume)
            if not (p / MARKER).is_file():
                raise CheckpointError(f"checkpoint.resume: {p} is not a complete checkpoint ({_why_not(p)})")
            paths = [p]
        for p in paths:
            check_owned(p)
        return paths

    def _rename_aside(self, checkpoints: list[tuple[int, Path]], prefix: str) -> list[Path]:
        """Rename each (step, folder) of this run's `checkpoints/` to `<prefix><step>` (a time stamp added where that
        name is taken), fsynced; the new paths. Rank 0 only."""
        moved: list[Path] = []
        for n, p in checkpoints:
            target = self.root / f"{prefix}{n}"
            if target.exists():
                target = self.root / f"{prefix}{n}_{time.strftime('%Y%m%d%H%M%S')}"
            os.replace(p, target)
            moved.append(target)
        if moved:
            fsync_dir(self.root)
        return moved

    def set_aside_newer(self, loaded: Path, step: int) -> list[Path]:
        """After an explicit resume from `loaded` at `step` (a checkpoint of this run's `checkpoints/` folder, or of
        another run's): the complete checkpoints of this folder at later steps belong to a run this one abandons (a
        rewind; or an earlier attempt started from `loaded`, killed, and started again by the same command: its
        later checkpoints would otherwise be overwritten one by one, or loaded by `resume = "auto"` after a crash
        in place of this run's own). Rank 0 renames them `.abandoned_step_<N>` (kept, never loaded or pruned) and
        says how to continue them instead. Collective; returns the new paths (rank 0)."""
        moved: list[Path] = []
        if self.rank == 0:
            moved = self._rename_aside([(n, p) for n, p in list_complete(self.root) if n > step], ".abandoned_step_")
            if moved:
                log.warning("resumed from %s (step %d), as checkpoint.resume says: the later checkpoints of this run "
                            "folder were set aside as %s (delete them when not needed; to continue them instead, move "
                            "them back as step_<N> and set checkpoint.resume = \"auto\")", loaded, step,
                            ", ".join(str(m) for m in moved))
        _barrier()
        return moved

    def set_aside_unloadable(self, failed: list[Path], loaded: Path) -> list[Path]:
        """After `resume = "auto"` fell back past the complete checkpoints `failed` (they did not load: corrupt,
        truncated) to `loaded`: rank 0 renames them `.unloadable_step_<N>` (kept for inspection, never loaded or
        pruned). Left in place they counted toward `keep_last`, so the run kept one good checkpoint fewer than asked
        until it saved their steps again, and every later start tried them first. Collective; the new paths (rank 0)."""
        moved: list[Path] = []
        if self.rank == 0:
            steps = [(_STEP_RE.match(p.name), p) for p in failed]
            moved = self._rename_aside([(int(m.group(1)), p) for m, p in steps
                                        if m is not None and p.parent == self.root and p.is_dir()], ".unloadable_step_")
            if moved:
                log.warning("resumed from %s: the newer checkpoints that did not load were set aside as %s (kept for "
                            "inspection, never loaded or counted by checkpoint.keep_last; delete them when not needed)",
                            loaded, ", ".join(str(m) for m in moved))
        _barrier()
        return moved

    def resolve_resume(self, resume: str) -> Optional[Path]:
        """The first of `resume_candidates` (None: start fresh)."""
        paths = self.resume_candidates(resume)
        return paths[0] if paths else None

    def load(self, path: Path, model: torch.nn.Module, optimizer,
             modules: Optional[dict[str, tuple[torch.nn.Module, Any]]] = None) -> dict:
        """Load `path` into the model and optimizer (and `modules`, as `save` wrote them); the extra file's dict.
        With `parallel.fsdp = false` in bf16 the checkpoint's fp32 weights load into the masters."""
        with fp32_view(model):
            return self._load(path, model, optimizer, modules)

    def _load(self, path: Path, model: torch.nn.Module, optimizer,
              modules: Optional[dict[str, tuple[torch.nn.Module, Any]]] = None) -> dict:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        for name, (module, module_optim) in (modules or {}).items():
            m_sd, o_sd = get_state_dict(module, module_optim)
            state[name] = {"model": m_sd, "optim": o_sd}
        local_groups = [list(g["params"]) for g in optim_sd.get("param_groups", [])]
        saved_groups = _saved_param_group_count(path) if local_groups else 0
        # parallel.pp > 1 (parallel/pipeline.py: the saved groups are every stage's), or another group count
        by_name = bool(saved_groups) and (hasattr(model, "optim_state_dict_for_save") or saved_groups != len(local_groups))
        if by_name:
            # DCP fills the template's groups by position: give it as many as were saved, so each comes back, and
            # this optimizer takes its own by parameter name
            template = {k: v for k, v in optim_sd["param_groups"][0].items() if k != "params"}
            groups = optim_sd["param_groups"][:saved_groups]
            optim_sd["param_groups"] = groups + [{**template, "params": []} for _ in range(saved_groups - len(groups))]
        dcp.load(state, checkpoint_id=str(path))
        # flipped bytes can make NaN / 3.4e38 without breaking the format: a corrupt checkpoint (the caller falls back)
        check_finite({"model": state["model"], "optim": state["optim"].get("state", {})}, f"{path}")
        for name, (module, module_optim) in (modules or {}).items():
            check_finite({name: state[name]["model"], f"{name} optimizer": state[name]["optim"].get("state", {})}, f"{path}")
            set_state_dict(module, module_optim, model_state_dict=state[name]["model"],
                           optim_state_dict=state[name]["optim"])
        if by_name:
            restore_param_groups_by_name(state["optim"], local_groups)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        extra_file = path / f"extra_rank{self.rank}.pt"
        if not extra_file.is_file() and not (path / "extra_rank0.pt").is_file():
            also = "" if self.rank == 0 else " and extra_rank0.pt"
            raise FileNotFoundError(f"{extra_file}{also} missing")
        if not extra_file.is_file():
            # written by fewer processes: the scheduler, step and data position are global (the data state holds
            # the global pack count), and every rank of a fresh run starts from the same RNG seed, so rank 0's
            # file is what this rank would have had
            extra_file = path / "extra_rank0.pt"
            log.info("checkpoint %s was written by fewer processes: rank %d resumes from %s", path, self.rank, extra_file)
        extra = torch.load(extra_file, weights_only=True)
        set_rng_state(extra["rng"])
        return extra


def undo_state_init_step(optimizers: list) -> None:
    """The step count of optimizers whose state torch's `get_state_dict` has just made (they had none: no step yet,
    e.g. PPO's policy during `rl.critic.warmup_steps`) back to 0. It makes it by a step with zero gradients at lr 0,
    which leaves the weights and moments at their initial values (zero moments) but counts a step: the first real
    update would then be AdamW's second (another bias correction), and saving a checkpoint would change training.
    The state made (saved as such) is then that of a fresh optimizer."""
    for optimizer in optimizers:
        for param_state in optimizer.state.values():
            step = param_state.get("step")
            if torch.is_tensor(step):
                step.zero_()
        getattr(optimizer, "sync_steps", lambda: None)()  # an optimizer that mirrors the counts on the host


def full_model_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Gathered, CPU, unsharded model state dict (on every rank; used for HF export; the fp32 masters under
    `parallel.fsdp = false`)."""
    with fp32_view(model, writes=False):
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
