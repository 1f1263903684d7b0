"""Routing replay through the GRPO entry point on the tiny Qwen3-VL-MoE policy (bf16 rollout copy vs the
bf16 training forwards: the decode / packed layouts round differently, so some tokens route elsewhere).

- synchronous, replay off and on: both log rollout/routing_mismatch_frac (a fraction) with the mismatch KL;
  a run with replay killed (SIGKILL) before step 3 and resumed from its step-2 checkpoint repeats the
  uninterrupted run exactly (the rollouts of a resumed step are generated, and their routes recorded, again);
- asynchronous with stale samples (max_head_offpolicyness = 2, one rollout + one training rank): the routes
  travel over the bridge with the samples and the decoupled loss trains on them (routing mismatch logged).
- tensor parallelism (tp = 2, fp32): the replicated MoE blocks take the routes of the gathered sequence.
- context parallelism (cp = 2, fp32): each rank's context-parallel layers take the routes of its chunks.
- the megatron-core backend (fp32): its MoE layers record in the rollout and replay in the training forwards;
  also with ep = 2 (its all-to-all dispatcher, the rollout decoding in lock-step through the sharded layers).
- multi-turn [rl.env] (fp32): the trajectories' routes cover the environment's tokens too, and replay over them.
- a LoRA policy (fp32) replays as well.
"""
from __future__ import annotations

import pytest
from jobs import REPO, read_metrics, run_job
from test_grpo_job import grpo_overrides

pytestmark = pytest.mark.heavy  # whole jobs (~45 s each on the loaded CI machine)

GRPO_DEMO = REPO / "launch" / "configs" / "demo_grpo.toml"
COMPARED = ("reward/mean", "loss", "grad_norm", "rollout/mismatch_kl", "rollout/routing_mismatch_frac")


def _sets(out, assets, replay: str, **extra):
    base = {"model.synthesize": '"tiny_qwen3_vl_moe"', "rl.routing_replay": f'"{replay}"', "train.precision": '"bf16"',
            "rl.rollout.weights": '"copy"', "rl.loss.kl_coef": "0.0", "rl.reward_pool.workers": "1",
            "checkpoint.export_hf": "false"}
    base.update(extra)
    return grpo_overrides(out, assets, **base)


def _frac(row) -> float:
    v = float(row["rollout/routing_mismatch_frac"])
    assert 0.0 <= v <= 1.0, v
    return v


def test_sync_replay_off_and_on_and_exact_resume(tmp_path):
    assets = tmp_path / "assets"
    off = tmp_path / "off"
    run_job(_sets(off, assets, "off", **{"train.max_steps": "2", "checkpoint.enable": "false"}), config=GRPO_DEMO)
    for row in read_metrics(off / "metrics_train.csv"):
        _frac(row)
        assert float(row["rollout/mismatch_kl"]) >= 0

    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    run_job(_sets(straight, assets, "rollout"), config=GRPO_DEMO)
    rows = read_metrics(straight / "metrics_train.csv")
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4] and all(_frac(r) >= 0 for r in rows)
    r = run_job(_sets(crashed, assets, "rollout"), config=GRPO_DEMO, env={"MEGATRON_VLM_FAULT_KILL_AT_STEP": "3"},
                check=False)
    assert r.returncode == -9, (r.returncode, r.stderr[-3000:])
    r = run_job(_sets(crashed, assets, "rollout"), config=GRPO_DEMO)
    assert "Resumed from checkpoint: step=2" in r.stderr
    resumed = {int(x["step"]): x for x in read_metrics(crashed / "metrics_train.csv")}
    for row in rows:
        for key in COMPARED:
            assert float(resumed[int(row["step"])][key]) == float(row[key]), (row["step"], key)


@pytest.mark.distributed
def test_async_stale_samples_carry_their_routes(tmp_path):
    out = tmp_path / "async"
    sets = _sets(out, tmp_path / "assets", "rollout", **{
        "rl.allocation": '"rollout:1+train:1"', "rl.asynchronous.max_head_offpolicyness": "2",
        "rl.loss.behav_imp_weight_cap": "5.0", "train.max_steps": "4", "checkpoint.enable": "false",
        "rl.recompute_logprobs": "false", "rl.batch.ppo_epochs": "1"})
    run_job(sets, nproc=2, config=GRPO_DEMO)
    rows = read_metrics(out / "metrics_train.csv")
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]
    assert all(_frac(r) >= 0 for r in rows)
    assert max(float(r["async/version_lag_max"]) for r in rows) >= 1  # stale samples were trained on


@pytest.mark.distributed
def test_tensor_parallel_training_forwards_take_the_routes(tmp_path):
    """tp = 2 (MoE blocks replicated over tp: they run the gathered sequence, the recorded routes' token order),
    fp32: the training forwards route as the rollout did and their log-probs equal the rollout's."""
    out = tmp_path / "tp"
    sets = grpo_overrides(out, tmp_path / "assets", **{
        "model.synthesize": '"tiny_qwen3_vl_moe"', "rl.routing_replay": '"rollout"', "parallel.tp": "2",
        "train.max_steps": "2", "checkpoint.enable": "false", "checkpoint.export_hf": "false", "rl.loss.kl_coef": "0.0",
        "rl.reward_pool.workers": "1"})
    run_job(sets, nproc=2, config=GRPO_DEMO)
    rows = read_metrics(out / "metrics_train.csv")
    assert [int(r["step"]) for r in rows] == [1, 2]
    for r in rows:
        assert _frac(r) <= 0.01 and float(r["rollout/logprob_abs_diff"]) < 1e-5, r


@pytest.mark.distributed
def test_context_parallel_training_forwards_take_the_routes(tmp_path):
    """cp = 2 (each rank's MoE blocks run its load-balanced chunks of the pack), fp32: the training forwards
    route as the rollout did (the counts summed over the cp ranks) and their log-probs equal the rollout's."""
    out = tmp_path / "cp"
    sets = grpo_overrides(out, tmp_path / "assets", **{
        "model.synthesize": '"tiny_qwen3_vl_moe"', "rl.routing_replay": '"rollout"', "parallel.cp": "2",
        "train.max_steps": "2", "checkpoint.enable": "false", "checkpoint.export_hf": "false", "rl.loss.kl_coef": "0.0",
        "rl.reward_pool.workers": "1"})
    run_job(sets, nproc=2, config=GRPO_DEMO)
    rows = read_metrics(out / "metrics_train.csv")
    assert [int(r["step"]) for r in rows] == [1, 2]
    for r in rows:
        assert _frac(r) <= 0.01 and float(r["rollout/logprob_abs_diff"]) < 1e-5, r


def test_mcore_backend_replays(tmp_path):
    """parallel.backend = "mcore" (megatron-core's MoELayer in every MoE layer, the engine decoding through them),
    fp32: the routes its rollout recorded lie over its training forwards and the log-probs equal the rollout's."""
    out = tmp_path / "mcore"
    sets = grpo_overrides(out, tmp_path / "assets", **{
        "model.synthesize": '"tiny_qwen3_vl_moe"', "rl.routing_replay": '"rollout"', "parallel.backend": '"mcore"',
        "train.max_steps": "2", "checkpoint.enable": "false", "checkpoint.export_hf": "false", "rl.loss.kl_coef": "0.0",
        "rl.reward_pool.workers": "1"})
    run_job(sets, config=GRPO_DEMO)
    rows = read_metrics(out / "metrics_train.csv")
    assert [int(r["step"]) for r in rows] == [1, 2]
    for r in rows:
        assert _frac(r) <= 0.01 and float(r["rollout/logprob_abs_diff"]) < 1e-5, r


@pytest.mark.distributed
def test_mcore_expert_parallel_replays(tmp_path):
    """parallel.backend = "mcore" with ep = 2 (each rank holds half of megatron-core's experts; the rollout decodes
    in lock-step through them, rollout.weights = "shared"), fp32: recorded and replayed routes agree."""
    out = tmp_path / "mcore_ep"
    sets = grpo_overrides(out, tmp_path / "assets", **{
        "model.synthesize": '"tiny_qwen3_vl_moe"', "rl.routing_replay": '"rollout"', "parallel.backend": '"mcore"',
        "parallel.ep": "2", "rl.rollout.weights": '"shared"', "train.max_steps": "2", "checkpoint.enable": "false",
        "checkpoint.export_hf": "false", "rl.loss.kl_coef": "0.0", "rl.reward_pool.workers": "1"})
    run_job(sets, nproc=2, config=GRPO_DEMO)
    rows = read_metrics(out / "metrics_train.csv")
    assert [int(r["step"]) for r in rows] == [1, 2]
    for r in rows:
        assert _frac(r) <= 0.01 and float(r["rollout/logprob_abs_diff"]) < 1e-5, r


def test_multiturn_trajectories_replay(tmp_path):
    """[rl.env] (an environment answering turn 1 with an image), fp32: every trajectory carries the routes of its
    model and environment tokens; the training forwards route as the rollout did and match its log-probs."""
    from test_grpo_multiturn import multiturn_overrides

    out = tmp_path / "env"
    sets = multiturn_overrides(out, tmp_path / "assets", **{
        "model.synthesize": '"tiny_qwen3_vl_moe"', "rl.routing_replay": '"rollout"', "train.max_steps": "2",
        "checkpoint.enable": "false", "checkpoint.export_hf": "false", "rl.loss.kl_coef": "0.0",
        "rl.reward_pool.workers": "1"})
    run_job(sets, config=GRPO_DEMO)
    rows = read_metrics(out / "metrics_train.csv")
    assert [int(r["step"]) for r in rows] == [1, 2]
    assert max(float(r["env/turns_mean"]) for r in rows) > 1.0  # conversations went past turn 1
    for r in rows:
        assert _frac(r) <= 0.01 and float(r["rollout/logprob_abs_diff"]) < 1e-5, r


def test_lora_policy_replays(tmp_path):
    """[lora] (adapters on the attention / MLP projections; the engine's copy mirrors them), fp32: the routes
    lie over the training forwards and the log-probs equal the rollout's."""
    out = tmp_path / "lora"
    sets = grpo_overrides(out, tmp_path / "assets", **{
        "model.synthesize": '"tiny_qwen3_vl_moe"', "rl.routing_replay": '"rollout"', "lora.r": "4",
        "train.train_layers": "[]", "rl.rollout.weights": '"copy"', "train.max_steps": "2", "checkpoint.enable": "false",
        "checkpoint.export_hf": "false", "rl.loss.kl_coef": "0.0", "rl.reward_pool.workers": "1"})
    run_job(sets, config=GRPO_DEMO)
    rows = read_metrics(out / "metrics_train.csv")
    assert [int(r["step"]) for r in rows] == [1, 2]
    for r in rows:
        assert _frac(r) <= 0.01 and float(r["rollout/logprob_abs_diff"]) < 1e-5, r
