"""An evaluation job (train.mode = "eval") stopped by SIGTERM / SIGUSR1 (`kill`, SLURM's time limit or preemption,
torchrun's shutdown) ends within seconds with one line and exit 143, writing no results.

Before: the training runs' stop handler (which only sets a flag that the training loop reads at a step boundary)
was installed for evaluation jobs too, and nothing read the flag there: the job ignored SIGTERM to the end of its
benchmarks, and a scheduler's SIGKILL after its grace period ended it without a word."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from jobs import REPO


def test_sigterm_stops_an_evaluation_job_at_once_with_exit_143(tmp_path):
    from PIL import Image

    Image.new("RGB", (56, 56), (200, 30, 30)).save(tmp_path / "red.png")
    row = {"messages": [{"role": "user", "content": [{"type": "image", "image": "red.png"},
                                                     {"type": "text", "text": "What colour is it?"}]},
                        {"role": "assistant", "content": "red"}]}
    (tmp_path / "bench.jsonl").write_text((json.dumps(row) + "\n") * 4000)  # far more than the test waits for
    out = tmp_path / "eval"
    cfg = tmp_path / "eval.toml"
    cfg.write_text(f'[model]\npath = "{tmp_path / "model"}"\nsynthesize = "tiny_qwen2_5_vl"\n[data]\nmax_tokens_per_pack = 256\n'
                   f'num_workers = 0\n[train]\nmode = "eval"\noutput_dir = "{out}"\n[eval]\nmax_new_tokens = 32\n'
                   f'[[eval.benchmarks]]\nname = "a"\npath = "{tmp_path / "bench.jsonl"}"\nformat = "messages"\n')
    p = subprocess.Popen([sys.executable, str(REPO / "launch" / "pretrain_vlm.py"), "--config", str(cfg)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=str(REPO),
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = []
    assert p.stderr is not None
    for line in p.stderr:  # wait until the first batch is scored: the job is inside its benchmark
        lines.append(line)
        if "eval a (greedy): batch 1/" in line:
            break
    assert p.poll() is None, "".join(lines)[-3000:]
    p.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    try:
        _, rest = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise AssertionError("the evaluation job went on after SIGTERM") from None
    took = time.monotonic() - t0
    assert p.returncode == 143, (p.returncode, took, rest[-3000:])
    assert took < 30, took
    last = rest.strip().splitlines()[-1]
    assert last.startswith("stopped: SIGTERM during the evaluation"), last
    assert not (out / "eval_results.json").exists()
