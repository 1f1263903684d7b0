"""The GRPO demo (launch/configs/demo_grpo.toml, tiny random Qwen2.5-VL, synthetic VQA prompts, the
smallest settings of test_grpo_job.py) runs a few steps with every `[rl] policy_loss`, every
`advantage`, DAPO's dynamic sampling and overlong shaping, and every `rollout_correction`. Three
jobs cover them all (clip / grpo / no correction are what the other GRPO job tests run):

    A  gspo (paper clip ranges) + dr_grpo + seq-mean-token-sum-norm + dynamic sampling + tis
    B  gspo_token + rloo + overlong penalty + mask_truncated + mis
    C  cispo + entropy bonus + grpo advantages

The reward of A is constant for half the prompts (the synthetic questions repeat: about 70 % of the
groups have zero variance), so dynamic sampling has to sample again.
Each job must finish, log the variant's metrics without NaN and make real updates."""
from __future__ import annotations

import math

import pytest
from jobs import REPO, read_metrics, run_job
from test_grpo_job import grpo_overrides

pytestmark = pytest.mark.distributed

GRPO_DEMO = REPO / "launch" / "configs" / "demo_grpo.toml"
STEPS = 2

COMMON = {
    "train.max_steps": STEPS, "checkpoint.enable": "false", "checkpoint.export_hf": "false",
    "rl.batch.ppo_epochs": 1, "rl.batch.mini_batches_per_step": 1, "rl.loss.kl_coef": "0.0", "rl.recompute_logprobs": "false",
    "rl.eval.at_start": "false", "rl.eval.max_prompts": 2,
}
JOBS = {
    "gspo_drgrpo_dynamic_tis": {
        "rl.policy_loss": '"gspo"', "rl.loss.clip_ratio_low": "3e-4", "rl.loss.clip_ratio_high": "4e-4",
        "rl.advantage": '"dr_grpo"', "rl.loss.loss_agg": '"seq-mean-token-sum-norm"',
        "rl.advantages.dynamic_sampling": "true", "rl.advantages.max_sampling_rounds": 6,
        "rl.recompute_logprobs": "true", "rl.loss.rollout_correction": '"tis"', "rl.loss.rollout_correction_cap": "2.0",
        "rl.rewards": '[{type = "custom", function = "tests.integration.grpo_variant_reward_fns.half_constant"}, '
                      '{type = "exact_match", weight = 0.0}]',
    },
    "gspo_token_rloo_overlong_mis": {
        "rl.policy_loss": '"gspo_token"', "rl.advantage": '"rloo"', "rl.loss.loss_agg": '"seq-mean"',
        "rl.advantages.overlong_buffer": 3, "rl.advantages.overlong_penalty": "0.5", "rl.update.mask_truncated": "true",
        "rl.rollout.stop": '["e", "a"]',  # the random model rarely ends before max_new_tokens: stop strings vary the lengths
        "rl.recompute_logprobs": "true", "rl.loss.rollout_correction": '"mis"', "rl.loss.rollout_correction_cap": "2.0",
    },
    "cispo_entropy": {
        "rl.policy_loss": '"cispo"', "rl.loss.entropy_coef": "0.01", "rl.advantage": '"grpo"',
    },
}
EXPECTED = {
    "gspo_drgrpo_dynamic_tis": ("sampling/rounds", "sampling/kept_groups", "sampling/dropped_groups", "actor/tis_weight_mean",
                                "rollout/mismatch_kl", "rollout/mismatch_ratio_min", "rollout/mismatch_ratio_max"),
    "gspo_token_rloo_overlong_mis": ("reward/overlong_penalty", "train/masked_truncated", "rollout/mis_dropped_frac",
                                     "rollout/mismatch_kl"),
    "cispo_entropy": ("actor/entropy", "actor/clip_frac"),
}
ALWAYS = ("actor/entropy", "response_length/mean", "response_length/max", "response_length/truncated_frac",
          "reward/zero_var_group_frac", "loss", "grad_norm")


@pytest.mark.heavy  # ~31 s; CI keeps the loss-variant unit tests (tests/unit/rl/test_loss_variants.py)
def test_grpo_demo_runs_every_variant(tmp_path):
    assets = tmp_path / "assets"
    for name, sets in JOBS.items():
        out = tmp_path / name
        run_job(grpo_overrides(out, assets, **{**COMMON, **sets}), config=GRPO_DEMO)
        rows = read_metrics(out / "metrics_train.csv")
        assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1)), name
        for key in ALWAYS + EXPECTED[name]:
            for r in rows:
                assert key in r and math.isfinite(float(r[key])), (name, key, r.get(key))
        assert any(float(r["grad_norm"]) > 0 for r in rows), name  # real updates happened
        if name == "gspo_drgrpo_dynamic_tis":
            # half the groups have a constant reward: dynamic sampling refills the 4 groups of each step
            assert all(float(r["sampling/kept_groups"]) == 4 for r in rows), [r["sampling/kept_groups"] for r in rows]
            assert any(float(r["sampling/rounds"]) > 1 for r in rows)
        if name == "gspo_token_rloo_overlong_mis":  # some completions cut (masked, penalised), some not
            masked = [float(r["train/masked_truncated"]) for r in rows]
            assert sum(masked) > 0 and all(m < 16 for m in masked), masked
            assert all(-0.5 < float(r["reward/overlong_penalty"]) <= 0 for r in rows)
            assert any(float(r["reward/overlong_penalty"]) < 0 for r in rows)
        assert (out / "metrics_eval.csv").is_file()
