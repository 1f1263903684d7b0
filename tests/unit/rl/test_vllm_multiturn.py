"""Multi-turn rollouts through the vLLM back end (inference/vllm_multiturn.py) against the built-in engine's loop
and the training forward (marker `vllm`: runs in the environment docs/vllm.md builds, `bash .ci/vllm_tests.sh`;
skipped where vllm is not importable).

- greedy trajectories through vLLM equal the built-in engine's token for token (model and environment tokens,
  loss mask, turn texts, finish reasons), their behaviour log-probs within 1e-4: a text environment on tiny Qwen2,
  and an environment answering turn 1 with a new image on tiny Qwen2.5-VL (vLLM's expanded prompt of every turn
  equal to ours; the earlier turns' KV found in vLLM's prefix cache);
- sampled trajectories: every model token's log-prob equals the training forward's (a cache-free forward over the
  whole trajectory with all its images; the packed training forward for the image case) within 1e-4 in fp32, and
  the same seed repeats the same trajectories;
- an environment whose worker process dies ends only its own trajectories ("env_error"), the others run on;
- a turn whose expanded prompt differs from vLLM's fails naming the conversation and the turn;
- an environment answering turn 1 with a video (Qwen2.5-VL: the text after it resumes past the video's last
  frame, vLLM's M-RoPE rule and ours): greedy trajectories equal the built-in engine's, log-probs the training
  forward's within 1e-4.
"""
import dataclasses
import importlib.util

import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                   reason="vllm is not installed here (run these tests in the vLLM environment: docs/vllm.md, "
                                                          "'Running the vLLM tests')")]

from megatron_vlm.checkpoint.hf import load_hf_model  # noqa: E402
from megatron_vlm.data.batch import VISION_KEYS  # noqa: E402
from megatron_vlm.data.processor import load_processor  # noqa: E402
from megatron_vlm.inference.engine import SamplingParams  # noqa: E402
from megatron_vlm.inference.multiturn import MultiTurnLimits, MultiTurnRollout  # noqa: E402
from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine, vision_token_ids  # noqa: E402
from megatron_vlm.rl.config import VLLMConfig  # noqa: E402
from megatron_vlm.rl.env.pool import EnvWorkerPool, InlineEnvRunner  # noqa: E402
from megatron_vlm.rl.env.session import EnvSession, env_sample  # noqa: E402
from megatron_vlm.rl.env.turns import TurnEncoder  # noqa: E402
from megatron_vlm.rl.prompts.dataset import PromptSample, load_prompt_dataset  # noqa: E402
from megatron_vlm.rl.prompts.encoder import PromptEncoder  # noqa: E402
from megatron_vlm.testing.synthesize import synthesize_model_folder  # noqa: E402

FNS = "rl_env_fns_for_tests"
MAX_TOTAL = 512

needs_torchvision = pytest.mark.skipif(importlib.util.find_spec("torchvision") is None,
                                       reason="vLLM's Qwen2.5-VL imports transformers' torchvision image processor")


def _policy(folder):
    """The folder's random model moved away from its initialisation (pushed into vLLM): a tiny random model
    repeats one token greedily, this one writes varied turns of a few tokens."""
    model = load_hf_model(str(folder), dtype=torch.float32, device="cpu").eval()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def _vllm(folder, eos, model):
    from megatron_vlm.inference.vllm_engine import VLLMRolloutEngine

    proc = load_processor(str(folder))
    tok = proc.tokenizer
    placeholders = [tok.convert_tokens_to_ids(t) for t in (getattr(proc, "image_token", None),
                                                             getattr(proc, "video_token", None)) if t]
    engine = VLLMRolloutEngine(str(folder), VLLMConfig(max_num_seqs=16, cpu_kv_cache_gib=1), dtype=torch.float32,
                             device="cpu", max_model_len=1024, seed=0, eos_token_ids=sorted(eos),
                             placeholder_ids=placeholders, sync_from=model,
                             suppress_token_ids=vision_token_ids(model))  # as the job builds it: vision ids never drawn
    engine.load_weights(None, version=1)
    return engine


# vLLM's CPU prefix cache works in blocks of 128 tokens: a system turn makes the prompts longer than one block, so
# a conversation's later turns (and the group's other conversations) can find its first block cached
SYSTEM = {"role": "system", "content": "the quick brown fox jumps over the lazy dog. " * 4}


def _text_samples():
    texts = ["what is two plus two", "the cat sat on the", "seven eight nine"]
    return [PromptSample(prompt_id=str(i), messages=[SYSTEM, {"role": "user", "content": t}], answer="4", problem=t)
            for i, t in enumerate(texts)]


def _run(engine, proc, samples, prompts, *, env, kwargs=None, runner=None, n=2, temperature=0.0, max_turns=3,
         max_new=8, seed=0):
    from megatron_vlm.inference.vllm_multiturn import VLLMMultiTurnRollout

    eos = engine.eos_token_ids
    session = EnvSession(runner or InlineEnvRunner(), TurnEncoder(proc), name=env, kwargs=kwargs or {},
                         samples=[env_sample(s, p) for s, p in zip(samples, prompts)],
                         histories=[s.messages for s in samples], n=n, eos_token_ids=sorted(eos))
    loop = (MultiTurnRollout(engine) if isinstance(engine, PolicyRolloutEngine)
            else VLLMMultiTurnRollout(engine, tokenizer=proc.tokenizer))
    trajs = loop.generate(prompts, SamplingParams(max_new_tokens=max_new, n=n, temperature=temperature), session,
                          MultiTurnLimits(max_turns=max_turns, max_total_tokens=MAX_TOTAL), seed=seed)
    return trajs, session, dict(loop.stats)


def _assert_same(theirs, ours, *, atol=1e-4):
    assert len(theirs) == len(ours)
    for a, b in zip(theirs, ours):
        assert (a.prompt_index, a.sample_index) == (b.prompt_index, b.sample_index)
        assert a.token_ids.tolist() == b.token_ids.tolist()
        assert a.model_mask.tolist() == b.model_mask.tolist()
        assert (a.finish_reason, a.turn_texts, a.turn_rewards) == (b.finish_reason, b.turn_texts, b.turn_rewards)
        assert a.vision.keys() == b.vision.keys()
        for k in a.vision:
            torch.testing.assert_close(a.vision[k], b.vision[k], atol=0, rtol=0)
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=atol, rtol=0)


def _vision(p, t) -> dict:
    """The prompt's vision inputs followed by the trajectory's (the prompt's placeholders come first)."""
    out = {}
    for k in VISION_KEYS:
        parts = [v for v in (getattr(p, k, None), t.vision.get(k)) if v is not None]
        if parts:
            out[k] = torch.cat(parts)
    return out


def _check_training_logprobs(model, prompts, trajs, temperature):
    """Every model token's behaviour log-prob = the cache-free forward's over the whole trajectory within 1e-4 (of the
    distribution the engines draw from: the vision tokens masked)."""
    n = 0
    for t in trajs:
        p = prompts[t.prompt_index]
        ids = torch.cat([p.input_ids, t.token_ids])[None]
        with torch.no_grad():
            logits = model(ids, **_vision(p, t))[0].float()
        logits = logits.index_fill(-1, torch.tensor(vision_token_ids(model), dtype=torch.long), float("-inf"))  # never drawn
        logp = torch.log_softmax(logits[:-1] / (temperature or 1.0), -1).gather(-1, ids[0, 1:, None])[:, 0]
        mask = torch.cat([torch.zeros(len(p), dtype=torch.bool), t.model_mask])[1:]
        torch.testing.assert_close(t.logprobs, logp[mask], atol=1e-4, rtol=0)
        n += int(t.model_mask.sum())
    assert n > len(trajs)


@pytest.mark.heavy  # 4 rollouts and a worker pool, 45-105 s here; CI runs the image test below (~30 s)
def test_text_environment_equals_builtin_and_training_forward(tmp_path):
    folder = synthesize_model_folder("tiny_qwen2", tmp_path / "m", seed=0)
    model = _policy(folder)
    proc = load_processor(str(folder))
    samples = _text_samples()
    encoder = PromptEncoder(proc, max_frames=4, fps=2.0, max_new_tokens=8, max_tokens=MAX_TOTAL)
    prompts = [encoder.encode(s) for s in samples]
    eos = set(range(0, model.lm_head.weight.shape[0], 3))  # every third id ends a turn: turns of a few tokens
    builtin = PolicyRolloutEngine(model, proc.tokenizer, EngineOptions(eos_token_ids=eos, max_num_seqs=3))
    engine = _vllm(folder, eos, model)
    try:
        ours, _, _ = _run(builtin, proc, samples, prompts, env=f"{FNS}:Echo")
        theirs, session, stats = _run(engine, proc, samples, prompts, env=f"{FNS}:Echo")
        T = 0.8
        sampled, _, _ = _run(engine, proc, samples, prompts, env=f"{FNS}:Echo", temperature=T, seed=5)
        again, _, _ = _run(engine, proc, samples, prompts, env=f"{FNS}:Echo", temperature=T, seed=5)
        with EnvWorkerPool(num_workers=2, timeout_s=10.0) as pool:
            pool.start()
            crashed, crash_session, _ = _run(engine, proc, samples, prompts, env=f"{FNS}:CrashOn", runner=pool)
    finally:
        engine.close()
    _assert_same(theirs, ours)
    assert any(int(t.model_mask.sum()) > t.num_turns for t in theirs)  # turns of several tokens, not only EOS
    assert session.errors == 0 and {t.finish_reason for t in theirs} <= {"max_turns", "length"}
    assert max(t.num_turns for t in theirs) == 3 and stats["requests"] > len(theirs)
    assert stats["cached_tokens"] > 0, stats  # later turns found the earlier turns' KV in vLLM's prefix cache
    _check_training_logprobs(model, prompts, theirs, 0.0)
    _check_training_logprobs(model, prompts, sampled, T)
    assert [t.token_ids.tolist() for t in sampled] == [t.token_ids.tolist() for t in again]
    assert [t.token_ids.tolist() for t in sampled] != [t.token_ids.tolist() for t in theirs]
    # the dying environment ends only its own trajectories; the others are the greedy run's, unchanged
    dead = [t for t in crashed if "seven" in samples[t.prompt_index].problem]
    alive = [t for t in crashed if "seven" not in samples[t.prompt_index].problem]
    assert len(dead) == 2 and crash_session.errors == 2
    assert all(t.finish_reason == "env_error" and "died" in t.error and t.num_turns == 1 for t in dead)
    _assert_same(alive, [t for t in theirs if "seven" not in samples[t.prompt_index].problem])


def _vqa_prompts(folder, tmp_path):
    from megatron_vlm.data.synthetic_vqa import write_synthetic_vqa

    vqa = write_synthetic_vqa(tmp_path / "vqa", 2, 2, seed=0)["eval"]
    samples = [dataclasses.replace(s, messages=[SYSTEM, *s.messages])
               for s in load_prompt_dataset(vqa, schema="messages").samples]
    encoder = PromptEncoder(load_processor(str(folder)), max_frames=4, fps=2.0, max_new_tokens=8, max_tokens=MAX_TOTAL)
    prompts = [encoder.encode(s) for s in samples]
    assert all(p is not None and p.images for p in prompts)
    return samples, prompts


class _DropOnePlaceholder:
    """A turn source whose replies lose one image placeholder token: vLLM's expansion no longer matches ours."""

    def __init__(self, inner, placeholder):
        self.inner, self.placeholder = inner, placeholder

    def step(self, items):
        replies = self.inner.step(items)
        for r in replies:
            if r.chunk is not None:
                ids = r.chunk.input_ids.tolist()
                k = max(i for i, t in enumerate(ids) if t == self.placeholder)
                r.chunk.input_ids = torch.tensor(ids[:k] + ids[k + 1:])
        return replies


@needs_torchvision
def test_image_in_turn_two_equals_builtin_and_training_forward(tmp_path):
    from megatron_vlm.inference.vllm_multiturn import VLLMMultiTurnRollout
    from megatron_vlm.rl.batching import pack_samples
    from megatron_vlm.rl.env.trajectories import trajectory_train_sample
    from megatron_vlm.training.lm_loss import TokenLogprobModel

    folder = synthesize_model_folder("tiny_qwen2_5_vl", tmp_path / "vl", seed=0)
    model = _policy(folder)
    proc = load_processor(str(folder))
    samples, prompts = _vqa_prompts(folder, tmp_path)
    eos = set(range(0, model.lm_head.weight.shape[0], 3))
    env, kwargs = f"{FNS}:ImageSecondTurn", {"sizes": [56, 84]}
    builtin = PolicyRolloutEngine(model, proc.tokenizer, EngineOptions(eos_token_ids=eos, max_num_seqs=3))
    engine = _vllm(folder, eos, model)
    try:
        ours, _, _ = _run(builtin, proc, samples, prompts, env=env, kwargs=kwargs)
        theirs, session, stats = _run(engine, proc, samples, prompts, env=env, kwargs=kwargs)
        sampled, _, _ = _run(engine, proc, samples, prompts, env=env, kwargs=kwargs, temperature=1.0, seed=3)
        source = EnvSession(InlineEnvRunner(), TurnEncoder(proc), name=env, kwargs=kwargs,
                            samples=[env_sample(s, p) for s, p in zip(samples, prompts)],
                            histories=[s.messages for s in samples], n=1, eos_token_ids=sorted(eos))
        bad = _DropOnePlaceholder(source, model.args.image_token_id)
        with pytest.raises(ValueError, match=r"conversation \d, turn 2: vLLM's expanded prompt has (\d+) tokens, ours"):
            VLLMMultiTurnRollout(engine, tokenizer=proc.tokenizer).generate(
                prompts, SamplingParams(max_new_tokens=8, n=1, temperature=0.0), bad,
                MultiTurnLimits(max_turns=3, max_total_tokens=MAX_TOTAL))
        after, _, _ = _run(engine, proc, samples, prompts, env=env, kwargs=kwargs)  # the engine is still usable
        video, _, _ = _run(engine, proc, samples, prompts, env=f"{FNS}:VideoSecondTurn", n=1)
    finally:
        engine.close()
    _assert_same(theirs, ours)
    _assert_same(after, ours)
    assert session.errors == 0 and all(t.finish_reason == "done" and t.num_turns == 2 for t in theirs)
    # a video observation goes to vLLM with its frames: the built-in loop's trajectories, the training forward's
    # log-probs (the 4-frame clip's temporal extent passes max(h, w) / merge: the M-RoPE rule matters here)
    video_ours, _, _ = _run(builtin, proc, samples, prompts, env=f"{FNS}:VideoSecondTurn", n=1)
    _assert_same(video, video_ours)
    # turn 2 answers the video (the random policy may run it to max_new_tokens: "length")
    assert all(t.num_turns == 2 and t.finish_reason in ("done", "length") and "pixel_values_videos" in t.vision
               for t in video)
    _check_training_logprobs(model, prompts, video, 0.0)
    assert all("pixel_values" in t.vision for t in theirs)
    assert len({int(t.vision["image_grid_thw"].prod()) for t in theirs}) == 2  # images of two sizes
    assert any(int(t.model_mask.sum()) > t.num_turns for t in theirs)
    assert stats["cached_tokens"] > 0, stats
    _check_training_logprobs(model, prompts, theirs, 0.0)
    _check_training_logprobs(model, prompts, sampled, 1.0)
    # the packed training forward (several trajectories per pack, and one per pack) gives vLLM's log-probs
    train = [trajectory_train_sample(prompts[t.prompt_index], t, advantage=1.0) for t in sampled]
    behav = torch.cat([s.behav_logp for s in train])
    with torch.no_grad():
        lp_model = TokenLogprobModel(model)
        for packs in ([train], [[s] for s in train]):
            got = [lp_model({k: v for k, v in pack_samples(group).items() if k != "num_response_tokens"},
                            masked_token_ids=vision_token_ids(model)) for group in packs]
            torch.testing.assert_close(torch.cat(got), behav, atol=1e-4, rtol=0)
