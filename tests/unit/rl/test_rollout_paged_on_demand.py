"""The paged KV cache allocated on demand, with preemption, and in static (CUDA-graph form) decode steps.

The reference is the slot cache (every slot holds the longest prompt + the budget, nothing is ever preempted),
greedy decoding, fp32, tiny random Qwen2.5-VL with images in the prompts:
- static steps on the paged pool ("on": the step a CUDA graph captures, run eagerly with its graph-safety probe)
  give the slot cache's tokens and log-probs, with early finishes and refills across bucket sizes;
- a pool far smaller than the running samples' full lengths runs more samples at once than reserving each
  sample's budget could, preempts (counted in the stats and `metrics()`), and still gives the reference's
  tokens, log-probs within 1e-4 (the preempted samples' cached keys are recomputed by a prefill), eager and
  static steps alike;
- a sample interrupted while it waits for blocks keeps what it generated (a prefix of the reference's);
- a pool that cannot hold one sample is refused before anything runs; a static step over a slot past its
  blocks is refused on the host;
- routing replay: the routes of a preempted sample equal the unpreempted run's (tiny Qwen3-MoE).
"""
from __future__ import annotations

import pytest
import torch

from megatron_vlm.inference.decode_graphs import DecodeStepRunner
from megatron_vlm.inference.engine import RolloutPrompt, SamplingParams
from megatron_vlm.inference.slot_run import SlotRun
from megatron_vlm.models.common.slot_cache import PagedSlotCache
from tests.fixtures.rollout_engine import SilentTokenizer, make_engine, tiny_vl_model_and_prompts

NEW = 10
BLOCK = 4


Tok = SilentTokenizer


@pytest.fixture(scope="module")
def setup():
    return tiny_vl_model_and_prompts(4)


def _run(model, prompts, eos=(-1,), **kw):
    eng = make_engine(model, Tok(), eos_token_ids=list(eos), max_num_seqs=8, **kw)
    res = eng.generate(prompts, SamplingParams(max_new_tokens=NEW, n=2, temperature=0.0))
    return eng, res


def _same(ref, got, atol):
    assert [(s.prompt_index, s.sample_index) for s in got] == [(s.prompt_index, s.sample_index) for s in ref]
    for a, b in zip(ref, got):
        assert a.token_ids.tolist() == b.token_ids.tolist()
        assert a.finish_reason == b.finish_reason
        torch.testing.assert_close(b.logprobs, a.logprobs, atol=atol, rtol=0)


def _small_pool(prompts) -> int:
    """Blocks for the longest sample at full length + 2 more (+ the scratch block): far fewer than 8 samples need."""
    longest = max(len(p) for p in prompts) + NEW
    return 1 + -(-longest // BLOCK) + 2


def _rows_per_step(monkeypatch) -> list[int]:
    rows: list[int] = []
    begin = PagedSlotCache.begin_step

    def spy(self, n_new, new_mask=None):
        rows.append(self.batch)
        return begin(self, n_new, new_mask)

    monkeypatch.setattr(PagedSlotCache, "begin_step", spy)
    return rows


def test_static_steps_on_the_paged_pool_equal_the_slot_cache(setup):
    model, prompts = setup
    free = _run(model, prompts[:3])[1].samples  # end-of-sequence ids from a run with none: early finishes
    eos = sorted({s.token_ids[k].item() for s, k in zip(free, (2, 5, 3, 7, 1, 8))})
    _, ref = _run(model, prompts, eos)
    eng, got = _run(model, prompts, eos, kv_block_size=BLOCK, cuda_graphs="on")
    assert eng._runner is not None and isinstance(eng._runner.cache, PagedSlotCache)
    assert len(eng._runner.buckets) >= 2  # several bucket sizes, padded rows on the scratch block
    assert len({len(s.token_ids) for s in ref.samples}) > 1
    _same(ref.samples, got.samples, 1e-5)
    eng2, again = _run(model, prompts, eos, kv_block_size=BLOCK, cuda_graphs="on")  # a second call
    _same(ref.samples, again.samples, 1e-5)


@pytest.mark.parametrize("graphs", ["off", "on"])
def test_small_pool_preempts_and_gives_the_same_tokens(setup, graphs, monkeypatch):
    model, prompts = setup
    _, ref = _run(model, prompts)
    rows = _rows_per_step(monkeypatch)
    blocks = _small_pool(prompts)
    eng, got = _run(model, prompts, kv_block_size=BLOCK, kv_cache_blocks=blocks, cuda_graphs=graphs)
    assert got.stats["preemptions"] > 0
    assert eng.metrics() == {"rollout/preemptions": got.stats["preemptions"]} and eng.metrics()["rollout/preemptions"] == 0
    # reserving each sample's prompt + budget, the pool would run at most this many at once
    full = (blocks - 1) // -(-(min(len(p) for p in prompts) + NEW) // BLOCK)
    if graphs == "off":  # eager steps go through begin_step with their real rows (static ones: the bucket's)
        assert max(rows) > full, (rows, full)
    _same(ref.samples, got.samples, 1e-4)
    assert all(s.finish_reason == "length" and len(s.token_ids) == NEW for s in got.samples)


def test_interrupted_while_preempted_keeps_its_tokens(setup, monkeypatch):
    model, prompts = setup
    _, ref = _run(model, prompts)
    preempted: list[int] = []
    original = SlotRun.preempt

    def preempt_then_interrupt(run, slot, cache):
        preempted.append(run.slot_sample[slot])
        sample = original(run, slot, cache)
        eng._interrupt.set()
        return sample

    monkeypatch.setattr(SlotRun, "preempt", preempt_then_interrupt)
    eng = make_engine(model, Tok(), eos_token_ids=[-1], max_num_seqs=8, kv_block_size=BLOCK,
                      kv_cache_blocks=_small_pool(prompts))
    got = eng.generate(prompts, SamplingParams(max_new_tokens=NEW, n=2, temperature=0.0))
    assert got.interrupted and preempted
    by_id = {(s.prompt_index, s.sample_index): s for s in got.samples}
    for sample in preempted:
        s, r = by_id[(sample // 2, sample % 2)], ref.samples[sample]
        assert s.finish_reason == "interrupted" and 1 <= len(s.token_ids) < NEW
        assert s.token_ids.tolist() == r.token_ids[: len(s.token_ids)].tolist()
        torch.testing.assert_close(s.logprobs, r.logprobs[: len(s.token_ids)], atol=1e-5, rtol=0)


def test_refusals(setup):
    model, prompts = setup
    longest = max(len(p) for p in prompts) + NEW
    with pytest.raises(RuntimeError, match="kv_cache_blocks: the pool of 3 blocks"):
        _run(model, prompts, kv_block_size=BLOCK, kv_cache_blocks=3)
    assert -(-longest // BLOCK) > 2
    cache = PagedSlotCache(model.new_cache(4, BLOCK), num_slots=2, max_len=3 * BLOCK)
    runner = DecodeStepRunner(model, cache, pad_token_id=0, capture=False)
    cache.reserve(0, 2)  # one block: positions 0-3
    cache.host_lengths[0] = BLOCK
    with pytest.raises(ValueError, match="past their blocks"):
        runner.step([0], torch.zeros(1, dtype=torch.long))
    assert cache.grow(0) and cache.slot_capacity[0] == 2 * BLOCK
    assert cache.grow(0) and not cache.grow(1)  # the pool's 3 free blocks are slot 0's now
    with pytest.raises(ValueError, match="already holds 3 blocks"):
        cache.grow(0)


def test_routes_of_preempted_samples_equal_the_unpreempted_run(tmp_path):
    from megatron_vlm.checkpoint.hf import load_hf_model
    from megatron_vlm.testing.synthesize import synthesize_model_folder

    folder = synthesize_model_folder("tiny_qwen3_moe", tmp_path / "m", seed=0)
    model = load_hf_model(str(folder), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [RolloutPrompt(torch.randint(0, model.lm_head.weight.shape[0], (n,), generator=g)) for n in (7, 12, 4)]

    def rollout(**kw):
        eng = make_engine(model, Tok(), eos_token_ids=[-1], max_num_seqs=6, record_routes=True, **kw)
        return eng.generate(prompts, SamplingParams(max_new_tokens=NEW, n=2, temperature=0.0))

    ref = rollout()
    got = rollout(kv_block_size=BLOCK, kv_cache_blocks=_small_pool(prompts))
    assert got.stats["preemptions"] > 0
    for a, b in zip(ref.samples, got.samples):
        assert torch.equal(a.token_ids, b.token_ids)
        assert a.routes is not None and b.routes is not None and torch.equal(a.routes, b.routes)
