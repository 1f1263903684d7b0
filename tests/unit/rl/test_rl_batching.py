"""GRPO training micro-batches: packing rollout samples (prompt + response, images in order,
shifted labels on response tokens only) gives the same response log-probs as scoring every sample
alone with a plain full forward; token-budget plans; splitting per-token vectors back to samples;
prompt encoding through the data pipeline with skips counted."""
import pytest
import torch

from megatron_vlm.inference.engine import RolloutPrompt
from megatron_vlm.models import build_model
from megatron_vlm.rl.batching import TrainSample, pack_samples, plan_micro_batches, split_by_response
from megatron_vlm.training.lm_loss import TokenLogprobModel
from tests.fixtures import tiny_qwen2_5_vl as F


def _samples():
    g = torch.Generator().manual_seed(0)
    prompts = []
    for parts in ([2, ("image", (1, 4, 6)), 3], [4], [1, ("image", (1, 4, 4)), 2]):
        s = F.build_sample(parts, g)
        prompts.append(RolloutPrompt(torch.tensor(s["input_ids"]), s["pixel_values"], s["image_grid_thw"]))
    out = []
    for i, p in enumerate(prompts + [prompts[0]]):
        resp = torch.tensor(F.text_tokens(3 + i, g))
        out.append(TrainSample(prompt=p, response_ids=resp, behav_logp=torch.zeros(len(resp)), advantage=float(i)))
    return out


def test_packed_logprobs_equal_per_sample_full_forward():
    torch.manual_seed(0)
    model = F.randomize_constants_(build_model(F.tiny_qwen2_5_vl_config_dict())).eval()
    samples = _samples()
    batch = pack_samples(samples)
    # every sample's final response token is left out (it predicts nothing the loss reads)
    assert batch["input_ids"].shape == (1, sum(s.num_tokens - 1 for s in samples))
    assert batch["cu_seqlens"].tolist() == [0, *torch.cumsum(torch.tensor([s.num_tokens - 1 for s in samples]), 0).tolist()]
    assert batch["num_response_tokens"] == sum(s.response_length for s in samples)
    assert int((batch["labels"] != -100).sum()) == batch["num_response_tokens"]
    assert batch["image_grid_thw"].tolist() == [[1, 4, 6], [1, 4, 4], [1, 4, 6]]  # text-only prompt has none
    with torch.no_grad():
        packed = TokenLogprobModel(model)({k: v for k, v in batch.items() if k != "num_response_tokens"}, temperature=0.9)
    pieces = split_by_response(packed, samples)
    for s, piece in zip(samples, pieces):
        ids = torch.cat([s.prompt.input_ids, s.response_ids])[None]
        with torch.no_grad():
            logits = model(ids, pixel_values=s.prompt.pixel_values, image_grid_thw=s.prompt.image_grid_thw)[0]
        n = len(s.prompt)
        expect = torch.log_softmax(logits[n - 1:-1] / 0.9, -1).gather(-1, s.response_ids[:, None]).squeeze(-1)
        torch.testing.assert_close(piece, expect, atol=1e-4, rtol=0)


def test_plan_micro_batches():
    assert plan_micro_batches([3, 4, 2, 5, 1], 7) == [[0, 1], [2, 3], [4]]
    assert plan_micro_batches([7, 7], 7) == [[0], [1]]
    assert plan_micro_batches([], 7) == []
    with pytest.raises(ValueError, match="sample 1: 9 tokens exceed the micro-batch budget of 8"):
        plan_micro_batches([2, 9], 8)


def test_split_by_response_checks_lengths():
    samples = _samples()
    total = sum(s.response_length for s in samples)
    parts = split_by_response(torch.arange(total, dtype=torch.float32), samples)
    assert [len(p) for p in parts] == [s.response_length for s in samples]
    with pytest.raises(ValueError, match="entries for"):
        split_by_response(torch.zeros(total + 1), samples)
    with pytest.raises(ValueError, match="no samples"):
        pack_samples([])


def test_prompt_encoder_uses_the_data_pipeline_and_counts_skips(tmp_path):
    from megatron_vlm.data.processing import process_record
    from megatron_vlm.data.synthetic_vqa import write_synthetic_vqa
    from megatron_vlm.rl.prompts.dataset import load_prompt_dataset
    from megatron_vlm.rl.prompts.encoder import PromptEncoder
    from megatron_vlm.testing.tiny_processor import build_tiny_qwen2_5_vl_processor

    proc = build_tiny_qwen2_5_vl_processor(tmp_path / "proc")
    paths = write_synthetic_vqa(tmp_path / "vqa", n_train=2, n_eval=2, seed=0)
    ds = load_prompt_dataset(paths["eval"], schema="messages")
    enc = PromptEncoder(proc, max_frames=4, fps=2.0, max_new_tokens=8, max_tokens=64)
    p = enc.encode(ds[0])
    ref = process_record(ds[0].to_record(), proc, max_frames=4, for_generation=True)
    assert torch.equal(p.input_ids, ref.input_ids) and torch.equal(p.pixel_values, ref.pixel_values)
    assert proc.tokenizer.decode(p.input_ids).endswith("<|im_start|>assistant\n")
    tight = PromptEncoder(proc, max_frames=4, fps=2.0, max_new_tokens=8, max_tokens=len(p) + 7)
    assert tight.encode(ds[0]) is None and tight.skipped == 1
    with pytest.raises(ValueError, match="leaves no room"):
        PromptEncoder(proc, max_frames=4, fps=2.0, max_new_tokens=64, max_tokens=64)
