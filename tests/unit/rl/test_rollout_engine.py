"""The built-in rollout engine on a tiny random Qwen2.5-VL (fp32, images in the prompts):

* KV-cache greedy decoding equals no-cache greedy decoding (a full forward per step, each prompt
  alone) and transformers' `generate` token for token, with left-padded prompts of different lengths;
* one shared prefill per prompt (copied into the group's slots) gives the same completions as n
  independent prefills, and as generating for the prompt alone;
* sampled behaviour log-probs (temperature, top-k, top-p) equal the log-probs recomputed by a
  transformers forward pass over prompt + completion, and by our packed training path;
* EOS and stop strings end a completion at the right token; continuous batching (a finished row's
  slot taken by the next waiting sample) and lock-step dummy steps (other ranks still generating)
  change nothing.
"""
import pytest
import torch

from megatron_vlm.inference.engine import RolloutPrompt, SamplingParams
from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine
from megatron_vlm.models import build_model
from megatron_vlm.models.qwen2_5_vl.state_dict_adapter import Qwen2_5_VLStateDictAdapter
from megatron_vlm.rl.logprobs import response_token_logprobs
from tests.fixtures import tiny_qwen2_5_vl as F
from tests.fixtures.rollout_engine import make_engine

TOL = 1e-4
# the engine never samples these: its log-probs are of the distribution with them removed
VISION = [F.IMAGE_TOKEN_ID, F.VIDEO_TOKEN_ID, F.VISION_START_TOKEN_ID, F.VISION_END_TOKEN_ID]


def masked_log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.index_fill(-1, torch.tensor(VISION), float("-inf")), -1)
NEVER = -1  # an EOS id no token has: completions run to the budget


class DigitsTokenizer:
    """Stand-in tokenizer: token i decodes to "i|"."""

    pad_token_id = F.PAD_TOKEN_ID
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=False):
        return "".join(f"{int(i)}|" for i in ids)


@pytest.fixture(scope="module")
def models():
    hf = F.hf_reference_model(seed=0)
    ours = build_model(F.tiny_qwen2_5_vl_config_dict())
    ours.load_state_dict(Qwen2_5_VLStateDictAdapter(ours.args).from_hf(hf.state_dict())[0], strict=True)
    return hf, ours.eval()


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(7)
    parts = [[2, ("image", (1, 4, 6)), 3], [5], [1, ("image", (1, 4, 4)), 1, ("image", (1, 6, 4)), 6]]
    out = []
    for p in parts:
        s = F.build_sample(p, g)
        out.append(RolloutPrompt(torch.tensor(s["input_ids"]), s["pixel_values"], s["image_grid_thw"]))
    return out


def engine(model, **kw):
    kw.setdefault("eos_token_ids", [NEVER])
    return make_engine(model, DigitsTokenizer(), **kw)


def hf_inputs(prompt: RolloutPrompt, completion=None) -> dict:
    ids = prompt.input_ids if completion is None else torch.cat([prompt.input_ids, completion])
    ids = ids[None]
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": F.mm_token_type_ids(ids)}
    if prompt.pixel_values is not None:
        out.update(pixel_values=prompt.pixel_values, image_grid_thw=prompt.image_grid_thw)
    return out


@torch.no_grad()
def greedy_without_cache(model, prompt: RolloutPrompt, steps: int) -> list[int]:
    """Reference decoding: a full forward over prompt + tokens so far at every step, prompt alone."""
    ids = prompt.input_ids.clone()
    out = []
    for _ in range(steps):
        logits = model(ids[None], pixel_values=prompt.pixel_values, image_grid_thw=prompt.image_grid_thw)
        nxt = int(logits[0, -1].argmax())
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([nxt])])
    return out


def test_greedy_kv_cache_equals_no_cache_and_transformers_generate(models, prompts):
    hf, ours = models
    steps = 8
    res = engine(ours).generate(prompts, SamplingParams(max_new_tokens=steps, temperature=0.0))
    assert [s.prompt_index for s in res.samples] == [0, 1, 2]
    assert res.num_generated_tokens == 3 * steps and res.stats["forward_calls"] == steps  # 1 prefill + 7 decode steps
    for p, s in zip(prompts, res.samples):
        assert s.finish_reason == "length" and s.truncated and s.prompt_length == len(p)
        assert s.token_ids.tolist() == greedy_without_cache(ours, p, steps)
        with torch.no_grad():
            ref = hf.generate(**hf_inputs(p), max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
            assert s.token_ids.tolist() == ref[0, len(p):].tolist()
            # greedy behaviour log-probs: log_softmax at temperature 1 (vision tokens removed) from transformers'
            logits = hf(**hf_inputs(p, s.token_ids)).logits[0, len(p) - 1:-1]
        expect = masked_log_softmax(logits.float()).gather(-1, s.token_ids[:, None]).squeeze(-1)
        torch.testing.assert_close(s.logprobs, expect, atol=TOL, rtol=0)


def test_shared_prefix_equals_independent_generation(models, prompts):
    _, ours = models
    params = SamplingParams(max_new_tokens=6, temperature=0.0, n=3)
    shared = engine(ours, share_prefix=True).generate(prompts, params)
    independent = engine(ours, share_prefix=False).generate(prompts, params)
    assert shared.stats["forward_calls"] == independent.stats["forward_calls"]
    assert len(shared.samples) == len(independent.samples) == 9
    for a, b in zip(shared.samples, independent.samples):
        assert (a.prompt_index, a.sample_index) == (b.prompt_index, b.sample_index)
        assert torch.equal(a.token_ids, b.token_ids)
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=TOL, rtol=0)
    for p_idx, p in enumerate(prompts):
        alone = engine(ours).generate([p], SamplingParams(max_new_tokens=6, temperature=0.0)).samples[0]
        for j in range(3):
            assert torch.equal(shared.samples[p_idx * 3 + j].token_ids, alone.token_ids), (p_idx, j)


def test_sampled_logprobs_equal_recomputed(models, prompts):
    hf, ours = models
    temperature = 0.7
    params = SamplingParams(max_new_tokens=6, n=4, temperature=temperature, top_k=50, top_p=0.9)
    gen = torch.Generator().manual_seed(3)
    res = engine(ours, max_prompts_per_batch=2).generate(prompts, params, generator=gen)
    assert len(res.samples) == 12 and [s.prompt_index for s in res.samples] == [0] * 4 + [1] * 4 + [2] * 4
    assert len({tuple(s.token_ids.tolist()) for s in res.samples}) > 3  # really sampled
    # transformers: one right-padded batch of prompt + completion rows
    rows = []
    for s in res.samples:
        p = prompts[s.prompt_index]
        rows.append({"input_ids": torch.cat([p.input_ids, s.token_ids]).tolist(), "pixel_values": p.pixel_values,
                     "image_grid_thw": p.image_grid_thw, "pixel_values_videos": None, "video_grid_thw": None})
    batch = F.batch_samples(rows, padding_side="right")
    with torch.no_grad():
        hf_logits = hf(**{k: v for k, v in batch.items() if v is not None}).logits
    packed_ids, resp_mask, pix, grids, cu, behav = [], [], [], [], [0], []
    for r, s in enumerate(res.samples):
        p = prompts[s.prompt_index]
        logits = hf_logits[r, len(p) - 1:len(p) - 1 + len(s.token_ids)]
        expect = masked_log_softmax(logits.float() / temperature).gather(-1, s.token_ids[:, None]).squeeze(-1)
        torch.testing.assert_close(s.logprobs, expect, atol=TOL, rtol=0)
        packed_ids.append(torch.cat([p.input_ids, s.token_ids]))
        resp_mask.append(torch.cat([torch.zeros(len(p), dtype=torch.bool), torch.ones(len(s.token_ids), dtype=torch.bool)]))
        if p.pixel_values is not None:
            pix.append(p.pixel_values)
            grids.append(p.image_grid_thw)
        cu.append(cu[-1] + len(packed_ids[-1]))
        behav.append(s.logprobs)
    # the trainer's path: one packed forward (cu_seqlens) + fused LM-head log-probs
    ids, mask = torch.cat(packed_ids), torch.cat(resp_mask)
    cu_seqlens = torch.tensor(cu, dtype=torch.int32)
    with torch.no_grad():
        hidden = ours(ids[None], pixel_values=torch.cat(pix), image_grid_thw=torch.cat(grids), cu_seqlens=cu_seqlens,
                      return_hidden=True)[0]
        logp = response_token_logprobs(hidden, ours.lm_head.weight, ids, mask, cu_seqlens=cu_seqlens,
                                       temperature=temperature, masked_token_ids=VISION)
        full = response_token_logprobs(hidden, ours.lm_head.weight, ids, mask, cu_seqlens=cu_seqlens,
                                       temperature=temperature)
    torch.testing.assert_close(logp[mask], torch.cat(behav), atol=TOL, rtol=0)
    assert (full[mask] - torch.cat(behav)).abs().max() > TOL  # the full softmax is not the distribution drawn from


def test_seeded_sampling_is_reproducible(models, prompts):
    _, ours = models
    params = SamplingParams(max_new_tokens=5, n=2, temperature=1.0)
    a = engine(ours).generate(prompts, params, generator=torch.Generator().manual_seed(11))
    b = engine(ours).generate(prompts, params, generator=torch.Generator().manual_seed(11))
    assert [s.token_ids.tolist() for s in a.samples] == [s.token_ids.tolist() for s in b.samples]


def _first_new(tokens: list[int], start: int) -> int:
    """Index >= start of the first token that does not occur earlier in `tokens`."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


def test_eos_and_stop_strings_end_completions(models, prompts):
    _, ours = models
    steps = 8
    # seeded sampling (greedy decoding of a random tiny model repeats a 2-token cycle); the engine draws
    # the random numbers per slot and step, so a row's draws do not depend on the rows that ended

    def run(stop=(), **kw):
        p = SamplingParams(max_new_tokens=steps, temperature=1.5, stop=stop)
        return engine(ours, **kw).generate(prompts, p, generator=torch.Generator().manual_seed(5))

    ref = run().samples
    row0 = ref[0].token_ids.tolist()
    k = _first_new(row0, 2)
    res = run(eos_token_ids=[row0[k]]).samples
    assert res[0].finish_reason == "eos" and res[0].token_ids.tolist() == row0[:k + 1]  # the EOS token is kept
    for r, out in zip(ref, res):  # every row: cut at its own first occurrence of that id, if any
        toks = r.token_ids.tolist()
        cut = toks.index(row0[k]) + 1 if row0[k] in toks else steps
        assert out.token_ids.tolist() == toks[:cut]
        torch.testing.assert_close(out.logprobs, r.logprobs[:cut], atol=TOL, rtol=0)

    row1 = ref[1].token_ids.tolist()
    j = _first_new(row1, 3)
    stop = f"{row1[j - 1]}|{row1[j]}"  # completed by token j (its trailing "|" is cut from the text)
    assert stop not in DigitsTokenizer().decode(row1[:j])
    s = run(stop=("@@", stop)).samples[1]
    assert s.finish_reason == "stop" and s.token_ids.tolist() == row1[:j + 1]
    assert s.text == DigitsTokenizer().decode(row1[:j + 1])[:-1] and s.text.endswith(stop)


def test_continuous_batching_and_lockstep_dummy_steps_change_nothing(models, prompts):
    _, ours = models
    steps = 10
    params = SamplingParams(max_new_tokens=steps, temperature=0.0, n=2)
    ref = engine(ours).generate(prompts, params).samples
    # EOS ids that end the rows at different steps: the second token of prompt 0's completion, the
    # first of prompt 1's, the second of prompt 2's (a row ends at its first EOS id)
    eos = {ref[0].token_ids[1].item(), ref[2].token_ids[0].item(), ref[4].token_ids[1].item()}
    never = engine(ours, eos_token_ids=eos).generate(prompts, params)  # a slot per sample: no refill
    always = engine(ours, eos_token_ids=eos, max_num_seqs=2).generate(prompts, params)  # 2 slots, refilled
    extra = []

    def other_rank_busy(active: bool) -> bool:  # another rank keeps generating 4 steps longer
        extra.append(active)
        return active or sum(not a for a in extra) <= 4

    lockstep = engine(ours, eos_token_ids=eos, all_ranks_active=other_rank_busy).generate(prompts, params)
    assert all(s.finish_reason == "eos" for s in never.samples)
    lengths = [len(s.token_ids) for s in never.samples]
    assert max(lengths) <= 2 and min(lengths) == 1
    for r, a, b, c in zip(ref, never.samples, always.samples, lockstep.samples):
        assert a.token_ids.tolist() == b.token_ids.tolist() == c.token_ids.tolist() == r.token_ids.tolist()[:len(a.token_ids)]
        assert a.finish_reason == b.finish_reason == c.finish_reason
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=TOL, rtol=0)
        torch.testing.assert_close(a.logprobs, c.logprobs, atol=TOL, rtol=0)
    assert never.stats["forward_calls"] == 1 + max(lengths) - 1
    assert always.stats["prefill_calls"] == 3 and never.stats["prefill_calls"] == 1
    assert lockstep.stats["forward_calls"] == never.stats["forward_calls"] + 4


def test_vision_placeholders_are_never_generated(models, prompts):
    """A generated <|image_pad|> would be taken for an image slot by the training forward: the engine
    never emits the model's vision tokens, even when the model prefers them."""
    _, ours = models
    vision = VISION
    bias = torch.zeros(F.VOCAB)
    bias[vision] = 50.0  # the vision tokens are by far the most likely next tokens everywhere

    def biased(**kw):
        return ours(**kw) + bias

    for temperature in (0.0, 1.0):
        res = engine(ours, forward=biased).generate(prompts, SamplingParams(max_new_tokens=5, n=2, temperature=temperature),
                                                    generator=torch.Generator().manual_seed(0))
        assert not any(set(s.token_ids.tolist()) & set(vision) for s in res.samples)
        for p, s in zip(prompts, res.samples[::2]):  # log-probs of the distribution drawn from: the rest, renormalised
            with torch.no_grad():
                logits = biased(input_ids=torch.cat([p.input_ids, s.token_ids])[None], pixel_values=p.pixel_values,
                                image_grid_thw=p.image_grid_thw)[0, len(p) - 1:-1].float()
            logits = logits / (temperature or 1.0)
            expect = torch.log_softmax(logits.index_fill(-1, torch.tensor(vision), float("-inf")), -1)
            torch.testing.assert_close(s.logprobs, expect.gather(-1, s.token_ids[:, None]).squeeze(-1), atol=TOL, rtol=0)
    unsuppressed = engine(ours, forward=biased, suppress_token_ids=[]).generate(
        prompts, SamplingParams(max_new_tokens=2, temperature=0.0))
    assert all(set(s.token_ids.tolist()) <= set(vision) for s in unsuppressed.samples)


def test_bad_arguments(models, prompts):
    _, ours = models
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(max_new_tokens=1, top_p=0.0)
    with pytest.raises(ValueError, match="stop strings must not be empty"):
        SamplingParams(max_new_tokens=1, stop=("",))
    with pytest.raises(ValueError, match="nothing to generate"):
        engine(ours).generate([], SamplingParams(max_new_tokens=1))
    with pytest.raises(TypeError, match="not a family model"):
        PolicyRolloutEngine(torch.nn.Linear(2, 2), DigitsTokenizer(), EngineOptions(eos_token_ids=[0]))
    eng = engine(ours)
    eng.load_weights(None, version=3)
    assert eng.generate(prompts[:1], SamplingParams(max_new_tokens=1)).samples[0].policy_version == 3


def test_interrupt_returns_partial_completions_and_token_versions(models, prompts):
    """`interrupt()` stops at a token boundary: finished samples stay whole, running ones keep the tokens
    drawn so far (a prefix of the uninterrupted run), waiting ones come back empty; weights loaded while
    generating apply from the next token on, and every token records its version."""
    _, ours = models
    params = SamplingParams(max_new_tokens=6, temperature=0.0, n=2)
    full = engine(ours, max_num_seqs=2).generate(prompts, params)
    calls = []
    eng = None

    def forward(**kw):
        calls.append(1)
        if len(calls) == 3:  # prefill, 1 decode step, then: new weights (same values) as version 7
            eng.load_weights({k: v.clone() for k, v in ours.state_dict().items()}, version=7)
        if len(calls) == 5:
            eng.interrupt()
        return ours(**kw)

    eng = engine(ours, forward=forward, max_num_seqs=2)
    res = eng.generate(prompts, params)
    assert res.interrupted and len(res.samples) == 6
    partial = [s for s in res.samples if s.finish_reason == "interrupted"]
    # interrupted during the 4th decode forward: its logits still give a token (1 from the prefill + 4)
    assert [len(s.token_ids) for s in res.samples[:2]] == [5, 5]
    assert all(len(s.token_ids) == 0 for s in res.samples[2:]) and len(partial) == 6
    for a, b in zip(res.samples, full.samples):
        assert a.token_ids.tolist() == b.token_ids.tolist()[:len(a.token_ids)]
        assert a.token_versions.tolist() == [0, 0, 7, 7, 7][:len(a.token_ids)]
    assert res.samples[0].policy_version == 0 and eng.policy_version == 7
    again = eng.generate(prompts[:1], SamplingParams(max_new_tokens=2, temperature=0.0))  # the flag was cleared
    assert not again.interrupted and again.samples[0].token_versions.tolist() == [7, 7]


def test_own_weight_copy_is_refreshed_by_load_weights(models, prompts):
    """An engine with its own copy of the policy generates with the weights it was last given."""
    import copy

    _, ours = models
    params = SamplingParams(max_new_tokens=5, temperature=0.0)
    changed = copy.deepcopy(ours)
    with torch.no_grad():
        for p in changed.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    eng = engine(copy.deepcopy(ours))
    before = eng.generate(prompts, params)
    eng.load_weights(changed.state_dict(), version=1)
    after = eng.generate(prompts, params)
    expect = engine(changed).generate(prompts, params)
    assert [s.token_ids.tolist() for s in after.samples] == [s.token_ids.tolist() for s in expect.samples]
    assert [s.token_ids.tolist() for s in after.samples] != [s.token_ids.tolist() for s in before.samples]
    with pytest.raises(KeyError, match="unknown parameter"):
        eng.load_weights({"no.such.weight": torch.zeros(1)}, version=2)
    # sync_from: load_weights(None) gathers the trainer model's weights (rl.rollout.weights = "copy")
    trainer_model = copy.deepcopy(changed)
    synced = engine(copy.deepcopy(ours), sync_from=trainer_model)
    synced.load_weights(None, version=4)
    res = synced.generate(prompts, params)
    assert [s.token_ids.tolist() for s in res.samples] == [s.token_ids.tolist() for s in expect.samples]
    assert res.stats["weight_sync_s"] > 0 and all(s.policy_version == 4 for s in res.samples)
    with pytest.raises(ValueError, match="sync_from"):
        engine(ours, forward=ours, sync_from=trainer_model)


def test_own_weight_copy_of_a_lora_policy(models, prompts):
    """rl.rollout.weights = "copy" with [lora]: the trainer's state dict holds adapter factors, which the copy
    (read from the model folder, no adapters) could not load. `mirror_lora` gives the copy the same adapters; it
    then generates what the LoRA policy itself generates (same tokens and behaviour log-probs)."""
    import copy

    from megatron_vlm.models.common.lora import apply_lora, lora_modules, mirror_lora

    _, ours = models
    trainer_model = copy.deepcopy(ours)
    targets = [n for n, m in trainer_model.named_modules()
               if n.startswith("language_model.") and n.endswith(("q_proj", "v_proj", "down_proj"))]
    apply_lora(trainer_model, targets, r=4, alpha=8.0)
    torch.manual_seed(0)
    with torch.no_grad():  # non-zero B: the adapters change the policy
        for m in lora_modules(trainer_model).values():
            m.lora_B.weight.normal_(0.0, 0.5)
    params = SamplingParams(max_new_tokens=5, temperature=0.0)
    expect = engine(trainer_model).generate(prompts, params)
    base = engine(ours).generate(prompts, params)
    assert [s.token_ids.tolist() for s in expect.samples] != [s.token_ids.tolist() for s in base.samples]
    plain = engine(copy.deepcopy(ours), sync_from=trainer_model)
    with pytest.raises(KeyError, match="lora_A"):  # what a copy without adapters does
        plain.load_weights(None, version=1)
    policy_copy = copy.deepcopy(ours)
    assert sorted(mirror_lora(policy_copy, trainer_model)) == sorted(targets)
    synced = engine(policy_copy, sync_from=trainer_model)
    synced.load_weights(None, version=1)
    res = synced.generate(prompts, params)
    assert [s.token_ids.tolist() for s in res.samples] == [s.token_ids.tolist() for s in expect.samples]
    for a, b in zip(res.samples, expect.samples):
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-6, rtol=0)
    assert mirror_lora(copy.deepcopy(ours), ours) == []  # no adapters: nothing changes


@pytest.mark.parametrize("stop", [(), ("@@",)])
def test_a_non_finite_behaviour_logprob_is_refused(models, prompts, monkeypatch, stop):
    """Off the CPU the sampler does not look for rows without a distribution (a NaN logit: that would add a device
    sync per step); it returns their token with a non-finite log-prob, which the engine's per-step host read
    refuses, naming the prompt, instead of putting it into the rollout."""
    import megatron_vlm.inference.policy_engine as pe

    real, calls = pe.sample_tokens, []

    def accelerator_like(logits, **kw):
        tok, lp = real(logits, **kw)
        calls.append(1)
        if len(calls) == 3:  # the third decoding step: the first row's log-prob is NaN
            lp = lp.clone()
            lp[0] = float("nan")
        return tok, lp

    monkeypatch.setattr(pe, "sample_tokens", accelerator_like)
    params = SamplingParams(max_new_tokens=5, n=2, temperature=1.0, stop=stop)
    with pytest.raises(ValueError, match=r"rollout: prompt 0 \(sample 0\), generated token 2: .*NaN"):
        engine(ours := models[1]).generate(prompts, params, generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(pe, "sample_tokens", real)
    assert len(engine(ours).generate(prompts, params, generator=torch.Generator().manual_seed(0)).samples) == 6


def test_a_refresh_from_the_trainer_gathers_one_block_at_a_time(models, prompts, monkeypatch):
    """rl.rollout.weights = "copy": `load_weights(None)` gathers the trainer's sharded tensors (each `full_tensor()` a
    collective) one block at a time, so the refresh never holds a second whole model in the trainer's master dtype;
    the copy then generates what the trainer's weights generate. Sharded entries are imitated by objects with a
    `full_tensor()` whose results are tracked while alive."""
    import copy
    import weakref

    _, ours = models
    trainer_model = copy.deepcopy(ours)
    with torch.no_grad():
        for p in trainer_model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    live: set[int] = set()
    peak = [0, 0]  # most full tensors alive at once, most bytes

    class Sharded:
        def __init__(self, t):
            self.t = t

        def full_tensor(self):
            out = self.t.clone()
            key = id(out)
            live.add(key)
            weakref.finalize(out, live.discard, key)
            peak[0] = max(peak[0], len(live))
            return out

    state = trainer_model.state_dict()
    monkeypatch.setattr(trainer_model, "state_dict", lambda: {k: Sharded(v) for k, v in state.items()})
    synced = engine(copy.deepcopy(ours), sync_from=trainer_model)
    synced.load_weights(None, version=3)
    params = SamplingParams(max_new_tokens=5, temperature=0.0)
    expect = engine(copy.deepcopy(trainer_model)).generate(prompts, params)
    got = synced.generate(prompts, params)
    assert [s.token_ids.tolist() for s in got.samples] == [s.token_ids.tolist() for s in expect.samples]
    largest_block = max(sum(1 for k in state if k.startswith(f"{prefix}."))
                        for prefix in {k.split(".", 3)[0] + "." + k.split(".", 3)[1] + "." + k.split(".", 3)[2]
                                       for k in state if k.count(".") >= 3})
    assert 0 < peak[0] <= largest_block < len(state) // 4, (peak[0], largest_block, len(state))
