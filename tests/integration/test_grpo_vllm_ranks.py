"""A synchronous GRPO job with `rl.rollout_backend = "vllm"` on two processes (torchrun, gloo, FSDP over both):
every rank runs its own in-process vLLM engine (vLLM's external-launcher executor) on its share of the prompts,
fed from the FSDP shards after every optimizer step (marker `vllm`: runs in the environment docs/vllm.md
builds; skipped where vllm is not importable).

The run trains (rewards vary, gradients flow), each rank's engine is fed (weight pushes logged), vLLM's
log-probs stay within the masked-vision-token gap of the training forward's (as the one-process job), the job
ends cleanly (the engines' shutdown leaves the job's process group to the checkpoint and the export), and a
run killed with SIGKILL before step 3 and resumed repeats the uninterrupted run exactly: fresh engines on
both ranks, the checkpoint's weights pushed from the shards, the same per-request seeds."""
from __future__ import annotations

import importlib.util

import pytest
from jobs import REPO, load_safetensors_dir, read_metrics, run_job
from test_grpo_job import grpo_overrides

pytestmark = [pytest.mark.vllm, pytest.mark.distributed,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vllm is not installed here (run these tests in the vLLM environment: docs/vllm.md, "
                                        "'Running the vLLM tests')")]

GRPO_DEMO = REPO / "launch" / "configs" / "demo_grpo.toml"
VLLM = {"rl.rollout_backend": '"vllm"', "rl.vllm.cpu_kv_cache_gib": "1", "rl.vllm.max_num_seqs": "16"}


@pytest.mark.heavy  # three two-process vLLM jobs, minutes: `bash .ci/vllm_tests.sh -m vllm` runs it
def test_two_process_vllm_grpo_trains_and_resumes_exactly_after_kill9(tmp_path):
    assets = tmp_path / "assets"
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    r = run_job(grpo_overrides(straight, assets, **VLLM), config=GRPO_DEMO, nproc=2)
    assert "external_launcher executor, tensor-parallel 1" in r.stderr  # vLLM's executor inside the job's world
    rows = read_metrics(straight / "metrics_train.csv")
    assert [int(x["step"]) for x in rows] == [1, 2, 3, 4]
    assert float(rows[0]["reward/std"]) > 0 and float(rows[0]["grad_norm"]) > 0  # a real update happened
    for x in rows:
        assert float(x["rollout/weight_push_mb"]) > 0
        # vLLM's log-probs are of the distribution with the vision tokens masked (docs/vllm.md), the training
        # forward's without: ~3e-3 for this random tiny model, as in the one-process job
        assert 0 < float(x["rollout/logprob_abs_diff"]) < 0.02, x["rollout/logprob_abs_diff"]
    assert (straight / "checkpoints" / "step_4" / "COMPLETE").is_file() and (straight / "hf" / "config.json").is_file()

    r = run_job(grpo_overrides(crashed, assets, **VLLM), config=GRPO_DEMO, nproc=2,
                env={"MEGATRON_VLM_FAULT_KILL_AT_STEP": "3"}, check=False)
    assert r.returncode != 0
    assert (crashed / "checkpoints" / "step_2" / "COMPLETE").is_file()
    assert not (crashed / "checkpoints" / "step_4").exists()
    r = run_job(grpo_overrides(crashed, assets, **VLLM), config=GRPO_DEMO, nproc=2)
    assert "Resumed from checkpoint: step=2" in r.stderr
    resumed = {int(x["step"]): x for x in read_metrics(crashed / "metrics_train.csv")}
    assert sorted(resumed) == [1, 2, 3, 4]
    for row in rows:
        for key in ("reward/mean", "loss", "actor/kl", "response_length/mean", "grad_norm", "rollout/logprob_abs_diff"):
            assert float(resumed[int(row["step"])][key]) == float(row[key]), (row["step"], key)
    a, b = load_safetensors_dir(straight / "hf"), load_safetensors_dir(crashed / "hf")
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) == 0.0


@pytest.mark.heavy  # a two-process vLLM job, ~1-2 min
def test_tensor_parallel_vllm_engine_over_the_trainers_tp_group(tmp_path):
    """parallel.tp = 2 and rl.vllm.tensor_parallel_size = 2: one vLLM engine sharded over the trainer's tp group,
    fed from the trainer's tp shards (each rank gathers the full tensors, vLLM keeps its half). The engine's
    log-probs are the training forward's (up to the masked vision tokens' ~3e-3, as the one-process job): a
    wrong or missing half of any pushed weight would move them far more."""
    out = tmp_path / "tp"
    r = run_job(grpo_overrides(out, tmp_path / "assets", **VLLM, **{"parallel.tp": "2", "rl.vllm.tensor_parallel_size": "2"}),
                config=GRPO_DEMO, nproc=2)
    assert "external_launcher executor, tensor-parallel 2" in r.stderr
    rows = read_metrics(out / "metrics_train.csv")
    assert [int(x["step"]) for x in rows] == [1, 2, 3, 4]
    assert float(rows[0]["reward/std"]) > 0 and float(rows[0]["grad_norm"]) > 0
    for x in rows:
        assert float(x["rollout/weight_push_mb"]) > 0
        assert 0 < float(x["rollout/logprob_abs_diff"]) < 0.02, x["rollout/logprob_abs_diff"]
