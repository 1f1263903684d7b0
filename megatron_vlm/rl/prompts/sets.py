"""GRPO prompt sets from the `[data]` section.

`[data] type` picks where prompts come from (the same section as SFT, read for prompts):

    synthetic_vqa   the shapes-and-colours set written into `synthetic_dir` (train.jsonl / eval.jsonl,
                    messages format; written by rank 0 if missing)
    hf              local parquet / arrow / jsonl files with `columns = {prompt, answer, images}`
                    (Geometry3K, ViRL39K or any table), or without `columns`: the layout is detected
                    from the column names (verl's preprocessed parquet, TRL GRPO datasets,
                    Geometry3K, ViRL39K, messages; rl/prompts/dataset.py); `eval_path` optional
    messages_jsonl  messages-format JSONL whose last assistant turn (or "answer" field) is the reference

Paths name a file, a folder (searched recursively) or a glob, read by the same reader as SFT
(`megatron_vlm.data.table_rows`).

Every user question goes through `[rl] prompt_template` / `system_prompt` (rl/prompts/dataset.py).
Encoding into rollout prompts: rl/prompts/encoder.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megatron_vlm.data.bad_records import BadRecordLog
from megatron_vlm.data.data_files import HF_SUFFIXES, MESSAGES_SUFFIXES, data_path_errors
from megatron_vlm.data.synthetic_vqa import write_synthetic_vqa
from megatron_vlm.errors import ConfigError
from megatron_vlm.rl.prompts.dataset import PromptDataset, load_prompt_dataset

__all__ = ["PromptSets", "load_prompt_sets"]


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
    common = dict(prompt_template=rl_cfg.prompts.template, system_prompt=rl_cfg.prompts.system_prompt,
                  image_root=data_cfg.image_root or None)
    if data_cfg.type == "synthetic_vqa":
        train_path, eval_path = _synthetic_paths(data_cfg, run_dir, is_main, barrier)
        train = load_prompt_dataset(train_path, schema="messages", **common)
        evals = load_prompt_dataset(eval_path, schema="messages", **common) if data_cfg.synthetic_eval_size else None
        return PromptSets(train, evals)
    if data_cfg.type == "hf":
        cols = dict(data_cfg.columns)
        if "messages" in cols:
            raise ConfigError("data.columns: GRPO reads prompt / answer (/ images) columns, not a 'messages' column; "
                             "use data.type = 'messages_jsonl' for conversations")
        unread = sorted(set(cols) - {"prompt", "answer", "images", "image"})
        if unread:  # chosen / rejected are refused by mode (config/mode_keys.py); the others were dropped here
            raise ConfigError(f"data.columns: GRPO reads prompt / answer / image(s) columns; {unread[0]!r} is not read "
                              "(the system turn is rl.prompts.system_prompt); remove it")
        common.update(columns={k: v for k, v in cols.items() if k in ("prompt", "answer", "images", "image")},
                      suffixes=HF_SUFFIXES)
    elif data_cfg.type == "messages_jsonl":
        common.update(schema="messages", suffixes=MESSAGES_SUFFIXES)
    else:
        raise ConfigError(f"data.type: {data_cfg.type!r} has no GRPO prompt source")
    # no files, an unreadable table, missing columns or no usable row: a ConfigError naming the key (exit 2)
    with data_path_errors("data.train_path"):
        train = load_prompt_dataset(data_cfg.train_path, **common)
    with data_path_errors("data.eval_path"):
        evals = load_prompt_dataset(data_cfg.eval_path, **common) if data_cfg.eval_path else None
    return PromptSets(train, evals)
