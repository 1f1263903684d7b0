"""A GRPO job's bad_records.json across a kill and a resume (launch/pretrain_vlm.py, one process).

A prompt whose image header reads (so it passes the start-up length filter) but whose pixels do not
decode is skipped by the prompt encoder each time a step draws it: a mid-run skip. Those skips were
kept only in the process's log: a run killed after its step-2 checkpoint had no bad_records.json at
all, and the resumed run's summary restarted from the records found at start-up, losing the skips
made before the kill. They now go into the checkpoint's data state, come back on resume (a record
the resumed run finds again at start-up counted once), and bad_records.json is rewritten at each
checkpoint. Asynchronous GRPO's rollout ranks encode the prompts: their skips never reached the
trainer's log (bad_records.json held only the start-up records); they now come with each step's samples.
"""
from __future__ import annotations

import json

import pytest
from jobs import REPO, run_job
from PIL import Image
from test_grpo_job import grpo_overrides

pytestmark = pytest.mark.distributed

GRPO_DEMO = REPO / "launch" / "configs" / "demo_grpo.toml"


def _prompt(image: str, text: str) -> str:
    return json.dumps({"messages": [{"role": "user", "content": [{"type": "image", "image": image},
                                                                 {"type": "text", "text": text}]},
                                    {"role": "assistant", "content": "red"}]}) + "\n"


def _skips(out) -> dict:
    bad = json.loads((out / "bad_records.json").read_text())
    return {(rec["index"], rec["category"]): rec["skips"] for rec in bad["records"]}


def _job(tmp_path, **extra) -> tuple:
    """The run folder and the overrides of a 4-step job on 5 prompts: line 2 skipped whenever drawn, line 4 left
    out at start-up (too long); every step draws all 4 usable prompts, so every step skips line 2 once."""
    data = tmp_path / "data"
    data.mkdir()
    Image.new("RGB", (56, 56), (200, 30, 30)).save(data / "ok.png")
    ok = (data / "ok.png").read_bytes()
    (data / "cut.png").write_bytes(ok[: len(ok) // 2])  # the header reads (start-up filter), the pixels do not
    lines = [_prompt("ok.png", "What is 1?"), _prompt("cut.png", "What is 2?"), _prompt("ok.png", "What is 3?"),
             _prompt("ok.png", "word " * 300), _prompt("ok.png", "What is 5?")]  # line 4: too long, left out at start-up
    (data / "prompts.jsonl").write_text("".join(lines))
    out = tmp_path / "run"
    overrides = [o for o in grpo_overrides(out, tmp_path / "assets", **{
        "train.max_steps": 4, "rl.batch.prompts_per_step": 4, "rl.batch.group_size": 2, "rl.batch.mini_batches_per_step": 1,
        "rl.batch.ppo_epochs": 1, "rl.loss.kl_coef": "0.0", "rl.recompute_logprobs": "false",
        "checkpoint.every_steps": 2, "checkpoint.export_hf": "false", **extra}) if not o.startswith("data.synthetic")]
    overrides += ['data.type="messages_jsonl"', f'data.train_path="{data / "prompts.jsonl"}"']
    return out, overrides


def test_mid_run_prompt_skips_survive_a_kill_and_resume(tmp_path):
    out, overrides = _job(tmp_path)
    r = run_job(overrides, config=GRPO_DEMO, env={"MEGATRON_VLM_FAULT_KILL_AT_STEP": "3"}, check=False, timeout=300)
    assert r.returncode == -9, (r.returncode, r.stderr[-3000:])
    assert (out / "checkpoints" / "step_2" / "COMPLETE").is_file()
    # written with the step-2 checkpoint: the skips of steps 1 and 2
    assert _skips(out) == {(2, "corrupt_image"): 2, (4, "too_long"): 1}

    r = run_job(overrides, config=GRPO_DEMO, timeout=300)
    assert "Resumed from checkpoint: step=2" in r.stderr
    # steps 1-2 from the checkpoint, 3-4 after the resume; the start-up record once, not once per process
    assert _skips(out) == {(2, "corrupt_image"): 4, (4, "too_long"): 1}


@pytest.mark.heavy  # 2 processes, two jobs; the synchronous test above runs the same save / restore
def test_async_rollout_rank_skips_reach_the_summary_and_survive_a_resume(tmp_path):
    out, overrides = _job(tmp_path, **{"rl.allocation": '"rollout:1+train:1"', "rl.reward_pool.workers": 1,
                                       "rl.eval.at_start": "false"})
    r = run_job(overrides, nproc=2, config=GRPO_DEMO, env={"MEGATRON_VLM_FAULT_KILL_AT_STEP": "3"}, check=False,
                timeout=300)
    assert r.returncode != 0, r.stderr[-3000:]
    assert (out / "checkpoints" / "step_2" / "COMPLETE").is_file()
    assert _skips(out) == {(2, "corrupt_image"): 2, (4, "too_long"): 1}
    r = run_job(overrides, nproc=2, config=GRPO_DEMO, timeout=300)
    assert "Resumed from checkpoint: step=2" in r.stderr
    # step 3 was generated before the kill, not trained: its skip counts once, when the resumed run trains it
    assert _skips(out) == {(2, "corrupt_image"): 4, (4, "too_long"): 1}


@pytest.mark.heavy  # 2 processes
def test_two_ranks_count_each_skip_once(tmp_path):
    """Every rank reads the prompt set and leaves out the same over-long prompt at start-up: it counted once per
    rank (skips 2); the corrupt prompt is drawn by one rank per step."""
    out, overrides = _job(tmp_path, **{"checkpoint.every_steps": 4})
    run_job(overrides, nproc=2, config=GRPO_DEMO, timeout=300)
    assert _skips(out) == {(2, "corrupt_image"): 4, (4, "too_long"): 1}
