"""DPO set-up pieces used by `megatron_vlm.jobs.run_dpo`: the loaders of the pairs and the reference.

Order matters for the reference: `build_reference` runs after the model bundle is built and before
the checkpoint is resumed, so that a precomputed reference (and, with `[lora]`, the adapters-off
reference) is scored from the initial weights even in a resumed run.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from megatron_vlm.data.bad_records import BadRecordLog
from megatron_vlm.data.data_files import file_signature
from megatron_vlm.data.preference_loader import build_preference_dataloader, build_preference_pass_loader
from megatron_vlm.parallel.precision import compute_dtype, mixed_param_dtype
from megatron_vlm.training.context import RunContext
from megatron_vlm.training.dpo.config import DPOConfig, check_dpo_keys
from megatron_vlm.training.dpo.losses import REFERENCE_FREE
from megatron_vlm.training.dpo.reference import AdaptersOffReference, FrozenReference, PrecomputedReference
from megatron_vlm.training.model_bundle import ModelBundle

__all__ = ["dpo_section", "build_pair_loaders", "build_reference", "leave_out_unscored"]

log = logging.getLogger("megatron_vlm")


def dpo_section(cfg) -> DPOConfig:
    """The run's `[dpo]` section (its defaults when the config has none)."""
    return cfg.dpo if getattr(cfg, "dpo", None) is not None else DPOConfig()


def _dp(ctx: RunContext, bundle: ModelBundle) -> tuple[int, int]:
    return getattr(bundle.dims, "dp_rank", ctx.env.rank), bundle.dims.dp_size  # the tp ranks of a group read the same


def build_pair_loaders(ctx: RunContext, bundle: ModelBundle, bad_records: BadRecordLog):
    """(endless train loader, one-pass eval loader or None)."""
    cfg = ctx.cfg
    rank, size = _dp(ctx, bundle)
    train = build_preference_dataloader(cfg.data, bundle.processor, seed=cfg.train.seed, dp_rank=rank, dp_size=size,
                                        split="train", bad_records=bad_records,
                                        split_over_ranks=True)  # every rank builds it: 1 / world of the lengths each
    evaluation = build_preference_pass_loader(cfg.data, bundle.processor, split="eval", dp_rank=rank, dp_size=size,
                                              bad_records=bad_records)
    return train, evaluation


def _weight_files(folder: Path) -> list[dict]:
    """Signatures (path, size, modification time) of a model folder's config and weight files."""
    if not folder.is_dir():
        return []
    return [file_signature(f) for f in sorted(folder.iterdir())
            if f.is_file() and (f.name == "config.json" or f.suffix in (".safetensors", ".bin"))]


def initial_model_identity(cfg) -> str:
    """What the precomputed reference was scored with: the model folder and its config / weight files (sizes and
    modification times: a folder exported again at the same path is scored again), and with `lora.init_from` the
    adapter (its folder, mode and files), so another starting adapter is scored again."""
    identity: dict = {"model": cfg.model.path, "model_files": _weight_files(Path(cfg.model.path))}
    lora = getattr(cfg, "lora", None)
    if lora is not None and lora.init_from:
        folder = Path(lora.init_from)
        files = sorted(folder.rglob("*")) if folder.is_dir() else [folder]
        identity.update({"init_from": lora.init_from, "mode": lora.init_from_mode,
                         "files": [file_signature(f) for f in files if f.is_file()]})
    return json.dumps(identity)


def leave_out_unscored(reference: PrecomputedReference, loaders: dict) -> None:
    """Pairs a pack plans but the reference pass did not score (it failed there: a transient read error, a pack it
    could not join) have no reference log-prob: every later pack of their split skips them, counted in
    bad_records.json, instead of training them against 0. The train pass loader shares the training loader's
    dataset, so telling it tells both."""
    for split, loader in loaders.items():
        missing = reference.unscored(split, loader.planned_lengths)
        if missing:
            log.warning("dpo: %d %s pairs were not scored by the reference pass (see bad_records.json); they are left "
                        "out of training and evaluation", len(missing), split)
            why = ("reference_unscored", "the precomputed reference pass could not score this pair (it failed there); "
                   "without a reference log-prob it is not trained or evaluated")
            loader.dataset.leave_out(dict.fromkeys(missing, why))


def build_reference(ctx: RunContext, bundle: ModelBundle, dpo: DPOConfig, train_loader, eval_loader):
    """The reference of `[dpo] reference` (training/dpo/reference.py); None for a reference-free loss."""
    cfg, env = ctx.cfg, ctx.env
    if dpo.loss_type in REFERENCE_FREE:
        return None
    lora = getattr(cfg, "lora", None)
    if dpo.reference == "precomputed":
        rank, size = _dp(ctx, bundle)
        loaders = {"train": build_preference_pass_loader(cfg.data, bundle.processor, split="train", dp_rank=rank,
                                                         dp_size=size, like=train_loader)}
        if eval_loader is not None:
            loaders["eval"] = eval_loader
        reference = PrecomputedReference.load_or_compute(ctx.run_dir, bundle.wrapper, loaders, device=env.device,
                                                         copies=getattr(bundle.dims, "data_copies", 1),
                                                         is_main=env.is_main, model_path=initial_model_identity(cfg),
                                                         stop=lambda: ctx.stop.should_stop(env.device))
        leave_out_unscored(reference, loaders)
        return reference
    if lora is not None:
        check_dpo_keys(dpo, lora)  # lora.init_from continued: not the adapters-off policy (the config checks refuse it)
        return AdaptersOffReference(bundle.wrapper, bundle.model)
    dtype = compute_dtype(cfg.train.precision, getattr(torch, cfg.model.dtype), env.device)
    log.info("dpo: frozen reference model loaded from %s (%s)", cfg.model.path, dtype)
    return FrozenReference(cfg.model.path, dtype=dtype, device=env.device,
                           param_dtype=mixed_param_dtype(cfg.train.precision, env.device))
