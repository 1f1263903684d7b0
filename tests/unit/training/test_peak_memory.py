"""`peak_memory_gib`: the peak of the logging interval (since the previous train row), not since the process
started, for every job kind (the loop adds it to each train row): on CUDA torch's allocator peak is read, then
reset after each row; on a Linux CPU the peak RSS (VmHWM) is reset the same way."""
from __future__ import annotations

import sys
from types import SimpleNamespace as NS

import pytest
import torch

from megatron_vlm.training import peak_memory as peak_mod
from megatron_vlm.training.loop import run_loop


class Steps:
    """Steps whose memory use is given per step: `use(step)` runs inside each."""

    def __init__(self, use):
        self.use = use

    def load_data_state(self, state, step):
        pass

    def train_step(self, step, *, log):
        self.use(step)
        return {"loss": 1.0} if log else {}

    def evaluate(self, step):
        return None

    def data_state(self, step):
        return {}

    def finish(self):
        pass


class Rows:
    def __init__(self):
        self.rows = []

    def set_start(self, step):
        pass

    def log(self, split, step, metrics):
        self.rows.append((split, step, dict(metrics)))


class NoCheckpoints:
    enabled, export_at_end = False, False

    def periodic_due(self, step):
        return False


def _run(device, steps, *, total, log_every):
    rows = Rows()
    ctx = NS(stop=NS(should_stop=lambda dev: False), device=torch.device(device), run_dir=None)
    assert run_loop(ctx, steps, total_steps=total, checkpointer=NoCheckpoints(), metrics=rows, log_every=log_every) == 0
    return [(s, m["peak_memory_gib"]) for split, s, m in rows.rows if split == "train"]


def test_cuda_peak_is_read_then_reset_at_each_row(monkeypatch):
    """A fake allocator: its peak is the largest use since the last reset. Step 2 peaks at 6 GiB, steps 3-4 use
    1 GiB: the row of steps 3-4 says 1, not the 6 of the earlier interval (it used to repeat the process's peak)."""
    G = 2**30
    alloc = {"peak": 3 * G, "calls": []}  # 3 GiB before the loop (the model build): not in any row

    def use(step):
        alloc["calls"].append(("step", step))
        alloc["peak"] = max(alloc["peak"], (6 if step == 1 else 1) * G)

    def max_allocated(device=None):
        alloc["calls"].append("read")
        return alloc["peak"]

    def reset(device=None):
        alloc["calls"].append("reset")
        alloc["peak"] = 0

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", max_allocated)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    rows = _run("cuda", Steps(use), total=4, log_every=2)
    assert rows == [(2, 6.0), (4, 1.0)]
    assert alloc["calls"] == ["reset", ("step", 0), ("step", 1), "read", "reset", ("step", 2), ("step", 3), "read",
                              "reset"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the peak RSS is reset through /proc on Linux")
def test_cpu_peak_rss_is_per_interval():
    """Step 1 holds 256 MiB more than the others (then frees it): only its row shows it."""
    held = []

    def use(step):
        if step == 0:
            held.append(torch.ones(64 * 2**20))  # 256 MiB, touched
            held.clear()

    rows = _run("cpu", Steps(use), total=3, log_every=1)
    (_, first), (_, second), (_, third) = rows
    assert first - second > 0.2 and first - third > 0.2, rows
    assert second > 0 and third > 0


def test_cpu_without_a_resettable_peak_says_since_start(monkeypatch, caplog):
    """Where the peak RSS cannot be reset (no /proc), the value is the peak since the process started, and the
    log says so once."""
    monkeypatch.setattr(peak_mod, "_PROC", "/nonexistent/proc")
    mem = peak_mod.PeakMemory(torch.device("cpu"))
    with caplog.at_level("WARNING", logger="megatron_vlm"):
        mem.reset()
        first = mem.read_gib()
        mem.reset()
    assert first > 0 and mem.since_start
    assert sum("since the process started" in r.getMessage() for r in caplog.records) == 1
