"""`[[stages]]` jobs: killed with SIGKILL mid-way through stage 2: the same command skips the finished
stage 1, resumes stage 2 from its own newest checkpoint and ends with the losses and exported
weights of an uninterrupted run (the per-stage checkpoint, data position and schedule are the
stage's own; nothing of stage 1's leaks into the resumed stage); an error found when a stage's model is
built names the stage key."""
from __future__ import annotations

import pytest
from jobs import load_safetensors_dir, read_metrics, run_job, small_demo_overrides

pytestmark = pytest.mark.distributed

STAGES = 'stages=[{name = "a", max_steps = 2, lr = 2e-3}, {name = "b"}]'
"""Stage b takes the main train.max_steps (4) and optimizer.lr (1e-3): a main key every stage set would be refused."""


def _overrides(out, assets):
    return small_demo_overrides(out, assets, **{"checkpoint.every_steps": 2, "checkpoint.keep_last": 0}) + [
        STAGES, "train.max_steps=4", "optimizer.lr=1e-3"]


@pytest.mark.heavy  # 14 s
def test_stages_resume_after_kill9_matches_an_uninterrupted_run(tmp_path):
    assets = tmp_path / "assets"
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    run_job(_overrides(straight, assets))
    r = run_job(_overrides(crashed, assets), env={"MEGATRON_VLM_FAULT_KILL_AT_STEP": "3"}, check=False)
    assert r.returncode == -9, (r.returncode, r.stderr[-2000:])  # stage a (2 steps) done, stage b killed at step 3
    assert (crashed / "a" / "hf" / "config.json").is_file() and not (crashed / "b" / "hf").exists()
    stamp = (crashed / "a" / "hf" / "config.json").stat().st_mtime_ns
    r = run_job(_overrides(crashed, assets))
    assert "Resumed from checkpoint: step=2" in r.stderr
    assert (crashed / "a" / "hf" / "config.json").stat().st_mtime_ns == stamp  # stage a skipped
    for stage in ("a", "b"):
        la = [(int(x["step"]), float(x["loss"]), float(x["lr"])) for x in read_metrics(straight / stage / "metrics_train.csv")]
        lb = {int(x["step"]): (int(x["step"]), float(x["loss"]), float(x["lr"]))
              for x in read_metrics(crashed / stage / "metrics_train.csv")}
        assert [lb[s] for s, _, _ in la] == la and len(la) == (2 if stage == "a" else 4)
    a, b = load_safetensors_dir(straight / "b" / "hf"), load_safetensors_dir(crashed / "b" / "hf")
    assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-7


def test_a_stage_train_layers_matching_nothing_exits_2_naming_the_stage_key(tmp_path):
    """A pattern is checked against the built model (when the stage starts); the error names the key
    as the user wrote it, `stages[0].train_layers`, not the main section's `train.train_layers`."""
    sets = small_demo_overrides(tmp_path / "run", tmp_path / "assets", **{"train.max_steps": 1, "train.train_layers": "[]"}) + [
        'stages=[{name = "a", train_layers = ["^no_such_layer"]}]']
    r = run_job(sets, check=False)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "stages[0].train_layers: " in r.stderr and "match no parameter" in r.stderr, r.stderr[-2000:]
