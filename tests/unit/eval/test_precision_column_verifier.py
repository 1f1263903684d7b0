"""`columns.precision` is read by the math verifier only: a benchmark whose verifier never is math (choice,
exact_match, short_answer, or "auto" on a format whose "auto" never picks math) refuses the key instead of
accepting it and scoring without it."""
from __future__ import annotations

import pytest

from megatron_vlm.config.eval_section import AUTO_WITHOUT_MATH, BenchmarkConfig
from megatron_vlm.eval.benchmarks import FORMATS

_COLS = {"question": "q", "answer": "a", "precision": "p"}


@pytest.mark.parametrize("verifier", ["choice", "exact_match", "short_answer"])
def test_precision_with_a_verifier_that_does_not_read_it_is_refused(verifier):
    cfg = BenchmarkConfig(name="b", path="x.jsonl", columns=_COLS, verifier=verifier)
    with pytest.raises(ValueError, match=rf"columns.precision: .*verifier = {verifier!r}"):
        cfg.validate()


def test_precision_with_auto_on_a_format_whose_auto_is_never_math_is_refused():
    cfg = BenchmarkConfig(name="b", path="x.jsonl", format="logicvista", columns={"precision": "p"})
    with pytest.raises(ValueError, match=r"columns.precision: .*'logicvista'"):
        cfg.validate()


@pytest.mark.parametrize("verifier", ["math", "auto"])
def test_precision_with_a_verifier_that_reads_it_is_accepted(verifier):
    BenchmarkConfig(name="b", path="x.jsonl", columns=_COLS, verifier=verifier).validate()


def test_the_formats_whose_auto_is_never_math_are_the_presets_that_say_so():
    never = {name for name, f in FORMATS.items() if "math" not in (f.free_verifier, f.choice_verifier)}
    assert set(AUTO_WITHOUT_MATH) == never
