"""A DataLoader worker and a length-pass worker see the rank's environment and logging as the rank had them when it
built the loader.

The workers are the worker server's children (worker_start.py), not the rank's: they inherited the environment of
the rank when the server started (not a variable set later, nor the removal of one) and no logging setup at all (a
rank's `logging.basicConfig`, its file handler and the library's DEBUG level did not reach them: a worker's records
went to Python's last-resort stderr output at WARNING and above)."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from megatron_vlm.data.bad_records import BadRecordError, BadRecordLog
from megatron_vlm.data.lengths import _POOL_CHUNK, compute_lengths
from megatron_vlm.data.loader import EvalDataLoader

_LOGGER = "megatron_vlm.data.test_worker_env"


class _Reports:
    """Each item: the worker's environment and its logging levels; it also logs one DEBUG and one INFO record."""

    def __getitem__(self, key):
        log = logging.getLogger(_LOGGER)
        log.debug("debug from worker %d", os.getpid())
        log.info("info from worker %d", os.getpid())
        return {"pid": os.getpid(), "env": dict(os.environ), "root": logging.getLogger().level,
                "library": logging.getLogger("megatron_vlm").level, "_bad_records": []}


def _one_item(dataset) -> dict:
    loader = EvalDataLoader(dataset, [0], num_workers=1, prefetch_factor=2, bad_records=BadRecordLog(),
                            mode="batches", timeout_s=60)
    (item,) = list(loader)
    return item


@pytest.fixture
def logging_restored():
    root, lib = logging.getLogger(), logging.getLogger("megatron_vlm")
    saved = (root.level, list(root.handlers), lib.level, list(lib.handlers), lib.propagate)
    yield
    for h in root.handlers[:]:
        if h not in saved[1]:
            root.removeHandler(h)
            h.close()
    for h in lib.handlers[:]:
        if h not in saved[3]:
            lib.removeHandler(h)
            h.close()
    root.setLevel(saved[0])
    lib.setLevel(saved[2])
    lib.propagate = saved[4]


def test_a_worker_sees_the_environment_of_the_rank_at_loader_creation(monkeypatch):
    _one_item(_Reports())  # the worker server is running from here on
    gone = next(k for k in ("HOME", "PATH", "LANG") if k in os.environ)
    monkeypatch.setenv("MEGATRON_VLM_SET_AFTER_THE_SERVER", "late")
    monkeypatch.delenv(gone)
    item = _one_item(_Reports())
    assert item["pid"] != os.getpid()
    assert item["env"].get("MEGATRON_VLM_SET_AFTER_THE_SERVER") == "late"
    assert gone not in item["env"]
    assert item["env"] == dict(os.environ)


def test_a_worker_logs_at_the_rank_s_levels_into_its_file(tmp_path, logging_restored):
    _one_item(_Reports())
    path = tmp_path / "rank.log"
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("FILE %(levelname)s %(name)s %(message)s"))
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.INFO)
    logging.getLogger("megatron_vlm").setLevel(logging.DEBUG)
    item = _one_item(_Reports())
    handler.flush()
    text = path.read_text()
    assert (item["root"], item["library"]) == (logging.INFO, logging.DEBUG)
    assert f"FILE DEBUG {_LOGGER} debug from worker {item['pid']}" in text, text
    assert f"FILE INFO {_LOGGER} info from worker {item['pid']}" in text, text


def test_a_worker_s_records_below_the_rank_s_level_are_dropped(tmp_path, logging_restored):
    path = tmp_path / "rank.log"
    handler = logging.FileHandler(path)
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.WARNING)
    logging.getLogger("megatron_vlm").setLevel(logging.NOTSET)
    item = _one_item(_Reports())
    assert (item["root"], item["library"]) == (logging.WARNING, logging.NOTSET)
    assert "from worker" not in path.read_text()


class _LogsFromLengthPass:
    """A source whose every record is a bad record, logged at INFO from the worker that estimated it, with its
    environment."""

    def __len__(self):
        return 2 * _POOL_CHUNK

    def locate(self, i):
        return ("records.jsonl", i)

    def get(self, i):
        if i % _POOL_CHUNK == 0:
            logging.getLogger(_LOGGER).info("length pass worker %d", os.getpid())
        raise BadRecordError("invalid_record", os.environ.get("MEGATRON_VLM_SET_AFTER_THE_SERVER", "unset"))


def test_a_length_pass_worker_sees_the_rank_s_environment_and_logging(tmp_path, monkeypatch, logging_restored):
    _one_item(_Reports())
    monkeypatch.setenv("MEGATRON_VLM_SET_AFTER_THE_SERVER", "late")
    path = tmp_path / "rank.log"
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("FILE %(levelname)s %(message)s"))
    logging.getLogger().addHandler(handler)
    logging.getLogger("megatron_vlm").setLevel(logging.INFO)
    bad = BadRecordLog()
    compute_lengths(_LogsFromLengthPass(), None, max_frames=4, bad_records=bad, num_workers=2)
    assert {b.detail for b in bad.entries} == {"late"}
    handler.flush()
    workers = {int(line.rsplit(" ", 1)[1]) for line in path.read_text().splitlines() if "length pass worker" in line}
    assert workers and os.getpid() not in workers, path.read_text()


_BASIC_CONFIG = """
import logging, os
from megatron_vlm.data.bad_records import BadRecordLog
from megatron_vlm.data.loader import EvalDataLoader


class _Reports:
    def __getitem__(self, key):
        logging.getLogger("megatron_vlm.x").debug("debug from worker %d", os.getpid())
        logging.getLogger("megatron_vlm.x").info("info from worker %d", os.getpid())
        return {{"pid": os.getpid(), "_bad_records": []}}


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="RANK0 %(levelname)s %(message)s")  # as launch/pretrain_vlm.py
    loader = EvalDataLoader(_Reports(), [0], num_workers=1, prefetch_factor=2, bad_records=BadRecordLog(),
                            mode="batches", timeout_s=60)
    (item,) = list(loader)
    print(item["pid"], flush=True)
"""


def test_a_worker_logs_to_stderr_in_the_format_of_the_rank_s_basic_config(tmp_path):
    """The entry point's `logging.basicConfig` (a stderr handler, which does not pickle) becomes a stderr handler of
    the same format and level in each worker."""
    import subprocess
    import sys

    script = tmp_path / "rank.py"
    script.write_text(_BASIC_CONFIG.format())
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=40,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])})
    assert r.returncode == 0, r.stderr[-3000:]
    pid = int(r.stdout.split()[-1])
    assert f"RANK0 INFO info from worker {pid}" in r.stderr, r.stderr[-3000:]
    assert "debug from worker" not in r.stderr


def test_handlers_that_cannot_reach_a_worker_have_one_stderr_handler_stand_in(tmp_path, logging_restored):
    """Rebuilt in this process as a worker would: an in-memory handler and a queue handler become one stderr
    handler with the first one's format; a rotating file handler appends to the same file (a worker never rotates)."""
    import io
    import logging.handlers
    import queue
    import sys

    from megatron_vlm.data.worker_env import adopt_rank_state, rank_state

    lib = logging.getLogger("megatron_vlm")
    memory = logging.StreamHandler(io.StringIO())
    memory.setFormatter(logging.Formatter("MEM {message}", style="{"))
    memory.setLevel(logging.INFO)
    rotating = logging.handlers.RotatingFileHandler(tmp_path / "rank.log", maxBytes=10, backupCount=1)
    for h in (memory, logging.handlers.QueueHandler(queue.Queue()), rotating):
        lib.addHandler(h)
    adopt_rank_state(rank_state())
    stderr, file = lib.handlers
    assert type(stderr) is logging.StreamHandler and stderr.stream is sys.stderr and stderr.level == logging.INFO
    assert stderr.formatter.format(logging.makeLogRecord({"msg": "hi"})) == "MEM hi"
    assert type(file) is logging.handlers.WatchedFileHandler and file.baseFilename == rotating.baseFilename
    for h in (memory, rotating):
        h.close()

    for h in lib.handlers[:]:
        lib.removeHandler(h)
    lib.addHandler(logging.StreamHandler(io.StringIO()))
    lib.addHandler(logging.StreamHandler(sys.stderr))
    adopt_rank_state(rank_state())  # writes to stderr already: no stand-in
    (only,) = lib.handlers
    assert type(only) is logging.StreamHandler and only.stream is sys.stderr

