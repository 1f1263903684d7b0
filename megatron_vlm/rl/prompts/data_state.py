"""A GRPO run's data state in its checkpoints, and the refusal to resume it with another prompt order.

The prompts a GRPO step draws are a function of the train prompt count (after the over-long ones are
left out at start-up), `train.seed` and `rl.batch.prompts_per_step` (`prompt_batches`); the data state
records the three. A resume whose values differ would draw other prompts than the uninterrupted run
from the resumed step on, so it exits 2 with one line naming the key, both values and the two ways
forward (keep the old value, or start a fresh run), as an SFT resume does. The state also records the
content of the prompt files (`data_files`: size and a digest of each, `data.data_files.content_signatures`), so
a file replaced by another with as many prompts is refused too, naming it. A checkpoint written before a field
was recorded is not checked on that field.
"""
from __future__ import annotations

from typing import Optional

from megatron_vlm.data.data_files import changed_data_file, keep_files_hint

__all__ = ["grpo_data_state", "grpo_data_state_refusal"]

_FRESH = ('or start a fresh run from step 0 (checkpoint.resume = "none" or another train.output_dir; '
          "model.path = an export of the checkpoint keeps its weights)")

_KEYS = {"seed": "train.seed", "prompts_per_step": "rl.batch.prompts_per_step"}
"""The data-state fields set by one config key each (num_prompts has several: see below)."""


def grpo_data_state(step: int, *, seed: int, num_prompts: int, prompts_per_step: int,
                    data_files: Optional[dict] = None) -> dict:
    """The data state saved with a checkpoint after `step` steps (`data_files`: the train prompt files'
    `content_signatures`, None for prompts without files)."""
    state: dict = {"next_step": step, "seed": seed, "num_prompts": num_prompts, "prompts_per_step": prompts_per_step}
    if data_files is not None:
        state["data_files"] = data_files
    return state


def grpo_data_state_refusal(state: dict, *, seed: int, num_prompts: int, prompts_per_step: int,
                            data_files: Optional[dict] = None) -> Optional[str]:
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
