"""`parallel.fsdp = false` in bf16 (bf16 weights, fp32 masters: parallel/master_weights.py) on the paths beside the
plain SFT step that tests/integration/test_no_fsdp_job.py compares: the resume checks that read the optimizer's
state, run in this process through the job runner (tiny demo jobs)."""
from __future__ import annotations

import contextlib
import io

from jobs import DEMO, small_demo_overrides

from megatron_vlm.config import load_config
from megatron_vlm.runner import run_job

BF16 = {"train.precision": '"bf16"', "train.eval_generate": "false", "data.synthetic_eval_size": 4,
        "logging.console": "false", "checkpoint.export_hf": "false", "checkpoint.keep_last": 0}
NO_FSDP = {"parallel.fsdp": "false"}


def _job(out, assets, **sets) -> tuple[int, str]:
    """Run one job in this process: (exit code, stderr)."""
    cfg = load_config(DEMO, small_demo_overrides(out, assets, **{**BF16, **sets}))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = run_job(cfg)
        except SystemExit as e:  # a refused resume ends the job with SystemExit(2)
            code = e.code
    return code, err.getvalue()


def test_resume_training_more_parameters_is_refused_without_fsdp(tmp_path):
    """The layout check asks the optimizer which parameters it has state for (torch's `get_state_dict`, which
    initialises the state of an optimizer that has none by a step with zero gradients); under fsdp = false that
    step must reach the masters, or the run reports none trained and the widened train_layers go unrefused."""
    code, err = _job(tmp_path / "a", tmp_path / "assets", **NO_FSDP, **{"train.max_steps": 2, "checkpoint.every_steps": 2})
    assert code == 0, err[-4000:]
    ckpt = tmp_path / "a" / "checkpoints" / "step_2"
    code, err = _job(tmp_path / "b", tmp_path / "assets", **NO_FSDP,
                     **{"train.max_steps": 3, "train.train_layers": "[]", "checkpoint.resume": f'"{ckpt}"'})
    assert code == 2, err[-4000:]
    assert "error: train.train_layers:" in err and "of them with no state in it" in err, err[-4000:]
