"""GRPO prompt sets from the `[data]` section, and their encoding into rollout prompts.

`[data] type` picks where prompts come from (the same section as SFT, read for prompts):

    synthetic_vqa   the shapes-and-colours set written into `synthetic_dir` (train.jsonl / eval.jsonl,
                    messages format; written by rank 0 if missing)
    hf              local parquet / arrow / jsonl files with `columns = {prompt, answer, images}`
                    (Geometry3K, ViRL39K or any table); `eval_path` optional
    messages_jsonl  messages-format JSONL whose last assistant turn (or "answer" field) is the reference

Paths name a file, a folder (searched recursively) or a glob, read by the same reader as SFT
(`megatron_vlm.data.table_rows`).

Every user question goes through `[rl] prompt_template` / `system_prompt` (rl.data). A prompt is
encoded by the data pipeline (`process_record(..., for_generation=True)`: chat template, image
preprocessing, placeholder expansion, the `[data]` pixel caps and video decode timeout), so rollouts
see exactly the tokens SFT trains on. A prompt that cannot be encoded, or whose prompt +
`max_new_tokens` exceeds `data.max_tokens_per_pack`, is skipped and counted instead of stopping the
run: every exception of one prompt's encoding (a BadRecordError with its category, a
decompression-bomb image as "image_too_large", anything else as "unexpected_error" with its type and
message, the first one logged with a traceback) is a bad record under the prompt's file and line /
row, so the same prompt met again after a resume is skipped again, never fatal.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megatron_vlm.data.bad_records import BadRecordError, BadRecordLog, unexpected
from megatron_vlm.data.data_files import HF_SUFFIXES, MESSAGES_SUFFIXES, data_path_errors
from megatron_vlm.data.media import DEFAULT_LIMITS, MediaLimits
from megatron_vlm.data.processing import process_record
from megatron_vlm.data.synthetic_vqa import write_synthetic_vqa
from megatron_vlm.rl.data import PromptDataset, PromptSample, load_prompt_dataset
from megatron_vlm.rl.rollout.engine import RolloutPrompt

__all__ = ["PromptSets", "load_prompt_sets", "PromptEncoder"]

log = logging.getLogger("megatron_vlm")


@dataclass
class PromptSets:
    train: PromptDataset
    eval: Optional[PromptDataset]


def _synthetic_paths(data_cfg, run_dir: Path, is_main: bool, barrier) -> tuple[Path, Path]:
    folder = Path(data_cfg.synthetic_dir) if data_cfg.synthetic_dir else run_dir / "data"
    if is_main:
        write_synthetic_vqa(folder, data_cfg.synthetic_train_size, data_cfg.synthetic_eval_size,
                            seed=data_cfg.synthetic_seed, image_size=data_cfg.synthetic_image_size)
    barrier()
    return folder / "train.jsonl", folder / "eval.jsonl"


def load_prompt_sets(data_cfg, rl_cfg, *, run_dir: Path, is_main: bool = True, barrier=lambda: None,
                     bad_records: Optional[BadRecordLog] = None) -> PromptSets:
    """Train (and, when available, held-out) prompt sets for a GRPO run. `bad_records`, when given,
    receives the rows of both sets that were left out (each set also keeps its own log)."""
    sets = _load_prompt_sets(data_cfg, rl_cfg, run_dir=run_dir, is_main=is_main, barrier=barrier)
    if bad_records is not None:
        for ds in (sets.train, sets.eval):
            if ds is not None:
                bad_records.extend(ds.bad_records.to_dict()["records"])
    return sets


def _load_prompt_sets(data_cfg, rl_cfg, *, run_dir: Path, is_main: bool, barrier) -> PromptSets:
    common = dict(prompt_template=rl_cfg.prompt_template, system_prompt=rl_cfg.system_prompt,
                  image_root=data_cfg.image_root or None)
    if data_cfg.type == "synthetic_vqa":
        train_path, eval_path = _synthetic_paths(data_cfg, run_dir, is_main, barrier)
        train = load_prompt_dataset(train_path, schema="messages", **common)
        evals = load_prompt_dataset(eval_path, schema="messages", **common) if data_cfg.synthetic_eval_size else None
        return PromptSets(train, evals)
    if data_cfg.type == "hf":
        cols = dict(data_cfg.columns)
        if "messages" in cols:
            raise ValueError("data.columns: GRPO reads prompt / answer (/ images) columns, not a 'messages' column; "
                             "use data.type = 'messages_jsonl' for conversations")
        common.update(columns={k: v for k, v in cols.items() if k in ("prompt", "answer", "images", "image")},
                      suffixes=HF_SUFFIXES)
    elif data_cfg.type == "messages_jsonl":
        common.update(schema="messages", suffixes=MESSAGES_SUFFIXES)
    else:
        raise ValueError(f"data.type: {data_cfg.type!r} has no GRPO prompt source")
    # no files, an unreadable table, missing columns or no usable row: a ConfigError naming the key (exit 2)
    with data_path_errors("data.train_path"):
        train = load_prompt_dataset(data_cfg.train_path, **common)
    with data_path_errors("data.eval_path"):
        evals = load_prompt_dataset(data_cfg.eval_path, **common) if data_cfg.eval_path else None
    return PromptSets(train, evals)


class PromptEncoder:
    """PromptSample -> RolloutPrompt through the data pipeline, with a per-run skip count and a log of
    the prompts that failed (`bad_records`: by the sample's file and line / row, with the category).

    `limits`: the `[data]` pixel caps and video decode timeout (`MediaLimits.from_config(cfg.data)`);
    default: the `[data]` defaults."""

    def __init__(self, processor, *, max_frames: int, fps: float, max_new_tokens: int, max_tokens: int,
                 limits: Optional[MediaLimits] = None, bad_records: Optional[BadRecordLog] = None):
        if max_new_tokens >= max_tokens:
            raise ValueError(
                f"data.max_tokens_per_pack: {max_tokens} leaves no room for a prompt before rl.max_new_tokens = "
                f"{max_new_tokens} generated tokens; raise it above prompt length + max_new_tokens"
            )
        self.processor = processor
        self.max_frames, self.fps = max_frames, fps
        self.max_prompt_tokens = max_tokens - max_new_tokens
        self.limits = limits or DEFAULT_LIMITS
        self.bad_records = bad_records if bad_records is not None else BadRecordLog()
        self.skipped = 0
        self.last_skip: Optional[str] = None
        """`<prompt id>: <category>: <detail>` of the latest skipped prompt (named when a whole step is unusable)."""
        self._warned = 0

    def encode(self, sample: PromptSample) -> Optional[RolloutPrompt]:
        """The encoded prompt, or None (counted, logged for the first few) if it cannot be used."""
        try:
            processed = process_record(sample.to_record(), self.processor, max_frames=self.max_frames, fps=self.fps,
                                       for_generation=True, limits=self.limits)
        except Exception as e:  # every per-prompt failure is a counted bad record (module docstring)
            return self._skip(sample, unexpected(e, f"prompt {sample.prompt_id}"))
        if len(processed) > self.max_prompt_tokens:
            return self._skip(sample, BadRecordError(
                "too_long", f"prompt of {len(processed)} tokens + max_new_tokens exceeds data.max_tokens_per_pack"))
        return RolloutPrompt.from_processed(processed)

    def _skip(self, sample: PromptSample, err: BadRecordError) -> None:
        self.skipped += 1
        self.bad_records.add_error(sample.source or sample.prompt_id, sample.index, err)
        why = str(err)
        self.last_skip = f"{sample.prompt_id}: {why}"
        if self._warned < 5:
            self._warned += 1
            log.warning("GRPO prompt %s skipped: %s", sample.prompt_id, why)
        return None
