"""Over-long GRPO prompts are left out when the run starts, not met one step at a time.

Policy (what verl users expect from its `data.filter_overlong_prompts`): a prompt whose tokens plus
the generation budget (the larger of `rl.rollout.max_new_tokens` and `rl.eval.max_new_tokens`) exceed
`data.max_tokens_per_pack` is dropped from its prompt set before the first step and counted as a
bad record "too_long" under its file and line / row; a prompt that already fails while its length
is computed (a missing or unreadable image header, a placeholder mismatch, ...) is dropped and
counted under its own category. A set with no prompt left is a ConfigError naming
`data.train_path` / `data.eval_path` (exit 2).

Why up front: before, such a prompt was skipped (and counted) only when a step drew it, and a step
that drew nothing but such prompts ended the run with exit 2 in the middle of training — with half
the prompts over-long and `rl.batch.prompts_per_step = 1` that happened within a few steps, and at any
size it was a matter of time. What is left to fail at a step is a prompt whose pixels cannot be
decoded although its header could; those are still skipped and counted there.

Lengths come from `data.lengths.compute_lengths` (the chat template, the tokenizer and image headers:
exact, no pixel decoding), the same estimate SFT plans its packs with; it is not cached (a prompt
set has no file identity of its own here), which costs about a millisecond per prompt at start-up
(with images, the headers read). A synchronous job's ranks all call this together, so there each
estimates 1 / world of the prompts and the lengths and bad records are all-gathered
(`split_over_ranks`: every rank keeps the same prompts as the serial pass); the asynchronous trainer and
rollout ranks reach it at different times, so each of them runs the whole pass. `data.num_workers` is
refused in GRPO, so the length pool of forked workers is not used here.
The trainer and the asynchronous rollout ranks call this with the same configuration, so both keep
the same prompts in the same order.

Which prompts are kept, and so the prompt order of every step, depends on these lengths: the kept set carries them
(`PromptDataset.start_lengths`), and a checkpoint records their digest (rl/prompts/data_state.py), so a resume whose
tokenizer, chat template or image settings keep other prompts (as many or not) is refused.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, Optional

import numpy as np

from megatron_vlm.data.bad_records import BadRecordLog
from megatron_vlm.data.lengths import compute_lengths, planning_settings
from megatron_vlm.data.media import MediaLimits
from megatron_vlm.data.plan_lengths import plan_lengths_state
from megatron_vlm.errors import ConfigError
from megatron_vlm.rl.config import RLRolloutConfig
from megatron_vlm.rl.prompts.dataset import PromptDataset
from megatron_vlm.rl.prompts.sets import PromptSets

__all__ = ["check_generation_budget", "prompt_token_budget", "drop_unusable_prompts", "PromptLengths"]

log = logging.getLogger("megatron_vlm")


_DEFAULT_ROLLOUT_TOKENS = RLRolloutConfig.max_new_tokens
"""`rl.rollout.max_new_tokens` when not set: left at it, the pack size is the key to change."""


def check_generation_budget(data_cfg: Any, rl_cfg: Any) -> None:
    """ConfigError (exit 2, one line) when the generation budget leaves no room for a prompt in
    `data.max_tokens_per_pack`; the one check of both `--check` (plan/check.py) and the run (below).

    It names the key to change: the generation key that sets the budget (`rl.eval.max_new_tokens` when it is
    the larger), or `data.max_tokens_per_pack` when the budget is `rl.rollout.max_new_tokens`' default."""
    eval_tokens = getattr(getattr(rl_cfg, "eval", None), "max_new_tokens", 0) or 0
    rollout_tokens = rl_cfg.rollout.max_new_tokens
    key, generated = (("rl.eval.max_new_tokens", eval_tokens) if eval_tokens > rollout_tokens
                      else ("rl.rollout.max_new_tokens", rollout_tokens))
    pack = data_cfg.max_tokens_per_pack
    env = getattr(rl_cfg, "env", None)
    if env is not None and env.max_total_tokens > pack:  # a multi-turn trajectory is trained as one packed sample
        raise ConfigError(f"rl.env.max_total_tokens: {env.max_total_tokens} exceeds data.max_tokens_per_pack = {pack} "
                          "(a trajectory is trained as one packed sample); lower it (0 = the pack size) or raise "
                          "data.max_tokens_per_pack")
    if generated < pack:
        return
    if key == "rl.rollout.max_new_tokens" and generated == _DEFAULT_ROLLOUT_TOKENS:
        raise ConfigError(f"data.max_tokens_per_pack: {pack} leaves no room for a prompt before {key} = {generated} "
                          f"generated tokens; raise it above the longest prompt + {generated}, or lower {key}")
    raise ConfigError(f"{key}: {generated} generated tokens leave no room for a prompt in data.max_tokens_per_pack = "
                      f"{pack} tokens per sequence; set it below {pack} minus the longest prompt, "
                      f"or raise data.max_tokens_per_pack")


def prompt_token_budget(data_cfg: Any, rl_cfg: Any) -> int:
    """Most prompt tokens a rollout (training or held-out evaluation) leaves room for (> 0: ConfigError
    from `check_generation_budget` otherwise)."""
    check_generation_budget(data_cfg, rl_cfg)
    eval_cfg = getattr(rl_cfg, "eval", None)
    generated = max(rl_cfg.rollout.max_new_tokens, getattr(eval_cfg, "max_new_tokens", 0) or 0)
    return data_cfg.max_tokens_per_pack - generated


class PromptLengths:
    """Every prompt's token length as the start-up filter measured it (-1: unreadable), the prompt-token budget it
    kept them under, and the settings they were measured with (computed when first recorded: that hashes the
    tokenizer). `state()`: the record a checkpoint keeps (`plan_lengths.plan_lengths_state`: a digest of every
    length, the kept prompts and their tokens, the settings; and the prompts measured)."""

    def __init__(self, lengths: np.ndarray, budget: int, settings: Callable[[], dict[str, str]]):
        self.lengths, self.budget, self.settings = lengths, budget, settings
        self._state: Optional[dict] = None

    def state(self) -> dict:
        if self._state is None:
            self._state = {**plan_lengths_state(self.lengths, self.budget, self.settings()),
                           "prompts": int(np.asarray(self.lengths).size)}
        return self._state


class _PromptRecords:
    """A prompt set as a data-pipeline record source (`get`, `locate`) for `compute_lengths`."""

    def __init__(self, ds: PromptDataset, name: str):
        self.ds, self.name = ds, name

    def __len__(self) -> int:
        return len(self.ds)

    def get(self, i: int):
        return self.ds[i].to_record()

    def locate(self, i: int) -> tuple[str, int]:
        s = self.ds[i]
        return s.source or s.prompt_id, s.index


def _filter(ds: PromptDataset, processor, data_cfg: Any, budget: int, key: str, log_to: BadRecordLog,
            split_over_ranks: bool) -> PromptDataset:
    found = BadRecordLog()
    lengths = compute_lengths(_PromptRecords(ds, key), processor, max_frames=data_cfg.max_frames, for_generation=True,
                              fps=data_cfg.fps, limits=MediaLimits.from_config(data_cfg), bad_records=found,
                              split_over_ranks=split_over_ranks)
    keep = [i for i in range(len(ds)) if 0 < lengths[i] <= budget]
    for i in np.nonzero(lengths > budget)[0]:
        s = ds[int(i)]
        found.add(s.source or s.prompt_id, s.index, "too_long",
                  f"prompt of {int(lengths[i])} tokens > {budget} (data.max_tokens_per_pack - max_new_tokens)")
    for log_ in (ds.bad_records, log_to):
        log_.extend(found.to_dict()["records"])
    if not keep:
        first = found.entries[0] if found.entries else "none"
        raise ConfigError(f"{key}: none of the {len(ds)} prompts can be used (longer than {budget} tokens = "
                          f"data.max_tokens_per_pack - max_new_tokens, or unreadable); by category "
                          f"{found.counts_by_category()}, first: {first}")
    if len(keep) < len(ds):
        log.warning("%s: %d of %d prompts left out at start-up %s (over %d prompt tokens or unreadable; see bad_records)",
                    key, len(ds) - len(keep), len(ds), found.counts_by_category(), budget)
    ids = {(b.source, b.index) for b in found.entries}
    skipped = list(ds.skipped) + [(ds[i].prompt_id, "left out at start-up") for i in range(len(ds))
                                  if (ds[i].source or ds[i].prompt_id, ds[i].index) in ids]
    settings = functools.partial(planning_settings, processor, max_frames=data_cfg.max_frames, fps=data_cfg.fps,
                                 limits=MediaLimits.from_config(data_cfg))
    return PromptDataset([ds[i] for i in keep], ds.schema, skipped, ds.bad_records, files=ds.files,
                         start_lengths=PromptLengths(np.asarray(lengths), budget, settings))


def drop_unusable_prompts(sets: PromptSets, processor, data_cfg: Any, rl_cfg: Any,
                          bad_records: Optional[BadRecordLog] = None, *, split_over_ranks: bool = False) -> PromptSets:
    """`sets` without the prompts that cannot fit or be read (module docstring); what was dropped goes
    to each set's `bad_records` and to `bad_records` (the run's log) when given. `split_over_ranks`: every
    rank of the default process group calls this together (a collective; the result is the serial pass's)."""
    budget = prompt_token_budget(data_cfg, rl_cfg)
    run_log = bad_records if bad_records is not None else BadRecordLog()
    train = _filter(sets.train, processor, data_cfg, budget, "data.train_path", run_log, split_over_ranks)
    evals = (_filter(sets.eval, processor, data_cfg, budget, "data.eval_path", run_log, split_over_ranks)
             if sets.eval else None)
    return PromptSets(train, evals)
