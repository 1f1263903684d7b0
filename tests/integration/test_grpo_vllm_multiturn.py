"""A multi-turn GRPO job ([rl.env]) on the vLLM back end through the entry point (one process, tiny random
Qwen2.5-VL, an environment that answers turn 1 with a new image; marker `vllm`: runs in the environment
docs/vllm.md builds, `bash .ci/vllm_tests.sh -m vllm`; skipped where vllm is not importable).

The job reports the env/* metrics, its conversations go past turn 1 with no environment error, the update is
real, vLLM's log-probs stay close to the training forward's (`rollout/logprob_abs_diff`: the vision tokens vLLM
never samples make them differ by log(1 - p(vision tokens)), docs/vllm.md), and a run killed with SIGKILL before
step 3 and resumed repeats the uninterrupted run exactly (every turn's request seed is drawn from its
conversation's generator, a function of the seed, the step and the conversation). With vLLM rollout ranks
(`rl.allocation = "vllm:d1+d1"`) and max_head_offpolicyness = 0 the asynchronous loop repeats the synchronous
multi-turn vLLM run exactly."""
from __future__ import annotations

import importlib.util

import pytest
from jobs import load_safetensors_dir, read_metrics, run_job
from test_grpo_job import GRPO_DEMO, grpo_overrides

pytestmark = [pytest.mark.vllm, pytest.mark.distributed, pytest.mark.heavy,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vllm is not installed here (run these tests in the vLLM environment: docs/vllm.md, "
                                        "'Running the vLLM tests')")]

ENV = '{name = "tests.integration.grpo_env_fns:ShowImage", max_turns = 3, turn_timeout_s = 60.0}'


def vllm_multiturn_overrides(out, assets, **extra):
    return grpo_overrides(out, assets, **{
        "rl.env": ENV, "rl.rollout.stop": '["e", "a", "o"]', "data.max_tokens_per_pack": "200",
        "rl.batch.ppo_epochs": "1", "rl.batch.mini_batches_per_step": "1",
        "rl.rollout_backend": '"vllm"', "rl.vllm.cpu_kv_cache_gib": "1", "rl.vllm.max_num_seqs": "16", **extra})


def test_vllm_multiturn_grpo_job_and_exact_resume_after_kill9(tmp_path):
    assets = tmp_path / "assets"
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    run_job(vllm_multiturn_overrides(straight, assets), config=GRPO_DEMO)
    rows = read_metrics(straight / "metrics_train.csv")
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]
    assert max(float(r["env/turns_mean"]) for r in rows) > 1.0  # conversations went past turn 1
    for r in rows:
        assert float(r["env/errors"]) == 0 and float(r["rollout/weight_push_mb"]) > 0
        assert 0 <= float(r["rollout/logprob_abs_diff"]) < 0.02, r["rollout/logprob_abs_diff"]
    assert float(rows[0]["grad_norm"]) > 0

    r = run_job(vllm_multiturn_overrides(crashed, assets), config=GRPO_DEMO,
                env={"MEGATRON_VLM_FAULT_KILL_AT_STEP": "3"}, check=False)
    assert r.returncode == -9, (r.returncode, r.stderr[-3000:])
    r = run_job(vllm_multiturn_overrides(crashed, assets), config=GRPO_DEMO)
    assert "Resumed from checkpoint: step=2" in r.stderr
    resumed = {int(x["step"]): x for x in read_metrics(crashed / "metrics_train.csv")}
    for row in rows:
        for key in ("reward/mean", "loss", "env/turns_mean", "env/tokens_mean", "grad_norm"):
            assert float(resumed[int(row["step"])][key]) == float(row[key]), (row["step"], key)
    a, b = load_safetensors_dir(straight / "hf"), load_safetensors_dir(crashed / "hf")
    assert max((a[k] - b[k]).abs().max().item() for k in a) == 0.0


COMPARED = ("reward/mean", "loss", "grad_norm", "response_length/mean", "advantage/std", "env/turns_mean",
            "env/tokens_mean", "env/errors")


def test_vllm_rollout_ranks_multiturn_offpolicyness_0_equal_sync(tmp_path):
    assets = tmp_path / "assets"
    quick = {"rl.loss.kl_coef": "0.0", "rl.recompute_logprobs": "false", "rl.eval.at_start": "false",
             "rl.eval.every_steps": "0", "checkpoint.export_hf": "false", "checkpoint.enable": "false",
             "rl.reward_pool.workers": "1", "train.max_steps": "3"}
    run_job(vllm_multiturn_overrides(tmp_path / "sync", assets, **quick), config=GRPO_DEMO)
    want = read_metrics(tmp_path / "sync" / "metrics_train.csv")
    assert [int(r["step"]) for r in want] == [1, 2, 3] and max(float(r["env/turns_mean"]) for r in want) > 1.0
    run_job(vllm_multiturn_overrides(tmp_path / "async", assets, **quick, **{"rl.allocation": '"vllm:d1+d1"'}), nproc=2,
            config=GRPO_DEMO)
    got = {int(x["step"]): x for x in read_metrics(tmp_path / "async" / "metrics_train.csv")}
    assert sorted(got) == [1, 2, 3]
    for row in want:
        step = int(row["step"])
        for key in COMPARED:
            assert float(got[step][key]) == float(row[key]), (step, key, got[step][key], row[key])
        assert float(got[step]["async/version_lag_max"]) == 0.0
