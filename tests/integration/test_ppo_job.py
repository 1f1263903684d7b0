"""Whole PPO jobs (`[rl] advantage = "gae"` with a critic) through the entry point, tiny random Qwen2.5-VL: the
run logs the critic's metrics and saves its state in the checkpoints; a run killed with SIGKILL and resumed
repeats the uninterrupted one exactly — policy and critic, with the critic's warm-up step, the KL penalty in
the reward (reference model), recomputed old log-probs and 2 PPO epochs x 2 mini-batches all active; a GRPO
checkpoint resumed as PPO is refused (exit 2) naming rl.critic; a PPO run with one completion per prompt
(rl.batch.group_size = 1) learns, and a GRPO one is refused (exit 2) naming rl.batch.group_size."""
from __future__ import annotations

import json
import math

import pytest
from jobs import load_safetensors_dir, read_metrics, run_job
from test_grpo_job import GRPO_DEMO, grpo_overrides

pytestmark = [pytest.mark.distributed, pytest.mark.heavy]

PPO = {"rl.advantage": '"gae"', "rl.critic.lr": "0.001", "rl.critic.warmup_steps": "1", "rl.advantages.lam": "0.9",
       "rl.loss.kl_estimator": '"k1"'}
G1_STEPS = 8
CRITIC_METRICS = ("critic/value_loss", "critic/vf_clip_frac", "critic/values_old_mean", "critic/returns_mean",
                  "critic/explained_var", "critic/kl_in_reward", "critic/grad_norm", "advantage/max", "advantage/min")


def _critic_state(step_dir) -> dict:
    """The critic's tensors of a checkpoint (DCP -> one torch file)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = step_dir.parent.parent / f"critic_{step_dir.parent.parent.name}.pt"
    dcp_to_torch_save(str(step_dir), str(out))
    state = torch.load(out, weights_only=False)
    return state["critic"]


def test_ppo_run_and_exact_resume_after_kill9(tmp_path):
    assets = tmp_path / "assets"
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    run_job(grpo_overrides(straight, assets, **PPO), config=GRPO_DEMO)
    rows = read_metrics(straight / "metrics_train.csv")
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]
    for key in CRITIC_METRICS:
        assert all(float(r[key]) == float(r[key]) for r in rows), key  # present, not NaN
    assert float(rows[0]["critic/warmup"]) == 1.0  # the policy held at step 1: no policy loss or gradient
    assert math.isnan(float(rows[0]["loss"])) and math.isnan(float(rows[0]["grad_norm"]))
    assert float(rows[1]["critic/warmup"]) == 0.0 and float(rows[1]["grad_norm"]) > 0
    assert float(rows[0]["critic/values_old_mean"]) == 0.0 and float(rows[1]["critic/values_old_mean"]) != 0.0
    assert float(rows[2]["critic/kl_in_reward"]) != 0.0  # the policy has moved from the reference
    critic = _critic_state(straight / "checkpoints" / "step_4")
    assert any(k.startswith("value_head.") for k in critic["model"]) and critic["optim"]["state"]

    r = run_job(grpo_overrides(crashed, assets, **PPO), config=GRPO_DEMO,
                env={"MEGATRON_VLM_FAULT_KILL_AT_STEP": "3"}, check=False)
    assert r.returncode == -9, (r.returncode, r.stderr[-3000:])
    r = run_job(grpo_overrides(crashed, assets, **PPO), config=GRPO_DEMO)
    assert "Resumed from checkpoint: step=2" in r.stderr
    resumed = {int(x["step"]): x for x in read_metrics(crashed / "metrics_train.csv")}
    for row in rows:
        for key in ("reward/mean", "loss", "grad_norm", *CRITIC_METRICS):
            a, b = float(resumed[int(row["step"])][key]), float(row[key])
            assert a == b or (math.isnan(a) and math.isnan(b)), (row["step"], key)
        if int(row["step"]) > 1:  # actor/* from step 2 on (the policy held at step 1): the CSV's `extra` column
            assert json.loads(resumed[int(row["step"])]["extra"])["actor/kl"] == json.loads(row["extra"])["actor/kl"]
    a, b = load_safetensors_dir(straight / "hf"), load_safetensors_dir(crashed / "hf")
    assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) == 0.0
    c = _critic_state(crashed / "checkpoints" / "step_4")
    assert c["model"].keys() == critic["model"].keys()
    assert all(bool((c["model"][k] == critic["model"][k]).all()) for k in critic["model"])


def test_a_grpo_checkpoint_is_not_resumed_as_ppo(tmp_path):
    out = tmp_path / "run"
    run_job(grpo_overrides(out, tmp_path / "assets", **{"train.max_steps": "2"}), config=GRPO_DEMO)
    r = run_job(grpo_overrides(out, tmp_path / "assets", **{**PPO, "train.max_steps": "4"}), config=GRPO_DEMO, check=False)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "rl.critic: " in r.stderr and "holds no critic state" in r.stderr


def test_a_separate_critic_folder_trains_and_a_foreign_one_is_refused(tmp_path):
    """`rl.critic.model` = another model folder of the policy's family (here the tiny model with other weights);
    a folder of another family exits 2 naming rl.critic.model before anything is loaded."""
    from megatron_vlm.testing.synthesize import synthesize_model_folder

    synthesize_model_folder("tiny_qwen2_5_vl", tmp_path / "critic", seed=1)
    out = tmp_path / "run"
    sets = {**PPO, "train.max_steps": "2", "rl.critic.model": f'"{tmp_path / "critic"}"'}
    r = run_job(grpo_overrides(out, tmp_path / "assets", **sets), config=GRPO_DEMO)
    assert f"critic (advantage = 'gae'): {tmp_path / 'critic'}" in r.stderr
    rows = read_metrics(out / "metrics_train.csv")
    assert len(rows) == 2 and float(rows[1]["critic/values_old_mean"]) != 0.0
    synthesize_model_folder("tiny_qwen3_vl", tmp_path / "foreign", seed=0)
    sets["rl.critic.model"] = f'"{tmp_path / "foreign"}"'
    r = run_job(grpo_overrides(tmp_path / "run2", tmp_path / "assets", **sets), config=GRPO_DEMO, check=False)
    assert r.returncode == 2 and "rl.critic.model: " in r.stderr and "model_type" in r.stderr, r.stderr[-2000:]


def test_ppo_with_one_completion_per_prompt_runs_and_learns(tmp_path):
    """`rl.batch.group_size = 1` (verl's PPO with rollout.n = 1): the job generates one completion per prompt, trains
    the policy on the critic's GAE advantages (its reward rises) and the critic on the returns (its value loss falls),
    and logs no group metric; the same run
    with a group estimator exits 2 before anything is loaded, naming rl.batch.group_size and the estimator."""
    sets = {**PPO, "rl.critic.warmup_steps": "0", "rl.loss.kl_coef": "0.0", "rl.loss.kl_estimator": '"k3"',
            "rl.recompute_logprobs": "false", "rl.batch.group_size": "1", "rl.batch.prompts_per_step": "8",
            "rl.batch.ppo_epochs": "1", "rl.batch.mini_batches_per_step": "1", "train.max_steps": str(G1_STEPS),
            "checkpoint.every_steps": "0"}
    out = tmp_path / "run"
    r = run_job(grpo_overrides(out, tmp_path / "assets", **sets), config=GRPO_DEMO)
    assert "rl.update.prompt_sharing: off (rl.batch.group_size = 1" in r.stderr
    rows = read_metrics(out / "metrics_train.csv")
    assert [int(x["step"]) for x in rows] == list(range(1, G1_STEPS + 1))
    assert all(float(x["rollout/prompts"]) == 8.0 for x in rows)
    assert "reward/zero_var_group_frac" not in rows[0] and "reward/zero_var_group_frac" not in json.loads(rows[0]["extra"] or "{}")
    for key in ("loss", "grad_norm", *CRITIC_METRICS):
        assert all(math.isfinite(float(x[key])) for x in rows), key
    assert all(float(x["grad_norm"]) > 0 for x in rows)
    # the policy learns the reward (text length; measured 0.42, 0.45 at steps 1-2 and 0.68, 0.82 at steps 7-8), and
    # the critic the returns: its values start at 0, its value loss falls (0.060 -> 0.004 measured)
    reward = [float(x["reward/mean"]) for x in rows]
    assert sum(reward[-2:]) / 2 > sum(reward[:2]) / 2 + 0.15, reward
    loss = [float(x["critic/value_loss"]) for x in rows]
    assert float(rows[0]["critic/values_old_mean"]) == 0.0 and loss[-1] < loss[0] / 3, loss

    r = run_job(grpo_overrides(tmp_path / "grpo", tmp_path / "assets", **{"rl.batch.group_size": "1"}), config=GRPO_DEMO,
                check=False)
    assert r.returncode == 2 and "rl.batch.group_size: 1 completion per prompt with advantage = 'grpo'" in r.stderr, \
        r.stderr[-2000:]
