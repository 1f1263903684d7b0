"""Distributed checkpoints for exact resume.

Layout: `<output_dir>/checkpoints/step_<N>/` holding a torch.distributed.checkpoint (DCP) of the
sharded model + optimizer state, `extra_rank<R>.pt` per rank (scheduler, data-loader position, RNG
states, step) and a `COMPLETE` marker. A checkpoint is written to `.tmp_step_<N>`, all ranks
barrier, rank 0 renames it and writes the marker last — so a crash at any moment leaves either a
complete checkpoint or one that `latest_complete` ignores. `keep_last` prunes older complete ones.
"""
from __future__ import annotations

import logging
import random
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

log = logging.getLogger(__name__)

_STEP_RE = re.compile(r"^step_(\d+)$")
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
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n[0], n[1].numpy(), *n[2:]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def list_complete(ckpt_root: Path) -> list[tuple[int, Path]]:
    out = []
    if ckpt_root.is_dir():
        for p in ckpt_root.iterdir():
            m = _STEP_RE.match(p.name)
            if m and (p / MARKER).is_file():
                out.append((int(m.group(1)), p))
    return sorted(out)


def latest_complete(ckpt_root: Path) -> Optional[Path]:
    done = list_complete(ckpt_root)
    return done[-1][1] if done else None


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


class CheckpointManager:
    def __init__(self, output_dir: str | Path, keep_last: int, rank: int):
        self.root = Path(output_dir) / "checkpoints"
        self.keep_last = keep_last
        self.rank = rank

    def save(self, step: int, model: torch.nn.Module, optimizer, extra: dict[str, Any]) -> Path:
        final = self.root / f"step_{step}"
        tmp = self.root / f".tmp_step_{step}"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        _barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
        torch.save({**extra, "rng": rng_state(), "step": step}, tmp / f"extra_rank{self.rank}.pt")
        _barrier()
        if self.rank == 0:
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            (final / MARKER).write_text(f"step={step}\n")
            self._prune()
        _barrier()
        log.info("saved checkpoint %s", final)
        return final

    def _prune(self) -> None:
        if self.keep_last <= 0:
            return
        done = list_complete(self.root)
        for _, p in done[: -self.keep_last]:
            shutil.rmtree(p, ignore_errors=True)

    def resolve_resume(self, resume: str) -> Optional[Path]:
        if resume == "none":
            return None
        if resume == "auto":
            return latest_complete(self.root)
        p = Path(resume)
        if not (p / MARKER).is_file():
            raise FileNotFoundError(f"checkpoint.resume: {p} is not a complete checkpoint (no {MARKER} marker)")
        return p

    def load(self, path: Path, model: torch.nn.Module, optimizer) -> dict:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        extra_file = path / f"extra_rank{self.rank}.pt"
        if not extra_file.is_file():
            raise FileNotFoundError(
                f"{extra_file} missing: the checkpoint was written by a different number of processes"
            )
        extra = torch.load(extra_file, weights_only=True)
        set_rng_state(extra["rng"])
        return extra


def full_model_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Gathered, CPU, unsharded model state dict (on every rank; used for HF export)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
