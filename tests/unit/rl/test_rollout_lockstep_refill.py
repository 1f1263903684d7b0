"""Lock-stepped rollouts refill their slots as completions end (admission rounds all ranks make together).

- One process (the trainer-forward form, `all_ranks_active` = the local flag): slots for two prompts' groups,
  four prompts whose completions end at different steps: the greedy tokens and log-probs equal the
  continuous-batching engine's, and the decode steps are fewer than chunked batches (each as long as its
  longest completion) would take.
- A small on-demand paged pool in lock-step: samples preempted and re-admitted within admission rounds (one
  prefill forward each), the same greedy completions.
- Two gloo ranks, a forward that runs a collective in every call (as the FSDP root and the expert-parallel
  blocks do), different prompts, budgets and end-of-sequence ids per rank, on the slot cache and on a paged
  pool where rank 0 preempts: both ranks make the same sequence of prefill / decode forwards (compared across
  ranks), and each rank's completions equal the one-process engine's.
"""
from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_vlm.inference.engine import SamplingParams
from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine
from tests.fixtures.rollout_engine import SilentTokenizer, tiny_vl_model_and_prompts

NEW = 8


Tok = SilentTokenizer


def _eos_for_varied_lengths(model, prompts, picks) -> list[int]:
    """End-of-sequence ids taken from a run with none (`picks`: (prompt, position) pairs), so that completions end
    at different steps."""
    free = PolicyRolloutEngine(model, Tok(), EngineOptions(eos_token_ids=[-1])).generate(
        prompts, SamplingParams(max_new_tokens=NEW, n=1, temperature=0.0)).samples
    return sorted({free[p].token_ids[k].item() for p, k in picks})


def test_lockstep_slots_are_refilled_and_give_the_same_completions():
    model, prompts = tiny_vl_model_and_prompts(5)
    eos = _eos_for_varied_lengths(model, prompts, [(0, 0), (3, 3)])  # group lengths 1, 8, 8, 4 (8: the budget)
    params = SamplingParams(max_new_tokens=NEW, n=2, temperature=0.0)
    ref = PolicyRolloutEngine(model, Tok(), EngineOptions(eos_token_ids=eos)).generate(prompts[:4], params)
    calls: list[str] = []

    def forward(**kw):
        calls.append("prefill" if kw.get("attention_mask") is not None else "decode")
        return model(**kw)

    eng = PolicyRolloutEngine(model, Tok(), EngineOptions(eos_token_ids=eos, max_prompts_per_batch=2), forward=forward,
                              all_ranks_active=lambda active: active)
    got = eng.generate(prompts[:4], params)
    group = [len(s.token_ids) for s in ref.samples[::2]]  # greedy: a group's two samples are the same
    assert len(set(group)) > 1
    for a, b in zip(ref.samples, got.samples):
        assert a.token_ids.tolist() == b.token_ids.tolist() and a.finish_reason == b.finish_reason
        torch.testing.assert_close(b.logprobs, a.logprobs, atol=1e-5, rtol=0)
    # chunked batches of two groups: each runs until its longer group ends (the first token is the prefill's)
    chunked = max(group[0], group[1]) - 1 + max(group[2], group[3]) - 1
    # refilled: g2 starts when g0 ends (at once), g3 when g1 and g2 end: 7 + 3 decode steps against 7 + 7
    assert group == [1, NEW, NEW, 4] and got.stats["decode_steps"] <= chunked - 3, (got.stats, group)
    assert 2 <= got.stats["prefill_calls"] <= 4 and "prefill" in calls[1:]  # refills in admission rounds
    assert got.stats["dummy_prefills"] == 0


def test_lockstep_on_a_small_paged_pool_preempts_and_gives_the_same_completions():
    """The "shared" weights form with a fixed on-demand paged pool far smaller than its slots at full length:
    samples are preempted and re-admitted in admission rounds (their prompt + generated tokens prefilled with
    the round's new prompts, one forward); greedy results unchanged."""
    model, prompts = tiny_vl_model_and_prompts(5)
    eos = _eos_for_varied_lengths(model, prompts, [(0, 0), (3, 3)])
    params = SamplingParams(max_new_tokens=NEW, n=2, temperature=0.0)
    ref = PolicyRolloutEngine(model, Tok(), EngineOptions(eos_token_ids=eos)).generate(prompts[:4], params)
    blocks = 1 + -(-(max(len(p) for p in prompts[:4]) + NEW) // 2) + 2  # one sample at full length + 2 blocks
    prefills: list[int] = []

    def forward(**kw):
        if kw.get("attention_mask") is not None:
            prefills.append(kw["input_ids"].shape[0])
        return model(**kw)

    eng = PolicyRolloutEngine(model, Tok(), EngineOptions(eos_token_ids=eos, max_prompts_per_batch=4, kv_block_size=2,
                                                          kv_cache_blocks=blocks),
                              forward=forward, all_ranks_active=lambda active: active)
    got = eng.generate(prompts[:4], params)
    assert got.stats["preemptions"] > 0 and eng.metrics()["rollout/preemptions"] == got.stats["preemptions"]
    assert got.stats["prefill_calls"] + got.stats["dummy_prefills"] == len(prefills)  # one forward per admission round
    # one process: a round happens only when this rank needs a prefill (a group's prompt prefilled already: none)
    assert got.stats["dummy_prefills"] == 0
    for a, b in zip(ref.samples, got.samples):
        assert a.token_ids.tolist() == b.token_ids.tolist() and a.finish_reason == b.finish_reason
        torch.testing.assert_close(b.logprobs, a.logprobs, atol=1e-4, rtol=0)


def _rank_worker(rank: int, init_file: str, world: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        model, prompts = tiny_vl_model_and_prompts(5)
        mine = prompts[rank * 2:rank * 2 + 2] if rank == 0 else [prompts[4], prompts[1]]
        budget = NEW if rank == 0 else 3
        eos = _eos_for_varied_lengths(model, prompts, [(0, 0), (3, 3)]) if rank == 0 else [-1]
        params = SamplingParams(max_new_tokens=budget, n=2, temperature=0.0)
        want = PolicyRolloutEngine(model, Tok(), EngineOptions(eos_token_ids=eos)).generate(mine, params).samples
        kinds: list[int] = []

        def forward(**kw):
            kinds.append(1 if kw.get("attention_mask") is not None else 0)  # prefills pass a mask, decode steps none
            dist.all_reduce(torch.zeros(1))  # the collective every forward of the trainer's model makes
            return model(**kw)

        def any_rank(active: bool) -> bool:
            flag = torch.tensor([int(active)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            return bool(flag.item())

        for paged in ({}, {"kv_block_size": 2, "kv_cache_blocks": 1 + -(-(max(len(p) for p in mine) + budget) // 2) + 1}):
            kinds.clear()
            eng = PolicyRolloutEngine(model, Tok(), EngineOptions(eos_token_ids=eos, max_prompts_per_batch=1 if not paged else 2,
                                                                  **paged), forward=forward, all_ranks_active=any_rank)
            res = eng.generate(mine, params)
            for a, b in zip(want, res.samples):
                assert a.token_ids.tolist() == b.token_ids.tolist(), (rank, paged)
                torch.testing.assert_close(b.logprobs, a.logprobs, atol=1e-4, rtol=0)
            seqs: list = [None] * world
            dist.all_gather_object(seqs, kinds)
            assert seqs[0] == seqs[1], (paged, seqs)  # the same prefill / decode calls in the same order on every rank
            assert sum(seqs[0]) >= 2  # admission rounds happened after the first
            if paged and rank == 0:
                assert res.stats["preemptions"] > 0
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_two_ranks_make_the_same_forward_calls(tmp_path):
    mp.spawn(_rank_worker, args=(str(tmp_path / "store"), 2), nprocs=2, join=True)
