"""The rollout engine drives every model family (attention-only KV cache: Qwen2.5-VL, Qwen3-VL,
InternVL; hybrid Mamba cache: Nemotron-VL) on its own tiny folder and processor: sampled completions
with a shared prefix, dropped finished rows, and behaviour log-probs equal to the packed training
forward's log-probs of the same tokens (the PPO ratio starts at 1), both of the distribution with the vision
tokens removed (the engine never samples them; the full softmax would be off by log(1 - p(vision))). The hybrid decoder also decodes
greedily with its slots refilled (continuous batching: Mamba2 states copied into and out of slots)
exactly as a full forward per step without any cache."""
import pytest
import torch

from megatron_vlm.checkpoint.hf import load_hf_model
from megatron_vlm.data.processor import load_processor
from megatron_vlm.data.synthetic_vqa import write_synthetic_vqa
from megatron_vlm.inference.engine import SamplingParams
from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine, vision_token_ids
from megatron_vlm.rl.batching import TrainSample, pack_samples
from megatron_vlm.rl.prompts.dataset import load_prompt_dataset
from megatron_vlm.rl.prompts.encoder import PromptEncoder
from megatron_vlm.testing.synthesize import synthesize_model_folder
from megatron_vlm.training.lm_loss import TokenLogprobModel


@pytest.fixture(scope="module")
def vqa(tmp_path_factory):
    return write_synthetic_vqa(tmp_path_factory.mktemp("vqa"), 2, 3, seed=0)["eval"]


@pytest.mark.parametrize("kind", ["tiny_qwen2_5_vl", "tiny_qwen3_vl", "tiny_internvl", "tiny_nemotron_vl"])
def test_engine_on_every_family(kind, vqa, tmp_path):
    folder = synthesize_model_folder(kind, tmp_path / kind, seed=0)
    model, proc = load_hf_model(str(folder)).eval(), load_processor(str(folder))
    encoder = PromptEncoder(proc, max_frames=4, fps=2.0, max_new_tokens=5, max_tokens=4096)
    prompts = [encoder.encode(s) for s in load_prompt_dataset(vqa, schema="messages").samples]
    assert all(p is not None for p in prompts)
    res = PolicyRolloutEngine(model, proc.tokenizer).generate(
        prompts, SamplingParams(max_new_tokens=5, n=2, temperature=1.0), generator=torch.Generator().manual_seed(0))
    assert len(res.samples) == 6 and all(1 <= len(s.token_ids) <= 5 for s in res.samples)
    samples = [TrainSample(prompt=prompts[s.prompt_index], response_ids=s.token_ids, behav_logp=s.logprobs, advantage=0.0)
               for s in res.samples]
    batch = pack_samples(samples)
    batch.pop("num_response_tokens")
    masked = vision_token_ids(model)
    assert masked  # every family here is a VLM
    with torch.no_grad():
        recomputed = TokenLogprobModel(model)(batch, masked_token_ids=masked)
        full = TokenLogprobModel(model)(batch)
    behav = torch.cat([s.behav_logp for s in samples])
    torch.testing.assert_close(recomputed, behav, atol=1e-4, rtol=0)
    assert (full - behav).abs().max() > 5e-4  # the random tiny models give the vision tokens ~0.1 % of the mass


@pytest.mark.parametrize("kind", ["tiny_nemotron_vl"])
def test_refilled_slots_equal_decoding_without_cache(kind, vqa, tmp_path):
    folder = synthesize_model_folder(kind, tmp_path / kind, seed=0)
    model, proc = load_hf_model(str(folder)).eval(), load_processor(str(folder))
    encoder = PromptEncoder(proc, max_frames=4, fps=2.0, max_new_tokens=4, max_tokens=4096)
    prompts = [encoder.encode(s) for s in load_prompt_dataset(vqa, schema="messages").samples]
    res = PolicyRolloutEngine(model, proc.tokenizer, EngineOptions(eos_token_ids=[-1], max_num_seqs=2)).generate(
        prompts, SamplingParams(max_new_tokens=4, n=2, temperature=0.0))
    assert res.stats["prefill_calls"] == 3  # one prompt per refill
    masked = torch.tensor(vision_token_ids(model))  # never picked, and not in the reported log-probs
    for s in res.samples:
        p = prompts[s.prompt_index]
        ids, vision = p.input_ids.clone(), {k: getattr(p, k) for k in ("pixel_values", "image_grid_thw") if getattr(p, k) is not None}
        expect, logps = [], []
        with torch.no_grad():
            for _ in range(4):
                logits = model(ids[None], **vision)[0, -1].float().index_fill(0, masked, float("-inf"))
                expect.append(int(logits.argmax()))
                logps.append(float(torch.log_softmax(logits, -1)[expect[-1]]))
                ids = torch.cat([ids, torch.tensor([expect[-1]])])
        assert s.token_ids.tolist() == expect
        torch.testing.assert_close(s.logprobs, torch.tensor(logps), atol=1e-5, rtol=0)
