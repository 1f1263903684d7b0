"""Curriculum stages: one SFT command that runs `[[stages]]` one after the other, each stage starting
from the previous stage's Hugging Face export.

Why: a curriculum (the RoboVQA recipe: single questions first, then multi-turn conversations over
the same videos) is several SFT runs chained by hand — stage 2's `model.path` is stage 1's export,
its optimizer and schedule start fresh, its data, frames, length budget, learning rate and trained
layers differ. Written as `[[stages]]` tables it is one command that resumes where it stopped.

Each stage is the run's config with the stage's keys put in place (a key left out keeps the value of
the main sections) and:

- `train.output_dir` = `<output_dir>/<stage name>` (its own checkpoints, metrics and `hf/` export);
- `model.path` = the previous stage's `<output_dir>/<previous name>/hf` (the first stage uses
  `model.path`, synthesized when `model.synthesize` says so); `lora.init_from` is the first stage's
  start only (a later stage's model, the previous export, has that adapter merged in already);
- a fresh optimizer and schedule (a new run folder); `checkpoint.resume = "auto"` applies per stage,
  so an interrupted stage continues from its newest checkpoint and a finished stage (its `hf/`
  export is complete: exports are put in place atomically) is skipped when the command runs again
  (a warning says so when the stage's settings changed since: `config/stage_configs.stage_changed`).

`stage_overrides` is the pure part (dict edits on the resolved config); `config/stage_configs.py` loads and
checks every stage's config (an error names the stage key that caused it, `stages[1].train_layers`) and
keeps each finished stage's config digest; `megatron_vlm.jobs.run_stages` runs the stages.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Optional

__all__ = ["StageConfig", "stage_overrides", "stage_dir", "stage_error", "STAGE_KEYS"]

@dataclass(kw_only=True)
class StageConfig:
    PATHS: ClassVar[tuple[str, ...]] = ("train_path", "eval_path")  # filesystem paths: a leading ~ is expanded (config/loader.py)
    name: str
    """Stage name: its run folder is `<train.output_dir>/<name>`."""
    train_path: Optional[str] = None
    """Training data of this stage (same format as data.train_path); unset = data.train_path."""
    eval_path: Optional[str] = None
    """Held-out data of this stage; unset = data.eval_path."""
    max_frames: Optional[int] = None
    """data.max_frames for this stage (e.g. 4 frames, then 10)."""
    max_tokens_per_pack: Optional[int] = None
    """data.max_tokens_per_pack for this stage (longer multi-turn samples need more)."""
    max_steps: Optional[int] = None
    """Optimizer steps of this stage (or `epochs`, not both; a `--set` of one replaces the file's other); with both
    unset, the main [train] length applies."""
    epochs: Optional[float] = None
    """Passes over this stage's data, instead of max_steps (not both)."""
    lr: Optional[float] = None
    """Peak learning rate of this stage (optimizer.lr)."""
    train_layers: Optional[list[str]] = None
    """train.train_layers for this stage (which parameters train; [] = all)."""

    def validate(self) -> None:
        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"name: use letters, digits, '_' and '-' (it names a folder), got {self.name!r}")
        if self.max_steps is not None and self.max_steps <= 0:
            raise ValueError(f"max_steps: must be > 0, got {self.max_steps}")
        if self.epochs is not None and self.epochs <= 0:
            raise ValueError(f"epochs: must be > 0, got {self.epochs}")
        if self.max_steps is not None and self.epochs is not None:  # max_steps would decide, epochs be ignored
            raise ValueError(f"epochs: set max_steps or epochs, not both (max_steps = {self.max_steps} would decide the "
                             f"stage's length and epochs = {self.epochs} be ignored)")
        if self.lr is not None and self.lr <= 0:
            raise ValueError(f"lr: must be > 0, got {self.lr}")
        if self.max_frames is not None and self.max_frames <= 0:
            raise ValueError(f"max_frames: must be > 0, got {self.max_frames}")


def stage_dir(output_dir: str | Path, stage: StageConfig) -> Path:
    return Path(output_dir) / stage.name


def stage_overrides(raw: dict, stages: list[StageConfig], index: int) -> dict:
    """The config dict of stage `index` from the run's resolved config dict `raw` (`to_dict(cfg)`):
    the stage's keys in place, its own run folder, the previous stage's export as the model, no
    `[[stages]]` left (a stage is a plain SFT run)."""
    stage = stages[index]
    out: dict[str, Any] = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items() if k != "stages"}
    data, train = dict(out.get("data", {})), dict(out.get("train", {}))
    for key in ("train_path", "eval_path", "max_frames", "max_tokens_per_pack"):
        if getattr(stage, key) is not None:
            data[key] = getattr(stage, key)
    if stage.max_steps is not None or stage.epochs is not None:
        train.pop("max_steps", None)
        train.pop("epochs", None)
        if stage.max_steps is not None:
            train["max_steps"] = stage.max_steps
        if stage.epochs is not None:
            train["epochs"] = stage.epochs
    if stage.train_layers is not None:
        train["train_layers"] = list(stage.train_layers)
    train["output_dir"] = str(stage_dir(raw["train"]["output_dir"], stage))
    if stage.lr is not None:
        out["optimizer"] = dict(out.get("optimizer", {}), lr=stage.lr)
    if index > 0:
        model = dict(out["model"])
        model["path"] = str(stage_dir(raw["train"]["output_dir"], stages[index - 1]) / "hf")
        model.pop("synthesize", None)
        out["model"] = model
        if out.get("lora"):  # the previous export holds the init_from adapter already (merged): not loaded twice
            out["lora"] = {k: v for k, v in out["lora"].items() if k not in ("init_from", "init_from_mode")}
    out["data"], out["train"] = data, train
    return out


# the run-config key each stage key sets (stage_overrides), to name a stage's error as the user wrote it
STAGE_KEYS = {"data.train_path": "train_path", "data.eval_path": "eval_path", "data.max_frames": "max_frames",
              "data.max_tokens_per_pack": "max_tokens_per_pack", "train.max_steps": "max_steps",
              "train.epochs": "epochs", "train.train_layers": "train_layers", "optimizer.lr": "lr"}


def stage_error(msg: str, stage: StageConfig, index: int) -> str:
    """A stage config's error named after the stage key behind it: the key the message starts with
    (or else the first one it mentions) when this stage sets it, else `stages[i] (<name>)`."""
    head, sep, rest = msg.partition(": ")
    key = STAGE_KEYS.get(head)
    if sep and key is not None and getattr(stage, key) is not None:
        return f"stages[{index}].{key}: {rest}"
    named = next((k for dotted, k in STAGE_KEYS.items() if dotted in msg and getattr(stage, k) is not None), None)
    return f"stages[{index}].{named}: {msg}" if named else f"stages[{index}] ({stage.name}): {msg}"
