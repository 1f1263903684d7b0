"""Reference log-probs of a DPO run: the frozen initial model, scored on the fly or precomputed once.

- `FrozenReference`: a frozen copy of `model.path` (full fine-tuning), unsharded on every rank in the
  compute dtype, scoring each packed batch in the step (`dpo.reference = "on_the_fly"`);
- `AdaptersOffReference`: with `[lora]` the initial model is the policy with its adapters switched off
  (B = 0 at the start), so the policy's own (sharded) forward scores it: no second copy;
- `PrecomputedReference`: one pass over the train (and held-out) pairs before the first step, scored by
  the policy while it still holds the initial weights (before a checkpoint is resumed), summed per response
  and kept as a [pairs, 2] table per split in `<output_dir>/dpo_reference_logps.pt` (written like a checkpoint
  file: temporary name, fsync, rename, fsync of the folder, so a crash never leaves it cut short); a later start of the
  same run reads the file back instead of scoring again (scored again when the split sizes, the rows the packs
  hold and their lengths, the data files / synthetic seed, or the model folder and its weight files differ). The table also records
  which rows the pass scored: a pair that failed there (a transient read error, or a pack it could not join)
  has no reference, so the loaders leave it out of every later pack and count it (`unscored`), rather than
  train it against a reference log-prob of 0. A stop request (SIGTERM / SIGUSR1) is acted on after the pack in
  scoring: the sums so far go to `<output_dir>/dpo_reference_logps.partial.pt` and the job exits 143 at once; the
  next start of the run (same data, plan, model and ranks) continues after the packs already scored.

Every kind answers `pair_logps(batch, split)` -> (reference log p of each chosen, of each rejected
response) of a pack (`pair_index` keys the precomputed table).
"""
from __future__ import annotations

import copy
import hashlib
import itertools
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from megatron_vlm.durable import write_file_durably
from megatron_vlm.host_copies import on_host
from megatron_vlm.models.common.lora import lora_disabled
from megatron_vlm.models.common.parallel_plan import copy_input_casts
from megatron_vlm.parallel.collectives import all_reduce_, barrier, world_size
from megatron_vlm.training.dpo.sequence import pair_sums
from megatron_vlm.training.lm_loss import TokenLogprobModel

__all__ = ["FrozenReference", "AdaptersOffReference", "PrecomputedReference", "ReferencePassStopped", "REFERENCE_FILE",
           "REFERENCE_PARTIAL_FILE"]

log = logging.getLogger("megatron_vlm")

REFERENCE_FILE = "dpo_reference_logps.pt"
REFERENCE_PARTIAL_FILE = "dpo_reference_logps.partial.pt"
"""What a reference pass stopped by SIGTERM / SIGUSR1 had scored: the next start of the run continues from it."""


class FrozenReference:
    def __init__(self, path: str, *, dtype: torch.dtype, device: torch.device, param_dtype: Optional[torch.dtype] = None):
        """`param_dtype`: the trainer's mixed-precision dtype (`mixed_param_dtype`; None: full precision), whose input
        casts the copy makes too (`copy_input_casts`): it scores what the policy (and `PrecomputedReference`, the
        policy's own pass) scores at the initial weights, bit for bit."""
        from megatron_vlm.checkpoint.hf import load_hf_model

        model = load_hf_model(path, dtype=dtype, device="cpu").eval().requires_grad_(False)
        self.scorer = TokenLogprobModel(model).to(device)
        copy_input_casts(model, param_dtype, root=self.scorer)

    @torch.no_grad()
    def pair_logps(self, batch: dict, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ARG002
        return pair_sums(self.scorer(batch).float(), batch)[:2]


class AdaptersOffReference:
    """The policy's FSDP root with every adapter disabled, in eval mode; collective like the policy's forward."""

    def __init__(self, wrapper: torch.nn.Module, model: torch.nn.Module):
        self.wrapper, self.model = wrapper, model

    @torch.no_grad()
    def pair_logps(self, batch: dict, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ARG002
        was_training = self.wrapper.training
        self.wrapper.eval()
        try:
            with lora_disabled(self.model):
                return pair_sums(self.wrapper(batch).float(), batch)[:2]
        finally:
            self.wrapper.train(was_training)


def _plan_digest(loader) -> str:
    """A digest of the data a split's table was scored on: which rows its packs hold and their lengths
    (`planned_lengths`) and where the pairs come from (`data_identity`: files with size and modification time, or
    the synthetic seed, and the processor's settings); "" for a loader without them.

    Why: the table has a row per data row, but only the rows some pack holds are scored, and a row is looked up by
    its index alone. A restart that plans other rows (a larger `data.max_tokens_per_pack`) or reads other pairs
    under the same indices (an edited data file of the same size) would otherwise take 0, or another pair's
    log-prob, as the reference."""
    planned = getattr(loader, "planned_lengths", None)
    identity = getattr(loader, "data_identity", None)
    if planned is None and identity is None:
        return ""
    h = hashlib.sha256()
    if planned is not None:
        h.update(np.ascontiguousarray(np.asarray(planned, dtype=np.int64)).tobytes())
    h.update(json.dumps(identity, sort_keys=True, default=str).encode())
    return h.hexdigest()


class PrecomputedReference:
    """[pairs, 2] tables of reference log-probs per split, indexed by a pack's `pair_index`; `scored`: [pairs] bool
    per split, the rows the pass scored."""

    def __init__(self, tables: dict[str, torch.Tensor], scored: dict[str, torch.Tensor]):
        self.tables, self.scored = tables, scored

    def unscored(self, split: str, planned_lengths) -> list[int]:
        """The rows of `split` that a pack plans (`planned_lengths` >= 0) but the pass did not score."""
        planned = torch.as_tensor(np.asarray(planned_lengths) >= 0)
        return torch.nonzero(planned & ~self.scored[split].bool()).flatten().tolist()

    def pair_logps(self, batch: dict, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        idx = on_host(batch["pair_index"]).cpu()  # the loader's host copy: no device read
        rows = self.tables[split][idx].to(device=batch["input_ids"].device, dtype=torch.float32, non_blocking=True)
        return rows[:, 0], rows[:, 1]

    @classmethod
    def load_or_compute(cls, run_dir: Path, wrapper: torch.nn.Module, loaders: dict, *, device: torch.device,
                        copies: int, is_main: bool, model_path: str,
                        stop: Callable[[], bool] = lambda: False) -> PrecomputedReference:
        """Read `run_dir/REFERENCE_FILE` when it holds tables of the same splits and sizes, else score every
        pair of `loaders` (split -> one-pass loader) with `wrapper` (the initial weights) and write the file.

        `stop()`: the run's stop request, agreed by every rank (SIGTERM / SIGUSR1: training/signals.py), asked after
        each pack. When it answers True the sums so far are saved to `run_dir/REFERENCE_PARTIAL_FILE` and
        `ReferencePassStopped` is raised (the job exits 143, and is requeued); a restart of the same run (the same
        data, plan, model, ranks) continues the pass after the packs already scored, instead of losing them."""
        path = Path(run_dir) / REFERENCE_FILE
        sizes = {split: int(ld.num_pairs) for split, ld in loaders.items()}
        plans = {split: _plan_digest(ld) for split, ld in loaders.items()}
        if path.is_file():
            try:
                saved = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001 - an unreadable file costs one pass, never a crash at every start
                log.warning("dpo: %s is unreadable (%s: %s); scoring again", path, type(e).__name__, e)
                saved = {}
            if not isinstance(saved, dict):
                saved = {}
            if saved and saved.get("sizes") == sizes and saved.get("model") == model_path and saved.get("plans") == plans \
                    and isinstance(saved.get("scored"), dict):
                log.info("dpo: reference log-probs read from %s (%s pairs)", path, sizes)
                return cls(dict(saved["tables"]), dict(saved["scored"]))
            if saved:
                log.warning("dpo: %s was computed for other data, another packing plan or another model, or does not "
                            "say which pairs it scored (%s); scoring again", path, saved.get("sizes"))
        partial = _Partial(Path(run_dir), {"sizes": sizes, "model": model_path, "plans": plans,
                                           "packs": {split: _num_packs(ld) for split, ld in loaders.items()},
                                           "world": world_size(), "copies": copies})
        done, sums = partial.read()
        tables, scored = {}, {}
        was_training = wrapper.training
        wrapper.eval()
        try:
            with torch.no_grad():
                for split, loader in loaders.items():
                    # columns: chosen, rejected, how many times the row was scored (once per data copy)
                    table = torch.zeros(sizes[split], 3, dtype=torch.float64, device=device)
                    start = done.get(split, 0)
                    for n, pack in enumerate(_after(loader, start), start=start + 1):
                        batch = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in pack.items()}
                        chosen, rejected = pair_sums(wrapper(batch).float(), batch)[:2]
                        idx = batch["pair_index"]
                        table[idx, 0] += chosen.double()
                        table[idx, 1] += rejected.double()
                        table[idx, 2] += 1.0
                        if n < _num_packs(loader) and stop():  # after the last pack the split is done: no save needed
                            sums[split] = _with_saved(all_reduce_(table).cpu(), sums.get(split))
                            partial.write({**done, split: n}, sums, is_main)
                            raise ReferencePassStopped(f"dpo: stop requested during the reference pass; {split} packs "
                                                       f"1-{n} of {_num_packs(loader)} per rank saved to {partial.path}")
                    table = _with_saved(all_reduce_(table).cpu(), sums.get(split))
                    sums[split] = table
                    done[split] = _num_packs(loader)
                    table = table / copies
                    tables[split], scored[split] = table[:, :2].contiguous(), table[:, 2] > 0
        finally:
            wrapper.train(was_training)
        if is_main:
            table_file = {"tables": tables, "scored": scored, "sizes": sizes, "model": model_path, "plans": plans}
            write_file_durably(path, lambda f: torch.save(table_file, f))
            partial.path.unlink(missing_ok=True)
            log.info("dpo: reference log-probs of %s pairs precomputed into %s", sizes, path)
        barrier()
        return cls(tables, scored)


class ReferencePassStopped(Exception):
    """A stop request (SIGTERM / SIGUSR1) arrived during the precomputed reference pass: the packs scored so far are
    saved (`REFERENCE_PARTIAL_FILE`) and the job exits 143 (`EXIT_STOPPED`) at once, without a step."""


def _num_packs(loader) -> int:
    """This rank's packs of a one-pass loader (the same on every rank: the pass loaders pad with empty packs)."""
    return len(loader)


def _after(loader, start: int) -> Iterator[dict]:
    """The loader's packs after its first `start`: a pass loader's keys are cut, so the skipped packs are not read."""
    if start == 0:
        return iter(loader)
    keys = getattr(loader, "keys", None)
    if isinstance(keys, list):
        rest = copy.copy(loader)
        rest.keys = keys[start:]
        return iter(rest)
    return itertools.islice(iter(loader), start, None)


def _with_saved(table: torch.Tensor, saved: Optional[torch.Tensor]) -> torch.Tensor:
    return table if saved is None else table + saved


class _Partial:
    """`REFERENCE_PARTIAL_FILE`: the summed [pairs, 3] tables (chosen, rejected, times scored) of the packs a stopped
    pass scored, per split, and how many packs per rank each split had done. Read back only by a start whose data,
    plan, model and rank layout (`identity`) are the same: each rank then continues after the same packs."""

    def __init__(self, run_dir: Path, identity: dict):
        self.path, self.identity = run_dir / REFERENCE_PARTIAL_FILE, identity

    def read(self) -> tuple[dict[str, int], dict[str, torch.Tensor]]:
        if not self.path.is_file():
            return {}, {}
        try:
            saved = torch.load(self.path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - an unreadable partial file costs the packs it held, nothing more
            log.warning("dpo: ignoring the unreadable partial reference pass %s (%s: %s)", self.path, type(e).__name__, e)
            return {}, {}
        if saved.get("identity") != json.dumps(self.identity, sort_keys=True):
            log.warning("dpo: %s was scored for other data, another plan, model or rank layout; scoring from the "
                        "start", self.path)
            return {}, {}
        done = {k: int(v) for k, v in saved["done"].items()}
        log.info("dpo: reference pass continued from %s (packs per rank already scored: %s)", self.path, done)
        return done, dict(saved["sums"])

    def write(self, done: dict[str, int], sums: dict[str, torch.Tensor], is_main: bool) -> None:
        """Rank 0 writes (atomically and durably, like the complete file); every rank waits for it, so a requeued job
        finds the file."""
        if is_main:
            partial = {"identity": json.dumps(self.identity, sort_keys=True), "done": done, "sums": sums}
            write_file_durably(self.path, lambda f: torch.save(partial, f))
            log.warning("dpo: stop requested during the reference pass: %s saved (packs per rank: %s)", self.path, done)
        barrier()
