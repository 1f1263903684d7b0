"""Asynchronous GRPO with vLLM rollout ranks (`rl.allocation = "vllm:d1+d1"`, `rl.rollout_backend = "vllm"`)
through the entry point: one rollout rank + one training rank (2 processes, gloo, tiny random Qwen2.5-VL,
synthetic VQA prompts with images; marker `vllm`: runs in the environment docs/vllm.md builds,
`bash .ci/vllm_tests.sh`; skipped where vllm is not importable).

- max_head_offpolicyness = 0 repeats the synchronous loop with the vLLM back end (one process): the same
  rewards, losses, gradient norms, lengths and vLLM / training log-prob differences at every step — the
  rollout rank's engine is fed the trainer's pushes (received into its model, then streamed into vLLM
  with generation paused), and draws every request's seed from the same (seed, step, rank) generator;
- max_head_offpolicyness = 1: the rollout rank runs ahead (samples a version old arrive) and the
  trainer's per-token staleness check never fires (marked heavy: a 4-step job more).
The push into a running generation itself (versions 0 then 1, each token's log-prob the policy's that
drew it) is tested in tests/unit/rl/test_vllm_engine.py."""
from __future__ import annotations

import importlib.util

import pytest
from jobs import REPO, read_metrics, run_job
from test_grpo_job import grpo_overrides

pytestmark = [pytest.mark.vllm, pytest.mark.distributed,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vllm is not installed here (run these tests in the vLLM environment: docs/vllm.md, "
                                        "'Running the vLLM tests')")]

GRPO_DEMO = REPO / "launch" / "configs" / "demo_grpo.toml"
COMPARED = ("reward/mean", "loss", "grad_norm", "response_length/mean", "advantage/std")


def _tiny(out, assets, **extra):
    base = {"rl.loss.kl_coef": "0.0", "rl.recompute_logprobs": "false", "rl.batch.ppo_epochs": "1",
            "rl.batch.mini_batches_per_step": "2", "rl.eval.at_start": "false", "checkpoint.export_hf": "false",
            "rl.reward_pool.workers": "1", "checkpoint.enable": "false", "rl.rollout_backend": '"vllm"',
            "rl.vllm.cpu_kv_cache_gib": "1", "rl.vllm.max_num_seqs": "16"}
    base.update(extra)
    return grpo_overrides(out, assets, **base)


def test_vllm_rollout_ranks_offpolicyness_0_equal_sync(tmp_path):
    assets = tmp_path / "assets"
    sync = tmp_path / "sync"
    run_job(_tiny(sync, assets, **{"train.max_steps": "3"}), config=GRPO_DEMO)
    want = read_metrics(sync / "metrics_train.csv")
    assert [int(r["step"]) for r in want] == [1, 2, 3] and float(want[0]["grad_norm"]) > 0
    out = tmp_path / "async"
    run_job(_tiny(out, assets, **{"rl.allocation": '"vllm:d1+d1"', "train.max_steps": "3"}), nproc=2, config=GRPO_DEMO)
    got = {int(x["step"]): x for x in read_metrics(out / "metrics_train.csv")}
    assert sorted(got) == [1, 2, 3]
    for row in want:
        step = int(row["step"])
        for key in COMPARED:
            assert float(got[step][key]) == float(row[key]), (step, key, got[step][key], row[key])
        assert float(got[step]["async/version_lag_max"]) == 0.0


@pytest.mark.heavy  # a 4-step 2-process job with two vLLM engines; CI runs the k = 0 comparison above
def test_vllm_rollout_ranks_bounded_staleness(tmp_path):
    out = tmp_path / "run"
    sets = _tiny(out, tmp_path / "assets", **{"rl.allocation": '"vllm:d1+d1"', "rl.asynchronous.max_head_offpolicyness": "1",
                                               "rl.loss.behav_imp_weight_cap": "5.0", "train.max_steps": "4",
                                               "rl.eval.every_steps": "0"})
    run_job(sets, nproc=2, config=GRPO_DEMO)
    rows = read_metrics(out / "metrics_train.csv")
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]
    lags = [float(r["async/version_lag_max"]) for r in rows]
    assert max(lags) <= 1 and max(lags) > 0, lags  # ran ahead, never beyond the bound
    for r in rows:
        w = float(r["actor/behav_imp_weight"])
        assert w == w and w > 0
