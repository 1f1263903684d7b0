"""The settings an evaluation job records in `eval_results.json`: every config value that changes its result.

A result is reproduced from the model folder and these values: the `[eval]` keys that decide what is generated and
how it is scored (all but `benchmarks`, recorded per benchmark, and `reward_workers`, which only sets how many
processes score), each `[[eval.benchmarks]]` table (files, format, columns, verifier, template, image root, row
limit), the `[data]` keys an evaluation reads (the chat template's variables, image / video sizes and limits, the
token budget a prompt must fit), the model's dtype, `train.seed` (sampling) and `train.precision`, and the
`[parallel]` / `[kernels]` choices and world size that decide the arithmetic. Left out: the `[data]` keys an
evaluation refuses (`mode_keys.EVAL_DATA_IGNORED`) and those that only set how fast rows are read
(`_DATA_SPEED_ONLY`).

The `[eval]` keys sit at the top level (as the results table reads them: `samples`, `greedy`, `temperature`), the
other sections under their names. Torch-free.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from megatron_vlm.config.mode_keys import EVAL_DATA_IGNORED

__all__ = ["eval_settings"]

_EVAL_NOT_RECORDED = ("benchmarks", "reward_workers")
_DATA_SPEED_ONLY = ("num_workers", "prefetch_factor", "loader_timeout_s", "length_cache_dir")


def _fields(section: Any, leave_out: tuple[str, ...] = ()) -> dict[str, Any]:
    return {f.name: getattr(section, f.name) for f in dataclasses.fields(section) if f.name not in leave_out}


def eval_settings(cfg: Any, world_size: int) -> dict[str, Any]:
    """The `settings` of an evaluation job's `eval_results.json` (module docstring); `cfg` a validated Config."""
    e = cfg.eval
    out: dict[str, Any] = {"model": cfg.model.path}
    out |= {f"model_{k}": v for k, v in _fields(cfg.model, ("path",)).items()}
    out |= _fields(e, _EVAL_NOT_RECORDED)
    out["adapter"] = e.adapter or None
    out |= {"seed": cfg.train.seed, "precision": cfg.train.precision, "world_size": world_size}
    out["benchmarks"] = {b.name: _fields(b, ("name",)) for b in e.benchmarks}
    out["data"] = _fields(cfg.data, EVAL_DATA_IGNORED + _DATA_SPEED_ONLY)
    out["parallel"] = _fields(cfg.parallel)
    out["kernels"] = _fields(cfg.kernels)
    return out
