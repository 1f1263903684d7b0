"""`rl.rollout.kv_block_size` through the entry point (one process, tiny random Qwen2.5-VL, synthetic VQA prompts):
a GRPO job whose rollout engine decodes on the paged KV cache (blocks of 4 positions) trains as the same
job on the slot cache. Sampled at temperature 1 with the job's fixed seed, so equal rewards and response
lengths mean equal tokens; the rollout log-probs enter the logged rollout / training mismatch (recomputed
old log-probs vs the engine's) and, through the PPO ratio, the loss; the held-out evaluation before and
after training (greedy, the same engine) must agree too. The log shows the engine took the paged cache.
The default weights mode ("shared": lock-step forwards through the FSDP root) is the one exercised. A Nemotron-VL
(Mamba2 hybrid) job with the key exits 2 naming it.

Heavy (three jobs, one of two processes, ~1-2 min): asynchronous GRPO (1 rollout + 1 training rank, the
rollout rank's own engine) with rl.rollout.kv_block_size = 4 equals the synchronous "copy" job on the slot cache, and
a "copy" job with the smallest pool rl.rollout.kv_cache_blocks allows (one sample of a full pack: samples wait for
blocks) runs to the end with the pool the log names."""
from __future__ import annotations

import pytest
from jobs import REPO, read_metrics, run_job
from test_grpo_job import grpo_overrides

pytestmark = pytest.mark.distributed

GRPO_DEMO = REPO / "launch" / "configs" / "demo_grpo.toml"
EXACT = ("reward/mean", "reward/std", "response_length/mean", "response_length/min", "response_length/max",
         "advantage/std")  # functions of the sampled tokens
# Functions of the rollout log-probs. Paged and slot decode steps run the same SDPA on the same gathered keys
# (kernels/reference/decode_attention.py), equal to the last bit here; the tolerances allow a few ulps of float32
# log-probs (~1e-7 at |logp| ~ 7) and still fail for keys scaled by 1.001 in the paged cache (a tried mutation:
# logprob_abs_diff 2.7e-7 -> 5.5e-7, mismatch_ratio_min / max off by 9.5e-7).
CLOSE = {"loss": 1e-6, "grad_norm": 1e-6, "actor/clip_frac": 1e-6, "rollout/mismatch_ratio_mean": 2e-7,
         "rollout/mismatch_ratio_min": 2e-7, "rollout/mismatch_ratio_max": 2e-7, "rollout/logprob_abs_diff": 1e-7}


@pytest.mark.heavy  # two GRPO jobs (~21 s); CI keeps the unit tests (config flow, lock-step steps on the paged cache)
def test_paged_kv_cache_job_trains_like_the_slot_cache(tmp_path):
    assets = tmp_path / "assets"
    rows, evals = {}, {}
    for block in (0, 4):
        out = tmp_path / f"block{block}"
        r = run_job(grpo_overrides(out, assets, **{
            "rl.rollout.kv_block_size": str(block), "train.max_steps": "2", "rl.batch.ppo_epochs": "1", "checkpoint.export_hf": "false",
            "checkpoint.every_steps": "0", "rl.reward_pool.workers": "1"}), config=GRPO_DEMO)
        assert ("rollout KV cache: paged, 4 positions per block" in r.stderr) == (block == 4), r.stderr[-3000:]
        rows[block] = read_metrics(out / "metrics_train.csv")
        evals[block] = read_metrics(out / "metrics_eval.csv")
    assert len(rows[0]) == len(rows[4]) == 2 and float(rows[0][0]["reward/std"]) > 0 and float(rows[0][0]["grad_norm"]) > 0
    for a, b in zip(rows[0], rows[4]):
        for key in EXACT:
            assert float(b[key]) == float(a[key]), (a["step"], key, a[key], b[key])
        for key, tol in CLOSE.items():
            assert float(b[key]) == pytest.approx(float(a[key]), abs=tol), (a["step"], key, a[key], b[key])
    assert [int(e["step"]) for e in evals[0]] == [int(e["step"]) for e in evals[4]] == [0, 2]
    for a, b in zip(evals[0], evals[4]):
        for key in ("avg@1", "pass@1", "response_length"):
            assert float(b[key]) == float(a[key]), (a["step"], key)


def test_hybrid_decoder_job_exits_2_naming_the_key(tmp_path):
    """Nemotron-VL (Mamba2 hybrid) with rl.rollout.kv_block_size: the job's engine refuses it (exit 2, one line), ~5 s."""
    r = run_job(grpo_overrides(tmp_path / "out", tmp_path / "assets", **{
        "model.path": f'"{tmp_path / "nemotron"}"', "model.synthesize": '"tiny_nemotron_vl"', "train.train_layers": "[]",
        "rl.rollout.kv_block_size": "4"}), config=GRPO_DEMO, check=False)
    errors = [x for x in r.stderr.splitlines() if x.startswith("config error:")]
    assert r.returncode == 2 and len(errors) == 1, r.stderr[-3000:]
    assert errors[0].startswith("config error: rl.rollout.kv_block_size: 4 (the paged KV cache) is not possible: ") and "Mamba2" in errors[0]


@pytest.mark.heavy  # three jobs (one of two processes)
def test_async_rollout_ranks_and_a_fixed_pool(tmp_path):
    assets = tmp_path / "assets"
    common = {"rl.loss.kl_coef": "0.0", "rl.recompute_logprobs": "false", "rl.batch.ppo_epochs": "1", "rl.eval.at_start": "false",
              "train.max_steps": "2", "checkpoint.export_hf": "false", "rl.reward_pool.workers": "1", "checkpoint.enable": "false"}
    sync = tmp_path / "sync"
    run_job(grpo_overrides(sync, assets, **common, **{"rl.rollout.weights": '"copy"'}), config=GRPO_DEMO)
    want = read_metrics(sync / "metrics_train.csv")
    out = tmp_path / "async"
    run_job(grpo_overrides(out, assets, **common, **{"rl.allocation": '"rollout:1+train:1"', "rl.rollout.kv_block_size": "4"}),
            nproc=2, config=GRPO_DEMO)
    got = read_metrics(out / "metrics_train.csv")
    assert [int(r["step"]) for r in got] == [int(r["step"]) for r in want] == [1, 2]
    for a, b in zip(want, got):
        for key in EXACT:
            assert float(b[key]) == float(a[key]), (a["step"], key, a[key], b[key])
        for key in ("loss", "grad_norm"):
            assert float(b[key]) == pytest.approx(float(a[key]), abs=CLOSE[key]), (a["step"], key)
        assert float(b["async/version_lag_max"]) == 0.0
    pool = tmp_path / "pool"  # data.max_tokens_per_pack = 160: 1 + 160 / 4 blocks, room for one sample at a time
    r = run_job(grpo_overrides(pool, assets, **common, **{"rl.rollout.weights": '"copy"', "rl.rollout.kv_block_size": "4",
                                                          "rl.rollout.kv_cache_blocks": "41"}), config=GRPO_DEMO)
    assert "rollout KV cache: paged, 4 positions per block, pool of 41 blocks" in r.stderr, r.stderr[-3000:]
    rows = read_metrics(pool / "metrics_train.csv")
    assert [int(x["step"]) for x in rows] == [1, 2]
    assert all(float(x["loss"]) == float(x["loss"]) and float(x["response_length/mean"]) >= 1 for x in rows)
