"""DataLoader workers start from the worker server, not forked from the rank, and the rank still sees at once
a worker that died, waits on for a slow one, and keeps its workers through a stop signal sent to every process."""
from __future__ import annotations

import json
import os
import pickle
import signal
import time

import pytest

import megatron_vlm.data.loader as loader_mod
from megatron_vlm.data.bad_records import BadRecordError, BadRecordLog
from megatron_vlm.data.config import DataConfig
from megatron_vlm.data.loader import EvalDataLoader, build_sft_dataloader
from megatron_vlm.data.worker_start import modules_of


class _Parent:
    """Each item: the pid of the process that started the worker, and the worker's own pid."""

    def __getitem__(self, key):
        return {"ppid": os.getppid(), "pid": os.getpid(), "_bad_records": []}


class _Dies:
    """Each item kills its worker (the out-of-memory killer's way: no exception, no message)."""

    def __getitem__(self, key):
        os.kill(os.getpid(), signal.SIGKILL)


class _Slow:
    def __getitem__(self, key):
        time.sleep(1.5)
        return {"key": key, "_bad_records": []}


def _eval_loader(dataset, *, timeout_s: float, n: int = 1) -> EvalDataLoader:
    return EvalDataLoader(dataset, list(range(n)), num_workers=1, prefetch_factor=2, bad_records=BadRecordLog(),
                          mode="batches", timeout_s=timeout_s)


def test_workers_are_not_forked_from_the_rank():
    # a child forked from a rank running threads (gloo's, TensorBoard's) can deadlock inside fork itself
    (item,) = list(_eval_loader(_Parent(), timeout_s=60))
    assert item["ppid"] != os.getpid() and item["pid"] != os.getpid()


def test_a_dead_worker_is_named_long_before_the_loader_timeout():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="exited unexpectedly"):
        list(_eval_loader(_Dies(), timeout_s=600))
    assert time.monotonic() - t0 < 60  # one check slice (5 s) plus the worker's start, not 600 s


def test_a_worker_slower_than_one_check_slice_is_waited_for(monkeypatch):
    monkeypatch.setattr(loader_mod, "LIVENESS_CHECK_S", 0.3)
    items = list(_eval_loader(_Slow(), timeout_s=30, n=2))
    assert [x["key"] for x in items] == [0, 1]


def test_the_timeout_still_ends_a_wait_made_of_slices(monkeypatch):
    monkeypatch.setattr(loader_mod, "LIVENESS_CHECK_S", 0.3)
    with pytest.raises(RuntimeError, match=r"data\[eval\]: .*data\.loader_timeout_s = 1 s"):
        list(_eval_loader(_Slow(), timeout_s=1.0))


def _server_pid() -> int:
    from multiprocessing import forkserver
    pid = forkserver._forkserver._forkserver_pid
    assert pid is not None
    return pid


def test_the_worker_server_outlives_a_stop_signal_sent_to_every_process(tmp_path):
    # SLURM signals every process of the step; the rank saves at its next step boundary and still needs workers
    list(_eval_loader(_Parent(), timeout_s=60))
    server = _server_pid()
    for s in (signal.SIGTERM, signal.SIGUSR1):
        os.kill(server, s)
    time.sleep(0.5)
    os.kill(server, 0)  # still there
    (item,) = list(_eval_loader(_Parent(), timeout_s=60))
    assert item["ppid"] == server


def test_training_packs_come_through_the_server(proc, tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Say {w}."},
                                                     {"role": "assistant", "content": w}]}) + "\n"
                            for w in ("hi", "yes", "no", "ok")))
    packs = {}
    for workers in (0, 1):
        cfg = DataConfig(type="messages_jsonl", train_path=str(path), num_workers=workers, max_tokens_per_pack=64)
        it = iter(build_sft_dataloader(cfg, proc, seed=0, dp_rank=0, dp_size=1))
        packs[workers] = [next(it) for _ in range(3)]
    for a, b in zip(packs[0], packs[1]):
        assert a["input_ids"].tolist() == b["input_ids"].tolist()


def test_a_bad_record_error_crosses_a_pickle():
    err = pickle.loads(pickle.dumps(BadRecordError("timeout", "video decode took 9 s")))
    assert (err.category, err.detail, str(err)) == ("timeout", "video decode took 9 s", "timeout: video decode took 9 s")


def test_the_server_preloads_the_modules_a_dataset_pickle_names():
    assert {"megatron_vlm.data.bad_records", "test_worker_start"} <= set(modules_of(
        {"x": [BadRecordError("timeout", "t"), _Slow()]}))


class _StandInDecoder:
    """Probes a 40-frame clip; decoding fails with its own words (picklable: no events or locks)."""

    def probe(self, src):
        from megatron_vlm.data.media import VideoInfo
        return VideoInfo(40, 10.0, 56, 56)

    def decode(self, src, indices):
        raise RuntimeError("decoded by the stand-in")


def test_the_rank_s_video_decoder_reaches_its_workers(proc, tmp_path):
    from megatron_vlm.data.media import set_video_decoder
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(b"not a video")
    video = {"messages": [{"role": "user", "content": [{"type": "video", "video": str(clip)},
                                                       {"type": "text", "text": "What happens?"}]},
                          {"role": "assistant", "content": "nothing"}]}
    text = {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]}
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(text) + "\n" + json.dumps(video) + "\n")
    previous = set_video_decoder(_StandInDecoder())
    try:
        cfg = DataConfig(type="messages_jsonl", train_path=str(path), num_workers=1, max_frames=4,
                         max_tokens_per_pack=1024)
        loader = build_sft_dataloader(cfg, proc, seed=0, dp_rank=0, dp_size=1)
        next(iter(loader))
    finally:
        set_video_decoder(previous)
    (bad,) = loader.bad_records.entries
    assert bad.index == 2 and "decoded by the stand-in" in bad.detail


_KILLED_RANK = """
import os, signal, sys
from megatron_vlm.data.bad_records import BadRecordLog
from megatron_vlm.data.loader import EvalDataLoader
sys.path.insert(0, {tests!r})
from test_worker_start import _Parent

if __name__ == "__main__":
    loader = EvalDataLoader(_Parent(), list(range(50)), num_workers=1, prefetch_factor=2, bad_records=BadRecordLog(),
                            mode="batches", timeout_s=60)
    it = iter(loader)
    item = next(it)
    print(item["pid"], item["ppid"], flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # the out-of-memory killer's way, mid-iteration
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_workers_and_their_server_end_when_the_rank_is_killed(tmp_path):
    """A worker forked by the server is not the rank's child: torch's own check (its parent's pid changed) cannot
    see the rank die, and the workers ignore TERM. A rank killed mid-iteration (OOM killer, kill -9, a torchrun
    restart) must not leave its workers and their server running (memory held, the job's output pipes kept open)."""
    import subprocess
    import sys

    script = tmp_path / "rank.py"
    script.write_text(_KILLED_RANK.format(tests=os.path.dirname(__file__)))
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        rc = subprocess.run([sys.executable, str(script)], stdout=f, stderr=subprocess.DEVNULL, timeout=120,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}).returncode
    assert rc == -signal.SIGKILL
    worker, server = (int(x) for x in out.read_text().split())
    try:
        deadline = time.monotonic() + 30
        while (_alive(worker) or _alive(server)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(worker) and not _alive(server), "the killed rank's worker or worker server still runs"
    finally:
        for pid in (worker, server):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


class _Unpicklable:
    """A dataset holding a lock (a user's processor with a cache guarded by one, say): a fork copied it, a pickle
    cannot."""

    def __init__(self):
        import threading
        self.lock = threading.Lock()

    def __getitem__(self, key):
        return {"key": key, "_bad_records": []}


def test_a_dataset_that_cannot_be_pickled_names_data_num_workers():
    with pytest.raises(RuntimeError, match=r"data\.num_workers = 1.*pickle.*_thread\.lock.*data\.num_workers = 0"):
        list(_eval_loader(_Unpicklable(), timeout_s=60))


def test_a_processor_that_cannot_be_pickled_names_data_num_workers(proc, tmp_path):
    """Through the Python API: a processor holding a lock (a user's cache, say) reaches the workers pickled, and
    cannot; the error names the key that avoids the workers."""
    import copy
    import threading

    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "Say hi."},
                                             {"role": "assistant", "content": "hi"}]}) + "\n")
    locked = copy.copy(proc)
    locked.cache_lock = threading.Lock()
    cfg = DataConfig(type="messages_jsonl", train_path=str(path), num_workers=1, max_tokens_per_pack=64)
    loader = build_sft_dataloader(cfg, locked, seed=0, dp_rank=0, dp_size=1)
    with pytest.raises(RuntimeError, match=r"data\.num_workers = 1: .*pickle.*data\.num_workers = 0"):
        next(iter(loader))
