"""GRPO prompts that cannot fit (or be read) are left out at start-up, counted, never a mid-run exit.

Found by a job with half its prompts over-long and `rl.batch.prompts_per_step = 1`: the first step that drew
only over-long prompts ended the run with exit 2. `drop_unusable_prompts` now drops them before the
first step, with the exact boundary of the step-time encoder (the reference here: `PromptEncoder`
encodes what is kept and refuses what is dropped as too long), counts them as bad records, and a set
with nothing left is a ConfigError naming its key.

Multi-turn (`[rl.env]`): a prompt that leaves no room under `rl.env.max_total_tokens` (which may be below
data.max_tokens_per_pack, the limit above; the tool specs lengthen every prompt too) is skipped and counted by the
multi-turn prompt encoder like any over-long prompt, instead of reaching the multi-turn loop, which refused the
whole round (ValueError: the job stopped mid-run).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from PIL import Image
from test_rl_prompt_faults import _row, write_png_bomb

from megatron_vlm.data.bad_records import BadRecordLog
from megatron_vlm.data.config import DataConfig
from megatron_vlm.data.processing import process_record
from megatron_vlm.errors import ConfigError
from megatron_vlm.inference.engine import RolloutPrompt
from megatron_vlm.rl.env.session import ToolPromptEncoder
from megatron_vlm.rl.prompts.dataset import PromptSample, load_prompt_dataset
from megatron_vlm.rl.prompts.encoder import PromptEncoder
from megatron_vlm.rl.prompts.lengths import drop_unusable_prompts
from megatron_vlm.rl.prompts.sets import PromptSets

NEW, EVAL_NEW = 8, 12


def _set(tmp_path, questions, name="p.jsonl", image="ok.png"):
    Image.new("RGB", (56, 56), (200, 30, 30)).save(tmp_path / "ok.png")
    path = tmp_path / name
    path.write_text("".join(_row(image if q != "BOMB" else "bomb.png", q) for q in questions))
    return path, load_prompt_dataset(path, schema="messages")


def _cfgs(max_tokens: int):
    return (DataConfig(type="messages_jsonl", max_tokens_per_pack=max_tokens),
            SimpleNamespace(rollout=SimpleNamespace(max_new_tokens=NEW), eval=SimpleNamespace(max_new_tokens=EVAL_NEW)))


def test_the_boundary_is_the_encoders(tmp_path, proc):
    write_png_bomb(tmp_path / "bomb.png", 9_000)
    qs = ["What colour?", "What colour is it?", "word " * 300, "BOMB", "What shape?"]
    path, ds = _set(tmp_path, qs)
    n = len(process_record(ds[0].to_record(), proc, max_frames=4, for_generation=True))
    assert len(process_record(ds[1].to_record(), proc, max_frames=4, for_generation=True)) > n
    data_cfg, rl_cfg = _cfgs(n + EVAL_NEW)  # the first prompt fits exactly (the larger of the two budgets)
    log = BadRecordLog()
    out = drop_unusable_prompts(PromptSets(ds, None), proc, data_cfg, rl_cfg, log)
    kept = [s.index for s in out.train.samples]
    assert kept == [1, 5] and out.eval is None
    assert [(b.index, b.category) for b in log.entries] == [(2, "too_long"), (3, "too_long"), (4, "image_too_large")]
    assert [(b.index, b.category) for b in out.train.bad_records.entries] == [(b.index, b.category) for b in log.entries]
    enc = PromptEncoder(proc, max_frames=4, fps=2.0, max_new_tokens=EVAL_NEW, max_tokens=n + EVAL_NEW)
    assert all(enc.encode(s) is not None for s in out.train.samples)
    assert enc.encode(ds[1]) is None and enc.last_skip.split(": ")[1] == "too_long"


def test_a_set_with_nothing_left_is_a_config_error_naming_its_key(tmp_path, proc):
    _, train = _set(tmp_path, ["What colour?"], "train.jsonl")
    _, evals = _set(tmp_path, ["word " * 300, "word " * 200], "eval.jsonl")
    data_cfg, rl_cfg = _cfgs(200)
    with pytest.raises(ConfigError, match=r"^data\.eval_path: none of the 2 prompts can be used .*too_long.*eval\.jsonl:1"):
        drop_unusable_prompts(PromptSets(train, evals), proc, data_cfg, rl_cfg)
    with pytest.raises(ConfigError, match=r"^data\.train_path: none of the 2 prompts"):
        drop_unusable_prompts(PromptSets(evals, None), proc, data_cfg, rl_cfg)


TOOLS = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object",
                                                                                           "properties": {}, "required": []}}}]


def _sample(words: int, i: int) -> PromptSample:
    return PromptSample(prompt_id=f"p{i}", messages=[{"role": "user", "content": " ".join(["seven"] * words)}],
                        answer="7", problem="q")


def test_prompts_longer_than_a_trajectory_are_skipped_and_counted(proc):
    inner = PromptEncoder(proc, max_frames=4, fps=2.0, max_new_tokens=8, max_tokens=4096)
    short, long_ = _sample(2, 0), _sample(300, 1)  # ~31 and ~630 tokens, ~330 more with the tool specs
    lengths = [len(inner.encode(s)) for s in (short, long_)]
    for tools in (TOOLS, []):
        enc = ToolPromptEncoder(PromptEncoder(proc, max_frames=4, fps=2.0, max_new_tokens=8, max_tokens=4096), tools,
                                max_total_tokens=600)
        ok = enc.encode(short)
        assert isinstance(ok, RolloutPrompt) and len(ok) < 600
        assert enc.encode(long_) is None and enc.skipped == 1
        assert "p1" in enc.last_skip and "rl.env.max_total_tokens = 600" in enc.last_skip
    assert lengths[0] < 600 <= lengths[1]
    # the limit is the loop's: a prompt of max_total_tokens - 1 tokens (room for one model token) is kept
    edge = ToolPromptEncoder(inner, [], max_total_tokens=lengths[1] + 1)
    assert torch.equal(edge.encode(long_).input_ids, inner.encode(long_).input_ids)
    assert ToolPromptEncoder(inner, [], max_total_tokens=lengths[1]).encode(long_) is None


def _split_rank(rank, world, store, path, proc, queue):
    import torch.distributed as dist

    from megatron_vlm.data import lengths as lengths_mod

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        calls = []
        original = lengths_mod.estimate_length_and_class
        lengths_mod.estimate_length_and_class = lambda *a, **k: calls.append(1) or original(*a, **k)
        log = BadRecordLog()
        out = drop_unusable_prompts(PromptSets(load_prompt_dataset(path, schema="messages"), None), proc, *_cfgs(60),
                                    log, split_over_ranks=True)
        queue.put((rank, [s.index for s in out.train.samples], log.to_dict(), len(calls)))
    finally:
        dist.destroy_process_group()


def _two_ranks(target, tmp_path, path, proc, *, timeout: float) -> list:
    """Run `target(rank, 2, store, path, proc, queue)` in two forked processes; their results, sorted by rank."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, 2, tmp_path / "store", path, proc, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(queue.get(timeout=timeout) for _ in procs)
    for p in procs:
        p.join(timeout=timeout / 2)
    return got


def test_synchronous_ranks_split_the_estimate_and_keep_the_serial_prompts(tmp_path, proc):
    """Every rank of a synchronous job filters together: each estimates half the prompts (two gloo ranks), and
    both keep exactly the prompts and bad records of the serial pass."""

    write_png_bomb(tmp_path / "bomb.png", 9_000)
    qs = ["What colour?", "word " * 300, "BOMB", "What shape?", "word " * 100, "Which?", "What size?", "Where?"]
    path, ds = _set(tmp_path, qs)
    want_log = BadRecordLog()
    want = drop_unusable_prompts(PromptSets(ds, None), proc, *_cfgs(60), want_log)
    got = _two_ranks(_split_rank, tmp_path, path, proc, timeout=120)
    assert [s.index for s in want.train.samples] == [1, 4, 6, 7, 8] and want_log.entries
    for rank, kept, log, calls in got:
        assert kept == [s.index for s in want.train.samples], rank
        assert log == want_log.to_dict(), rank
        assert calls == len(qs) // 2, rank  # its share only


class _Panic(BaseException):
    """What a Rust tokenizer's panic arrives as in Python (pyo3's PanicException derives from BaseException, not
    Exception): not a bad record the pass can count."""


def _panic_rank(rank, world, store, path, proc, queue):
    import torch.distributed as dist

    from megatron_vlm.data import lengths as lengths_mod

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    original = lengths_mod.estimate_length_and_class

    def estimate(rec, *a, **k):
        if "PANIC" in str(rec):
            raise _Panic("tokenizer panicked")
        return original(rec, *a, **k)

    lengths_mod.estimate_length_and_class = estimate
    try:
        drop_unusable_prompts(PromptSets(load_prompt_dataset(path, schema="messages"), None), proc, *_cfgs(60),
                              BadRecordLog(), split_over_ranks=True)
        queue.put((rank, "returned"))
    except BaseException as e:  # noqa: BLE001 - what each rank raised is the result
        queue.put((rank, f"{type(e).__name__}: {e}"))
    finally:
        dist.destroy_process_group()


def test_a_record_that_fails_one_ranks_share_stops_every_rank_naming_it(tmp_path, proc):
    """A prompt raising something that is not a bad record (line 4, in rank 1's share of the split pass) used to end
    rank 1 alone while rank 0 waited in the all-gather for a share that never came (torchrun tears such a job down
    much later, with no word of the record). Every rank now raises the same error naming the prompt's line."""

    path, _ = _set(tmp_path, ["What colour?", "What shape?", "Which?", "PANIC", "Where?", "What size?"])
    got = _two_ranks(_panic_rank, tmp_path, path, proc, timeout=60)
    assert got[0][1] == got[1][1], got
    assert f"{path}:4" in got[0][1] and "_Panic: tokenizer panicked" in got[0][1], got
