"""The planning lengths computed in parts (a pool of worker processes, 1 / world on each rank) equal the
serial pass: the same array and the same bad records in the same order, on records with images, a video
(frame folder), a tool trace (which the tiny template does not render: a named bad record) and bad lines of
several kinds; the length cache stays one file."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

import megatron_vlm.data.lengths as lengths_mod
from megatron_vlm.data.bad_records import BadRecordError, BadRecordLog
from megatron_vlm.data.config import DataConfig
from megatron_vlm.data.lengths import compute_length_slice, compute_lengths
from megatron_vlm.data.sources import open_split

_TOOLS = [{"type": "function", "function": {"name": "add", "description": "add two numbers",
                                            "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture
def source(tmp_path, write_image):
    for k in range(4):
        write_image(tmp_path / f"img{k}.png", size=(56 + 28 * k, 56), seed=k)
    for k in range(4):
        write_image(tmp_path / "clip" / f"{k:03d}.png", size=(56, 56), seed=10 + k)
    lines = []
    for i in range(40):
        content: list = [{"type": "text", "text": f"item {i}: what is shown " + "there " * (i % 7)}]
        if i % 2:
            content.insert(0, {"type": "image", "image": f"img{i % 4}.png"})
        lines.append({"messages": [{"role": "user", "content": content},
                                   {"role": "assistant", "content": f"answer {i}"}]})
    lines[5]["messages"][0]["content"][0]["image"] = "gone.png"  # missing image
    lines[17]["messages"][0]["content"].insert(0, {"type": "video", "video": str(tmp_path / "clip")})
    lines[22] = {"messages": [{"role": "user", "content": "add 1 and 2"},
                              {"role": "assistant", "content": None,
                               "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {}}}]},
                              {"role": "tool", "content": "3"},
                              {"role": "assistant", "content": "3"}], "tools": _TOOLS}
    lines[31]["messages"][0]["content"][0]["image"] = "gone_too.png"
    (tmp_path / "bad.png").write_bytes(b"not a png")
    lines[36]["messages"][0]["content"].insert(0, {"type": "image", "image": "bad.png"})
    text = [json.dumps(r) for r in lines]
    text.insert(9, "{not json")
    (tmp_path / "data.jsonl").write_text("\n".join(text) + "\n")
    cfg = DataConfig(type="messages_jsonl", train_path=str(tmp_path / "data.jsonl"), num_workers=0)
    return open_split(cfg, "train", BadRecordLog())


def _serial(source, proc):
    bad = BadRecordLog()
    got = compute_lengths(source, proc, max_frames=4, bad_records=bad)
    return got, bad


def test_the_fixture_has_good_and_bad_records(source, proc):
    lengths, bad = _serial(source, proc)
    assert {(b.index, b.category) for b in bad.entries} == {
        (6, "missing_image"), (24, "invalid_record"), (33, "missing_image"), (38, "corrupt_image")}  # 1-based lines
    assert (lengths > 0).sum() == len(source) - 4 and lengths[17] > lengths[15]  # the video's tokens count


def test_worker_pool_gives_the_serial_lengths_and_bad_records(source, proc, monkeypatch):
    want, want_bad = _serial(source, proc)
    monkeypatch.setattr(lengths_mod, "_POOL_CHUNK", 6)  # several chunks over 2 workers
    bad = BadRecordLog()
    got = compute_lengths(source, proc, max_frames=4, bad_records=bad, num_workers=2)
    assert np.array_equal(got, want)
    assert bad.to_dict() == want_bad.to_dict()


@pytest.mark.parametrize("world", [2, 3])
def test_each_rank_estimates_a_share_that_merges_into_the_serial_pass(source, proc, world):
    """What `compute_lengths(split_over_ranks=True)` does with an all-gather, with a fake world: rank r
    estimates records r, r + world, ...; put back in place they give the serial array and bad records."""
    want, want_bad = _serial(source, proc)
    merged = np.full(len(source), -2)
    bad_parts = {}
    for rank in range(world):
        mine = list(range(rank, len(source), world))
        got, bad = compute_length_slice(source, proc, mine, max_frames=4)
        assert len(got) == len(mine)
        merged[mine] = got
        bad_parts[rank] = bad
    assert np.array_equal(merged, want)
    bad_log = BadRecordLog()
    bad_log.extend(b for r in range(world) for b in bad_parts[r])
    assert bad_log.to_dict() == want_bad.to_dict()


def test_split_over_ranks_without_a_process_group_is_the_serial_pass(source, proc, tmp_path):
    want, _ = _serial(source, proc)
    cache = tmp_path / "cache"
    got = compute_lengths(source, proc, max_frames=4, split_over_ranks=True, cache_dir=cache, num_workers=2)
    assert np.array_equal(got, want)
    files = list(cache.glob("lengths-*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["lengths"] == want.tolist()
    assert not list(cache.glob(".*tmp"))


def _rank_main(rank, world, store_path, source, proc, cache, queue):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        bad = BadRecordLog()
        got = compute_lengths(source, proc, max_frames=4, bad_records=bad, split_over_ranks=True, cache_dir=cache)
        calls = []
        original = lengths_mod.estimate_length_and_class
        lengths_mod.estimate_length_and_class = lambda *a, **k: calls.append(1) or original(*a, **k)
        again = compute_lengths(source, proc, max_frames=4, split_over_ranks=True, cache_dir=cache)
        queue.put((rank, got.tolist(), bad.to_dict(), again.tolist(), len(calls)))
    finally:
        dist.destroy_process_group()


def test_split_over_two_gloo_ranks_gathers_the_serial_pass_and_writes_one_cache(source, proc, tmp_path):
    """The real collective: two forked processes in a gloo group. Each returns the serial array and every bad
    record; one cache file; on the second pass only the 4 records cached as bad are estimated, split 2 + 2."""
    import multiprocessing as mp

    want, want_bad = _serial(source, proc)
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    cache = tmp_path / "cache"
    procs = [ctx.Process(target=_rank_main, args=(r, 2, tmp_path / "store", source, proc, cache, queue))
             for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert [r[0] for r in results] == [0, 1]
    for _, got, bad, again, calls in results:
        assert got == want.tolist() and again == want.tolist()
        assert bad == want_bad.to_dict()
        assert calls == 2  # half of the 4 cached-as-bad records on each rank
    assert len(list(cache.glob("lengths-*.json"))) == 1


class _Unlocatable:
    """A record source whose second record cannot even be located (its file vanished between listing and reading)."""

    def __len__(self):
        return 2

    def locate(self, i):
        if i == 1:
            raise OSError("No such file or directory: 'part-1.jsonl'")
        return ("part-0.jsonl", 1)

    def get(self, i):  # noqa: ARG002
        raise ValueError("unreadable")


def test_a_record_that_cannot_be_located_is_a_counted_bad_record():
    bad = BadRecordLog()
    got = compute_lengths(_Unlocatable(), None, max_frames=4, bad_records=bad)
    assert got.tolist() == [-1, -1]
    assert [(b.source, b.index, b.category) for b in bad.entries] == [
        ("(record not located)", 1, "unexpected_error"), ("part-0.jsonl", 1, "unexpected_error")]
    assert "part-1.jsonl" in bad.entries[0].detail


class _ParentReporting:
    """A source whose every record is a bad record naming the pid of the process that estimated it and its parent."""

    def __len__(self):
        return 2 * lengths_mod._POOL_CHUNK

    def locate(self, i):
        return ("parent.jsonl", i)

    def get(self, i):  # noqa: ARG002
        raise BadRecordError("invalid_record", f"{os.getpid()} {os.getppid()}")


def test_the_pool_workers_are_not_forked_from_the_rank():
    """A child forked from a rank that runs threads (gloo, a TensorBoard writer) can deadlock inside fork itself;
    the pass's workers come from the worker server (worker_start.py), which forks them from its one thread."""
    bad = BadRecordLog()
    compute_lengths(_ParentReporting(), None, max_frames=4, bad_records=bad, num_workers=2)
    pids = {tuple(int(p) for p in b.detail.split()) for b in bad.entries}
    assert len(bad.entries) == 2 * lengths_mod._POOL_CHUNK and pids
    assert all(pid != os.getpid() and ppid != os.getpid() for pid, ppid in pids), pids


class _Unpicklable(_ParentReporting):
    def __init__(self):
        self.hook = lambda: None  # a lambda does not pickle


def test_an_unpicklable_source_is_an_error_naming_the_key():
    with pytest.raises(lengths_mod.LengthEstimateError, match=r"data.num_workers = 2: .*pickled.*data.num_workers = 0"):
        compute_lengths(_Unpicklable(), None, max_frames=4, num_workers=2)
    assert compute_lengths(_Unpicklable(), None, max_frames=4, num_workers=0).tolist() == [-1] * len(_Unpicklable())
