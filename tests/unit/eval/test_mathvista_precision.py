"""MathVista's `precision` column counts: a float answer is compared, as the official MathVista scorer compares it,
after the extracted value is rounded to `precision` decimal places (1.46 is right for 1.5 at one place, 1.45 is
not: Python rounds the double nearest 1.45, which lies below it).

The reference is a transcription of the float branch of the official scorer (MathVista's evaluation script,
`normalize_extracted_answer` and `safe_equal`), applied to the value the model stated; the rows are the MathVista
testmini columns of tests/fixtures/benchmark_files.py (precision a float64 column, as the released parquet has it)."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_vlm.config.eval_section import BenchmarkConfig, EvalConfig
from megatron_vlm.data.bad_records import BadRecordError
from megatron_vlm.eval.answer_accuracy import GeneratedAnswers
from megatron_vlm.eval.benchmark_eval import VerifierScorer
from megatron_vlm.eval.benchmarks import open_benchmark
from tests.fixtures.benchmark_files import write_mathvista
from tests.unit.eval.bench_harness import AnswerEngine, evaluate


def official_float_correct(extraction: str, precision, answer: str) -> bool:
    """The official rule for answer_type "float": str(round(float(extraction), precision)) == answer (a value that
    float() cannot read is no prediction). Its test file stores precision as an int, the parquet as a float."""
    try:
        prediction = str(round(float(extraction), int(precision)))
    except (TypeError, ValueError):
        return False
    return prediction == answer


STATED = ["1.5", "1.46", "1.54", "1.45", "1.55", "1.449", "1.4999", "1.50", "1.6", "2", "0.21", "0.214", "0.2149",
          "0.215", "0.205", "0.2", "0.2151", "0.22"]


@pytest.fixture(scope="module")
def float_rows(tmp_path_factory):
    path, rows = write_mathvista(tmp_path_factory.mktemp("mv"))
    src = open_benchmark(BenchmarkConfig(name="mv", path=str(path), format="mathvista"), template="{problem}").source
    records = {rows[i]["pid"]: (rows[i], src.get(i)) for i in range(len(rows))}
    return {pid: v for pid, v in records.items() if v[0]["answer_type"] == "float"}


def test_float_rows_scored_with_their_precision(float_rows):
    assert {row["precision"] for row, _ in float_rows.values()} == {1.0, 2.0}
    scorer = VerifierScorer(EvalConfig(reward_workers=1))
    try:
        for row, rec in float_rows.values():
            gen = [GeneratedAnswers(0, rec.meta["answer"], rec.meta, [f"The answer is {x}." for x in STATED])]
            got = [s == 1.0 for s in scorer.score(gen)[0]]
            want = [official_float_correct(x, row["precision"], row["answer"]) for x in STATED]
            assert dict(zip(STATED, got)) == dict(zip(STATED, want)), row["pid"]
            assert any(want) and not all(want)
    finally:
        scorer.close()


def test_evaluation_counts_a_value_that_rounds_to_the_answer(tmp_path, proc):
    path, rows = write_mathvista(tmp_path)
    res = evaluate(proc, BenchmarkConfig(name="mv", path=str(path), format="mathvista"),
                   engine=AnswerEngine("The answer is 1.46."))
    scores = {r["id"]: r["greedy_score"] for r in res["rows"]}
    want = {r["pid"]: float(r["answer_type"] == "float" and official_float_correct("1.46", r["precision"], r["answer"]))
            for r in rows}
    assert scores == want and scores["3"] == 1.0


@pytest.mark.parametrize("precision", [-1.0, 1.5, float("inf")])
def test_unreadable_precision_of_a_float_row_is_a_bad_record(tmp_path, precision):
    path, _ = write_mathvista(tmp_path)
    table = pq.read_table(path)
    column = [precision if p is not None else None for p in table.column("precision").to_pylist()]
    pq.write_table(table.set_column(table.column_names.index("precision"), "precision", pa.array(column, pa.float64())),
                   path)
    src = open_benchmark(BenchmarkConfig(name="mv", path=str(path), format="mathvista"), template="{problem}").source
    with pytest.raises(BadRecordError, match="precision"):
        src.get(2)
    assert "precision" not in src.get(1).meta  # an integer row: no precision, none read
