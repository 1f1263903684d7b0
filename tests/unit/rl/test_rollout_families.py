"""The rollout engine drives every model family (attention-only KV cache: Qwen2.5-VL, Qwen3-VL,
InternVL; hybrid Mamba cache: Nemotron-VL) on its own tiny folder and processor: sampled completions
with a shared prefix, dropped finished rows, and behaviour log-probs equal to the packed training
forward's log-probs of the same tokens (the PPO ratio starts at 1)."""
import pytest
import torch

from megatron_vlm.checkpoint.hf import load_hf_model
from megatron_vlm.data.processor import load_processor
from megatron_vlm.data.synthetic_vqa import write_synthetic_vqa
from megatron_vlm.rl.batching import TrainSample, pack_samples
from megatron_vlm.rl.data import load_prompt_dataset
from megatron_vlm.rl.prompts import PromptEncoder
from megatron_vlm.rl.rollout.engine import SamplingParams
from megatron_vlm.rl.rollout.policy_engine import PolicyRolloutEngine
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
    with torch.no_grad():
        recomputed = TokenLogprobModel(model)(batch)
    torch.testing.assert_close(recomputed, torch.cat([s.behav_logp for s in samples]), atol=1e-4, rtol=0)
