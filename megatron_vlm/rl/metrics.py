"""Per-step GRPO metrics: reward mean / std / min / max and per verifier,
accuracy, response length and truncation, loss-side means (clip fraction, KL, entropy, ...)
weighted by trained tokens, and the time split rollout / reward / train with tokens per second.

Everything returns flat `{name: float}` dicts ready for the loggers; names use "/" groups
(reward/mean, response_length/mean, actor/clip_frac, time/rollout_s, perf/rollout_tokens_per_s).
"""
from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

__all__ = ["reward_metrics", "length_metrics", "reduce_loss_metrics", "PhaseTimer"]


def _stats(prefix: str, values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return {f"{prefix}/mean": mean, f"{prefix}/std": math.sqrt(var), f"{prefix}/min": min(values), f"{prefix}/max": max(values)}


def reward_metrics(total: Sequence[float], per_reward: Mapping[str, Sequence[float]], *, accuracy_label: str,
                   threshold: float = 1.0) -> dict[str, float]:
    """Summed-reward stats, the mean of each verifier, and accuracy (share of samples whose
    `accuracy_label` reward is >= threshold)."""
    if accuracy_label not in per_reward:
        raise ValueError(f"accuracy_label: {accuracy_label!r} not among the rewards {sorted(per_reward)}")
    out = _stats("reward", list(total))
    for label, values in per_reward.items():
        if values:
            out[f"reward/{label}"] = sum(values) / len(values)
    acc = per_reward[accuracy_label]
    if acc:
        out["accuracy"] = sum(v >= threshold for v in acc) / len(acc)
    return out


def length_metrics(response_lengths: Sequence[int], truncated: Sequence[bool]) -> dict[str, float]:
    """Response length stats (tokens) and the share of responses cut at max_new_tokens."""
    if len(response_lengths) != len(truncated):
        raise ValueError(f"truncated: {len(truncated)} flags for {len(response_lengths)} responses")
    out = _stats("response_length", [float(x) for x in response_lengths])
    if truncated:
        out["response_length/truncated_frac"] = sum(bool(t) for t in truncated) / len(truncated)
    return out


def reduce_loss_metrics(outputs: Sequence) -> dict[str, float]:
    """Token-weighted means of the `PolicyLossOutput.metrics` of several micro-batches (prefix
    "actor/"), plus the trained token count."""
    totals: dict[str, float] = {}
    weights: dict[str, float] = {}
    n_tokens = 0.0
    for o in outputs:
        w = float(o.num_tokens)
        n_tokens += w
        for k, v in o.metrics.items():
            totals[k] = totals.get(k, 0.0) + float(v) * w
            weights[k] = weights.get(k, 0.0) + w
    out = {f"actor/{k}": totals[k] / weights[k] for k in totals if weights[k] > 0}
    out["actor/num_tokens"] = n_tokens
    return out


class PhaseTimer:
    """Wall-clock time per phase of a step (`with timer.phase("rollout"): ...`), accumulated until
    `metrics()` is read and `reset()`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def metrics(self, tokens: Mapping[str, float] | None = None) -> dict[str, float]:
        """time/<phase>_s for every phase, and perf/<phase>_tokens_per_s for phases given a token count
        (e.g. {"rollout": generated tokens, "train": trained tokens})."""
        out = {f"time/{k}_s": v for k, v in self.seconds.items()}
        out["time/step_s"] = sum(self.seconds.values())
        for k, n in (tokens or {}).items():
            s = self.seconds.get(k)
            if s:
                out[f"perf/{k}_tokens_per_s"] = n / s
        return out

    def reset(self) -> None:
        self.seconds = {}
