"""Score completions with the configured verifiers: weighted sums, per-reward values, and counted
failures.

`RewardManager(cfg.rewards, timeout_s=..., num_workers=...)` turns each `[[rl.rewards]]` table into
one verifier call per completion, runs all calls of a batch through the `RewardWorkerPool`, and
sums `weight * value` per completion. A call that times out or raises scores 0 for that verifier
only; it is counted (`num_timeouts`, `num_errors`, exposed as metrics) and logged — the first few
per verifier in full, then every 100th — so a broken verifier is visible without flooding the log.
A custom verifier whose module or function cannot be imported is a ConfigError naming
`rl.rewards[i].function` when the manager is built (the workers start then and report what they
could not import): found by a job whose misspelt function scored every completion 0, with a warning
per call, and trained on nothing. So is one whose signature cannot take `fn(completion, answer, prompt=...,
metadata=..., **kwargs)` (checked against the signature the worker reports), and a module that ends the
worker while it is imported (`os._exit` at import). An infinite or out-of-range value (beyond +-`value_limit`) is
clipped by the pool and counted (`num_clipped`, `reward/clipped`); the clipped value is used. NaN is a failed call
(`num_errors`), not a value. The pool's memory cap, parent-death and batch deadline are passed through (see pool.py). A verifier with `reasoning_end` set is handed only the
text after the last occurrence of that string; a completion without it scores 0 without a call and is counted
(`num_unclosed`, `reward/reasoning_unclosed`). Every scoring path (GRPO rounds, asynchronous rollout ranks,
held-out and benchmark evaluation) goes through `score`, so the cut is the same everywhere.
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from megatron_vlm.errors import ConfigError
from megatron_vlm.rl.rewards.config import CustomRewardConfig
from megatron_vlm.rl.rewards.pool import RewardCall, RewardWorkerPool

__all__ = ["RewardBatch", "RewardManager", "after_reasoning", "check_custom_rewards"]

logger = logging.getLogger(__name__)
_LOG_FIRST = 5
_LOG_EVERY = 100


@dataclass
class RewardBatch:
    total: list[float]
    """Weighted sum per completion."""
    per_reward: dict[str, list[float]]
    """Unweighted value of each verifier (by label) per completion."""
    timeouts: int = 0
    """Verifier calls of this batch that timed out."""
    errors: int = 0
    """Verifier calls of this batch that raised, returned NaN or something not a number (or whose worker died)."""
    clipped: int = 0
    """Verifier values of this batch that were infinite or beyond +-value_limit (clipped; NaN is an error)."""
    unclosed: int = 0
    """Verifier calls of this batch not made because the completion lacked the verifier's `reasoning_end` (0)."""


def after_reasoning(completion: str, reasoning_end: str) -> Optional[str]:
    """The text a verifier with `reasoning_end` scores: what follows the last occurrence of the delimiter (the
    whole completion when it is ""), None when the completion never closes its reasoning.

    Why the last occurrence: a reasoning that quotes the delimiter ("... then write </think> ...") ends at the
    last one, and an answer after the last one is the only text no reasoning follows."""
    if not reasoning_end:
        return completion
    head, found, tail = completion.rpartition(reasoning_end)
    return tail if found else None


def _call_spec(cfg: Any) -> tuple[str, Optional[str], dict]:
    if isinstance(cfg, CustomRewardConfig):
        return "custom", cfg.function, dict(cfg.kwargs)
    skip = {"type", "weight", "name", "reasoning_end"}
    options = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in skip}
    return cfg.type, None, options


def call_signature_problem(params: Optional[list], kwargs: Mapping[str, Any]) -> Optional[str]:
    """Why a function with parameters `params` ([[name, kind, has_default], ...] from the worker; None: not
    inspectable, not checked) cannot be called as `fn(completion, answer, prompt=..., metadata=..., **kwargs)`
    (None: it can). A `def f(completion, answer)` would fail on every call ("unexpected keyword argument
    'prompt'"): every reward 0, no gradient, exit 0."""
    if params is None:
        return None
    try:
        sig = inspect.Signature([inspect.Parameter(name, inspect._ParameterKind(kind),
                                                   default=None if has_default else inspect.Parameter.empty)
                                 for name, kind, has_default in params])
        sig.bind("completion", "answer", prompt="", metadata=None, **dict(kwargs))
    except (TypeError, ValueError) as e:
        return (f"cannot be called as fn(completion, answer, prompt=..., metadata=...{', ' if kwargs else ''}"
                f"{', '.join(f'{k}=...' for k in kwargs)}): {e}; add the missing parameters or **kwargs to it")
    return None


def reward_labels(rewards: Sequence[Any]) -> list[str]:
    """Each reward's metric label (`reward/<label>`), refused when two tables would log under one name. None is
    allowed: an [rl.env] run whose environment's turn rewards are the reward (the config refuses it otherwise)."""
    labels = [r.label() for r in rewards]
    if len(set(labels)) != len(labels):
        raise ValueError(f"rewards: duplicate labels {labels}; give each a distinct name")
    return labels


class RewardManager:
    """Runs the reward verifiers of one run. Not thread-safe; one per scoring process."""

    def __init__(self, rewards: Sequence[Any], *, timeout_s: float = 10.0, num_workers: int = 2, start_method: str = "spawn",
                 memory_limit_mb: int = 0, batch_timeout_s: Optional[float] = None, value_limit: Optional[float] = None,
                 config_indices: Optional[Sequence[int]] = None):
        """`config_indices`: the `rl.rewards[i]` index of each entry of `rewards` when they are a subset of the
        configured list (the rule rewards beside reward models), so a config error names the right table."""
        self.rewards = list(rewards)
        self.labels = reward_labels(self.rewards)
        self._specs = [_call_spec(r) for r in self.rewards]
        index = list(config_indices) if config_indices is not None else list(range(len(self.rewards)))
        if len(index) != len(self.rewards):
            raise ValueError(f"config_indices: {len(index)} indices for {len(self.rewards)} rewards")
        # (config index, position, dotted path) of the custom verifiers (their spec always carries the function)
        where = [(index[k], k, fn) for k, (verifier, fn, _) in enumerate(self._specs) if verifier == "custom" and fn is not None]
        custom = sorted({fn for _, _, fn in where})
        self.pool = RewardWorkerPool(num_workers=num_workers, timeout_s=timeout_s, start_method=start_method, preload=custom,
                                     memory_limit_mb=memory_limit_mb, batch_timeout_s=batch_timeout_s,
                                     value_limit=value_limit)
        if custom:  # a custom verifier that does not import, or cannot be called so, is a config error now, not 0 for every call
            try:
                failed = self.pool.start()
            except RuntimeError as e:  # the worker died importing them (os._exit / a crash in the module)
                keys = ", ".join(f"rl.rewards[{i}].function" for i, _, _ in where)
                raise ConfigError(f"{keys}: importing {', '.join(fn for _, _, fn in where)} ended the reward worker "
                                  f"({e}); does the module exit or crash at import?") from None
            bad = [(i, fn) for i, _, fn in where if fn in failed]
            if bad:
                self.pool.close()
                i, fn = bad[0]
                raise ConfigError(f"rl.rewards[{i}].function: {failed[fn]}")
            for i, k, fn in where:
                problem = call_signature_problem(self.pool.signatures.get(fn), self._specs[k][2])
                if problem:
                    self.pool.close()
                    raise ConfigError(f"rl.rewards[{i}].function: {fn} {problem}")
        self.num_calls = 0
        self.num_timeouts = 0
        self.num_errors = 0
        self.num_clipped = 0
        self.num_unclosed = 0
        self._fail_counts: dict[str, int] = {}
        self.last_error = ""
        """The newest failed call ("reward 'label': error: ..."), for the message of a run that stops on them."""

    def close(self) -> None:
        self.pool.close()

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def score(
        self,
        completions: Sequence[str],
        answers: Sequence[str],
        prompts: Optional[Sequence[str]] = None,
        metadata: Optional[Sequence[Optional[Mapping[str, Any]]]] = None,
        *,
        only: Optional[Sequence[str]] = None,
        abandon: Optional[Callable[[], bool]] = None,
    ) -> RewardBatch:
        """Score completion i against answers[i] (prompts / metadata optional, same length).

        `only` restricts scoring to these reward labels (e.g. the accuracy reward at evaluation); the
        total then sums only those. `abandon`: the pool's stop check (pool.py `map`): True while waiting
        raises `WaitAbandoned`, and nothing of the batch is counted."""
        n = len(completions)
        for name, seq in (("answers", answers), ("prompts", prompts), ("metadata", metadata)):
            if seq is not None and len(seq) != n:
                raise ValueError(f"{name}: {len(seq)} entries for {n} completions")
        active = list(range(len(self.rewards)))
        if only is not None:
            unknown = [x for x in only if x not in self.labels]
            if unknown:
                raise ValueError(f"only: unknown reward labels {unknown}; configured: {self.labels}")
            active = [k for k in active if self.labels[k] in only]
        calls: list[RewardCall] = []
        at: list[list[Optional[int]]] = []  # per active reward, per completion: its call's index (None: unclosed)
        for k in active:
            verifier, function, options = self._specs[k]
            end = getattr(self.rewards[k], "reasoning_end", "")
            at.append([])
            for i in range(n):
                completion = completions[i]
                text = after_reasoning(completion if isinstance(completion, str) else str(completion), end)
                if text is None:
                    at[-1].append(None)
                    continue
                at[-1].append(len(calls))
                meta = metadata[i] if metadata is not None else None
                calls.append(RewardCall(
                    verifier=verifier,
                    function=function,
                    options=options,
                    completion=text,
                    answer=str(answers[i]),
                    prompt=str(prompts[i]) if prompts is not None else "",
                    metadata=dict(meta) if meta is not None else None,
                ))
        results = self.pool.map(calls, abandon=abandon) if abandon is not None else self.pool.map(calls)
        total = [0.0] * n
        per_reward: dict[str, list[float]] = {}
        timeouts = errors = clipped = unclosed = 0
        for j, k in enumerate(active):
            label, weight = self.labels[k], self.rewards[k].weight
            values = []
            for i in range(n):
                c = at[j][i]
                if c is None:  # the reasoning never closed: the verifier's failure value, counted
                    unclosed += 1
                    values.append(0.0)
                    continue
                res = results[c]
                if res.status != "ok":
                    if res.status == "clipped":
                        clipped += 1
                    elif res.status == "timeout":
                        timeouts += 1
                    else:
                        errors += 1
                    self._warn(label, i, res.status, res.detail)
                values.append(res.value)
                total[i] += weight * res.value
            per_reward[label] = values
        self.num_calls += len(calls) + unclosed
        self.num_timeouts += timeouts
        self.num_errors += errors
        self.num_clipped += clipped
        self.num_unclosed += unclosed
        return RewardBatch(total=total, per_reward=per_reward, timeouts=timeouts, errors=errors, clipped=clipped,
                           unclosed=unclosed)

    def _warn(self, label: str, index: int, status: str, detail: str) -> None:
        if status != "clipped":
            self.last_error = f"reward {label!r}: {status}: {detail}"
        c = self._fail_counts[label] = self._fail_counts.get(label, 0) + 1
        if c <= _LOG_FIRST or c % _LOG_EVERY == 0:
            logger.warning(
                "reward %r on completion %d: %s (%s)%s; %d failed or clipped calls of %r so far",
                label, index, status, detail, "" if status == "clipped" else " -> reward 0", c, label,
            )

    def metrics(self) -> dict[str, float]:
        """Cumulative failure counters (for the step metrics)."""
        return {
            "reward/calls": float(self.num_calls),
            "reward/timeouts": float(self.num_timeouts),
            "reward/errors": float(self.num_errors),
            "reward/clipped": float(self.num_clipped),
            "reward/reasoning_unclosed": float(self.num_unclosed),
            "reward/worker_restarts": float(self.pool.restarts),
        }


def check_custom_rewards(rewards: Sequence[Any], *, timeout_s: float = 10.0, memory_limit_mb: int = 0) -> int:
    """Import every custom verifier of `rewards` in one reward worker, as a run does at its start, and raise the
    run's ConfigError (naming `rl.rewards[i].function`) for one that does not import, cannot be called with the
    run's arguments, or ends the worker. Returns how many were checked.

    Why: `--check` answers "will this config start?"; a misspelt module or function passed it and failed only
    once the job had its nodes, loaded its model and started the rollout."""
    where = [(i, r) for i, r in enumerate(rewards) if isinstance(r, CustomRewardConfig)]
    if not where:
        return 0
    manager = RewardManager([r for _, r in where], timeout_s=timeout_s, num_workers=1,
                            memory_limit_mb=memory_limit_mb, config_indices=[i for i, _ in where])
    manager.close()
    return len(where)
