"""The video curriculum demo config, shrunk to seconds, then the evaluation command on its result:

- `demo_internvl_video.toml` (tiny InternVL, 16-frame synthetic clips): stage 1 (4 frames) and
  stage 2 (8 frames, multi-turn) run from one command; stage 2 starts from stage 1's export; a
  second run of the command skips both finished stages;
- `launch/evaluate.py` on stage 1's export and stage 1's held-out file (16-frame videos, 4 used)
  scores the rows that stage 1's own end-of-run evaluation scored, with its accuracy (after 4 steps
  the tiny model still answers with EOS, so this checks the plumbing; the answers themselves are
  compared with transformers' greedy decoding, for a model that answers with task words, in
  test_sft_job.py::test_eval_answer_accuracy_matches_transformers_greedy), and scores an MMMU-style
  file (two images per row, choice verifier, a bad row) with sampled Avg@k / pass@k consistent with
  its predictions.
"""
from __future__ import annotations

import json
import sys

import pytest
import tomllib
from jobs import REPO, read_metrics

from megatron_vlm.data.messages import read_messages_jsonl
from megatron_vlm.data.processing import process_record
from megatron_vlm.data.processor import load_processor
from megatron_vlm.data.synthetic_video import write_synthetic_video
from tests.fixtures.benchmark_files import write_mmmu
from tests.fixtures.eval_config import write_eval_config

sys.path.insert(0, str(REPO / "launch"))
import evaluate  # noqa: E402
import pretrain_vlm  # noqa: E402

pytestmark = pytest.mark.slow


def _demo_config(tmp_path, data) -> str:
    text = (REPO / "launch" / "configs" / "demo_internvl_video.toml").read_text()
    text = text.replace("runs/demo_assets/synthetic_video", str(data))
    return text.replace("max_steps = 150", "max_steps = 4").replace("max_steps = 100", "max_steps = 2")


def test_video_curriculum_then_evaluate(tmp_path):
    data, out, model = tmp_path / "video", tmp_path / "run", tmp_path / "model"
    write_synthetic_video(data, train_clips=16, val_clips=6)
    cfg = tmp_path / "demo.toml"
    cfg.write_text(_demo_config(tmp_path, data))
    sets = [f'model.path="{model}"', "data.num_workers=0", f'train.output_dir="{out}"', "train.eval_every=0",
            "train.log_every=1", "checkpoint.every_steps=0", "logging.tensorboard=false", "scheduler.warmup_steps=1"]
    argv = ["--config", str(cfg)] + [x for s in sets for x in ("--set", s)]
    assert pretrain_vlm.main(argv) == 0
    s1, s2 = out / "stage1", out / "stage2"
    stage2 = tomllib.loads((s2 / "config.toml").read_text())
    assert stage2["model"]["path"] == str(s1 / "hf") and "synthesize" not in stage2["model"]
    assert stage2["data"]["max_frames"] == 8 and stage2["optimizer"]["lr"] == 1.5e-3
    assert [len(read_metrics(d / "metrics_train.csv")) for d in (s1, s2)] == [4, 2]
    assert (s2 / "hf" / "config.json").is_file()
    # 16-frame clips reach the model as 4 (stage 1) / 8 (stage 2) frames, one tile each
    proc = load_processor(str(s1 / "hf"))
    rec = read_messages_jsonl(data / "stage1" / "val.jsonl", image_root=str(data))[0]
    assert len(rec.videos()[0]["video"]) == 16
    assert [process_record(rec, proc, max_frames=f).pixel_values.shape[0] for f in (4, 8)] == [4, 8]

    stamp = (s1 / "hf" / "config.json").stat().st_mtime_ns
    assert pretrain_vlm.main(argv) == 0  # both stages finished: skipped, nothing retrained
    assert (s1 / "hf" / "config.json").stat().st_mtime_ns == stamp
    assert [len(read_metrics(d / "metrics_train.csv")) for d in (s1, s2)] == [4, 2]

    mmmu, _ = write_mmmu(tmp_path / "bench")
    ev = write_eval_config(
        tmp_path / "eval.toml", s1 / "hf", tmp_path / "eval",
        [{"name": "stage1_val", "path": data / "stage1" / "val.jsonl", "image_root": data, "format": "messages"},
         {"name": "mmmu_style", "path": mmmu, "format": "mmmu"}],
        data={"max_frames": 4, "max_tokens_per_pack": 1030}, eval={"max_new_tokens": 6, "batch_size": 16, "samples": 2})
    assert evaluate.main(["--config", str(ev)]) == 0
    res = json.loads((tmp_path / "eval" / "eval_results.json").read_text())["benchmarks"]
    trained = [r for r in read_metrics(s1 / "metrics_eval.csv") if r.get("answer_accuracy")][-1]
    v = res["stage1_val"]
    assert v["metrics"]["num_scored"] == int(float(trained["answer_n"])) == 12
    assert v["metrics"]["greedy_accuracy"] == pytest.approx(float(trained["answer_accuracy"]), abs=1e-12)
    m = res["mmmu_style"]
    assert (m["num_rows"], m["metrics"]["num_scored"], m["bad_records"]["num_bad_records"]) == (2, 1, 1)
    assert m["bad_records"]["records"][0]["index"] == 1 and m["verifiers"] == {"choice": 1}
    rows = [json.loads(line) for line in (tmp_path / "eval" / "eval_predictions" / "mmmu_style.jsonl").open()]
    scores = [r["sample_scores"] for r in rows]
    assert m["metrics"]["avg@2"] == sum(map(sum, scores)) / (2 * len(rows))
    assert m["metrics"]["pass@2"] == sum(max(s) for s in scores) / len(rows)
    table = (tmp_path / "eval" / "eval_results.md").read_text()
    assert "| mmmu_style | 2 | 1 | 1 |" in table and "invalid_record" in table


def test_robovqa_lora_curriculum_runs_as_written_on_a_tiny_internvl(tmp_path):
    """internvl3_8b_robovqa_curriculum.toml unchanged except for its sizes: its data folder replaced by
    the synthetic RoboVQA-layout clips, the tiny InternVL, 2 steps per stage. Both stages train LoRA
    adapters (r 128 as written), stage 2 on stage 1's merged export, and each leaves a PEFT adapter."""
    data, out, model = tmp_path / "robovqa", tmp_path / "run", tmp_path / "model"
    write_synthetic_video(data, train_clips=8, val_clips=2)
    text = (REPO / "launch" / "configs" / "internvl3_8b_robovqa_curriculum.toml").read_text()
    assert text.count("epochs = 1\n") == 2 and "[lora]" in text  # the stages' lengths
    text = text.replace("data/robovqa/processed", str(data)).replace("epochs = 1\nlr", "max_steps = 2\nlr")
    cfg = tmp_path / "robovqa.toml"
    cfg.write_text(text)
    sets = [f'model.path="{model}"', 'model.synthesize="tiny_internvl"', "data.num_workers=0", f'train.output_dir="{out}"',
            "train.eval_every=0", "train.log_every=1", "train.micro_batches_per_step=1", "checkpoint.every_steps=0",
            "logging.tensorboard=false"]
    argv = ["--config", str(cfg)] + [x for s in sets for x in ("--set", s)]
    assert pretrain_vlm.main(argv) == 0
    s1, s2 = out / "stage1", out / "stage2"
    assert [len(read_metrics(d / "metrics_train.csv")) for d in (s1, s2)] == [2, 2]
    for d in (s1, s2):
        adapter = json.loads((d / "adapter" / "adapter_config.json").read_text())
        assert (adapter["r"], adapter["lora_alpha"], adapter["lora_dropout"]) == (128, 256, 0.05)
        assert (d / "hf" / "config.json").is_file()
    assert tomllib.loads((s2 / "config.toml").read_text())["model"]["path"] == str(s1 / "hf")
