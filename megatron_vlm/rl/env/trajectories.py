"""A multi-turn trajectory as one training sample: its whole conversation, the loss on the model's tokens only.

One trajectory is one sample (as one completion is in single-turn GRPO): the response is everything after the
prompt — model turns and environment turns in order — with `response_mask` marking the model's tokens and
the environment's images / videos packed after the prompt's (rl/batching.py). The packed training forward over
it therefore sees what the rollout saw (every turn's images at their positions, M-RoPE positions continuous),
and its log-probs of the masked tokens are the rollout's behaviour log-probs. The advantage is the
trajectory's (group advantages over the G trajectories of a prompt), the same for each of its model tokens.
"""
from __future__ import annotations

from megatron_vlm.inference.engine import RolloutPrompt
from megatron_vlm.inference.multiturn import Trajectory
from megatron_vlm.rl.batching import TrainSample

__all__ = ["trajectory_train_sample", "trajectory_metrics", "trajectory_counts", "trajectory_metrics_of", "FINISH_REASONS"]


def trajectory_train_sample(prompt: RolloutPrompt, t: Trajectory, advantage: float) -> TrainSample:
    return TrainSample(prompt=prompt, response_ids=t.token_ids, behav_logp=t.logprobs, advantage=advantage,
                       old_logp=t.logprobs, response_mask=t.model_mask, response_vision=dict(t.vision) or None,
                       routes=t.routes)


FINISH_REASONS = ("done", "max_turns", "max_total_tokens", "length", "env_error")


def trajectory_counts(trajs: list[Trajectory], *, untrained_env_errors: int = 0) -> dict:
    """The sums behind the env/* metrics of one rank's trajectories of a step (gathered over the data shards and
    combined by `trajectory_metrics_of`, so the logged numbers are the step's, not the logging rank's share)."""
    return {"trajectories": len(trajs), "errors": sum(t.finish_reason == "env_error" for t in trajs),
            "untrained": int(untrained_env_errors), "turns": sum(t.num_turns for t in trajs),
            "tokens": sum(int(t.token_ids.numel()) for t in trajs),
            "model_tokens": sum(int(t.model_mask.sum()) for t in trajs),
            "finish": {why: sum(t.finish_reason == why for t in trajs) for why in FINISH_REASONS},
            "info": {k: float(sum(t.info.get(k, 0.0) for t in trajs)) for k in sorted({k for t in trajs for k in t.info})}}


def trajectory_metrics_of(parts: list[dict]) -> dict[str, float]:
    """env/* metrics of a step from every data shard's `trajectory_counts`: turns and tokens per trajectory, the
    share of each finish reason, environment errors (and how many of them were left out of the update), the
    environments' counters (env/<key>; env/info/<key> for a key named like one of the rollout's own metrics)."""
    out: dict[str, float] = {"env/errors": float(sum(p["errors"] for p in parts)),
                             "env/errors_untrained": float(sum(p["untrained"] for p in parts))}
    n = float(sum(p["trajectories"] for p in parts))
    if not n:
        return out
    out["env/turns_mean"] = sum(p["turns"] for p in parts) / n
    out["env/tokens_mean"] = sum(p["tokens"] for p in parts) / n
    out["env/model_tokens_mean"] = sum(p["model_tokens"] for p in parts) / n
    for why in FINISH_REASONS:
        out[f"env/finish_{why}"] = sum(p["finish"][why] for p in parts) / n
    own = set(out) | {f"env/finish_{why}" for why in FINISH_REASONS} | {"env/turns_mean", "env/tokens_mean",
                                                                         "env/model_tokens_mean"}
    for k in sorted({k for p in parts for k in p["info"]}):  # a counter named like one of ours: env/info/<key>
        name = f"env/{k}" if f"env/{k}" not in own else f"env/info/{k}"
        out[name] = float(sum(p["info"].get(k, 0.0) for p in parts))
    return out


def trajectory_metrics(trajs: list[Trajectory], *, untrained_env_errors: int = 0) -> dict[str, float]:
    """env/* metrics of trajectories held by one process (`trajectory_metrics_of` of their counts)."""
    return trajectory_metrics_of([trajectory_counts(trajs, untrained_env_errors=untrained_env_errors)])
