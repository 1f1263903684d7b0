"""Every `[[stages]]` stage's own Config, loaded and checked before any stage trains, and the digest of a finished one.

Why here (config/) and not beside `StageConfig` (training/stages.py): loading a stage's config is the config
loader's work, and the training package does not import the config package (the import graph keeps
config -> training one way).
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from megatron_vlm.config.loader import to_dict
from megatron_vlm.errors import ConfigError
from megatron_vlm.training.stages import stage_error, stage_overrides

__all__ = ["stage_configs", "stage_digest", "record_stage_digest", "stage_changed", "DIGEST_FILE"]

DIGEST_FILE = "stage_config.sha256"
"""Beside a finished stage's `hf/` export: the digest of the effective config that made it (`stage_digest`)."""


def stage_configs(cfg: Any, check: Optional[Callable[[Any], None]] = None) -> list:
    """Every stage's Config (`stage_overrides` loaded, then `check(stage_cfg)` if given); a ConfigError
    of one is raised again naming the stage key that caused it (`stage_error`), so a stage key that
    only fails combined with the main sections (train_layers with [lora]) is refused at load and by
    `--check`, before any stage trains."""
    from megatron_vlm.config import load_config_dict  # the package's loader (this module is below it)

    raw = to_dict(cfg)
    out = []
    for i, stage in enumerate(cfg.stages):
        try:
            stage_cfg = load_config_dict(stage_overrides(raw, cfg.stages, i))
            if check is not None:
                check(stage_cfg)
        except ConfigError as e:
            raise ConfigError(stage_error(str(e), stage, i)) from None
        out.append(stage_cfg)
    return out


def stage_digest(stage_cfg: Any) -> str:
    """sha256 of a stage's effective config (`[logging]` left out: it does not change the export), so a
    rerun can tell that the settings of a stage skipped for its existing export changed since."""
    raw = {k: v for k, v in to_dict(stage_cfg).items() if k != "logging"}
    return hashlib.sha256(json.dumps(raw, sort_keys=True, default=str).encode()).hexdigest()


def record_stage_digest(run_dir: Path, stage_cfg: Any) -> None:
    """Write `stage_digest` beside the stage's finished export (`<run_dir>/stage_config.sha256`)."""
    (run_dir / DIGEST_FILE).write_text(stage_digest(stage_cfg) + "\n")


def stage_changed(run_dir: Path, stage_cfg: Any) -> bool:
    """Whether the export in `run_dir` was made with other settings than `stage_cfg`'s; False for an export
    without a recorded digest (made before digests were written: nothing to compare)."""
    try:
        recorded = (run_dir / DIGEST_FILE).read_text().strip()
    except OSError:
        return False
    return recorded != stage_digest(stage_cfg)
