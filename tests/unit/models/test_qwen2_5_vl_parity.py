"""Logit parity of our Qwen2.5-VL with transformers' Qwen2_5_VLForConditionalGeneration (fp32, tiny
random config, randomised norms and biases). The reference always receives `mm_token_type_ids` so it
computes real 3-D M-RoPE positions; ours derives them from input_ids + grids."""
import pytest
import torch

from megatron_vlm.models import build_model
from megatron_vlm.models.qwen2_5_vl.state_dict_adapter import Qwen2_5_VLStateDictAdapter
from tests.fixtures import tiny_qwen2_5_vl as F
from tests.fixtures.parity import TOL, load_converted
from tests.fixtures.parity import assert_logits_close as _assert_close
from tests.fixtures.parity import ref_logits as _ref


@pytest.fixture(scope="module")
def models():
    hf = F.hf_reference_model(seed=0)
    ours = build_model(F.tiny_qwen2_5_vl_config_dict())
    return hf, load_converted(ours, Qwen2_5_VLStateDictAdapter(ours.args), hf.state_dict())


def _ours(ours, batch, with_types=False):
    with torch.no_grad():
        return ours(
            batch["input_ids"], batch.get("attention_mask"), batch.get("pixel_values"), batch.get("image_grid_thw"),
            batch.get("pixel_values_videos"), batch.get("video_grid_thw"), batch.get("second_per_grid_ts"),
            batch["mm_token_type_ids"] if with_types else None,
        )


def test_text_only(models):
    hf, ours = models
    g = torch.Generator().manual_seed(1)
    batch = F.batch_samples([F.build_sample([12], g), F.build_sample([9], g)])
    _assert_close(_ref(hf, batch), _ours(ours, batch), batch["attention_mask"])


def test_one_image(models):
    hf, ours = models
    g = torch.Generator().manual_seed(2)
    batch = F.batch_samples([F.build_sample([5, ("image", (1, 8, 12)), 7], g)])
    ref = _ref(hf, batch)
    _assert_close(ref, _ours(ours, batch))
    _assert_close(ref, _ours(ours, batch, with_types=True))
    # the trap: without mm_token_type_ids transformers silently falls back to 1-D positions - that must differ
    no_types = {k: v for k, v in batch.items() if k != "mm_token_type_ids"}
    assert (_ref(hf, no_types) - ref).abs().max() > 10 * TOL


def test_two_images_of_different_sizes(models):
    hf, ours = models
    g = torch.Generator().manual_seed(3)
    # 3x5 and 4x2 merged tokens: windows of 2x2 merged tokens are cut at the edges
    batch = F.batch_samples([F.build_sample([4, ("image", (1, 6, 10)), 3, ("image", (1, 8, 4)), 6], g)])
    _assert_close(_ref(hf, batch), _ours(ours, batch))


def test_video_with_second_per_grid_ts(models):
    """Videos: the reference given the original Qwen2.5-VL positions (`F.original_position_ids`: text after a video
    resumes at the video's largest position + 1, as the released checkpoints were trained and vLLM computes) equals
    ours. Left to compute its own, transformers 5.24 resumes it at start + max(h, w) / merge (a 5.3+ regression,
    huggingface/transformers#45381; where its positions part from ours: test_qwen2_5_vl_positions.py)."""
    hf, ours = models
    g = torch.Generator().manual_seed(4)
    sample = F.build_sample([3, ("video", (3, 4, 6)), 5, ("image", (1, 4, 4)), 4, ("video", (2, 6, 4)), 2], g)
    batch = F.batch_samples([sample])
    batch["second_per_grid_ts"] = torch.tensor([1.5, 0.5])
    _assert_close(_ref(hf, dict(batch, position_ids=F.original_position_ids(batch))), _ours(ours, batch))


def test_left_padded_batch(models):
    hf, ours = models
    g = torch.Generator().manual_seed(5)
    samples = [
        F.build_sample([3, ("image", (1, 4, 6)), 4], g),
        F.build_sample([20], g),
        F.build_sample([2, ("image", (1, 6, 4)), 2, ("image", (1, 4, 4)), 1], g),
    ]
    for side in ("left", "right"):
        batch = F.batch_samples(samples, padding_side=side)
        _assert_close(_ref(hf, batch), _ours(ours, batch), batch["attention_mask"])


def test_packed_batch_equals_each_sample_alone(models):
    hf, ours = models
    g = torch.Generator().manual_seed(6)
    samples = [
        F.build_sample([3, ("image", (1, 4, 6)), 4], g),
        F.build_sample([7], g),
        F.build_sample([2, ("video", (2, 4, 4)), 3, ("image", (1, 6, 4)), 2], g),
    ]
    packed_ids = torch.tensor([sum((s["input_ids"] for s in samples), [])])
    lengths = [len(s["input_ids"]) for s in samples]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    cat = lambda key: F._cat([s[key] for s in samples])  # noqa: E731
    with torch.no_grad():
        packed = ours(
            packed_ids, pixel_values=cat("pixel_values"), image_grid_thw=cat("image_grid_thw"),
            pixel_values_videos=cat("pixel_values_videos"), video_grid_thw=cat("video_grid_thw"), cu_seqlens=cu,
        )
    for s, lo, hi in zip(samples, cu[:-1].tolist(), cu[1:].tolist()):
        one = F.batch_samples([s])  # positions by the original rule (the video: test_video_with_second_per_grid_ts)
        alone = _ref(hf, dict(one, position_ids=F.original_position_ids(one)))
        _assert_close(alone, packed[:, lo:hi])


def test_return_hidden_matches_reference_last_hidden_state(models):
    hf, ours = models
    g = torch.Generator().manual_seed(7)
    batch = F.batch_samples([F.build_sample([4, ("image", (1, 4, 4)), 5], g)])
    with torch.no_grad():
        ref = hf.model(**batch).last_hidden_state
        out = ours(batch["input_ids"], pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                   return_hidden=True)
    _assert_close(ref, out)
    assert ours.lm_head.weight.shape == (F.VOCAB, 64)


def test_gradients_match_reference(models):
    hf, ours = models
    g = torch.Generator().manual_seed(8)
    batch = F.batch_samples([F.build_sample([3, ("image", (1, 4, 8)), 6], g)])
    w = torch.randn(batch["input_ids"].shape + (F.VOCAB,), generator=g)
    hf.zero_grad(set_to_none=True)
    ours.zero_grad(set_to_none=True)
    (hf(**batch).logits * w).sum().backward()
    (ours(batch["input_ids"], pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"]) * w).sum().backward()
    pairs = [
        (hf.model.language_model.layers[0].self_attn.k_proj.weight.grad,
         ours.language_model.layers[0].self_attn.k_proj.weight.grad),
        (hf.model.visual.blocks[0].attn.qkv.weight.grad[32:64], ours.visual.blocks[0].attn.k_proj.weight.grad),
        (hf.model.visual.patch_embed.proj.weight.grad.reshape(32, -1), ours.visual.patch_embed.proj.weight.grad),
        (hf.model.language_model.embed_tokens.weight.grad, ours.language_model.embed_tokens.weight.grad),
    ]
    for ref, out in pairs:
        scale = ref.abs().max().item()
        assert scale > 0
        assert (ref - out).abs().max().item() <= 1e-4 * max(1.0, scale)
    hf.zero_grad(set_to_none=True)
    ours.zero_grad(set_to_none=True)
