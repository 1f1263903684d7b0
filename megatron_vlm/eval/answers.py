"""Comparing short generated answers with reference answers, overall and per group of records.

`normalize_answer` (the synthetic set's rule, one definition): the first word, lower-cased, without
. , ! (a decimal point or digit separator inside a number stays) — a short-answer data set (e.g. the
synthetic VQA set: a count, a colour, a shape) is scored on that word. `AnswerTally` counts hits
overall and per value of a record's metadata field (default "question_type", which the synthetic
records carry), and merges the counts of all ranks by gathering them, so ranks that saw different
groups still agree on the result.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

from megatron_vlm.data.synthetic_vqa import normalize_answer
from megatron_vlm.parallel.collectives import all_gather_objects

__all__ = ["normalize_answer", "AnswerTally"]


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
        hit = normalize_answer(prediction) == normalize_answer(reference)
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
