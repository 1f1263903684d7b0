"""The vLLM rollout engine against vLLM itself and against our own decoder (marker `vllm`: runs in the
environment docs/vllm.md builds, "Running the vLLM tests"; `bash .ci/vllm_tests.sh` runs them
there, and so does `.ci/run`; skipped where vllm is not importable).

- greedy tokens through the vLLM back end equal the built-in engine's on tiny random Qwen2 / Qwen3
  text folders and on Qwen2.5-VL with images (vLLM's expanded prompt equal to ours);
- with the vision tokens holding ~20 % of the mass, vLLM's log-probs (vision tokens masked) equal the training
  forward's masked log-probs within 1e-4, where the full softmax's are off by ~0.2;
- video prompts (Qwen2.5-VL, the frames our pipeline kept): vLLM's expanded prompt equals ours (a mismatch
  fails naming the prompt and both lengths), greedy tokens and log-probs equal the built-in engine's, sampled
  log-probs the training forward's within 1e-4 (both place the text after a video by the original Qwen2.5-VL
  M-RoPE rule, as vLLM; transformers 5.x's rule would put it ~3e-3 off, measured);
- our M-RoPE positions equal vLLM's own `get_mrope_input_positions` for videos (fractional, integer and
  float32-boundary seconds per grid), images and text;
- the tokens a step may draw under top-k / top-p are exactly those vLLM's own `apply_top_k_top_p` keeps (bf16 ties,
  a Qwen-sized vocabulary with top_p near 1);
- the log-probs vLLM reports for sampled tokens (processed: after temperature) equal our training
  forward's log_softmax(logits / T) of the same tokens within 1e-4 (fp32);
- a weight push makes the engine generate exactly what a fresh vLLM engine loaded from the exported
  folder (`save_hf_model`) generates, for full fine-tuning and for LoRA (merged weights);
- a prompt whose expansion differs from vLLM's fails naming the prompt and both lengths;
- a weight push into a running `generate` (`paused()`, asynchronous GRPO): versions 0 then 1 per completion,
  each token's log-prob the training forward's of the policy that drew it;
- a prompt vLLM refuses fails naming it, a vLLM error mid-generate propagates, and neither leaves requests behind.
"""
import importlib.util

import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                   reason="vllm is not installed here (run these tests in the vLLM environment: docs/vllm.md, "
                                                          "'Running the vLLM tests')")]

from megatron_vlm.checkpoint.hf import load_hf_model, save_hf_model  # noqa: E402
from megatron_vlm.data.processor import load_processor  # noqa: E402
from megatron_vlm.inference.engine import RolloutPrompt, SamplingParams  # noqa: E402
from megatron_vlm.inference.policy_engine import PolicyRolloutEngine, vision_token_ids  # noqa: E402
from megatron_vlm.inference.stopping import eos_token_ids_of  # noqa: E402
from megatron_vlm.models.common.lora import apply_lora, lora_modules  # noqa: E402
from megatron_vlm.rl.config import VLLMConfig  # noqa: E402
from megatron_vlm.testing.synthesize import synthesize_model_folder  # noqa: E402
from megatron_vlm.testing.tiny_text_model import build_tiny_qwen_text_folder  # noqa: E402

NEW = 12


def _engine(folder, model=None, *, eos=(), suppress=()):
    from megatron_vlm.inference.vllm_engine import VLLMRolloutEngine

    proc = load_processor(str(folder))
    tok = proc.tokenizer
    placeholders = [tok.convert_tokens_to_ids(t) for t in (getattr(proc, "image_token", None),
                                                             getattr(proc, "video_token", None)) if t]
    return VLLMRolloutEngine(str(folder), VLLMConfig(max_num_seqs=16, cpu_kv_cache_gib=1), dtype=torch.float32, device="cpu",
                             max_model_len=1024, seed=0, sync_from=model, eos_token_ids=eos or sorted(eos_token_ids_of(tok)),
                             placeholder_ids=placeholders, suppress_token_ids=suppress)


def _text_prompts(tok):
    texts = ["what is two plus two", "the cat sat on the", "seven eight nine", "hello"]
    return [RolloutPrompt(input_ids=torch.tensor(tok(t)["input_ids"], dtype=torch.long)) for t in texts]


def _image_prompts(folder, tmp_path):
    from megatron_vlm.data.synthetic_vqa import write_synthetic_vqa
    from megatron_vlm.rl.prompts.dataset import load_prompt_dataset
    from megatron_vlm.rl.prompts.encoder import PromptEncoder

    vqa = write_synthetic_vqa(tmp_path / "vqa", 2, 3, seed=0)["eval"]
    encoder = PromptEncoder(load_processor(str(folder)), max_frames=4, fps=2.0, max_new_tokens=NEW, max_tokens=1024)
    prompts = [encoder.encode(s) for s in load_prompt_dataset(vqa, schema="messages").samples]
    assert prompts and all(p is not None and p.images for p in prompts)
    return prompts


def _ours_greedy(model, tok, prompts):
    eng = PolicyRolloutEngine(model, tok)
    return [s.token_ids.tolist() for s in eng.generate(prompts, SamplingParams(max_new_tokens=NEW, n=1, temperature=0.0)).samples]


def _greedy(engine, prompts):
    res = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, n=1, temperature=0.0))
    return [s.token_ids.tolist() for s in res.samples]


def _tiny_text(kind, out):
    if kind == "tiny_qwen3":  # hidden 96: head_dim 32 (the tiny default's 40 is not a head size vLLM's CPU attention runs)
        return build_tiny_qwen_text_folder(out, model_type="qwen3", seed=1, hidden=96)
    return synthesize_model_folder(kind, out, seed=0)


@pytest.mark.parametrize("kind", ["tiny_qwen2", "tiny_qwen3"])
def test_greedy_equals_builtin_and_logprobs_equal_training_forward(kind, tmp_path):
    folder = _tiny_text(kind, tmp_path / kind)
    model = load_hf_model(str(folder), dtype=torch.float32, device="cpu").eval()
    tok = load_processor(str(folder)).tokenizer
    prompts = _text_prompts(tok)
    engine = _engine(folder)
    try:
        theirs = _greedy(engine, prompts)
        # a greedy group (n > 1 at temperature 0, which vLLM refuses for one request): n equal completions
        group = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, n=2, temperature=0.0)).samples
        T = 0.7
        res = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, n=3, temperature=T),
                              generator=torch.Generator().manual_seed(0))
        # more prompt tokens than one scheduling step takes, sampled with per-request seeds (vLLM 0.32's CPU
        # worker failed on a chunked prefill of a seeded request): every group complete, and seeded = repeatable
        many = [RolloutPrompt(input_ids=p.input_ids.repeat(40)) for p in prompts] * 8
        big = SamplingParams(max_new_tokens=3, n=8, temperature=1.0)
        first = engine.generate(many, big, generator=torch.Generator().manual_seed(1))
        again = engine.generate(many, big, generator=torch.Generator().manual_seed(1))
    finally:
        engine.close()
    assert len(first.samples) == 8 * len(many) and all(s.token_ids.numel() >= 1 for s in first.samples)
    assert [s.token_ids.tolist() for s in first.samples] == [s.token_ids.tolist() for s in again.samples]
    assert theirs == _ours_greedy(model, tok, prompts)
    assert [(s.prompt_index, s.sample_index, s.token_ids.tolist()) for s in group] == \
        [(i, j, t) for i, t in enumerate(theirs) for j in range(2)]
    assert all(len(t) >= 1 for t in theirs)
    assert [(s.prompt_index, s.sample_index) for s in res.samples] == [(i, j) for i in range(len(prompts)) for j in range(3)]
    n = 0
    for s in res.samples:
        p = prompts[s.prompt_index].input_ids
        with torch.no_grad():
            logits = model(input_ids=torch.cat([p, s.token_ids])[None])[0].float()  # [T, V]
        lp = torch.log_softmax(logits[len(p) - 1: -1] / T, dim=-1).gather(-1, s.token_ids[:, None])[:, 0]
        torch.testing.assert_close(s.logprobs, lp, atol=1e-4, rtol=0)
        n += s.token_ids.numel()
    assert n > 3 * len(prompts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: ties at the top-k / top-p boundary
def test_kept_set_equals_vllms_top_k_top_p(dtype):
    """The tokens a step may draw (built-in `filter_logits`) are exactly those vLLM's own `apply_top_k_top_p` keeps
    (after its in-place temperature), on a Qwen-sized vocabulary too, top_p near 1 included (a running sum from the
    most likely token down once dropped hundreds of tokens there), ties and top_k past the vocabulary."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    from megatron_vlm.inference.sampling import filter_logits

    g = torch.Generator().manual_seed(0)
    small = [(1.0, 1.0, 0, 0.9), (3.0, 0.6, 0, 0.999), (3.0, 1.3, 20, 0.5), (0.01, 1.0, 3, 1.0), (3.0, 1.0, 55, 0.999),
             (1.0, 0.7, 1, 0.5), (3.0, 1.0, 0, 1e-4)]
    for vocab, cases in ((50, small), (151936, [(3.0, 0.6, 0, 0.999), (3.0, 1.3, 151941, 0.5)])):
        for scale, T, k, p in cases:
            x = (torch.randn(3, vocab, generator=g) * scale).to(dtype).float()
            theirs = apply_top_k_top_p(x.clone().div_(torch.full((3, 1), T)),
                                       torch.full((3,), min(k, vocab), dtype=torch.int32) if k else None,
                                       torch.full((3,), p) if p < 1 else None)
            ours = filter_logits(x / T, top_k=k, top_p=p)
            assert torch.equal(ours > float("-inf"), theirs > float("-inf")), (vocab, scale, T, k, p)


def _perturb_(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


@pytest.mark.parametrize("lora", [False, True])
def test_weight_push_equals_fresh_engine_on_export(lora, tmp_path):
    folder = synthesize_model_folder("tiny_qwen2", tmp_path / "m", seed=0)
    trainer = load_hf_model(str(folder), dtype=torch.float32, device="cpu").eval()
    if lora:
        names = [n for n, m in trainer.named_modules() if isinstance(m, torch.nn.Linear) and n.endswith(("q_proj", "v_proj"))]
        apply_lora(trainer, names, r=4, alpha=8)
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for m in lora_modules(trainer).values():
                m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.5)
    else:
        _perturb_(trainer, 7)
    tok = load_processor(str(folder)).tokenizer
    prompts = _text_prompts(tok)
    export = save_hf_model(trainer, tmp_path / "export", copy_from=folder)
    fresh_engine = _engine(export)  # one live vLLM engine per process: the fresh one first, closed
    try:
        fresh = _greedy(fresh_engine, prompts)
    finally:
        fresh_engine.close()
    engine = _engine(folder, trainer)
    engine.cfg = VLLMConfig(weight_bucket_mb=1)  # several buckets
    try:
        before = _greedy(engine, prompts)
        engine.load_weights(None, version=5)
        assert engine.policy_version == 5 and engine.weight_push_s > 0
        assert engine.metrics()["rollout/weight_push_s"] == engine.weight_push_s
        pushed = _greedy(engine, prompts)
    finally:
        engine.close()
    assert pushed == fresh
    assert pushed != before  # the push changed what it generates
    assert pushed == _ours_greedy(trainer, tok, prompts)


needs_torchvision = pytest.mark.skipif(importlib.util.find_spec("torchvision") is None,
                                       reason="vLLM's Qwen2.5-VL imports transformers' torchvision image processor; "
                                              "this environment has no torchvision (docs/vllm.md: the image environment)")


@needs_torchvision
def test_greedy_equals_builtin_qwen2_5_vl_images(tmp_path):
    folder = synthesize_model_folder("tiny_qwen2_5_vl", tmp_path / "vl", seed=0)
    model = load_hf_model(str(folder), dtype=torch.float32, device="cpu").eval()
    prompts = _image_prompts(folder, tmp_path)
    engine = _engine(folder, model, suppress=vision_token_ids(model))  # the vision tokens never sampled, as in a job
    try:
        _check_images(engine, folder, model, prompts)
        # a weight push, then the same images again: vLLM must recompute their vision features with the new
        # weights (not reuse the encoder outputs cached before the push, nor fail on a cache the push cleared)
        params = SamplingParams(max_new_tokens=NEW, n=1, temperature=0.0)
        before = engine.generate(prompts, params).samples
        _perturb_(model, 7)
        engine.load_weights(None, version=1)
        after = engine.generate(prompts, params).samples
        tok = load_processor(str(folder)).tokenizer
        ours = PolicyRolloutEngine(model, tok).generate(prompts, params).samples
        assert [s.token_ids.tolist() for s in after] == [s.token_ids.tolist() for s in ours]
        for a, o, b in zip(after, ours, before):
            torch.testing.assert_close(a.logprobs, o.logprobs, atol=1e-4, rtol=0)
            assert not torch.allclose(a.logprobs, b.logprobs, atol=1e-3)  # the push changed the policy
    finally:
        engine.close()


@needs_torchvision
def test_logprobs_equal_training_when_the_vision_tokens_carry_mass(tmp_path):
    """vLLM samples with the vision tokens masked (logit bias -100), the built-in engine suppresses them: both
    report log-probs of that masked distribution, and so must training (`masked_token_ids`). With a random tiny
    model the vision tokens hold ~0.4 % of the mass, which hides a full-softmax training forward; here their LM
    head rows are moved towards the hidden states so that they hold ~20 % (as a drifted policy's may), and the
    training forward's masked log-probs still equal vLLM's within 1e-4 while the full softmax's are far off."""
    from megatron_vlm.rl.batching import TrainSample, pack_samples
    from megatron_vlm.training.lm_loss import TokenLogprobModel

    folder = synthesize_model_folder("tiny_qwen2_5_vl", tmp_path / "vl", seed=0)
    model = load_hf_model(str(folder), dtype=torch.float32, device="cpu").eval()
    vision = vision_token_ids(model)
    prompts = _image_prompts(folder, tmp_path)
    with torch.no_grad():  # the vision rows' logits raised by ~4 where the hidden states point on average
        text = torch.cat([p.input_ids[~torch.isin(p.input_ids, torch.tensor(vision))] for p in prompts])
        mean = model(input_ids=text[None], return_hidden=True)[0].mean(0)
        model.lm_head.weight[vision] += 4.0 * mean / mean.dot(mean)
    engine = _engine(folder, model, suppress=vision)
    T = 0.8
    try:
        engine.load_weights(None, version=1)
        res = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, n=3, temperature=T),
                              generator=torch.Generator().manual_seed(0))
        greedy = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, n=1, temperature=0.0)).samples
    finally:
        engine.close()
    tok = load_processor(str(folder)).tokenizer
    ours = PolicyRolloutEngine(model, tok).generate(prompts, SamplingParams(max_new_tokens=NEW, n=1, temperature=0.0)).samples
    assert [s.token_ids.tolist() for s in greedy] == [s.token_ids.tolist() for s in ours]
    for a, o in zip(greedy, ours):
        torch.testing.assert_close(a.logprobs, o.logprobs, atol=1e-4, rtol=0)
    samples = [TrainSample(prompt=prompts[s.prompt_index], response_ids=s.token_ids, behav_logp=s.logprobs, advantage=0.0)
               for s in res.samples]
    assert not any(set(s.token_ids.tolist()) & set(vision) for s in res.samples)
    batch = pack_samples(samples)
    batch.pop("num_response_tokens")
    with torch.no_grad():
        masked = TokenLogprobModel(model)(batch, temperature=T, masked_token_ids=vision)
        full = TokenLogprobModel(model)(batch, temperature=T)
    behav = torch.cat([s.behav_logp for s in samples])
    torch.testing.assert_close(masked, behav, atol=1e-4, rtol=0)
    # log(1 - P) per token: the full softmax would fail the 1e-4 above by orders of magnitude
    assert float((masked - full).mean()) > 0.05 and float((full - behav).abs().max()) > 1e-2


def _video_prompts(folder):
    """Generation prompts of the synthetic video task through the data pipeline (RL prompt files take images
    only; videos reach a rollout as records, e.g. an environment's observation): 6-frame clips, 4 kept."""
    from megatron_vlm.data.messages import Record
    from megatron_vlm.data.processing import process_record
    from megatron_vlm.data.synthetic_video import clip_frames

    proc = load_processor(str(folder))
    prompts = []
    for i, (colour, direction) in enumerate([("red", "left"), ("blue", "down"), ("green", "up")]):
        video = {"type": "video", "video": clip_frames(colour, direction, num_frames=6, offset=i), "fps": 3.0}
        rec = Record(messages=[{"role": "user", "content": [video, {"type": "text", "text": "Which way does it move?"}]},
                               {"role": "assistant", "content": direction}], source="synthetic", index=i)
        prompts.append(RolloutPrompt.from_processed(process_record(rec, proc, max_frames=4, fps=2.0, for_generation=True)))
    assert all(p.videos and p.pixel_values_videos is not None for p in prompts)
    return prompts


@needs_torchvision
def test_video_prompts_qwen2_5_vl(tmp_path):
    """Video prompts: the frames our pipeline kept (4 of 6, so the sampled rate differs from the source's) go in with
    their metadata, vLLM's expanded prompt equals ours (one frame pair short fails naming the prompt and both
    lengths), greedy tokens and log-probs equal the built-in engine's, and the sampled tokens' log-probs equal the
    training forward's (vision vocabulary masked) within 1e-4 in fp32. Both place the text after a video at the
    video's largest M-RoPE position + 1 (the original Qwen2.5-VL rule, vLLM's; mrope_index.py); the same forward
    given transformers 5.x's positions (start + max(h, w) / merge) is measured ~3e-3 off, so the checks can fail."""
    from megatron_vlm.rl.batching import TrainSample, pack_samples
    from megatron_vlm.training.lm_loss import TokenLogprobModel

    folder = synthesize_model_folder("tiny_qwen2_5_vl", tmp_path / "vl", seed=0)
    model = load_hf_model(str(folder), dtype=torch.float32, device="cpu").eval()
    vision = vision_token_ids(model)
    prompts = _video_prompts(folder)
    assert all(p.videos[0].num_frames == 4 and p.videos[0].total_frames == 6 for p in prompts)
    engine = _engine(folder, model, suppress=vision)
    T = 0.9
    try:
        greedy = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, n=1, temperature=0.0)).samples
        res = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, n=2, temperature=T),
                              generator=torch.Generator().manual_seed(0))
        # one frame short of the prompt's video: vLLM's expansion differs from ours -> the named error
        short = prompts[0]
        clip = short.videos[0]
        bad = RolloutPrompt(input_ids=short.input_ids, pixel_values_videos=short.pixel_values_videos,
                            video_grid_thw=short.video_grid_thw, second_per_grid_ts=short.second_per_grid_ts,
                            videos=[type(clip)(clip.indices[:2], clip.total_frames, clip.fps, clip.height, clip.width,
                                               clip.frames[:2])])
        with pytest.raises(ValueError, match=r"prompt 0: vLLM's expanded prompt has \d+ tokens, ours \d+"):
            engine.generate([bad], SamplingParams(max_new_tokens=2, n=1, temperature=0.0))
    finally:
        engine.close()
    tok = load_processor(str(folder)).tokenizer
    ours = PolicyRolloutEngine(model, tok).generate(prompts, SamplingParams(max_new_tokens=NEW, n=1, temperature=0.0)).samples
    assert [s.token_ids.tolist() for s in greedy] == [s.token_ids.tolist() for s in ours]
    for a, o in zip(greedy, ours):
        torch.testing.assert_close(a.logprobs, o.logprobs, atol=1e-4, rtol=0)
    samples = [TrainSample(prompt=prompts[s.prompt_index], response_ids=s.token_ids, behav_logp=s.logprobs, advantage=0.0)
               for s in res.samples]
    batch = pack_samples(samples)
    batch.pop("num_response_tokens")
    with torch.no_grad():
        recomputed = TokenLogprobModel(model)(batch, temperature=T, masked_token_ids=vision)
    behav = torch.cat([s.behav_logp for s in samples])
    torch.testing.assert_close(recomputed, behav, atol=1e-4, rtol=0)
    # the same forward on transformers 5.x's positions (the rule the training forward followed before): off by more
    # than the tolerance, so the checks above see the rule
    gaps = {"original": float((recomputed - behav).abs().max()), "transformers5": _gap_5x(model, folder, prompts, res.samples, T, vision)}
    print("vLLM video log-prob gap (max |vLLM - training forward|, sampled):", gaps)
    assert gaps["transformers5"] > 1e-4


def _gap_5x(model, folder, prompts, samples, T, vision) -> float:
    """max |vLLM log-prob - our forward's| over `samples` with the forward given transformers 5.3+'s M-RoPE positions."""
    import json

    from tests.fixtures.original_mrope import original_qwen2_5_vl_positions

    cfg = json.loads((folder / "config.json").read_text())
    mask = torch.zeros(model.lm_head.weight.shape[0], dtype=torch.bool)
    mask[list(vision)] = True
    gap = 0.0
    for s in samples:
        p = prompts[s.prompt_index]
        ids = torch.cat([p.input_ids, s.token_ids])
        pos, _ = original_qwen2_5_vl_positions(
            ids, image_token_id=cfg["image_token_id"], video_token_id=cfg["video_token_id"],
            spatial_merge_size=cfg["vision_config"]["spatial_merge_size"],
            tokens_per_second=cfg["vision_config"]["tokens_per_second"], video_grid_thw=p.video_grid_thw,
            second_per_grid_ts=p.second_per_grid_ts, resume="transformers5")
        with torch.no_grad():
            logits = model(input_ids=ids[None], pixel_values_videos=p.pixel_values_videos, video_grid_thw=p.video_grid_thw,
                           second_per_grid_ts=p.second_per_grid_ts, position_ids=pos[:, None])[0].float()
        logits = logits[len(p.input_ids) - 1: -1].masked_fill(mask, float("-inf")) / T
        lp = torch.log_softmax(logits, dim=-1).gather(-1, s.token_ids[:, None])[:, 0]
        gap = max(gap, float((s.logprobs - lp).abs().max()))
    return gap


@needs_torchvision
@pytest.mark.parametrize("seconds", [[0.5, 1.5], [1.0, 2.0], [2 / 0.3, 0.7]], ids=["fractional", "integer", "boundary"])
def test_mrope_positions_equal_vllms(seconds):
    """Our M-RoPE positions and rope delta equal vLLM 0.32's own Qwen2.5-VL `get_mrope_input_positions` (called on a
    stand-in model holding only the config it reads): videos before, between and after text and images, seconds per
    grid fractional (0.5 s: temporal steps 0, 1, 2, ...), integer, and 6.666... s (fps 0.3, temporal patch 2), where
    vLLM's float64 product and the original's float32 one truncate differently (tests/fixtures/original_mrope.py)."""
    import types

    from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration as VLLMQwen

    from megatron_vlm.models.common.mrope_index import get_mrope_position_ids
    from tests.fixtures import tiny_qwen2_5_vl as F

    stub = types.SimpleNamespace(config=types.SimpleNamespace(vision_config=types.SimpleNamespace(
        spatial_merge_size=F.MERGE, tokens_per_second=2)))
    stub.iter_mm_grid_thw = types.MethodType(VLLMQwen.iter_mm_grid_thw, stub)
    g = torch.Generator().manual_seed(0)
    cases = [[3, ("video", (3, 4, 6)), 5], [2, ("image", (1, 6, 4)), 3, ("video", (4, 4, 4)), 2, ("image", (1, 4, 8)), 4],
             [2, ("video", (4, 4, 4)), 3, ("video", (2, 6, 4)), 2], [("video", (2, 4, 4)), 2, ("image", (1, 4, 4))],
             [("image", (1, 4, 4)), 2, ("video", (6, 2, 2))], [5, ("image", (1, 8, 4)), 3], [7]]
    for parts in cases:
        sample = F.build_sample(parts, g)
        ids = torch.tensor([sample["input_ids"]])
        n_videos = 0 if sample["video_grid_thw"] is None else len(sample["video_grid_thw"])
        secs = torch.tensor(seconds[:n_videos], dtype=torch.float32) if n_videos else None
        ours, delta = get_mrope_position_ids(
            ids, image_token_id=F.IMAGE_TOKEN_ID, video_token_id=F.VIDEO_TOKEN_ID, spatial_merge_size=F.MERGE,
            tokens_per_second=2, image_grid_thw=sample["image_grid_thw"], video_grid_thw=sample["video_grid_thw"],
            second_per_grid_ts=secs)
        feats, grids = [], {"image": iter(()), "video": iter(())}
        for kind in grids:
            g_kind = sample[f"{kind}_grid_thw"]
            grids[kind] = iter(g_kind if g_kind is not None else [])
        video_secs = iter(secs if secs is not None else [])
        ids_list, i = sample["input_ids"], 0
        while i < len(ids_list):
            kind = {F.IMAGE_TOKEN_ID: "image", F.VIDEO_TOKEN_ID: "video"}.get(ids_list[i])
            if kind is None:
                i += 1
                continue
            grid = next(grids[kind])
            data = {f"{kind}_grid_thw": types.SimpleNamespace(data=grid)}
            if kind == "video":
                data["second_per_grid_ts"] = types.SimpleNamespace(data=next(video_secs))
            feats.append(types.SimpleNamespace(modality=kind, mm_position=types.SimpleNamespace(offset=i), data=data))
            i += int(grid.prod()) // F.MERGE**2
        theirs, their_delta = VLLMQwen.get_mrope_input_positions(stub, ids_list, feats)
        assert torch.equal(ours[:, 0], theirs.long()), parts
        assert int(delta[0, 0]) == int(their_delta), parts


def _check_images(engine, folder, model, prompts):
    tok = load_processor(str(folder)).tokenizer
    assert _greedy(engine, prompts) == _ours_greedy(model, tok, prompts)
    # a prompt whose placeholder run is one token short: vLLM's expansion differs from ours -> named error
    bad = prompts[0]
    ids = bad.input_ids.tolist()
    pad = engine.placeholder_ids
    k = max(i for i, t in enumerate(ids) if t in pad)
    broken = RolloutPrompt(input_ids=torch.tensor(ids[:k] + ids[k + 1:]), pixel_values=bad.pixel_values,
                           image_grid_thw=bad.image_grid_thw, images=bad.images)
    with pytest.raises(ValueError, match=rf"prompt 0: vLLM's expanded prompt has {len(ids)} tokens, ours {len(ids) - 1}"):
        engine.generate([broken], SamplingParams(max_new_tokens=2, n=1, temperature=0.0))


def test_push_during_generation_resumes_requests_with_new_weights(tmp_path):
    """Asynchronous GRPO's push into a running `generate` (`paused()` from another thread): the completions
    carry version 0 then version 1 (never back), and every token's log-prob is the training forward's of the
    policy that drew it — version-0 tokens the old weights', version-1 tokens the new weights' on the whole
    sequence (vLLM recomputes the preempted requests' prefix with the new weights)."""
    import threading

    folder = synthesize_model_folder("tiny_qwen2", tmp_path / "m", seed=0)
    old = load_hf_model(str(folder), dtype=torch.float32, device="cpu").eval()
    new = load_hf_model(str(folder), dtype=torch.float32, device="cpu").eval()
    _perturb_(new, 11)
    tok = load_processor(str(folder)).tokenizer
    prompts = _text_prompts(tok)
    engine = _engine(folder, new)
    steps, reached = [0], threading.Event()
    step = engine.llm.llm_engine.step

    def counted():
        steps[0] += 1
        if steps[0] == 6:
            reached.set()
        return step()

    engine.llm.llm_engine.step = counted
    T, pushed = 0.9, {}

    def push():  # the rollout rank's weight thread; generation stays in the thread that built the engine
        try:
            if reached.wait(300):
                with engine.paused():
                    engine.load_weights(None, version=1)
                pushed["at"] = steps[0]
        except BaseException as e:  # noqa: BLE001 - reported below
            pushed["error"] = e

    pusher = threading.Thread(target=push)
    try:
        pusher.start()
        res = engine.generate(prompts, SamplingParams(max_new_tokens=40, n=2, temperature=T),
                              generator=torch.Generator().manual_seed(2))
        reached.set()
        pusher.join(300)
    finally:
        engine.close()
    assert "error" not in pushed and pushed.get("at", 0) >= 6, pushed
    out = {"r": res}
    assert "r" in out and engine.policy_version == 1 and not out["r"].interrupted
    mixed = 0
    for s in out["r"].samples:
        v = s.token_versions
        assert v.numel() == s.token_ids.numel() >= 1 and bool((v[1:] >= v[:-1]).all()), v  # never back to an older version
        p = prompts[s.prompt_index].input_ids
        seq = torch.cat([p, s.token_ids])[None]
        with torch.no_grad():
            lp = {ver: torch.log_softmax(m(input_ids=seq)[0].float()[len(p) - 1: -1] / T, dim=-1)
                  .gather(-1, s.token_ids[:, None])[:, 0] for ver, m in ((0, old), (1, new))}
        for ver in (0, 1):
            sel = v == ver
            torch.testing.assert_close(s.logprobs[sel], lp[ver][sel], atol=1e-4, rtol=0)
        mixed += int(v[0]) == 0 and int(v[-1]) == 1
    assert mixed > 0  # the push landed mid-generation: completions started on version 0 and ended on version 1


def test_failures_name_the_prompt_and_leave_the_engine_clean(tmp_path):
    """A prompt vLLM refuses (longer than its max_model_len) fails naming the prompt; a vLLM error in the middle
    of a generate propagates (no hang); either way no request of that call stays in the engine, so the next
    generate gets its own completions only (the requests submitted before the failure are aborted)."""
    folder = synthesize_model_folder("tiny_qwen2", tmp_path / "m", seed=0)
    tok = load_processor(str(folder)).tokenizer
    prompts = _text_prompts(tok)
    engine = _engine(folder)
    sampled = SamplingParams(max_new_tokens=NEW, n=2, temperature=1.0)
    try:
        too_long = RolloutPrompt(input_ids=prompts[0].input_ids.repeat(200))
        with pytest.raises(ValueError, match=r"^vLLM rollout: prompt 2 \(1[0-9]{3} tokens\): .*maximum context length is 1024"):
            engine.generate([*prompts[:2], too_long], sampled, generator=torch.Generator().manual_seed(0))
        assert not engine.llm.llm_engine.has_unfinished_requests()
        step, calls = engine.llm.llm_engine.step, [0]

        def failing_step():
            calls[0] += 1
            if calls[0] == 3:
                raise RuntimeError("engine core died")
            return step()

        engine.llm.llm_engine.step = failing_step
        with pytest.raises(RuntimeError, match="engine core died"):
            engine.generate(prompts, sampled, generator=torch.Generator().manual_seed(0))
        engine.llm.llm_engine.step = step
        assert not engine.llm.llm_engine.has_unfinished_requests()
        res = engine.generate(prompts, sampled, generator=torch.Generator().manual_seed(0))
    finally:
        engine.close()
    assert [(s.prompt_index, s.sample_index) for s in res.samples] == [(i, j) for i in range(len(prompts)) for j in range(2)]
    assert all(s.finish_reason in ("eos", "length") and s.token_ids.numel() >= 1 for s in res.samples)


def test_a_stop_gives_up_single_and_multi_turn_generation_between_engine_steps(tmp_path, monkeypatch):
    """A stop signal while the vLLM engine generates (`abandon`, the training rank's stop flag): asked between engine
    steps, as the built-in engine asks it between decode steps. Before, neither loop asked it: a stop waited for the
    whole rollout (here 300 tokens a completion). Now the call is given up at the step where the check has said stop
    for `ABANDON_GRACE_S` (0 here), `WaitAbandoned` ("generation"), its requests aborted: nothing stays in the engine,
    and the next call gets its own completions only."""
    from megatron_vlm import abandon
    from megatron_vlm.abandon import WaitAbandoned
    from megatron_vlm.inference.multiturn import MultiTurnLimits, TurnReply
    from megatron_vlm.inference.vllm_multiturn import VLLMMultiTurnRollout

    monkeypatch.setattr(abandon, "ABANDON_GRACE_S", 0.0)
    folder = synthesize_model_folder("tiny_qwen2", tmp_path / "m", seed=0)
    tok = load_processor(str(folder)).tokenizer
    prompts = _text_prompts(tok)
    engine = _engine(folder)
    llm_engine = engine.llm.llm_engine
    step, steps = llm_engine.step, [0]

    def counted():
        steps[0] += 1
        return step()

    llm_engine.step = counted
    long = SamplingParams(max_new_tokens=300, n=2, temperature=1.0)

    class Done:  # an environment that ends every conversation after its first turn
        def step(self, items):
            return [TurnReply(done=True) for _ in items]

    try:
        with pytest.raises(WaitAbandoned, match="generation given up after 3 engine steps") as e:
            engine.generate(prompts, long, generator=torch.Generator().manual_seed(0), abandon=lambda: steps[0] >= 3)
        assert e.value.waited_for == "generation" and steps[0] == 3
        assert not llm_engine.has_unfinished_requests()
        loop = VLLMMultiTurnRollout(engine, tokenizer=tok)
        steps[0] = 0
        with pytest.raises(WaitAbandoned, match="generation given up after 4 engine steps"):
            loop.generate(prompts, long, Done(), MultiTurnLimits(max_turns=2, max_total_tokens=512), seed=0,
                          abandon=lambda: steps[0] >= 4)
        assert steps[0] == 4 and not llm_engine.has_unfinished_requests()
        short = SamplingParams(max_new_tokens=4, n=2, temperature=1.0)
        res = engine.generate(prompts, short, generator=torch.Generator().manual_seed(0), abandon=lambda: False)
        trajs = loop.generate(prompts, short, Done(), MultiTurnLimits(max_turns=2, max_total_tokens=512), seed=0,
                              abandon=lambda: False)
    finally:
        llm_engine.step = step
        engine.close()
    assert [(s.prompt_index, s.sample_index) for s in res.samples] == [(i, j) for i in range(len(prompts)) for j in range(2)]
    assert all(s.finish_reason in ("eos", "length") and 1 <= s.token_ids.numel() <= 4 for s in res.samples)
    assert len(trajs) == 2 * len(prompts) and all(t.finish_reason in ("done", "length") for t in trajs)
    assert engine.takes_abandon and VLLMMultiTurnRollout.takes_abandon  # the GRPO round passes its check to both
