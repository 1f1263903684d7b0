"""The rollout engine on a paged KV cache (`kv_block_size`: blocks of a shared pool reserved per sample
for its prompt + budget, released when it finishes) gives the same completions as the slot cache:
greedy and sampled tokens equal and log-probs within 1e-5 (fp32) with a pool large enough for every
slot, greedy ones also with a pool so small that samples wait for the blocks of finished ones (sampling
would reschedule the random numbers, which follow slot and step); a pool that cannot hold one sample
is refused. Tiny random Qwen2.5-VL, images in the prompts, prompts of different lengths."""
import pytest
import torch

from megatron_vlm.inference.engine import SamplingParams
from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine
from megatron_vlm.models.common.slot_cache import PagedSlotCache
from tests.fixtures.rollout_engine import SilentTokenizer, make_engine, tiny_vl_model_and_prompts

Tok = SilentTokenizer


@pytest.fixture(scope="module")
def setup():
    return tiny_vl_model_and_prompts(3)


def _generate(model, prompts, params, **kw):
    eng = make_engine(model, Tok(), eos_token_ids=[-1], max_num_seqs=4, **kw)
    return eng.generate(prompts, params, generator=torch.Generator().manual_seed(3)).samples


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_paged_cache_equals_slot_cache(setup, temperature):
    model, prompts = setup
    params = SamplingParams(max_new_tokens=6, n=2, temperature=temperature)
    ref = _generate(model, prompts, params)
    longest = max(len(p) for p in prompts) + params.max_new_tokens
    configs = [dict(kv_block_size=4)]
    if temperature == 0:  # a sample's random numbers follow its slot and step: a smaller pool reschedules them
        configs.append(dict(kv_block_size=8, kv_cache_blocks=1 + -(-longest // 8)))  # one sample at a time
    for kw in configs:
        got = _generate(model, prompts, params, **kw)
        assert [(s.prompt_index, s.sample_index) for s in got] == [(s.prompt_index, s.sample_index) for s in ref]
        for a, b in zip(ref, got):
            assert a.token_ids.tolist() == b.token_ids.tolist(), kw
            torch.testing.assert_close(b.logprobs, a.logprobs, atol=1e-5, rtol=0)


def test_pool_too_small_is_refused_and_blocks_are_returned(setup):
    model, prompts = setup
    params = SamplingParams(max_new_tokens=6, n=2, temperature=0.0)
    with pytest.raises(RuntimeError, match="kv_cache_blocks"):
        _generate(model, prompts, params, kv_block_size=4, kv_cache_blocks=2)
    with pytest.raises(ValueError, match="kv_block_size"):
        PolicyRolloutEngine(model, Tok(), EngineOptions(kv_block_size=1))
    cache = PagedSlotCache(model.new_cache(5, 4), num_slots=2, max_len=12)
    cache.reserve(0, 9)  # 3 blocks of 4
    assert not cache.can_reserve(5) and cache.can_reserve(4)
    cache.release(0)
    assert cache.can_reserve(12) and len(cache.free_blocks) == 4


def test_the_derived_pool_admits_as_the_slot_cache_when_prompts_fill_whole_blocks(setup):
    """The derived pool (`kv_cache_blocks` unset) holds every slot at full length, and a waiting sample is admitted
    only with a headroom of free blocks besides its own: prompts whose blocks equal a slot's full length (here 50
    tokens + 6 in slots of 64 positions, 4 blocks of 16 each) left the last slot's sample waiting a token for that
    headroom, which moved every later random number to another sample: sampled tokens no longer the slot cache's.
    The derived pool now counts the headroom too."""
    from megatron_vlm.inference.engine import RolloutPrompt

    model, _ = setup
    g = torch.Generator().manual_seed(11)
    prompts = [RolloutPrompt(torch.randint(1, 100, (50,), generator=g)) for _ in range(2)]
    params = SamplingParams(max_new_tokens=6, n=4, temperature=1.0)
    ref = _generate(model, prompts, params)
    for bs in (16, 32):
        got = _generate(model, prompts, params, kv_block_size=bs)
        assert [s.token_ids.tolist() for s in got] == [s.token_ids.tolist() for s in ref], bs
        for a, b in zip(ref, got):
            torch.testing.assert_close(b.logprobs, a.logprobs, atol=1e-5, rtol=0)
