"""Logit parity of our InternVL with transformers' InternVLForConditionalGeneration (fp32, tiny random
configs with randomised norms, biases, layer scales, CLS token and position table), for both
supported variants: Qwen2 decoder + LayerNorm InternViT (InternVL3), and Qwen3 decoder + RMSNorm
InternViT with QK-norm and tied embeddings (InternVL3.5 / InternViT-6B style). Covers multi-tile
images, several images, video frames as tiles, padding on either side, packing, KV-cache decoding,
gradients, and OpenGVLab's original key layout loading to the same weights."""
import pytest
import torch

import megatron_vlm.testing.tiny_processor_internvl as F
from megatron_vlm.models import build_model
from megatron_vlm.models.common.kv_cache import KVCache
from megatron_vlm.models.internvl.model import pixel_shuffle
from megatron_vlm.models.internvl.state_dict_adapter import InternVLStateDictAdapter
from tests.fixtures.parity import assert_logits_close as _assert_close
from tests.fixtures.parity import ref_logits as _ref

VARIANTS = {
    "qwen2_layernorm": dict(),
    "qwen3_rmsnorm_qknorm_tied": dict(text_model="qwen3", norm_type="rms_norm", use_qk_norm=True, tie_word_embeddings=True),
}


def _load(ours, hf_state):
    converted, pending = InternVLStateDictAdapter(ours.args).from_hf(hf_state)
    assert not pending
    result = ours.load_state_dict(converted, strict=False)
    assert not result.unexpected_keys
    assert set(result.missing_keys) <= ({"lm_head.weight"} if ours.args.tie_word_embeddings else set())
    ours.tie_weights()
    return ours.eval()


@pytest.fixture(scope="module", params=list(VARIANTS))
def models(request):
    kw = VARIANTS[request.param]
    hf = F.hf_reference_model(seed=0, **kw)
    ours = _load(build_model(F.tiny_internvl_config_dict(**kw)), hf.state_dict())
    return hf, ours


def _ours(ours, batch, **kw):
    with torch.no_grad():
        return ours(batch["input_ids"], batch.get("attention_mask"), batch.get("pixel_values"), **kw)


def test_text_only(models):
    hf, ours = models
    g = torch.Generator().manual_seed(1)
    batch = F.batch_samples([F.build_sample([12], g), F.build_sample([9], g)], padding_side="right")
    _assert_close(_ref(hf, batch), _ours(ours, batch), batch["attention_mask"])


def test_one_image_of_several_tiles(models):
    hf, ours = models
    g = torch.Generator().manual_seed(2)
    batch = F.batch_samples([F.build_sample([5, ("image", 3), 7], g)])
    _assert_close(_ref(hf, batch), _ours(ours, batch))


def test_several_images_and_video_frames(models):
    hf, ours = models
    g = torch.Generator().manual_seed(3)
    batch = F.batch_samples([F.build_sample([4, ("image", 2), 3, ("video", 3), 2, ("image", 1), 5], g)])
    _assert_close(_ref(hf, batch), _ours(ours, batch))


def test_padded_batch_both_sides(models):
    hf, ours = models
    g = torch.Generator().manual_seed(4)
    samples = [F.build_sample([3, ("image", 2), 4], g), F.build_sample([20], g), F.build_sample([2, ("video", 2), 1], g)]
    for side in ("left", "right"):
        batch = F.batch_samples(samples, padding_side=side)
        _assert_close(_ref(hf, batch), _ours(ours, batch), batch["attention_mask"])


def test_packed_batch_equals_each_sample_alone(models):
    hf, ours = models
    g = torch.Generator().manual_seed(5)
    samples = [F.build_sample([3, ("image", 2), 4], g), F.build_sample([7], g), F.build_sample([2, ("video", 2), 3], g)]
    packed = F.pack_samples(samples)
    with torch.no_grad():
        out = ours(**packed)
    cu = packed["cu_seqlens"].tolist()
    for s, lo, hi in zip(samples, cu[:-1], cu[1:]):
        _assert_close(_ref(hf, F.batch_samples([s])), out[:, lo:hi])


def test_kv_cache_decoding_matches_full_forward(models):
    hf, ours = models
    g = torch.Generator().manual_seed(6)
    full = F.batch_samples([F.build_sample([3, ("image", 1), 5], g), F.build_sample([2, ("image", 2), 9], g)])
    ref = _ref(hf, full)
    n_new = 3
    cache = ours.new_cache(2, full["input_ids"].shape[1])
    assert isinstance(cache, KVCache) and cache.num_layers == ours.args.text.num_hidden_layers
    with torch.no_grad():
        pre = ours(full["input_ids"][:, :-n_new], full["attention_mask"][:, :-n_new], full["pixel_values"], kv_cache=cache)
        _assert_close(ref[:, :-n_new], pre, full["attention_mask"][:, :-n_new])
        for i in range(n_new):
            col = full["input_ids"].shape[1] - n_new + i
            _assert_close(ref[:, col : col + 1], ours(full["input_ids"][:, col : col + 1], kv_cache=cache))


def test_gradients_match_reference(models):
    hf, ours = models
    g = torch.Generator().manual_seed(7)
    batch = F.batch_samples([F.build_sample([3, ("image", 2), 6], g)])
    w = torch.randn(batch["input_ids"].shape + (F.VOCAB,), generator=g)
    hf.zero_grad(set_to_none=True)
    ours.zero_grad(set_to_none=True)
    (hf(**batch).logits * w).sum().backward()
    (ours(batch["input_ids"], pixel_values=batch["pixel_values"]) * w).sum().backward()
    v, t, p = hf.model.vision_tower, hf.model.language_model, hf.model.multi_modal_projector
    pairs = [
        (t.layers[0].self_attn.k_proj.weight.grad, ours.language_model.layers[0].self_attn.k_proj.weight.grad),
        (v.encoder.layer[0].attention.q_proj.weight.grad, ours.vision_tower.layers[0].attn.q_proj.weight.grad),
        (v.encoder.layer[1].lambda_1.grad, ours.vision_tower.layers[1].ls1.grad),
        (v.embeddings.position_embeddings.grad, ours.vision_tower.embeddings.position_embedding.grad),
        (v.embeddings.patch_embeddings.projection.weight.grad, ours.vision_tower.embeddings.patch_embedding.weight.grad),
        (p.linear_1.weight.grad, ours.multi_modal_projector.linear_1.weight.grad),
        (t.embed_tokens.weight.grad, ours.language_model.embed_tokens.weight.grad),
    ]
    for ref, out in pairs:
        scale = ref.abs().max().item()
        assert scale > 0
        assert (ref - out).abs().max().item() <= 1e-4 * max(1.0, scale)
    hf.zero_grad(set_to_none=True)
    ours.zero_grad(set_to_none=True)


def test_opengvlab_layout_gives_the_same_model(models, tmp_path):
    from safetensors.torch import load_file

    hf, ours = models
    kw = VARIANTS["qwen3_rmsnorm_qknorm_tied"] if ours.args.text.model_type == "qwen3" else {}
    hf.save_pretrained(tmp_path)  # transformers' checkpoint layout, renamed below to OpenGVLab's
    original = F.to_opengvlab_layout(load_file(str(tmp_path / "model.safetensors")))
    assert any(k.endswith("attn.qkv.weight") for k in original) and "mlp1.1.weight" in original
    assert not any(k.startswith(("vision_tower.", "multi_modal_projector.")) for k in original)
    from_original = _load(build_model(F.tiny_internvl_config_dict(**kw)), original)
    g = torch.Generator().manual_seed(8)
    batch = F.batch_samples([F.build_sample([3, ("image", 2), 4], g), F.build_sample([6], g)])
    _assert_close(_ref(hf, batch), _ours(from_original, batch), batch["attention_mask"])


def test_pixel_shuffle_layout_against_a_loop():
    x = torch.randn(2, 4, 4, 3)
    out = pixel_shuffle(x, 2)
    assert out.shape == (2, 2, 2, 12)
    for i in range(2):
        for j in range(2):
            expect = torch.cat([x[:, 2 * i + a, 2 * j + b] for a in range(2) for b in range(2)], dim=-1)
            assert torch.equal(out[:, i, j], expect)


def test_bad_inputs_raise_clear_errors(models):
    _, ours = models
    g = torch.Generator().manual_seed(9)
    s = F.build_sample([3, ("image", 2), 3], g)
    with pytest.raises(ValueError, match="placeholder tokens"):
        ours(torch.tensor([s["input_ids"]]), pixel_values=s["pixel_values"][:1])
    with pytest.raises(ValueError, match="pixel_values must be"):
        ours(torch.tensor([s["input_ids"]]), pixel_values=s["pixel_values"][:, :2])
