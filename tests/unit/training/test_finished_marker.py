"""The `finished` file a job leaves in its run folder when it ends with 0 (runner.FINISHED_FILE).

Why it exists: a stop signal (SIGTERM / SIGUSR1) that comes after the last training step is not acted on, the job
evaluates, exports and ends with 0, but torchrun (signalled too) exits 1 all the same. launch/slurm/train.sbatch
reads this file, not the exit status, to decide that the run needs no requeue."""
from __future__ import annotations

from pathlib import Path

import pytest

from megatron_vlm import runner
from megatron_vlm.config import load_config

SFT = Path(__file__).resolve().parents[3] / "launch" / "configs" / "demo_sft.toml"


@pytest.mark.parametrize("code", [0, 143, 1])
def test_only_a_job_that_ends_with_0_leaves_the_file(tmp_path, monkeypatch, code):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "finished").write_text("an earlier job's\n")  # must not speak for this job
    seen = {}

    def fake_kind(ctx, before_step=None):
        seen["during"] = (ctx.run_dir / "finished").exists()
        return code

    monkeypatch.setattr(runner, "run_kind", fake_kind)
    monkeypatch.setattr(runner, "_prepare_model_folder", lambda cfg, env: None)
    assert runner.run_job(load_config(SFT, [f'train.output_dir="{run_dir}"'])) == code
    assert seen == {"during": False}
    assert (run_dir / "finished").exists() == (code == 0)
