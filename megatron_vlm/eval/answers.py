"""Comparing short generated answers with reference answers, overall and per group of records.

`normalize_answer` (the synthetic set's rule, one definition): the first word, lower-cased, without
. , ! (a decimal point or digit separator inside a number stays) — a short-answer data set (e.g. the
synthetic VQA set: a count, a colour, a shape) is scored on that word. `AnswerTally` counts hits
overall and per value of a record's metadata field (default "question_type", which the synthetic
records carry), and merges the counts of all ranks by gathering them, so ranks that saw different
groups still agree on the result.

A reference with nothing left once normalised ("." under the short-answer rule; "." or "$$" under the
verifiers' rule, `math_equiv.is_empty_answer`) matches no prediction: an empty generation normalises to "" too,
and scored correct against it (`answers_match`). A benchmark refuses such a row when it is opened
(`reference_is_empty`: a bad record, not a row the model is scored on).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

from megatron_vlm.data.synthetic_vqa import normalize_answer
from megatron_vlm.parallel.collectives import all_gather_objects
from megatron_vlm.rl.rewards.extract import last_boxed
from megatron_vlm.rl.rewards.math_equiv import is_empty_answer

__all__ = ["normalize_answer", "answers_match", "reference_is_empty", "AnswerTally"]


def answers_match(prediction: str, reference: str) -> bool:
    """The short-answer rule: the normalised first words are equal, and the reference's is not empty."""
    ref = normalize_answer(reference)
    return bool(ref) and normalize_answer(prediction) == ref


def reference_is_empty(answer: str, verifier: str) -> bool:
    """Nothing of `answer` is left once `verifier` normalises it (the boxed content, when boxed): no prediction
    can match it."""
    if verifier == "short_answer":
        return not normalize_answer(answer)
    boxed = last_boxed(answer)
    return is_empty_answer(answer if boxed is None else boxed)


class AnswerTally:
    """Hits and counts, overall and per `group_field` value of the record metadata.

    Metrics: `answer_accuracy`, `answer_n`, and `answer_accuracy/<group>` for every group seen on any
    rank, groups ordered by the first record of each (lowest `index` given to `add`)."""

    def __init__(self, group_field: str = "question_type"):
        self.group_field = group_field
        self.correct = self.total = 0
        self.groups: dict[str, list[int]] = {}
        """group -> [hits, count, first index]."""

    def add(self, prediction: str, reference: str, meta: Optional[Mapping[str, Any]] = None, *, index: int = 0) -> bool:
        hit = answers_match(prediction, reference)
        self.correct += hit
        self.total += 1
        group = (meta or {}).get(self.group_field)
        if isinstance(group, str):
            g = self.groups.setdefault(group, [0, 0, index])
            g[0] += hit
            g[1] += 1
            g[2] = min(g[2], index)
        return hit

    def merged(self, copies: int = 1) -> AnswerTally:
        """The tally of all ranks (collective: every rank must call it). `copies`: ranks that scored the same
        rows (`ParallelDims.data_copies`: the tp / cp ranks of a data-parallel group); one of each counts."""
        out = AnswerTally(self.group_field)
        parts = all_gather_objects({"correct": self.correct, "total": self.total, "groups": self.groups})
        for part in parts[::copies]:  # tp innermost, cp next: consecutive ranks share a data shard
            out.correct += part["correct"]
            out.total += part["total"]
            for name, (hits, count, first) in part["groups"].items():
                g = out.groups.setdefault(name, [0, 0, first])
                g[0] += hits
                g[1] += count
                g[2] = min(g[2], first)
        return out

    def metrics(self) -> Optional[dict[str, float]]:
        if self.total == 0:
            return None
        out = {"answer_accuracy": self.correct / self.total, "answer_n": self.total}
        for name, (hits, count, _) in sorted(self.groups.items(), key=lambda kv: kv[1][2]):
            out[f"answer_accuracy/{name}"] = hits / count
        return out
