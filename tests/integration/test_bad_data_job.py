"""Bad data found by whole jobs (launch/pretrain_vlm.py, one process): refused before training or
left out and counted, never an exit in the middle of a run.

- An SFT eval split none of whose records is usable (here: a malformed line and a record whose image
  is missing) used to be opened only at the first evaluation: the job trained, then exited 2 there,
  losing the steps since its last checkpoint. It is now refused at start-up, before step 1.
- SFT packs whose every sample fails when processed (an image whose header reads but whose pixels do
  not decode) made steps with no trained token: the optimizer still moved the weights (momentum,
  weight decay) and the metrics logged a loss of 0. Such a step now takes the next packs (counted as
  `data/empty_steps_skipped`); a split where no sample can be processed is exit 2 after an epoch.
- An evaluation job none of whose benchmark rows could be scored (all malformed, all images missing)
  exited 0 with empty metrics; it now writes its results and exits 2 naming the first bad record
  (one unusable benchmark among usable ones is still reported and skipped).
- A GRPO prompt set with half its prompts over-long, one prompt per step: the first step that drew
  only over-long prompts ended the run with exit 2. They are now left out at start-up and counted
  (rl/prompts/lengths.py); the run trains every step.

The jobs whose subject is the data run in this process (`run_job_here`); the refusal of an unusable eval split and
the evaluation job's exit 2 are checked on real processes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from jobs import REPO, read_metrics, run_job, run_job_here, small_demo_overrides
from PIL import Image


def _line(image: str, i: int) -> str:
    return json.dumps({"messages": [{"role": "user", "content": [{"type": "image", "image": image},
                                                                 {"type": "text", "text": f"What is {i}?"}]},
                                    {"role": "assistant", "content": f"red {i}"}]}) + "\n"


def test_unusable_eval_split_stops_the_job_before_the_first_step(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    Image.new("RGB", (56, 56), (200, 30, 30)).save(data / "ok.png")
    (data / "train.jsonl").write_text("".join(_line("ok.png", i) for i in range(6)))
    (data / "eval.jsonl").write_text("{not json\n" + _line("missing.png", 0))
    out = tmp_path / "run"
    overrides = [o for o in small_demo_overrides(out, tmp_path / "assets", **{"train.max_steps": 3, "train.eval_every": 2})
                 if not o.startswith("data.synthetic")]
    overrides += ['data.type="messages_jsonl"', f'data.train_path="{data / "train.jsonl"}"',
                  f'data.eval_path="{data / "eval.jsonl"}"']
    r = run_job(overrides, check=False, timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("config error: data.eval: no usable samples (1 records"), last
    assert "malformed_json" in last and "missing_image" in last and "Traceback" not in r.stderr
    assert "step 1/" not in r.stderr + r.stdout  # nothing trained
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())


def test_grpo_over_long_prompts_are_left_out_at_start_not_fatal_mid_run(tmp_path):
    from test_grpo_job import grpo_overrides

    data = tmp_path / "data"
    data.mkdir()
    Image.new("RGB", (56, 56), (200, 30, 30)).save(data / "ok.png")
    lines = [_line("ok.png", i) if i % 2 else json.dumps(json.loads(_line("ok.png", i)) | {"messages": [
        {"role": "user", "content": [{"type": "image", "image": "ok.png"}, {"type": "text", "text": "word " * 300}]},
        {"role": "assistant", "content": "red"}]}) + "\n" for i in range(8)]
    (data / "prompts.jsonl").write_text("".join(lines))
    out = tmp_path / "run"
    overrides = [o for o in grpo_overrides(out, tmp_path / "assets", **{
        "train.max_steps": 4, "rl.batch.prompts_per_step": 1, "rl.batch.group_size": 2, "rl.batch.mini_batches_per_step": 1,
        "rl.batch.ppo_epochs": 1, "checkpoint.every_steps": 4}) if not o.startswith("data.synthetic")]
    overrides += ['data.type="messages_jsonl"', f'data.train_path="{data / "prompts.jsonl"}"']
    r = run_job_here(overrides, check=False, config=REPO / "launch" / "configs" / "demo_grpo.toml")
    assert r.returncode == 0, r.stderr[-3000:]
    assert [int(row["step"]) for row in read_metrics(out / "metrics_train.csv")] == [1, 2, 3, 4]
    bad = json.loads((out / "bad_records.json").read_text())
    assert bad["by_category"] == {"too_long": 4}
    assert sorted(rec["index"] for rec in bad["records"]) == [1, 3, 5, 7]
    assert "4 of 8 prompts left out at start-up" in r.stderr


def _sft_on(tmp_path, images: list[str], **extra):
    data = tmp_path / "data"
    data.mkdir()
    Image.new("RGB", (56, 56), (200, 30, 30)).save(data / "ok.png")
    ok = (data / "ok.png").read_bytes()
    (data / "cut.png").write_bytes(ok[: len(ok) // 2])  # the header reads (planning), the pixels do not
    (data / "train.jsonl").write_text("".join(_line(name, i) for i, name in enumerate(images)))
    out = tmp_path / "run"
    overrides = [o for o in small_demo_overrides(out, tmp_path / "assets", **{
        "data.max_tokens_per_pack": 60, "data.shuffle": "false", "checkpoint.enable": "false",
        "checkpoint.export_hf": "false", **extra}) if not o.startswith("data.synthetic")]
    overrides += ['data.type="messages_jsonl"', f'data.train_path="{data / "train.jsonl"}"', 'data.eval_path=""']
    return out, run_job_here(overrides, check=False)


def test_sft_step_whose_packs_hold_no_trained_token_takes_the_next_packs(tmp_path):
    out, r = _sft_on(tmp_path, ["ok.png", "cut.png"] * 3, **{"train.max_steps": 4})  # one sample per pack
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_metrics(out / "metrics_train.csv")
    assert [float(x["trained_tokens"]) for x in rows] == [3.0] * 4  # every step trains one real sample
    assert [float(x["data/empty_steps_skipped"]) for x in rows] == [0.0, 1.0, 2.0, 3.0]
    assert all(float(x["loss"]) > 1.0 for x in rows)
    assert json.loads((out / "bad_records.json").read_text())["by_category"] == {"corrupt_image": 3}


def test_sft_split_whose_samples_all_fail_when_processed_is_exit_2(tmp_path):
    out, r = _sft_on(tmp_path, ["cut.png"] * 3, **{"train.max_steps": 4})
    assert r.returncode == 2, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("config error: data.train_path: 4 packs in a row without a trained token"), last
    assert "corrupt_image" in last and "Traceback" not in r.stderr
    # the records that stopped the run are listed by file and line (the run stops before its end-of-run summary;
    # bad_records.json used to be missing, or to hold only what the last checkpoint had)
    bad = json.loads((out / "bad_records.json").read_text())
    assert bad["by_category"] == {"corrupt_image": 3}
    assert sorted(rec["index"] for rec in bad["records"]) == [1, 2, 3]


def test_eval_job_with_no_scorable_row_is_exit_2_after_writing_its_results(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "malformed.jsonl").write_text("{not json\n[1, 2]\n")
    (data / "no_images.jsonl").write_text("".join(_line("missing.png", i) for i in range(2)))
    out = tmp_path / "eval"
    cfg = tmp_path / "eval.toml"
    cfg.write_text(f'[model]\npath = "{tmp_path / "model"}"\nsynthesize = "tiny_qwen2_5_vl"\n[data]\nmax_tokens_per_pack = 256\n'
                   f'num_workers = 0\n[train]\nmode = "eval"\noutput_dir = "{out}"\n[eval]\nmax_new_tokens = 4\n'
                   f'[[eval.benchmarks]]\nname = "a"\npath = "{data / "malformed.jsonl"}"\nformat = "messages"\n'
                   f'[[eval.benchmarks]]\nname = "b"\npath = "{data / "no_images.jsonl"}"\nformat = "messages"\n')
    r = subprocess.run([sys.executable, str(REPO / "launch" / "pretrain_vlm.py"), "--config", str(cfg)], capture_output=True,
                       text=True, timeout=300, cwd=str(REPO), env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("config error: eval.benchmarks: no row of any benchmark could be scored; first bad record: "
                           f"{data / 'malformed.jsonl'}:1: malformed_json"), last
    results = json.loads((out / "eval_results.json").read_text())["benchmarks"]
    assert {k: v["bad_records"]["by_category"] for k, v in results.items()} == {
        "a": {"malformed_json": 2}, "b": {"missing_image": 2}}


def test_pair_split_whose_pairs_all_fail_when_processed_is_exit_2_with_its_records_listed(tmp_path):
    """Reward-model training (the pair trainers' step, DPO's too) on pairs whose images read at planning but do not
    decode: exit 2 naming bad_records.json, which used to be missing (the run stopped before its end-of-run summary)."""
    data = tmp_path / "data"
    data.mkdir()
    Image.new("RGB", (56, 56), (200, 30, 30)).save(data / "ok.png")
    ok = (data / "ok.png").read_bytes()
    (data / "cut.png").write_bytes(ok[: len(ok) // 2])  # the header reads (planning), the pixels do not
    pair = {"prompt": "<image>What colour is it?", "chosen": "red", "rejected": "blue", "images": ["cut.png"]}
    (data / "train.jsonl").write_text((json.dumps(pair) + "\n") * 3)
    out = tmp_path / "run"
    overrides = [o for o in small_demo_overrides(out, tmp_path / "assets", **{
        "data.max_tokens_per_pack": 100, "data.shuffle": "false", "checkpoint.enable": "false",
        "checkpoint.export_hf": "false"}) if not o.startswith("data.synthetic")]
    overrides += ['data.type="messages_jsonl"', f'data.train_path="{data / "train.jsonl"}"', 'data.eval_path=""']
    r = run_job_here(overrides, check=False, config=REPO / "launch" / "configs" / "demo_reward_model.toml")
    assert r.returncode == 2, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("config error: data.train_path: 4 packs in a row without a usable pair"), last
    bad = json.loads((out / "bad_records.json").read_text())
    assert bad["by_category"] == {"corrupt_image": 3}
    assert sorted(rec["index"] for rec in bad["records"]) == [1, 2, 3]
