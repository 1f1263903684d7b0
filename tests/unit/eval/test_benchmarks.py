"""Benchmark column adapters on local files in the releases' column formats, the verifier scorer
against the verifier functions called directly, and the [eval] config / mode checks."""
from __future__ import annotations

import io
from pathlib import Path

import pytest
from PIL import Image

from megatron_vlm.config import ConfigError, load_config_dict
from megatron_vlm.config.eval_section import BenchmarkConfig, EvalConfig
from megatron_vlm.config.mode_keys import check_keys_for_mode
from megatron_vlm.data.bad_records import BadRecordError
from megatron_vlm.eval.answer_accuracy import GeneratedAnswers
from megatron_vlm.eval.benchmark_eval import VerifierScorer
from megatron_vlm.eval.benchmarks import open_benchmark
from megatron_vlm.rl.rewards.verifiers import choice_reward, exact_match_reward, math_reward
from tests.fixtures.benchmark_files import (
    write_geometry3k,
    write_logicvista,
    write_mathvision,
    write_mathvista,
    write_mmmu,
)

WRITERS = {"geometry3k": write_geometry3k, "mathvista": write_mathvista, "mathvision": write_mathvision,
           "logicvista": write_logicvista, "mmmu": write_mmmu}


def _open(fmt: str, path, **kw):
    return open_benchmark(BenchmarkConfig(name=fmt, path=str(path), format=fmt, **kw), template="Q: {problem}")


def _user(record) -> tuple[list, str]:
    content = record.messages[-2]["content"]
    images = [it["image"] for it in content if it["type"] == "image"]
    text = " ".join(it["text"] for it in content if it["type"] == "text")
    return images, text


def _pixels(ref) -> tuple:
    return Image.open(io.BytesIO(ref["bytes"])).convert("RGB").getpixel((0, 0))


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_adapter_reads_release_columns(tmp_path, fmt):
    path, rows = WRITERS[fmt](tmp_path)
    src = _open(fmt, path).source
    assert len(src) == len(rows)
    for i, row in enumerate(rows):
        try:
            rec = src.get(i)
        except BadRecordError:
            assert fmt in ("geometry3k", "mmmu") and i == len(rows) - 1  # the fixtures' bad rows
            continue
        images, text = _user(rec)
        assert rec.messages[-1] == {"role": "assistant", "content": row["answer"]}
        assert rec.meta["answer"] == row["answer"] and text.startswith("Q: ") and "<image" not in text
        if fmt == "geometry3k":
            assert [_pixels(x) for x in images] == [_pixels(x) for x in row["images"]]
            assert text == "Q: " + row["problem"].replace("<image>", "").strip() and rec.meta["verifier"] == "math"
        elif fmt == "mathvista":  # the official query already lists the choices: not appended twice
            assert text == "Q: " + row["query"] and text.count("(A) red") == (1 if row["choices"] else 0)
            assert _pixels(images[0]) == _pixels(row["decoded_image"]) and rec.meta["id"] == row["pid"]
            assert rec.meta["verifier"] == ("choice" if row["choices"] else "math")
            assert rec.meta.get("choices") == row["choices"]
            assert rec.meta["question_type"] == row["question_type"]
        elif fmt == "mathvision":
            letters = [f"{chr(65 + k)}. {o}" for k, o in enumerate(row["options"])]
            assert text == "Q: " + "\n".join([row["question"].replace("<image1>", "").strip(), *letters]).strip()
            assert rec.meta["verifier"] == ("choice" if row["options"] else "math")
        elif fmt == "logicvista":
            assert text == "Q: " + row["question"] and rec.meta["verifier"] == "choice" and len(images) == 1
        elif fmt == "mmmu":
            assert len(images) == 2 and [_pixels(x) for x in images] == [(10, 10, 10), (250, 250, 250)]
            assert rec.meta["choices"] == ["The left one", "The right one", "Both the same"]
            assert text.endswith("A. The left one\nB. The right one\nC. Both the same")
            assert "Which painting is older?" in text and rec.meta["verifier"] == "choice"


def test_bad_rows_and_wrong_columns(tmp_path):
    path, _ = write_mmmu(tmp_path)
    with pytest.raises(BadRecordError, match="not a list literal"):  # never evaluated, only parsed as a literal
        _open("mmmu", path).source.get(1)
    g, _ = write_geometry3k(tmp_path)
    with pytest.raises(BadRecordError, match="empty"):
        _open("geometry3k", g).source.get(2)
    with pytest.raises(ValueError, match=r"no column\(s\) \['query'\]"):
        _open("mathvista", g)
    renamed = _open("mathvista", g, columns={"question": "problem", "images": "images"}, verifier="math").source
    assert renamed.get(0).meta["verifier"] == "math" and len(_user(renamed.get(0))[0]) == 1


def test_scorer_matches_the_verifier_functions():
    rows = [
        GeneratedAnswers(0, "30", {"verifier": "math", "problem": "Find x."}, ["so x = \\boxed{30}", "\\boxed{31}"]),
        GeneratedAnswers(1, "B", {"verifier": "choice", "problem": "Pick\nA. cat\nB. dog", "choices": ["cat", "dog"]},
                         ["The answer is B", "cat"]),
        GeneratedAnswers(2, "Paris", {"verifier": "exact_match", "problem": "Capital?"}, ["Answer: paris", "Lyon"]),
        GeneratedAnswers(3, "red", {"verifier": "short_answer"}, ["Red circle", "blue"]),
    ]
    scorer = VerifierScorer(EvalConfig(benchmarks=[BenchmarkConfig(name="x", path="x")], reward_workers=1))
    try:
        got = scorer.score(rows)
    finally:
        scorer.close()
    ref = [[math_reward(c, "30") for c in rows[0].completions],
           [choice_reward(c, "B", prompt=rows[1].meta["problem"], metadata={"choices": ["cat", "dog"]})
            for c in rows[1].completions],
           [exact_match_reward(c, "Paris") for c in rows[2].completions],
           [1.0, 0.0]]
    assert got == ref and ref[:3] == [[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]]


def _eval_raw(**extra) -> dict:
    raw = {"model": {"path": "/m"}, "train": {"mode": "eval"},
           "eval": {"benchmarks": [{"name": "g3k", "path": "/d", "format": "geometry3k"}]}}
    for k, v in extra.items():
        raw.setdefault(k, {}).update(v)
    return raw


def test_eval_config_and_mode_keys():
    cfg = load_config_dict(_eval_raw())  # no [data], no steps: an evaluation job needs neither
    check_keys_for_mode(cfg)
    for raw, match in [
        (_eval_raw(optimizer={"lr": 1e-3}), "optimizer.lr: has no effect"),
        (_eval_raw(train={"max_steps": 3}), "train.max_steps: has no effect"),
        (_eval_raw(data={"train_path": "/x"}), "data.train_path: has no effect"),
        (_eval_raw(parallel={"pp": 2}), "parallel.pp: pipeline parallelism"),  # was a ValueError traceback in the job
    ]:
        with pytest.raises(ConfigError, match=match):
            check_keys_for_mode(load_config_dict(raw))
    for raw, match in [
        (_eval_raw(eval={"samples": 4, "temperature": 0.0}), "eval.temperature"),
        (_eval_raw(eval={"greedy": False}), "eval.samples"),
        ({"model": {"path": "/m"}, "train": {"mode": "eval"}}, "eval: an \\[eval\\] section"),
        ({"model": {"path": "/m"}, "train": {"mode": "sft", "max_steps": 1}}, "data.train_path: required"),
        ({"model": {"path": "/m"}, "train": {"mode": "sft"}, "data": {"train_path": "/x"}}, "set max_steps or epochs"),
    ]:
        with pytest.raises(ConfigError, match=match):
            load_config_dict(raw)
    sft = load_config_dict({**_eval_raw(), "train": {"mode": "sft", "max_steps": 1}, "data": {"train_path": "/x"}})
    with pytest.raises(ConfigError, match="eval: the \\[eval\\] section is only read"):
        check_keys_for_mode(sft)


def test_unreadable_adapter_is_exit_2(tmp_path, capsys):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "launch"))
    import evaluate

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")  # never read: the adapter config is read first
    cfg = tmp_path / "e.toml"
    cfg.write_text(f'[model]\npath = "{tmp_path / "m"}"\n[train]\noutput_dir = "{tmp_path / "out"}"\n'
                   f'[eval]\nadapter = "{tmp_path / "lora"}"\n[[eval.benchmarks]]\nname = "x"\npath = "{tmp_path}"\nformat = "geometry3k"\n')
    assert evaluate.main(["--config", str(cfg)]) == 2
    assert "eval.adapter: " in (err := capsys.readouterr().err) and "not a readable PEFT LoRA adapter" in err
    with pytest.raises(SystemExit) as e:  # a training key in an evaluation job: refused before anything runs
        evaluate.main(["--config", str(cfg), "--set", "optimizer.lr=0.1"])
    assert e.value.code == 2 and "optimizer.lr: has no effect" in capsys.readouterr().err
