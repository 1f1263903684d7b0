"""`parallel.fsdp = false` in bf16 (bf16 weights, fp32 masters: parallel/master_weights.py) on the paths beside the
plain SFT step that tests/integration/test_no_fsdp_job.py compares: the resume checks that read the optimizer's
state, run in this process through the job runner (tiny demo jobs); a PPO job (critic, KL reference, the rollout on
the trainer's weights) against the same job under FSDP2, row for row."""
from __future__ import annotations

import contextlib
import io

import pytest
import torch
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


@pytest.mark.heavy  # two GRPO jobs, ~40 s
def test_ppo_job_without_fsdp_is_fsdp2_bitwise(tmp_path):
    """A PPO job (GRPO demo, `advantage = "gae"`): the critic, the KL reference and the rollout engine on the
    trainer's own weights ("shared"), with rewards that vary (tests' text_length) so the policy really moves, gives
    the same rows and export under fsdp = false as under FSDP2 mixed precision."""
    from jobs import load_safetensors_dir, read_metrics
    from jobs import run_job as run_process
    from test_grpo_job import GRPO_DEMO, grpo_overrides
    from test_ppo_job import PPO

    rows = {}
    for name, fsdp in (("fsdp", '"auto"'), ("plain", "false")):
        run_process(grpo_overrides(tmp_path / name, tmp_path / "assets",
                                   **{**PPO, "train.precision": '"bf16"', "train.max_steps": "3",
                                      "checkpoint.every_steps": "0", "parallel.fsdp": fsdp}), config=GRPO_DEMO)
        rows[name] = [{k: r[k] for k in ("reward/mean", "loss", "grad_norm", "critic/kl_in_reward", "critic/value_loss",
                                         "critic/grad_norm")} for r in read_metrics(tmp_path / name / "metrics_train.csv")]
    assert len(rows["fsdp"]) == 3 and rows["fsdp"] == rows["plain"], rows
    assert float(rows["fsdp"][2]["grad_norm"]) > 0 and float(rows["fsdp"][2]["critic/kl_in_reward"]) != 0  # the policy moved
    a, b = load_safetensors_dir(tmp_path / "fsdp" / "hf"), load_safetensors_dir(tmp_path / "plain" / "hf")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
