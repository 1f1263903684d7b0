"""The `[[eval.benchmarks]]` paths of docs/evaluation.md, pointed at local copies laid out as the public releases
are (MMMU/MMMU: one folder per subject holding its dev, validation and test parquet files; AI4Math/MathVista:
data/testmini-*.parquet beside data/test-*.parquet), read exactly the split the benchmark's name says.

The MMMU example read "every parquet file under" the release folder: dev and test rows too (the test split's
answers are held out), so "MMMU_val" was not the validation score."""
from __future__ import annotations

import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import tomllib

from megatron_vlm.config.eval_section import BenchmarkConfig
from megatron_vlm.eval.benchmarks import open_benchmark
from tests.fixtures.benchmark_files import IMAGE_STRUCT, png_bytes

REPO = Path(__file__).resolve().parents[3]


def _docs_benchmarks() -> dict[str, dict]:
    text = (REPO / "docs" / "evaluation.md").read_text()
    block = re.search(r"```toml\n(.*?)```", text, re.DOTALL).group(1)
    return {b["name"]: b for b in tomllib.loads(block)["eval"]["benchmarks"]}


def _mmmu_rows(split: str, subject: str, n: int) -> dict:
    image = {"bytes": png_bytes(), "path": None}
    rows = [{"id": f"{split}_{subject}_{k}", "question": f"<image 1> {split} question {k}?", "options": "['x', 'y']",
             "explanation": "", "image_1": image, **{f"image_{j}": None for j in range(2, 8)}, "img_type": "['Photos']",
             "answer": "" if split == "test" else "A", "topic_difficulty": "Easy", "question_type": "multiple-choice",
             "subfield": subject} for k in range(n)]
    return {c: pa.array([r[c] for r in rows], type=IMAGE_STRUCT if c.startswith("image_") else None) for c in rows[0]}


def _rebased(bench: dict, root: Path) -> BenchmarkConfig:
    assert bench["path"].startswith("/data/")
    return BenchmarkConfig(**{**bench, "path": str(root / bench["path"][len("/data/"):])})


def test_mmmu_example_reads_the_validation_split_only(tmp_path):
    for subject in ("Art", "Math"):
        for split, n in (("dev", 1), ("validation", 2), ("test", 3)):
            folder = tmp_path / "MMMU" / subject
            folder.mkdir(parents=True, exist_ok=True)
            pq.write_table(pa.table(_mmmu_rows(split, subject, n)), folder / f"{split}-00000-of-00001.parquet")
    bench = _rebased(_docs_benchmarks()["MMMU_val"], tmp_path)
    opened = open_benchmark(bench, template="{problem}")
    assert len(opened.source) == 4, f"{len(opened.source)} rows: dev / test files read too"
    ids = sorted(opened.source.get(i).meta["id"] for i in range(len(opened.source)))
    assert ids == ["validation_Art_0", "validation_Art_1", "validation_Math_0", "validation_Math_1"]


def test_mathvista_example_reads_testmini_only(tmp_path):
    data = tmp_path / "MathVista" / "data"
    data.mkdir(parents=True)
    for split, n in (("testmini", 2), ("test", 3)):
        image = {"bytes": png_bytes(), "path": None}
        cols = {"pid": [f"{split}{k}" for k in range(n)], "query": [f"What is {k} + 1?" for k in range(n)],
                "answer": [str(k + 1) for k in range(n)], "decoded_image": pa.array([image] * n, type=IMAGE_STRUCT),
                "choices": pa.array([None] * n, type=pa.list_(pa.string())), "question_type": ["free_form"] * n}
        pq.write_table(pa.table(cols), data / f"{split}-00000-of-00001-0123abcd.parquet")
    opened = open_benchmark(_rebased(_docs_benchmarks()["MathVista_mini"], tmp_path), template="{problem}")
    assert sorted(opened.source.get(i).meta["id"] for i in range(len(opened.source))) == ["testmini0", "testmini1"]
