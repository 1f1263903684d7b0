"""Answer accuracy of generated completions, scored with the same verifiers as the GRPO rewards.

Avg@k (as reported by VLMEvalKit, e.g. "Avg@8"): sample k completions per
prompt, count each as correct when its accuracy reward reaches `threshold`, average over all k
samples and all prompts. With k = 1 and greedy decoding this is plain accuracy. pass@k (the
unbiased estimator of Chen et al. 2021, "at least one of k correct") is reported alongside.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["AccuracyResult", "avg_at_k", "pass_at_k", "score_accuracy"]


@dataclass
class AccuracyResult:
    avg_at_k: float
    """Mean correctness over all samples of all prompts."""
    pass_at_k: float
    """Mean over prompts of P(at least one of k samples is correct), unbiased estimator."""
    k: int
    """Samples per prompt."""
    num_prompts: int
    per_prompt: list[float]
    """Fraction of correct samples for each prompt."""
    scores: list[list[float]]
    """Raw accuracy reward of every sample, [prompt][sample]."""
    unclosed: int = 0
    """Samples scored 0 because they lack the accuracy reward's `reasoning_end` (the reasoning never closed)."""

    def metrics(self, prefix: str = "eval") -> dict[str, float]:
        return {
            f"{prefix}/avg@{self.k}": self.avg_at_k,
            f"{prefix}/pass@{self.k}": self.pass_at_k,
            f"{prefix}/num_prompts": float(self.num_prompts),
        }


def pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one correct among k of n samples, c of them correct) = 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def avg_at_k(scores: Sequence[Sequence[float]], threshold: float = 1.0) -> float:
    """Mean correctness (score >= threshold) over every sample of every prompt."""
    if not scores:
        raise ValueError("scores: no prompts to average over")
    flat = [s >= threshold for row in scores for s in row]
    if not flat:
        raise ValueError("scores: every prompt has zero samples")
    return sum(flat) / len(flat)


def score_accuracy(
    manager: Any,
    completions: Sequence[Sequence[str]],
    answers: Sequence[str],
    prompts: Optional[Sequence[str]] = None,
    metadata: Optional[Sequence[Optional[Mapping[str, Any]]]] = None,
    *,
    label: str,
    threshold: float = 1.0,
    samples: Optional[Sequence[Any]] = None,
    abandon: Optional[Callable[[], bool]] = None,
) -> AccuracyResult:
    """Score k completions per prompt with the reward `label` of `manager` (a RewardManager).

    completions[p] holds the k samples of prompt p; every prompt needs the same k. `samples[p]`: prompt p's
    `PromptSample`, handed to a manager that scores with reward models (`takes_samples`: they read the prompt's
    messages and images, as in training) and ignored by one that does not. `abandon`: the stop check of the verifiers'
    wait (rl/rewards/pool.py `map`: `WaitAbandoned` once a stop has been pending a moment)."""
    n = len(completions)
    if n == 0:
        raise ValueError("completions: no prompts to evaluate")
    k = len(completions[0])
    for p, row in enumerate(completions):
        if len(row) != k or k == 0:
            raise ValueError(f"completions[{p}]: {len(row)} samples, expected k = {k} (k >= 1) for every prompt")
    for name, seq in (("answers", answers), ("prompts", prompts), ("metadata", metadata), ("samples", samples)):
        if seq is not None and len(seq) != n:
            raise ValueError(f"{name}: {len(seq)} entries for {n} prompts")
    flat = [c for row in completions for c in row]
    rep = lambda seq: None if seq is None else [seq[p] for p in range(n) for _ in range(k)]  # noqa: E731
    extra: dict[str, Any] = ({"samples": rep(samples)} if samples is not None and getattr(manager, "takes_samples", False)
                             else {})
    if abandon is not None:
        extra["abandon"] = abandon
    batch = manager.score(flat, rep(answers), rep(prompts), rep(metadata), only=[label], **extra)
    values = batch.per_reward[label]
    scores = [values[p * k:(p + 1) * k] for p in range(n)]
    correct = [sum(s >= threshold for s in row) for row in scores]
    return AccuracyResult(
        avg_at_k=avg_at_k(scores, threshold),
        pass_at_k=sum(pass_at_k(k, c, k) for c in correct) / n,
        k=k,
        num_prompts=n,
        per_prompt=[c / k for c in correct],
        scores=scores,
        unclosed=int(getattr(batch, "unclosed", 0)),
    )
