"""The metrics of one GRPO step, reduced over the data shards: rewards, lengths, advantages, sampling,
the loss's actor/* means, the rollout / training mismatch, phase times and throughput.

Why one gather: every rank contributes its numbers once (one `all_gather_objects` per step), and every
rank computes the same dictionary from them (the loop logs rank 0's).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_vlm.rl.advantages import advantage_stats
from megatron_vlm.rl.data_shards import DataShards
from megatron_vlm.rl.metrics import PhaseTimer, length_metrics, reward_metrics
from megatron_vlm.rl.policy_update import UpdateResult
from megatron_vlm.rl.rounds import Round

__all__ = ["StepCounts", "step_metrics"]


@dataclass
class StepCounts:
    """Counts of a step that neither the rounds nor the update hold."""
    rounds: int
    surplus: int
    """Dynamic sampling: groups of the last round dropped beyond prompts_per_step (over all ranks)."""
    masked_truncated: int
    """Completions left out of the update because they were cut at max_new_tokens (rl.update.mask_truncated)."""
    skipped_prompts: int
    """Prompts the encoder skipped so far (this rank)."""
    reward_failures: dict[str, float]
    """The reward manager's failure counters (this rank)."""
    skipped_steps: int
    """Updates skipped for a non-finite loss or gradient norm (the step guard's count)."""


def step_metrics(rl: Any, shards: DataShards, step: int, timer: PhaseTimer, rounds: Sequence[Round], upd: UpdateResult,
                 counts: StepCounts, *, reward_labels: Sequence[str], zero_adv_on: bool) -> dict[str, float]:
    """The step's metrics (the same on every rank). With [rl.env], "env" (the environment's return, every round's
    `per_reward`) is reported as a reward too: reward/env, and the accuracy when it is the accuracy label."""
    if getattr(rl, "env", None) is not None and "env" not in reward_labels:
        reward_labels = [*reward_labels, "env"]
    G = rl.batch.group_size
    real = [x for rd in rounds for x in rd.real]
    trained: list[bool] = []  # per real sample: its group is trained (mask_truncated is counted separately)
    for rd in rounds:
        trained += [rd.keep_group[i // G] for i in range(len(rd.real))]
    zero_var = [bool(z) for rd in rounds if rd.adv is not None and rd.adv.zero_variance is not None
                for z in rd.adv.zero_variance.tolist()]
    local = {
        "total": [t for rd in rounds for t in rd.total],
        "per_reward": {label: [v for rd in rounds for v in rd.per_reward.get(label, [])] for label in reward_labels},
        "penalty": [p for rd in rounds for p in rd.penalty],
        "lengths": [int(s.token_ids.numel()) for s in real], "truncated": [s.truncated for s in real],
        "adv": [a for rd in rounds if rd.adv is not None for a in rd.adv.advantages.tolist()], "keep": trained,
        "dropped": sum(rd.adv.num_dropped_groups for rd in rounds if rd.adv is not None),
        "groups": len(zero_var), "zero_var": sum(zero_var), "kept_groups": sum(sum(rd.keep_group) for rd in rounds),
        "masked_truncated": counts.masked_truncated, "mismatch": upd.mismatch, "routing": upd.routing,
        "zero_adv_skipped": upd.zero_adv_skipped,
        "sums": upd.sums, "weights": upd.weights, "diff": upd.diff, "train_tokens": upd.train_tokens,
        "gen_tokens": sum(int(s.token_ids.numel()) for s in real), "skipped": counts.skipped_prompts,
        "reward_fail": counts.reward_failures, "prompts": sum(rd.shard.num_real for rd in rounds),
    }
    parts = shards.gather(local)

    def cat(key: str) -> list[Any]:
        return [x for p in parts for x in p[key]]

    per = {label: [x for p in parts for x in p["per_reward"].get(label, [])] for label in reward_labels}
    out: dict[str, float] = {}
    # loss (mean over the optimizer updates of this step; identical on every rank once summed); a step without policy
    # updates (PPO's critic warm-up) computed neither: NaN, the loggers' "not computed" (an empty cell would move
    # the column out of a CSV header written from the first row), never a 0.0 a plot would show as a real loss
    losses = [sum(v) for v in zip(*shards.gather(upd.losses))] if upd.losses else []
    out["loss"] = sum(losses) / len(losses) if losses else math.nan
    out["grad_norm"] = sum(upd.grad_norms) / len(upd.grad_norms) if upd.grad_norms else math.nan
    out["lr"] = upd.lr
    out["skipped_steps"] = float(counts.skipped_steps)
    if upd.moe:
        out.update(upd.moe)
    out.update(reward_metrics(cat("total"), per, accuracy_label=rl.accuracy_label(), threshold=rl.eval.correct_threshold))
    out.update(length_metrics(cat("lengths"), cat("truncated")))
    out.update(advantage_stats(torch.tensor(cat("adv")), torch.tensor(cat("keep"), dtype=torch.bool)))
    out["advantage/dropped_groups"] = float(sum(p["dropped"] for p in parts))
    groups = sum(p["groups"] for p in parts)
    if groups and G >= 2:  # a group of one always has "equal rewards": a constant 1.0, no measurement
        out["reward/zero_var_group_frac"] = sum(p["zero_var"] for p in parts) / groups
    if rl.advantages.overlong_buffer > 0 and cat("penalty"):
        out["reward/overlong_penalty"] = sum(cat("penalty")) / len(cat("penalty"))
    if rl.advantages.dynamic_sampling:
        out["sampling/rounds"] = float(counts.rounds)
        out["sampling/extra_rounds"] = float(counts.rounds - 1)
        out["sampling/kept_groups"] = float(sum(p["kept_groups"] for p in parts))
        out["sampling/dropped_groups"] = float(sum(p["dropped"] for p in parts))
        out["sampling/surplus_groups"] = float(counts.surplus)
    if rl.update.mask_truncated:
        out["train/masked_truncated"] = float(sum(p["masked_truncated"] for p in parts))
    if zero_adv_on:
        out["train/zero_adv_skipped"] = float(sum(p["zero_adv_skipped"] for p in parts))
    out.update(_mismatch_metrics(rl, [p["mismatch"] for p in parts if p["mismatch"] is not None]))
    routing = [p["routing"] for p in parts if p.get("routing")]
    if routing:  # MoE policies with recorded routes: tokens x layers whose top-k set differs from the rollout's
        out["rollout/routing_mismatch_frac"] = sum(d for d, _ in routing) / max(1, sum(n for _, n in routing))
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    for p in parts:
        for k, v in p["sums"].items():
            sums[k] = sums.get(k, 0.0) + v
            weights[k] = weights.get(k, 0.0) + p["weights"][k]
    out.update({f"actor/{k}": sums[k] / weights[k] for k in sorted(sums) if weights[k] > 0})
    diff_sum, diff_n = (sum(p["diff"][0] for p in parts), sum(p["diff"][1] for p in parts))
    if diff_n:
        out["rollout/logprob_abs_diff"] = diff_sum / diff_n
    out["rollout/policy_version"] = float(step)
    out["rollout/prompts"] = float(sum(p["prompts"] for p in parts))
    gen_tokens = float(sum(p["gen_tokens"] for p in parts))
    train_tokens = float(sum(p["train_tokens"] for p in parts))
    out.update(timer.metrics({"rollout": gen_tokens, "train": train_tokens}))
    out["tokens_per_s"] = out.get("perf/train_tokens_per_s", 0.0)
    out["data/skipped_prompts"] = float(sum(p["skipped"] for p in parts))
    for k in parts[0]["reward_fail"]:
        out[k] = float(sum(p["reward_fail"][k] for p in parts))
    return out


def _mismatch_metrics(rl: Any, mm: list[dict[str, float]]) -> dict[str, float]:
    """rollout/mismatch_* over the ranks' `mismatch_sums` (empty when no rank recomputed old log-probs)."""
    out: dict[str, float] = {}
    n_tok = sum(m["n"] for m in mm)
    if n_tok:
        out["rollout/mismatch_kl"] = sum(m["kl"] for m in mm) / n_tok
        out["rollout/mismatch_ratio_mean"] = sum(m["ratio"] for m in mm) / n_tok
        out["rollout/mismatch_ratio_min"] = min(m["min"] for m in mm)
        out["rollout/mismatch_ratio_max"] = max(m["max"] for m in mm)
        if rl.loss.rollout_correction == "mis":
            out["rollout/mis_dropped_frac"] = sum(m["mis_dropped"] for m in mm) / max(1, sum(m["seqs"] for m in mm))
    return out
