"""The SFT / eval loaders: every sample exactly once per epoch, deterministic reshuffles, the same
global pack stream for any world size (1 rank x 2 micro-batches == 2 ranks x 1), exact resume,
worker processes, bad records skipped and counted while the run goes on, the length cache."""
from __future__ import annotations

import json
import random
import re

import pytest
import torch

from megatron_vlm.data.bad_records import BadRecordLog
from megatron_vlm.data.config import DataConfig
from megatron_vlm.data.loader import build_eval_dataloader, build_sft_dataloader

_WORDS = ["the", "a", "red", "blue", "circle", "square", "shape", "colour", "is", "what", "how", "many", "there", "are", "image", "robot", "cup"]


def _write_jsonl(tmp_path, write_image, n=36, seed=0, extra_lines=()):
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 40)))
        content = [{"type": "text", "text": f"item {i}: {words}"}]
        if i % 3 == 0:
            write_image(tmp_path / f"img{i}.png", size=(56, 56 + 28 * (i % 2)), seed=i)
            content.insert(0, {"type": "image", "image": f"img{i}.png"})
        lines.append(json.dumps({"messages": [{"role": "user", "content": content},
                                              {"role": "assistant", "content": f"answer {i}"}]}))
    lines += list(extra_lines)
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _samples(pack, proc):
    """[(item id, decoded labels)] of a pack, recovered from its tokens alone."""
    cu = pack["cu_seqlens"].tolist()
    out = []
    for a, b in zip(cu[:-1], cu[1:]):
        text = proc.tokenizer.decode(pack["input_ids"][0, a:b])
        m = re.search(r"item (\d+):", text)
        lab = pack["labels"][0, a:b]
        out.append((int(m.group(1)) if m else None, proc.tokenizer.decode(lab[lab != -100])))
    return out


def _take(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def _equal(p, q):
    return p.keys() == q.keys() and all(torch.equal(p[k], q[k]) for k in p)


@pytest.fixture
def cfg(tmp_path, write_image):
    path = _write_jsonl(tmp_path, write_image)
    return DataConfig(type="messages_jsonl", train_path=str(path), eval_path=str(path), max_tokens_per_pack=160,
                      num_workers=0)


def test_each_sample_once_per_epoch_with_correct_labels_and_reshuffled(cfg, proc):
    loader = build_sft_dataloader(cfg, proc, seed=0, dp_rank=0, dp_size=1)
    p0 = loader.packs_per_epoch
    packs = _take(loader, p0 + 3)
    epoch0 = [s for p in packs[:p0] for s in _samples(p, proc)]
    assert sorted(i for i, _ in epoch0) == list(range(36))
    assert all(lab == f"answer {i}<|im_end|>" for i, lab in epoch0)
    for p in packs:
        assert p["input_ids"].shape[1] <= 160 and p["cu_seqlens"][-1] == p["input_ids"].shape[1]
        assert int(p["num_samples"]) == len(p["cu_seqlens"]) - 1
        assert int(p["num_label_tokens"]) == int((p["labels"] != -100).sum())
        # placeholders and features agree inside every pack
        n_img = int((p["input_ids"] == proc.image_token_id).sum())
        feats = int(p["image_grid_thw"].prod(-1).sum()) // 4 if "image_grid_thw" in p else 0
        assert n_img == feats and (p["pixel_values"].shape[0] if feats else 0) == feats * 4
    assert loader.epoch == 1
    order0 = [i for i, _ in epoch0]
    epoch1 = _take(build_sft_dataloader(cfg, proc, seed=0, dp_rank=0, dp_size=1), 2 * p0 + 2)
    order1 = [i for p in epoch1[p0:] for i, _ in _samples(p, proc)]
    assert order1[:30] != order0[:30]  # reshuffled
    again = _take(build_sft_dataloader(cfg, proc, seed=0, dp_rank=0, dp_size=1), 4)
    assert all(_equal(a, b) for a, b in zip(again, packs))
    other = _take(build_sft_dataloader(cfg, proc, seed=1, dp_rank=0, dp_size=1), 4)
    assert not all(_equal(a, b) for a, b in zip(other, packs))
    stats = loader.stats()
    assert 0.6 < stats["packing_efficiency"] <= 1.0 and stats["bad_records"] == 0 and stats["epoch"] == 1


def test_one_rank_two_micro_batches_equals_two_ranks_across_epochs(cfg, proc):
    single = build_sft_dataloader(cfg, proc, seed=3, dp_rank=0, dp_size=1)
    p0 = single.packs_per_epoch
    steps = p0 // 2 + 3  # crosses the epoch boundary
    one = _take(single, 2 * steps)
    r0 = _take(build_sft_dataloader(cfg, proc, seed=3, dp_rank=0, dp_size=2), steps)
    r1 = _take(build_sft_dataloader(cfg, proc, seed=3, dp_rank=1, dp_size=2), steps)
    for k in range(steps):
        assert _equal(one[2 * k], r0[k]) and _equal(one[2 * k + 1], r1[k])


def test_resume_from_state_dict_yields_the_same_next_packs(cfg, proc):
    a = build_sft_dataloader(cfg, proc, seed=5, dp_rank=0, dp_size=1)
    it = iter(a)
    for _ in range(6):
        next(it)
    state = json.loads(json.dumps(a.state_dict()))  # survives a round trip through a checkpoint
    expected = [next(it) for _ in range(4)]
    b = build_sft_dataloader(cfg, proc, seed=5, dp_rank=0, dp_size=1)
    b.load_state_dict(state)
    assert all(_equal(x, y) for x, y in zip(_take(b, 4), expected))
    # resume on 2 ranks from a 1-rank position: rank r continues with global packs 6 + r, 8 + r
    c = build_sft_dataloader(cfg, proc, seed=5, dp_rank=1, dp_size=2)
    c.load_state_dict(state)
    got = _take(c, 2)
    assert _equal(got[0], expected[1]) and _equal(got[1], expected[3])
    with pytest.raises(ValueError, match="seed=5 in the checkpoint but 6 now"):
        build_sft_dataloader(cfg, proc, seed=6, dp_rank=0, dp_size=1).load_state_dict(state)
    odd = dict(state, global_packs_consumed=7)
    with pytest.raises(ValueError, match="7 packs consumed globally cannot be split evenly over dp_size=2"):
        c.load_state_dict(odd)


def test_resume_just_before_an_epoch_boundary_continues_into_the_next_epoch(cfg, proc):
    """A checkpoint two or three packs before the end of epoch 0 (an even position, for the 2-rank resume): the
    resumed loader (on 2 ranks, too) yields the straight run's packs over the boundary, with its epoch counter."""
    a = build_sft_dataloader(cfg, proc, seed=3, dp_rank=0, dp_size=1)
    n = a.packs_per_epoch
    it = iter(a)
    for _ in range((n - 2) // 2 * 2):
        next(it)
    state = json.loads(json.dumps(a.state_dict()))
    assert state["epoch"] == 0
    expected = [next(it) for _ in range(4)]
    assert a.epoch == 1
    b = build_sft_dataloader(cfg, proc, seed=3, dp_rank=0, dp_size=1)
    b.load_state_dict(state)
    got = _take(b, 4)
    assert all(_equal(x, y) for x, y in zip(got, expected)) and b.epoch == 1
    ranks = [build_sft_dataloader(cfg, proc, seed=3, dp_rank=r, dp_size=2) for r in (0, 1)]
    for r in ranks:
        r.load_state_dict(state)
    two = [_take(r, 2) for r in ranks]
    assert all(_equal(two[k % 2][k // 2], expected[k]) for k in range(4))


def test_resume_with_shuffle_turned_off_is_refused(cfg, proc):
    """data.shuffle decides the pack order: a position of the shuffled stream points elsewhere in the file-order one
    (samples trained twice, others skipped), so the other setting is refused as another train.seed is."""
    a = build_sft_dataloader(cfg, proc, seed=5, dp_rank=0, dp_size=1)
    _take(a, 3)
    state = json.loads(json.dumps(a.state_dict()))
    cfg.shuffle = False
    with pytest.raises(ValueError, match="shuffle=True in the checkpoint but False now"):
        build_sft_dataloader(cfg, proc, seed=5, dp_rank=0, dp_size=1).load_state_dict(state)
    del state["shuffle"]  # a checkpoint written before the setting was recorded resumes unchecked
    build_sft_dataloader(cfg, proc, seed=5, dp_rank=0, dp_size=1).load_state_dict(state)


def test_worker_processes_give_the_same_packs(cfg, proc):
    base = _take(build_sft_dataloader(cfg, proc, seed=0, dp_rank=1, dp_size=2), 5)
    cfg.num_workers = 2
    workers = _take(build_sft_dataloader(cfg, proc, seed=0, dp_rank=1, dp_size=2), 5)
    assert all(_equal(x, y) for x, y in zip(base, workers))


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGUSR1"])
def test_worker_processes_leave_a_stop_signal_to_the_rank(cfg, proc, signame):
    """SLURM sends its stop request (TERM, or USR1 with --signal=USR1@<s>) to every process of the job step; the
    rank saves a checkpoint at the next step boundary, so its loader workers must live on: a worker killed by USR1
    made the DataLoader raise in the rank wherever it was (its checkpoint save included)."""
    import multiprocessing as mp
    import os
    import signal
    import time

    want = _take(build_sft_dataloader(cfg, proc, seed=0, dp_rank=0, dp_size=1), 6)
    cfg.num_workers = 1
    it = iter(build_sft_dataloader(cfg, proc, seed=0, dp_rank=0, dp_size=1))
    got = [next(it)]
    workers = mp.active_children()
    assert workers
    for w in workers:
        os.kill(w.pid, getattr(signal, signame))
    time.sleep(0.5)  # a worker the signal ends is gone by now
    got += [next(it) for _ in range(5)]
    assert all(_equal(x, y) for x, y in zip(got, want))


def test_bad_records_are_skipped_counted_and_the_run_goes_on(tmp_path, write_image, proc):
    good = write_image(tmp_path / "good.png")
    trunc = tmp_path / "trunc.png"
    trunc.write_bytes(good.read_bytes()[:60])  # header readable, pixels not: fails only in the worker

    def rec(content, answer="ok"):
        return json.dumps({"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]})

    extra = [
        "{oops",                                                                              # line 13
        rec([{"type": "image", "image": "missing.png"}, {"type": "text", "text": "item 90: x"}]),  # 14
        rec([{"type": "image", "image": "trunc.png"}, {"type": "text", "text": "item 91: x"}]),    # 15
        rec([{"type": "text", "text": "item 92: " + "the " * 200}]),                          # 16 too long
        rec([{"type": "text", "text": "item 93: <|image_pad|>"}]),                          # 17
    ]
    path = _write_jsonl(tmp_path, write_image, n=12, seed=1, extra_lines=extra)
    cfg = DataConfig(type="messages_jsonl", train_path=str(path), max_tokens_per_pack=96, num_workers=2)
    loader = build_sft_dataloader(cfg, proc, seed=0, dp_rank=0, dp_size=1)
    packs = _take(loader, loader.packs_per_epoch)
    seen = [i for p in packs for i, _ in _samples(p, proc)]
    assert sorted(i for i in seen if i is not None) == list(range(12))
    bad = {(b.index, b.category) for b in loader.bad_records.entries}
    assert bad == {(13, "malformed_json"), (14, "missing_image"), (15, "corrupt_image"), (16, "too_long"),
                   (17, "placeholder_mismatch")}
    assert all(b.source == str(path) for b in loader.bad_records.entries)
    # with one sample per pack, the corrupt sample's pack is empty: a one-token pack, nothing trained
    cfg.max_tokens_per_pack = 48
    loader = build_sft_dataloader(cfg, proc, seed=0, dp_rank=0, dp_size=1)
    packs = _take(loader, loader.packs_per_epoch)
    empty = [p for p in packs if int(p["num_samples"]) == 0]
    assert len(empty) == 1 and empty[0]["input_ids"].shape == (1, 1) and int(empty[0]["num_label_tokens"]) == 0
    summary = json.loads(loader.bad_records.write_summary(tmp_path / "bad.json").read_text())
    assert summary["by_category"]["corrupt_image"] == 1


def test_length_cache_is_used_and_keeps_bad_records(cfg, proc, tmp_path, monkeypatch):
    import megatron_vlm.data.lengths as lengths_mod

    missing = {"messages": [{"role": "user", "content": [{"type": "image", "image": "gone.png"}]},
                            {"role": "assistant", "content": "x"}]}
    lines = (tmp_path / "data.jsonl").read_text() + json.dumps(missing) + "\n"
    (tmp_path / "data.jsonl").write_text(lines)
    cfg.length_cache_dir = str(tmp_path / "cache")
    first = build_sft_dataloader(cfg, proc, seed=0, dp_rank=0, dp_size=1)
    assert len(list((tmp_path / "cache").glob("lengths-*.json"))) == 1

    calls = []
    original = lengths_mod.estimate_length_and_class

    def counting(*a, **k):
        calls.append(1)
        return original(*a, **k)

    monkeypatch.setattr(lengths_mod, "estimate_length_and_class", counting)
    second = build_sft_dataloader(cfg, proc, seed=0, dp_rank=0, dp_size=1)
    assert calls == [1]  # only the record cached as bad is looked at again (its image may have been added since)
    calls.clear()
    assert (second.planner.lengths == first.planner.lengths).all()
    assert {(b.index, b.category) for b in second.bad_records.entries} == {(37, "missing_image")}
    assert _equal(_take(second, 1)[0], _take(first, 1)[0])
    # a different pixel budget is a different key
    cfg.max_pixels = 28 * 28 * 4
    build_sft_dataloader(cfg, proc, seed=0, dp_rank=0, dp_size=1)
    assert len(calls) == 37


def test_length_cache_does_not_keep_a_record_bad_once_its_image_is_there(cfg, proc, tmp_path, write_image):
    """A run that found missing images (a wrong data.image_root, an unfinished copy) and a run after they were
    put in place share the data file, so the cache key: the records cached as bad are checked again, never
    skipped for good by the cache. A changed data.image_root is another key."""
    lines = (tmp_path / "data.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    first["messages"][0]["content"][0]["image"] = "late/img0.png"
    (tmp_path / "data.jsonl").write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    cfg.length_cache_dir = str(tmp_path / "cache")
    before = build_sft_dataloader(cfg, proc, seed=0, dp_rank=0, dp_size=1)
    assert {(b.index, b.category) for b in before.bad_records.entries} == {(1, "missing_image")}
    write_image(tmp_path / "late" / "img0.png", size=(56, 56), seed=0)
    after = build_sft_dataloader(cfg, proc, seed=0, dp_rank=0, dp_size=1)
    assert len(after.bad_records) == 0 and before.planner.lengths[0] == -1
    cfg.length_cache_dir = ""
    fresh = build_sft_dataloader(cfg, proc, seed=0, dp_rank=0, dp_size=1)
    assert (after.planner.lengths == fresh.planner.lengths).all() and after.planner.lengths[0] > 0

    from megatron_vlm.data.lengths import lengths_cache_key
    from megatron_vlm.data.sources import open_split

    keys = set()
    for root in ("", str(tmp_path), str(tmp_path / "late")):
        cfg.image_root = root
        keys.add(lengths_cache_key(open_split(cfg, "train"), proc, max_frames=cfg.max_frames, for_generation=False))
    assert len(keys) == 3


def test_eval_loaders_cover_the_split_once_with_equal_counts_per_rank(cfg, proc):
    seen, counts = [], []
    for rank in range(3):
        ev = build_eval_dataloader(cfg, proc, dp_rank=rank, dp_size=3)
        items = list(ev)
        counts.append(len(items))
        seen += [i for p in items for i, _ in _samples(p, proc) if int(p["num_samples"])]
    assert sorted(seen) == list(range(36)) and len(set(counts)) == 1
    seen, counts = [], []
    for rank in range(3):
        ev = build_eval_dataloader(cfg, proc, dp_rank=rank, dp_size=3, mode="generation", batch_size=5,
                                   padding_side="left")
        batches = list(ev)
        counts.append(len(batches))
        for b in batches:
            assert b["input_ids"].shape[0] == len(b["answers"]) == b["sample_valid"].numel()
            assert (b["attention_mask"][:, -1] == 1).all()  # left padded
            for row, ok, ans in zip(b["input_ids"], b["sample_valid"], b["answers"]):
                if ok:
                    text = proc.tokenizer.decode(row)
                    item = int(re.search(r"item (\d+):", text).group(1))
                    assert text.endswith("<|im_start|>assistant\n") and ans == f"answer {item}"
                    seen.append(item)
    assert sorted(seen) == list(range(36)) and len(set(counts)) == 1
    cfg.eval_path = ""
    assert build_eval_dataloader(cfg, proc, dp_rank=0, dp_size=1) is None


def test_synthetic_vqa_source_end_to_end(tmp_path, tiny_dir):
    cfg = DataConfig(type="synthetic_vqa", synthetic_dir=str(tmp_path / "vqa"), synthetic_train_size=24,
                     synthetic_eval_size=6, max_tokens_per_pack=256, num_workers=0)
    loader = build_sft_dataloader(cfg, str(tiny_dir), seed=0, dp_rank=0, dp_size=1)  # a model folder works too
    pack = _take(loader, 1)[0]
    n = int(pack["num_samples"])
    assert n > 1 and pack["image_grid_thw"].shape == (n, 3) and pack["pixel_values"].shape[0] == 16 * n
    assert int(pack["num_label_tokens"]) == 2 * n  # one-token answers + <|im_end|>
    ev = build_eval_dataloader(cfg, str(tiny_dir), dp_rank=0, dp_size=1, mode="generation", batch_size=8)
    (batch,) = list(ev)
    assert len(batch["answers"]) == 6 and all(m["question_type"] for m in batch["meta"])


def test_a_bad_record_every_rank_finds_while_planning_is_counted_once(cfg, proc, tmp_path, monkeypatch):
    """Every rank plans the whole split, so every rank finds its missing image; the run's summary gathers
    the ranks' logs and adds their skips: a record skipped once must not read "skips: 2" on 2 ranks."""
    import torch.distributed as dist

    missing = {"messages": [{"role": "user", "content": [{"type": "image", "image": "gone.png"}]},
                            {"role": "assistant", "content": "x"}]}
    (tmp_path / "data.jsonl").write_text((tmp_path / "data.jsonl").read_text() + json.dumps(missing) + "\n")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    summary = BadRecordLog()  # what write_bad_record_summary merges from the gathered ranks
    for rank in range(2):
        monkeypatch.setattr(dist, "get_rank", lambda rank=rank: rank)
        loader = build_sft_dataloader(cfg, proc, seed=0, dp_rank=rank, dp_size=2)
        summary.extend(loader.bad_records.to_dict()["records"])
    assert summary.to_dict()["num_skips"] == 1 and [(b.index, b.category) for b in summary.entries] == [(37, "missing_image")]


def test_rewind_puts_back_the_packs_since_the_mark(tmp_path, write_image, proc):
    """A training step that fetched its packs and was then given up before using them (a stop agreed at its start:
    training/sft.py `agree_counts`) puts them back: the position, the counts and the records skipped in them are the
    mark's again (the checkpoint saved then holds the step boundary), and the packs come again, counted once."""
    good = write_image(tmp_path / "good.png")
    (tmp_path / "trunc.png").write_bytes(good.read_bytes()[:60])  # fails only when its pack is processed
    corrupt = json.dumps({"messages": [{"role": "user", "content": [{"type": "image", "image": "trunc.png"},
                                                                     {"type": "text", "text": "item 91: x"}]},
                                       {"role": "assistant", "content": "ok"}]})
    path = _write_jsonl(tmp_path, write_image, n=12, seed=1, extra_lines=[corrupt])
    cfg = DataConfig(type="messages_jsonl", train_path=str(path), max_tokens_per_pack=96, num_workers=0)
    loader = build_sft_dataloader(cfg, proc, seed=0, dp_rank=0, dp_size=1)
    it = iter(loader)
    first = next(it)
    loader.mark()
    state, stats, bad = loader.state_dict(), loader.stats(), loader.bad_records.to_dict()
    taken = [next(it) for _ in range(loader.packs_per_epoch)]  # the rest of the epoch and one more
    read = loader.bad_records.to_dict()
    assert read["by_category"] == {"corrupt_image": 1} and bad["num_bad_records"] == 0
    loader.rewind()
    assert (loader.state_dict(), loader.stats(), loader.bad_records.to_dict()) == (state, stats, bad)
    with pytest.raises(RuntimeError, match="rewound"):
        next(it)  # the iterator that yielded them is spent
    again = _take(loader, len(taken))
    assert all(_equal(x, y) for x, y in zip(again, taken)) and not _equal(again[0], first)
    assert loader.bad_records.to_dict() == read  # skipped once, not twice
