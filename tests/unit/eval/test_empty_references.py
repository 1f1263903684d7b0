"""A reference answer with nothing left after normalisation ("." , "...", "$$", "\\text{}") matches nothing.

Every scorer compares normalised texts, and "." normalised to "" as an empty completion does: an empty
generation scored 1 against such a reference (short_answer, exact_match), "$$" or "\\boxed{\\text{}}" scored 1
under choice and math. Now no scorer counts two texts that are both empty after normalisation as a match, and a
benchmark row whose reference normalises to empty under its verifier is refused when the benchmark is opened (a
bad record, not a row the model is scored on: it has no answer anyone could give)."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_vlm.config.eval_section import BenchmarkConfig
from megatron_vlm.data.bad_records import BadRecordError
from megatron_vlm.eval.answers import AnswerTally
from megatron_vlm.eval.benchmarks import open_benchmark
from megatron_vlm.rl.rewards.verifiers import choice_reward, exact_match_reward, math_reward

EMPTY_REFS = [".", "...", " . ", "$$", "\\text{}", "\\boxed{}", "\\boxed{ }", "\\boxed{.}", "\\boxed{\\text{}}"]
"""References with nothing left once normalised, for the math / choice / exact_match verifiers."""
SHORT_EMPTY_REFS = [".", "...", " . ", "!", ",", ". ,"]
"""The same for the short-answer rule (first word without . , !)."""
PREDICTIONS = ["", " ", ".", "!", ",", "$$", "\\boxed{}", "\\boxed{ }", "\\boxed{.}", "\\boxed{\\text{}}", "Answer: ."]
VERIFIERS = {"math": math_reward, "choice": choice_reward, "exact_match": exact_match_reward}


@pytest.mark.parametrize("ref", EMPTY_REFS)
@pytest.mark.parametrize("name", sorted(VERIFIERS))
def test_no_verifier_matches_a_reference_that_normalises_to_empty(name, ref):
    fn = VERIFIERS[name]
    scores = {p: fn(p, ref) for p in PREDICTIONS}
    scores |= {f"{p} (options)": fn(p, ref, metadata={"choices": ["3", "5"]}) for p in PREDICTIONS}
    assert not any(scores.values()), {p: s for p, s in scores.items() if s}


@pytest.mark.parametrize("ref", SHORT_EMPTY_REFS)
def test_short_answer_never_matches_empty_with_empty(ref):
    tally = AnswerTally()
    assert not any(tally.add(p, ref) for p in PREDICTIONS)
    assert tally.correct == 0 and tally.total == len(PREDICTIONS)


def test_ordinary_answers_still_match():
    assert math_reward("\\boxed{3}", "3") == 1.0 and math_reward("\\boxed{4}", "3") == 0.0
    assert choice_reward("B", "B", metadata={"choices": ["3", "5"]}) == 1.0
    assert choice_reward("\\boxed{5}", "B", metadata={"choices": ["3", "5"]}) == 1.0
    assert exact_match_reward("\\boxed{Paris}", "paris.") == 1.0
    tally = AnswerTally()
    assert tally.add("Red.", "red") and tally.add("3.5", "3.5") and not tally.add("", "red")


def _write_columns(tmp_path, answers):
    pq.write_table(pa.table({"q": [f"What is {i}?" for i in range(len(answers))], "a": answers}), tmp_path / "b.parquet")
    return BenchmarkConfig(name="b", path=str(tmp_path / "b.parquet"), format="columns",
                           columns={"question": "q", "answer": "a"}, verifier="exact_match")


@pytest.mark.parametrize("verifier", ["math", "choice", "exact_match", "short_answer"])
def test_benchmark_row_with_an_empty_reference_is_a_bad_record(tmp_path, verifier):
    cfg = _write_columns(tmp_path, [".", "4", "..."])
    cfg.verifier = verifier
    src = open_benchmark(cfg, template="{problem}").source
    assert src.get(1).meta["answer"] == "4"
    for i in (0, 2):
        with pytest.raises(BadRecordError, match="nothing left") as err:
            src.get(i)
        assert err.value.category == "invalid_record"


def test_messages_benchmark_row_with_an_empty_reference_is_a_bad_record(tmp_path):
    rows = [("What colour?", "."), ("What colour?", "red"), ("What colour?", "!")]
    path = tmp_path / "b.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
                            + "\n" for q, a in rows))
    opened = open_benchmark(BenchmarkConfig(name="b", path=str(path), format="messages"), template="{problem}")
    assert [opened.source.get(i).index for i in range(len(opened.source))] == [2]
    bad = opened.bad_records.to_dict()
    assert [(r["index"], r["category"]) for r in bad["records"]] == [(1, "invalid_record"), (3, "invalid_record")]
    assert "nothing left" in bad["records"][0]["detail"]
