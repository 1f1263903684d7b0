"""A GRPO run's data state in its checkpoints, and the refusal to resume it with another prompt order.

The prompts a GRPO step draws are a function of the train prompt count (after the over-long ones are
left out at start-up), `train.seed` and `rl.batch.prompts_per_step` (`prompt_batches`); the data state
records the three. A resume whose values differ would draw other prompts than the uninterrupted run
from the resumed step on, so it exits 2 with one line naming the key, both values and the two ways
forward (keep the old value, or start a fresh run), as an SFT resume does. The state also records the
content of the prompt files (`data_files`: size and a digest of each, `data.data_files.content_signatures`), so
a file replaced by another with as many prompts is refused too, naming it. A checkpoint written before a field
was recorded is not checked on that field.

Which prompts are kept at start-up depends on their token lengths (rl/prompts/lengths.py), which depend on the
tokenizer and chat template of `model.path`, `data.chat_template_kwargs` and the image / video settings: another
value keeps other prompts, as many or not, and the same count then puts other prompts at the order's positions (or
the same prompts are encoded otherwise). The state records a digest of every prompt's length and those settings
(`prompt_lengths`, as SFT's `plan_lengths`); a resume whose digest differs exits 2 naming the setting that differs.
A checkpoint written before the digest resumes unchecked on it, with one warning per process.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

from megatron_vlm.data.data_files import changed_data_file, keep_files_hint
from megatron_vlm.data.plan_lengths import differing_settings

__all__ = ["grpo_data_state", "grpo_data_state_refusal", "warn_unrecorded_prompt_lengths"]

log = logging.getLogger("megatron_vlm")

_warned = False

_FRESH = ('or start a fresh run from step 0 (checkpoint.resume = "none" or another train.output_dir; '
          "model.path = an export of the checkpoint keeps its weights)")

_KEYS = {"seed": "train.seed", "prompts_per_step": "rl.batch.prompts_per_step"}
"""The data-state fields set by one config key each (num_prompts has several: see below)."""


def grpo_data_state(step: int, *, seed: int, num_prompts: int, prompts_per_step: int,
                    data_files: Optional[dict] = None, prompt_lengths: Optional[dict] = None) -> dict:
    """The data state saved with a checkpoint after `step` steps (`data_files`: the train prompt files'
    `content_signatures`, None for prompts without files; `prompt_lengths`: `PromptLengths.state()` of the train
    prompts, None when they were not measured)."""
    state: dict = {"next_step": step, "seed": seed, "num_prompts": num_prompts, "prompts_per_step": prompts_per_step}
    if data_files is not None:
        state["data_files"] = data_files
    if prompt_lengths is not None:
        state["prompt_lengths"] = prompt_lengths
    return state


def _lengths_refusal(saved: object, now: Optional[dict]) -> Optional[str]:
    """The refusal of a resume whose train prompts' length digest differs from the checkpoint's (None: the same,
    or either side not recorded)."""
    if not isinstance(saved, dict) or now is None or saved.get("sha256") == now["sha256"]:
        return None
    what = (f"the train prompts' token lengths differ from the checkpoint's ({saved.get('usable')} prompts of "
            f"{saved.get('tokens')} tokens kept then, {now['usable']} of {now['tokens']} now), so the prompts kept at "
            "start-up or their encoding differ and the resumed steps would draw other prompts than the checkpoint's "
            "order")
    differing = differing_settings(saved, now)
    if differing:
        lead = differing[0].split(":")[0].split(" (")[0]
        return (f"{lead}: {what}; the settings the lengths are measured with differ ({'; '.join(differing)}). Set "
                f"them as the checkpoint's run had them to resume it, {_FRESH}")
    if saved.get("prompts") != now.get("prompts"):  # another prompt set (a synthetic set of another size, ...)
        if saved.get("usable") != now["usable"]:
            return None  # the kept-prompt count's refusal says so
        return (f"data.train_path: the checkpoint's run read {saved.get('prompts')} train prompts, this run "
                f"{now.get('prompts')} (as many kept, other ones), so the resumed steps would draw other prompts than "
                f"the checkpoint's order. Keep the checkpoint's data to resume it, {_FRESH}")
    return (f"data.train_path: {what}: the settings the lengths are measured with are the checkpoint's, so the images "
            f"or videos the prompts read changed. Restore the checkpoint's data to resume it, {_FRESH}")


def warn_unrecorded_prompt_lengths() -> None:
    """One warning per process (on rank 0) that a checkpoint without the prompt-lengths digest resumes unchecked."""
    global _warned
    if _warned or (os.environ.get("RANK") or "0") != "0":
        return
    _warned = True
    log.warning("data state: the checkpoint was written before the train prompts' token lengths were recorded in it, "
                "so a change of tokenizer, chat template, image size or media settings since then (other prompts kept "
                "at start-up, another prompt order) is not detected; resuming at its step")


def grpo_data_state_refusal(state: dict, *, seed: int, num_prompts: int, prompts_per_step: int,
                            data_files: Optional[dict] = None, prompt_lengths: Optional[dict] = None) -> Optional[str]:
    """None when this run continues the checkpoint's prompt order, else the one line to exit 2 with."""
    if "global_packs_consumed" in state and "next_step" not in state:  # layout record older than train.mode
        return ("train.mode: the checkpoint's data state is a packed-data position (an SFT, DPO or reward-model run's), "
                f"not a GRPO prompt order, so this run cannot continue it. Resume it with the train.mode that wrote it, "
                f"{_FRESH}")
    changed = changed_data_file(state.get("data_files"), data_files)
    if changed:  # before the prompt count: which files differ says more than how many prompts
        how = keep_files_hint(state.get("data_files"), data_files, "data.train_path") or (
            "Point data.train_path at the checkpoint's data (data.type = \"synthetic_vqa\": its data.synthetic_* keys)")
        return (f"data.train_path: {changed}, so the resumed steps would draw other prompts than the checkpoint's "
                f"order. {how} to resume it, {_FRESH}")
    lengths = _lengths_refusal(state.get("prompt_lengths"), prompt_lengths)
    if lengths:  # before the count: which setting changed says more than how many prompts are kept
        return lengths
    if "num_prompts" in state and int(state["num_prompts"]) != num_prompts:
        return (f"data.train_path: the checkpoint was written drawing from {state['num_prompts']} train prompts, this run "
                f"has {num_prompts} (another data.train_path or data.synthetic_train_size, changed files, or another "
                f"data.max_tokens_per_pack / rl.rollout.max_new_tokens leaving out other over-long prompts), so the "
                f"prompt order would differ. Keep the checkpoint's data and those keys to resume it, {_FRESH}")
    now = {"seed": seed, "prompts_per_step": prompts_per_step}
    for field, key in _KEYS.items():
        if field in state and int(state[field]) != now[field]:
            return (f"{key}: the checkpoint was written with {key} = {state[field]}, this run has {key} = {now[field]}; "
                    f"the prompt order would differ. Set {key} = {state[field]} to resume it, {_FRESH}")
    return None
