"""Bad data found by whole jobs (launch/pretrain_vlm.py, one process): stopped before training, exit 2.

An SFT eval split none of whose records is usable (here: a malformed line and a record whose image
is missing) used to be opened only at the first evaluation: the job trained, then exited 2 there,
losing the steps since its last checkpoint. It is now refused at start-up, before step 1.
"""
from __future__ import annotations

import json

from jobs import run_job, small_demo_overrides
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
