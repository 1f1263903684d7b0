"""A fingerprint of the lengths a pack plan is made of, kept in the data state so a resume sees them change.

The pack plan is a function of the records' token lengths (plan.py), and the lengths of the records and of the
settings they are estimated with: the tokenizer and chat template of `model.path`, `data.chat_template_kwargs`, the
image / video size settings, `data.max_frames`, `data.fps`, the media size limits, and the images themselves. A
resume that estimates other lengths from the same records (another processor, another `data.max_pixels`, replaced
images) plans other packs, and the checkpoint's position in its plan points at other samples there: that resume is
refused, naming the settings that differ (`plan_lengths_refusal`), instead of continuing silently in another plan.
The fingerprint is a SHA-256 of the lengths array (8 bytes a record: milliseconds for a million records) with the
usable-record and token counts and the settings' short text (`lengths.planning_settings`). A checkpoint written
before it was recorded resumes unchecked, with one warning per process.
"""
from __future__ import annotations

import hashlib
import logging
import os
from typing import Optional

import numpy as np

__all__ = ["plan_lengths_state", "plan_lengths_refusal", "warn_unrecorded_lengths", "differing_settings"]

log = logging.getLogger("megatron_vlm")

_warned = False


def plan_lengths_state(lengths: np.ndarray, capacity: int, settings: Optional[dict[str, str]]) -> dict:
    """The data state's record of the plan's lengths: digest, usable records and their tokens, the settings."""
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    usable = lengths[(lengths > 0) & (lengths <= capacity)]
    out: dict = {"sha256": hashlib.sha256(lengths.tobytes()).hexdigest()[:32], "usable": int(usable.size),
                 "tokens": int(usable.sum())}
    if settings is not None:
        out["settings"] = dict(settings)
    return out


def differing_settings(saved: dict, now: dict) -> list[str]:
    """'<key>: <then> then, <now> now' for each recorded setting that differs (a digest: 'another one')."""
    old, new = saved.get("settings"), now.get("settings")
    if not isinstance(old, dict) or not isinstance(new, dict):
        return []
    out = []
    for key, value in new.items():
        if key in old and old[key] != value:
            digest = key.startswith("model.path")
            out.append(f"{key}: another than the checkpoint's" if digest else f"{key}: {old[key]} then, {value} now")
    return out


def plan_lengths_refusal(saved: object, now: dict) -> Optional[str]:
    """None when the checkpoint's plan lengths (`saved`, None for a checkpoint written before they were recorded)
    match this run's; else one line (without the ways to start afresh) that starts with the config key to change."""
    if not isinstance(saved, dict) or saved.get("sha256") == now["sha256"]:
        return None
    counts = (f"{saved.get('usable')} usable records of {saved.get('tokens')} tokens in all then, {now['usable']} of "
              f"{now['tokens']} now")
    what = (f"the samples' token lengths differ from the checkpoint's ({counts}), so the pack plan differs and the "
            "checkpoint's data position would point at other samples")
    differing = differing_settings(saved, now)
    if differing:
        lead = differing[0].split(":")[0].split(" (")[0]
        return (f"{lead}: {what}; the settings the lengths are estimated with differ ({'; '.join(differing)}). Set "
                "them as the checkpoint's run had them to resume it")
    if isinstance(saved.get("settings"), dict):
        why = ("the settings the lengths are estimated with are the checkpoint's, so the images or videos the records "
               "read changed (other files at their paths, or ones that were bad then or are bad now)")
    else:
        why = ("another tokenizer or chat template (model.path), data.chat_template_kwargs, image / video size "
               "setting, data.max_frames / data.fps / media limit, or other images or videos")
    return f"data.train_path: {what}: {why}. Restore the checkpoint's data and settings to resume it"


def warn_unrecorded_lengths() -> None:
    """One warning per process (on rank 0) that a checkpoint without the lengths fingerprint resumes unchecked."""
    global _warned
    if _warned or (os.environ.get("RANK") or "0") != "0":
        return
    _warned = True
    log.warning("data state: the checkpoint was written before the samples' token lengths were recorded in it, so a "
                "change of tokenizer, chat template, image size or media settings since then (another pack plan) is "
                "not detected; resuming at its position")
