"""Whole GRPO jobs that must stop with exit 2 and one line naming the key to change (tiny random
Qwen2.5-VL, synthetic VQA prompts): a generation budget beyond the pack size, named as `--check` names it
(one function for both: rl/prompts/lengths.check_generation_budget), and a resume whose prompt order
would differ from the checkpoint's (rl/prompts/data_state.py)."""
from __future__ import annotations

import io

import pytest
from jobs import run_job
from test_grpo_job import GRPO_DEMO, grpo_overrides

from megatron_vlm.config import load_config
from megatron_vlm.plan.check import run_check

pytestmark = pytest.mark.distributed

BUDGET_LINE = ("rl.rollout.max_new_tokens: 1000000000 generated tokens leave no room for a prompt in "
               "data.max_tokens_per_pack = 160 tokens per sequence; set it below 160 minus the longest prompt, "
               "or raise data.max_tokens_per_pack")


def _config_errors(stderr: str) -> list[str]:
    return [x for x in stderr.splitlines() if x.startswith("config error:")]


def test_generation_budget_beyond_the_pack_names_the_key_in_the_run_and_in_check(tmp_path):
    sets = grpo_overrides(tmp_path / "out", tmp_path / "assets", **{"rl.rollout.max_new_tokens": "1000000000"})
    r = run_job(sets, config=GRPO_DEMO, check=False)
    assert r.returncode == 2 and _config_errors(r.stderr) == [f"config error: {BUDGET_LINE}"], r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "data.train_path" not in r.stderr

    out, err = io.StringIO(), io.StringIO()
    code = run_check(load_config(GRPO_DEMO, sets), world_size=1, device_memory_gib=80.0, out=out, err=err)
    assert code == 2 and err.getvalue().strip() == f"check failed: {BUDGET_LINE}", err.getvalue()


@pytest.mark.heavy  # kept out of CI's run for its time budget; the unit tests cover the logic
def test_resume_with_another_prompt_set_names_the_key(tmp_path):
    assets, out = tmp_path / "assets", tmp_path / "out"
    one_step = {"train.max_steps": "1", "checkpoint.every_steps": "1",
                "rl.batch.ppo_epochs": "1", "rl.batch.mini_batches_per_step": "1"}
    run_job(grpo_overrides(out, assets, **one_step), config=GRPO_DEMO)
    assert (out / "checkpoints" / "step_1" / "COMPLETE").is_file()
    r = run_job(grpo_overrides(out, assets, **{**one_step, "train.max_steps": "2", "data.synthetic_train_size": "24"}),
                config=GRPO_DEMO, check=False)
    errors = _config_errors(r.stderr)
    assert r.returncode == 2 and len(errors) == 1, r.stderr[-3000:]
    # the train file's size is checked first (a smaller synthetic set is another file): the key and both sizes named
    assert errors[0].startswith("config error: data.train_path: ") and "is not the file the checkpoint was written " \
        "reading" in errors[0] and "bytes, the checkpoint's " in errors[0], errors[0]
    assert "or start a fresh run from step 0" in errors[0]
    r = run_job(grpo_overrides(out, assets, **{**one_step, "train.max_steps": "2", "rl.batch.prompts_per_step": "2"}),
                config=GRPO_DEMO, check=False)
    errors = _config_errors(r.stderr)
    assert r.returncode == 2 and errors == [
        "config error: rl.batch.prompts_per_step: the checkpoint was written with rl.batch.prompts_per_step = 4, this run "
        "has rl.batch.prompts_per_step = 2; the prompt order would differ. Set rl.batch.prompts_per_step = 4 to resume it, "
        'or start a fresh run from step 0 (checkpoint.resume = "none" or another train.output_dir; model.path = an '
        "export of the checkpoint keeps its weights)"], r.stderr[-3000:]
