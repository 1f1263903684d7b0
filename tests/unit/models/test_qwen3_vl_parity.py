"""Logit parity of our Qwen3-VL with transformers' Qwen3VLForConditionalGeneration (fp32, tiny random
config, randomised norms and biases). The reference always receives `mm_token_type_ids` (it refuses
multimodal input without it); ours derives the 3-D positions from input_ids + grids, and must give
the same logits with or without it. Covers DeepStack (vision blocks 0 and 2 into decoder layers 0
and 1), the resampled position table (grids smaller and larger than the 4 x 4 table), per-frame
video runs with timestamps, padding on either side, packing, KV-cache decoding and gradients."""
import pytest
import torch

import megatron_vlm.testing.tiny_processor_qwen3_vl as F
from megatron_vlm.models import build_model
from megatron_vlm.models.common.kv_cache import KVCache
from megatron_vlm.models.qwen3_vl.state_dict_adapter import Qwen3VLStateDictAdapter
from tests.fixtures.parity import TOL, load_converted
from tests.fixtures.parity import assert_logits_close as _assert_close
from tests.fixtures.parity import ref_logits as _ref


@pytest.fixture(scope="module")
def models():
    hf = F.hf_reference_model(seed=0)
    ours = build_model(F.tiny_qwen3_vl_config_dict())
    return hf, load_converted(ours, Qwen3VLStateDictAdapter(ours.args), hf.state_dict())


def _ours(ours, batch, with_types=False, **kw):
    with torch.no_grad():
        return ours(
            batch["input_ids"], batch.get("attention_mask"), batch.get("pixel_values"), batch.get("image_grid_thw"),
            batch.get("pixel_values_videos"), batch.get("video_grid_thw"), None,
            batch["mm_token_type_ids"] if with_types else None, **kw,
        )


def test_text_only(models):
    hf, ours = models
    g = torch.Generator().manual_seed(1)
    batch = F.batch_samples([F.build_sample([12], g), F.build_sample([9], g)])
    _assert_close(_ref(hf, batch), _ours(ours, batch), batch["attention_mask"])


def test_one_image_with_and_without_token_types(models):
    hf, ours = models
    g = torch.Generator().manual_seed(2)
    batch = F.batch_samples([F.build_sample([5, ("image", (1, 8, 12)), 7], g)])
    ref = _ref(hf, batch)
    _assert_close(ref, _ours(ours, batch))
    _assert_close(ref, _ours(ours, batch, with_types=True))
    # the 3-D positions matter: 1-D positions (what transformers 5 falls back to for other
    # families without mm_token_type_ids) give clearly different logits
    ids = batch["input_ids"]
    flat = torch.arange(ids.shape[1]).expand(3, 1, -1)
    assert (_ours(ours, batch, position_ids=flat) - ref).abs().max() > 10 * TOL


def test_two_images_of_different_sizes(models):
    hf, ours = models
    g = torch.Generator().manual_seed(3)
    # 2 x 2 patches (smaller than the 4 x 4 position table) and 6 x 10 (larger, non-square)
    batch = F.batch_samples([F.build_sample([4, ("image", (1, 2, 2)), 3, ("image", (1, 6, 10)), 6], g)])
    _assert_close(_ref(hf, batch), _ours(ours, batch))


def test_videos_and_image(models):
    hf, ours = models
    g = torch.Generator().manual_seed(4)
    sample = F.build_sample([3, ("video", (3, 4, 6)), 5, ("image", (1, 4, 4)), 4, ("video", (2, 6, 4)), 2], g)
    batch = F.batch_samples([sample])
    _assert_close(_ref(hf, batch), _ours(ours, batch))
    _assert_close(_ref(hf, batch), _ours(ours, batch, with_types=True))


def test_padded_batch_both_sides(models):
    hf, ours = models
    g = torch.Generator().manual_seed(5)
    samples = [
        F.build_sample([3, ("image", (1, 4, 6)), 4], g),
        F.build_sample([20], g),
        F.build_sample([2, ("video", (2, 4, 4)), 2, ("image", (1, 4, 4)), 1], g),
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
    packed = F.pack_samples(samples)
    with torch.no_grad():
        out = ours(**packed)
    cu = packed["cu_seqlens"].tolist()
    for s, lo, hi in zip(samples, cu[:-1], cu[1:]):
        _assert_close(_ref(hf, F.batch_samples([s])), out[:, lo:hi])


def test_kv_cache_decoding_matches_full_forward(models):
    hf, ours = models
    g = torch.Generator().manual_seed(7)
    samples = [F.build_sample([3, ("image", (1, 4, 4)), 5], g), F.build_sample([2, ("video", (2, 4, 4)), 9], g)]
    full = F.batch_samples(samples, padding_side="left")
    ref = _ref(hf, full)  # full left-padded sequences; the last 3 tokens are "decoded" below
    n_new = 3
    prompt = {k: v for k, v in full.items()}
    prompt["input_ids"], prompt["attention_mask"] = full["input_ids"][:, :-n_new], full["attention_mask"][:, :-n_new]
    cache = ours.new_cache(2, full["input_ids"].shape[1])
    assert isinstance(cache, KVCache) and cache.num_layers == ours.args.text.num_hidden_layers
    with torch.no_grad():
        pre = ours(prompt["input_ids"], prompt["attention_mask"], full["pixel_values"], full["image_grid_thw"],
                   full["pixel_values_videos"], full["video_grid_thw"], kv_cache=cache)
        _assert_close(ref[:, :-n_new], pre, prompt["attention_mask"])
        for i in range(n_new):
            col = full["input_ids"].shape[1] - n_new + i
            step = ours(full["input_ids"][:, col : col + 1], kv_cache=cache)
            _assert_close(ref[:, col : col + 1], step)


def test_images_and_videos_appended_to_a_cache_match_full_forward(models):
    """A chunk with images / videos fed to a cache that holds tokens (a later turn: `forward(ids, pixels..., kv_cache=)`)
    gets the positions the whole sequence has (its index from 0 shifted to each sequence's next text position) and
    moves the rope deltas on, so the next step continues right. It used to get text positions (logits off by ~0.2)."""
    hf, ours = models
    g = torch.Generator().manual_seed(11)
    heads = [F.build_sample([4], g), F.build_sample([6], g)]
    tails = [F.build_sample([2, ("image", (1, 4, 4)), 3], g), F.build_sample([("video", (2, 4, 2)), 1, ("image", (1, 2, 2))], g)]
    last = torch.randint(2, 290, (2, 1), generator=g)
    chunk = F.batch_samples(tails, padding_side="left")
    cache = ours.new_cache(2, 64)
    with torch.no_grad():
        head = F.batch_samples(heads, padding_side="left")
        ours(head["input_ids"], head["attention_mask"], kv_cache=cache)
        mask = torch.cat([head["attention_mask"], chunk["attention_mask"]], 1)
        out = ours(chunk["input_ids"], mask, chunk["pixel_values"], chunk["image_grid_thw"], chunk["pixel_values_videos"],
                   chunk["video_grid_thw"], kv_cache=cache)
        step = ours(last, kv_cache=cache)
    for i, (h, t) in enumerate(zip(heads, tails)):
        whole = {k: v for k, v in t.items()}
        whole["input_ids"] = h["input_ids"] + t["input_ids"] + last[i].tolist()
        ref = _ref(hf, {k: v for k, v in F.batch_samples([whole]).items() if v is not None})[0]
        n = len(t["input_ids"])
        _assert_close(ref[len(h["input_ids"]):-1], out[i, -n:])
        _assert_close(ref[-1:], step[i])


def test_return_hidden_matches_reference_last_hidden_state(models):
    hf, ours = models
    g = torch.Generator().manual_seed(8)
    batch = F.batch_samples([F.build_sample([4, ("image", (1, 4, 4)), 5], g)])
    with torch.no_grad():
        ref = hf.model(**batch).last_hidden_state
        out = ours(batch["input_ids"], pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                   return_hidden=True)
    _assert_close(ref, out)
    assert ours.lm_head.weight.shape == (F.VOCAB, 64)
    assert len(ours.transformer_blocks()) == 3 + 3


def test_gradients_match_reference(models):
    hf, ours = models
    g = torch.Generator().manual_seed(9)
    batch = F.batch_samples([F.build_sample([3, ("image", (1, 4, 8)), 6], g)])
    w = torch.randn(batch["input_ids"].shape + (F.VOCAB,), generator=g)
    hf.zero_grad(set_to_none=True)
    ours.zero_grad(set_to_none=True)
    (hf(**batch).logits * w).sum().backward()
    (ours(batch["input_ids"], pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"]) * w).sum().backward()
    v, t = hf.model.visual, hf.model.language_model
    pairs = [
        (t.layers[0].self_attn.k_proj.weight.grad, ours.language_model.layers[0].self_attn.k_proj.weight.grad),
        (t.layers[1].self_attn.q_norm.weight.grad, ours.language_model.layers[1].self_attn.q_norm.weight.grad),
        (v.blocks[0].attn.qkv.weight.grad[32:64], ours.visual.blocks[0].attn.k_proj.weight.grad),
        (v.pos_embed.weight.grad, ours.visual.pos_embed.weight.grad),
        (v.deepstack_merger_list[1].linear_fc1.weight.grad, ours.visual.deepstack_merger_list[1].fc1.weight.grad),
        (v.patch_embed.proj.weight.grad.reshape(32, -1), ours.visual.patch_embed.proj.weight.grad),
        (t.embed_tokens.weight.grad, ours.language_model.embed_tokens.weight.grad),
    ]
    for ref, out in pairs:
        scale = ref.abs().max().item()
        assert scale > 0
        assert (ref - out).abs().max().item() <= 1e-4 * max(1.0, scale)
    hf.zero_grad(set_to_none=True)
    ours.zero_grad(set_to_none=True)


def test_bad_inputs_raise_clear_errors(models):
    _, ours = models
    g = torch.Generator().manual_seed(10)
    s = F.build_sample([3, ("image", (1, 4, 4)), 3], g)
    ids = torch.tensor([s["input_ids"][:5]])  # placeholders cut short
    with pytest.raises(ValueError, match="placeholder tokens"):
        ours(ids, pixel_values=s["pixel_values"], image_grid_thw=s["image_grid_thw"])
    with pytest.raises(ValueError, match="without its grid_thw"):
        ours(torch.tensor([s["input_ids"]]), pixel_values=s["pixel_values"])
