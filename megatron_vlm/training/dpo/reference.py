"""Reference log-probs of a DPO run: the frozen initial model, scored on the fly or precomputed once.

- `FrozenReference`: a frozen copy of `model.path` (full fine-tuning), unsharded on every rank in the
  compute dtype, scoring each packed batch in the step (`dpo.reference = "on_the_fly"`);
- `AdaptersOffReference`: with `[lora]` the initial model is the policy with its adapters switched off
  (B = 0 at the start), so the policy's own (sharded) forward scores it: no second copy;
- `PrecomputedReference`: one pass over the train (and held-out) pairs before the first step, scored by
  the policy while it still holds the initial weights (before a checkpoint is resumed), summed per response
  and kept as a [pairs, 2] table per split in `<output_dir>/dpo_reference_logps.pt`; a later start of the
  same run reads the file back instead of scoring again (scored again when the split sizes, the rows the packs
  hold and their lengths, the data files / synthetic seed, or the model folder and its weight files differ). The table also records
  which rows the pass scored: a pair that failed there (a transient read error, or a pack it could not join)
  has no reference, so the loaders leave it out of every later pack and count it (`unscored`), rather than
  train it against a reference log-prob of 0.

Every kind answers `pair_logps(batch, split)` -> (reference log p of each chosen, of each rejected
response) of a pack (`pair_index` keys the precomputed table).
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np
import torch

from megatron_vlm.models.common.lora import lora_disabled
from megatron_vlm.parallel.collectives import all_reduce_, barrier
from megatron_vlm.training.dpo.sequence import pair_sums
from megatron_vlm.training.lm_loss import TokenLogprobModel

__all__ = ["FrozenReference", "AdaptersOffReference", "PrecomputedReference", "REFERENCE_FILE"]

log = logging.getLogger("megatron_vlm")

REFERENCE_FILE = "dpo_reference_logps.pt"


class FrozenReference:
    def __init__(self, path: str, *, dtype: torch.dtype, device: torch.device):
        from megatron_vlm.checkpoint.hf import load_hf_model

        model = load_hf_model(path, dtype=dtype, device="cpu").eval().requires_grad_(False)
        self.scorer = TokenLogprobModel(model).to(device)

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
        idx = batch["pair_index"].to("cpu")
        rows = self.tables[split][idx].to(device=batch["input_ids"].device, dtype=torch.float32)
        return rows[:, 0], rows[:, 1]

    @classmethod
    def load_or_compute(cls, run_dir: Path, wrapper: torch.nn.Module, loaders: dict, *, device: torch.device,
                        copies: int, is_main: bool, model_path: str) -> PrecomputedReference:
        """Read `run_dir/REFERENCE_FILE` when it holds tables of the same splits and sizes, else score every
        pair of `loaders` (split -> one-pass loader) with `wrapper` (the initial weights) and write the file."""
        path = Path(run_dir) / REFERENCE_FILE
        sizes = {split: int(ld.num_pairs) for split, ld in loaders.items()}
        plans = {split: _plan_digest(ld) for split, ld in loaders.items()}
        if path.is_file():
            saved = torch.load(path, map_location="cpu", weights_only=True)
            if saved.get("sizes") == sizes and saved.get("model") == model_path and saved.get("plans") == plans \
                    and isinstance(saved.get("scored"), dict):
                log.info("dpo: reference log-probs read from %s (%s pairs)", path, sizes)
                return cls(dict(saved["tables"]), dict(saved["scored"]))
            log.warning("dpo: %s was computed for other data, another packing plan or another model, or does not say "
                        "which pairs it scored (%s); scoring again", path, saved.get("sizes"))
        tables, scored = {}, {}
        was_training = wrapper.training
        wrapper.eval()
        try:
            with torch.no_grad():
                for split, loader in loaders.items():
                    # columns: chosen, rejected, how many times the row was scored (once per data copy)
                    table = torch.zeros(sizes[split], 3, dtype=torch.float64, device=device)
                    for pack in loader:
                        batch = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in pack.items()}
                        chosen, rejected = pair_sums(wrapper(batch).float(), batch)[:2]
                        idx = batch["pair_index"]
                        table[idx, 0] += chosen.double()
                        table[idx, 1] += rejected.double()
                        table[idx, 2] += 1.0
                    table = (all_reduce_(table) / copies).cpu()
                    tables[split], scored[split] = table[:, :2].contiguous(), table[:, 2] > 0
        finally:
            wrapper.train(was_training)
        if is_main:
            tmp = path.with_name(f".{path.name}.tmp")
            torch.save({"tables": tables, "scored": scored, "sizes": sizes, "model": model_path, "plans": plans}, tmp)
            tmp.replace(path)
            log.info("dpo: reference log-probs of %s pairs precomputed into %s", sizes, path)
        barrier()
        return cls(tables, scored)
