"""Rule rewards and model rewards of one run behind the reward manager's interface: `CombinedRewards`.

Why: the rule verifiers run in the worker pool (`RewardManager`), the reward models and judges
(`type = "model"` / `"judge"`) in the training process on the device; a round, the evaluation and the
failure watch see one scorer with the manager's `labels`, `score(...)`, `metrics()` and `last_error`. The
total is the weighted sum over every `[[rl.rewards]]` table in config order, rule and model alike.

Counters are the manager's, summed: a model call is one call per completion (`reward/calls`), its failures
are `reward/errors` and `reward/clipped` (so `rl.reward_pool.max_failed_steps` sees them), a reward model's
input cut to its `max_tokens` is `reward/truncated`, and each failed call is logged as the manager logs its own (the first few per reward, then every 100th). `score` takes the
prompts' `samples` (`PromptSample`: messages with images) when the caller has them (`takes_samples`); without
them a model reward sees the prompt text as a text-only user turn.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

import torch

from megatron_vlm.data.media import DEFAULT_LIMITS, MediaLimits
from megatron_vlm.errors import ConfigError
from megatron_vlm.rl.rewards.config import MODEL_REWARD_TYPES
from megatron_vlm.rl.rewards.manager import RewardBatch, RewardManager, reward_labels
from megatron_vlm.rl.rewards.model_reward import ScoredValues

__all__ = ["CombinedRewards", "has_model_rewards"]

logger = logging.getLogger(__name__)
_LOG_FIRST = 5
_LOG_EVERY = 100


def has_model_rewards(rewards: Sequence[Any]) -> bool:
    """Whether any `[[rl.rewards]]` table is scored by a model (`type = "model"` / `"judge"`)."""
    return any(getattr(r, "type", None) in MODEL_REWARD_TYPES for r in rewards)


class CombinedRewards:
    """`rewards`: every `[[rl.rewards]]` config; `pool`: the `RewardManager` keywords (timeouts, workers, limits) for
    the rule rewards; `dtype` / `device` / `max_frames` / `fps` / `limits`: how the model rewards load and render;
    `scorers`: ready scorers by reward index (tests), built from the configs otherwise."""

    takes_samples = True

    def __init__(self, rewards: Sequence[Any], *, pool: Optional[Mapping[str, Any]] = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", max_frames: int = 8, fps: float = 2.0,
                 limits: MediaLimits = DEFAULT_LIMITS, scorers: Optional[Mapping[int, Any]] = None):
        from megatron_vlm.rl.rewards.judge import JudgeRewardScorer
        from megatron_vlm.rl.rewards.model_reward import ModelRewardScorer

        self.rewards = list(rewards)
        self.labels = reward_labels(self.rewards)
        pool = dict(pool or {})
        rule_index = [k for k, r in enumerate(self.rewards) if r.type not in MODEL_REWARD_TYPES]
        rule = [self.rewards[k] for k in rule_index]
        self.rule = RewardManager(rule, config_indices=rule_index, **pool) if rule else None
        self.value_limit = pool.get("value_limit")
        self.scorers: dict[int, Any] = dict(scorers or {})
        render: dict[str, Any] = dict(dtype=dtype, device=device, max_frames=max_frames, fps=fps, limits=limits)
        try:
            for k, r in enumerate(self.rewards):
                if k in self.scorers or r.type not in MODEL_REWARD_TYPES:
                    continue
                try:
                    if r.type == "model":
                        self.scorers[k] = ModelRewardScorer(r, value_limit=self.value_limit, **render)
                    else:
                        self.scorers[k] = JudgeRewardScorer(r, **render)
                except ConfigError as e:  # a key that does not fit the folder (logit_index, activation)
                    raise ConfigError(str(e).replace("rl.rewards.", f"rl.rewards[{k}].")) from None
                except (OSError, ValueError) as e:  # no folder, not a supported model, not a classification head
                    raise ConfigError(f"rl.rewards[{k}].path: cannot load the {r.type} folder {r.path}: {e}") from None
        except BaseException:
            self.close()
            raise
        self.num_calls = self.num_errors = self.num_clipped = self.num_truncated = 0
        self._fail_counts: dict[str, int] = {}
        self._last_error = ""

    @property
    def last_error(self) -> str:
        """The newest failed call of a model reward, else of the rule rewards (for the failure watch's message)."""
        return self._last_error or (self.rule.last_error if self.rule is not None else "")

    def close(self) -> None:
        if self.rule is not None:
            self.rule.close()

    def __enter__(self) -> CombinedRewards:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def score(self, completions: Sequence[str], answers: Sequence[str], prompts: Optional[Sequence[str]] = None,
              metadata: Optional[Sequence[Optional[Mapping[str, Any]]]] = None, *, only: Optional[Sequence[str]] = None,
              samples: Optional[Sequence[Any]] = None, abandon: Optional[Callable[[], bool]] = None) -> RewardBatch:
        """As `RewardManager.score`; `samples[i]`: the `PromptSample` completion i answers (its messages and images);
        `abandon`: the stop check of the rule rewards' wait and of the model rewards' scoring (asked between their
        forwards / decode steps: `WaitAbandoned`, "reward models", once it has said stop for the grace)."""
        n = len(completions)
        for name, seq in (("answers", answers), ("prompts", prompts), ("metadata", metadata), ("samples", samples)):
            if seq is not None and len(seq) != n:
                raise ValueError(f"{name}: {len(seq)} entries for {n} completions")
        if only is not None:
            unknown = [x for x in only if x not in self.labels]
            if unknown:
                raise ValueError(f"only: unknown reward labels {unknown}; configured: {self.labels}")
        active = [k for k in range(len(self.rewards)) if only is None or self.labels[k] in only]
        rule_active = [self.labels[k] for k in active if k not in self.scorers]
        ruled = None
        if rule_active and self.rule is not None:
            ruled = self.rule.score(completions, answers, prompts, metadata, only=rule_active, abandon=abandon)
        questions = [str(p) for p in prompts] if prompts is not None else [""] * n
        messages = ([list(s.messages) for s in samples] if samples is not None
                    else [[{"role": "user", "content": [{"type": "text", "text": q}]}] for q in questions])
        total = [0.0] * n
        per_reward: dict[str, list[float]] = {}
        errors = clipped = 0
        for k in active:
            label, weight = self.labels[k], self.rewards[k].weight
            if k in self.scorers:
                res = self._score_model(k, completions, answers, questions, messages, abandon)
                values = res.values
                for i, status in enumerate(res.status):
                    if status != "ok":
                        errors += status == "error"
                        clipped += status == "clipped"
                        self._warn(label, i, status, res.detail[i] if i < len(res.detail) else "", values[i])
                self.num_calls += n
                self.num_truncated += int(getattr(res, "truncated", 0))
            else:
                assert ruled is not None
                values = ruled.per_reward[label]
            per_reward[label] = values
            for i in range(n):
                total[i] += weight * values[i]
        self.num_errors += errors
        self.num_clipped += clipped
        return RewardBatch(total=total, per_reward=per_reward, timeouts=ruled.timeouts if ruled else 0,
                           errors=errors + (ruled.errors if ruled else 0), clipped=clipped + (ruled.clipped if ruled else 0),
                           unclosed=ruled.unclosed if ruled else 0)

    def _score_model(self, k: int, completions: Sequence[str], answers: Sequence[str], questions: list[str],
                     messages: list[list[dict]], abandon: Optional[Callable[[], bool]] = None) -> ScoredValues:
        """One model reward's values; a scorer that raises scores every completion its failure value (0 unless
        `failure_value` is set: the same for all, so none ranks above another) as an error (never a crash);
        `WaitAbandoned` (a BaseException: not caught) when `abandon` gives the scoring up."""
        scorer, n = self.scorers[k], len(completions)
        texts = [c if isinstance(c, str) else str(c) for c in completions]
        wait = {"abandon": abandon} if abandon is not None and getattr(scorer, "takes_abandon", False) else {}
        try:
            if self.rewards[k].type == "judge":
                res = scorer.score(texts, [str(a) for a in answers], questions, messages, **wait)
            else:
                res = scorer.score(texts, messages, **wait)
            if len(res.values) != n or len(res.status) != n:
                raise RuntimeError(f"{len(res.values)} values for {n} completions")
            return res
        except Exception as e:  # noqa: BLE001 - the reward pool's guarantee: a counted failure, not a crash
            failed = getattr(self.rewards[k], "failure_value", None)
            return ScoredValues(values=[0.0 if failed is None else float(failed)] * n, status=["error"] * n,
                                detail=[f"{type(e).__name__}: {e}"] * n)

    def _warn(self, label: str, index: int, status: str, detail: str, value: float) -> None:
        if status != "clipped":
            self._last_error = f"reward {label!r}: {status}: {detail}"
        c = self._fail_counts[label] = self._fail_counts.get(label, 0) + 1
        if c <= _LOG_FIRST or c % _LOG_EVERY == 0:
            logger.warning("reward %r on completion %d: %s (%s)%s; %d failed or clipped calls of %r so far",
                           label, index, status, detail, "" if status == "clipped" else f" -> reward {value:g}", c,
                           label)

    def metrics(self) -> dict[str, float]:
        """The manager's cumulative counters with the model rewards' calls and failures added."""
        out = self.rule.metrics() if self.rule is not None else {
            "reward/calls": 0.0, "reward/timeouts": 0.0, "reward/errors": 0.0, "reward/clipped": 0.0,
            "reward/reasoning_unclosed": 0.0, "reward/worker_restarts": 0.0}
        out["reward/calls"] += float(self.num_calls)
        out["reward/errors"] += float(self.num_errors)
        out["reward/clipped"] += float(self.num_clipped)
        out["reward/truncated"] = float(self.num_truncated)
        return out
