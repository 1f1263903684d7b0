"""Logit parity of our Qwen3-VL-MoE with transformers' Qwen3VLMoeForConditionalGeneration (fp32, tiny
random config: 4 experts, top-2, layer 1 dense via mlp_only_layers; randomised norms and biases).
The MoE layers are the shared `models/common/moe.py` block (softmax router, renormalised top-k)."""
import pytest
import torch

import megatron_vlm.testing.tiny_processor_qwen3_vl as F
from megatron_vlm.models import build_model
from megatron_vlm.models.common.mlp import SwiGLUMLP
from megatron_vlm.models.common.moe import MoE
from megatron_vlm.models.qwen3_vl.state_dict_adapter import Qwen3VLStateDictAdapter
from tests.fixtures.parity import assert_logits_close as _assert_close
from tests.fixtures.parity import load_converted


@pytest.fixture(scope="module")
def models():
    hf = F.hf_reference_model(seed=1, moe=True)
    ours = build_model(F.tiny_qwen3_vl_config_dict(moe=True))
    return hf, load_converted(ours, Qwen3VLStateDictAdapter(ours.args), hf.state_dict())


def test_layer_kinds_follow_the_config(models):
    _, ours = models
    kinds = [type(layer.mlp) for layer in ours.language_model.layers]
    assert kinds == [MoE, SwiGLUMLP, MoE]
    assert ours.args.model_type == "qwen3_vl_moe" and ours.args.is_moe


def test_padded_batch_with_images_and_video(models):
    hf, ours = models
    g = torch.Generator().manual_seed(11)
    samples = [
        F.build_sample([3, ("image", (1, 4, 6)), 4], g),
        F.build_sample([11], g),
        F.build_sample([2, ("video", (2, 4, 4)), 2, ("image", (1, 2, 4)), 1], g),
    ]
    for side in ("left", "right"):
        batch = F.batch_samples(samples, padding_side=side)
        with torch.no_grad():
            ref = hf(**batch).logits
            out = ours(batch["input_ids"], batch["attention_mask"], batch["pixel_values"], batch["image_grid_thw"],
                       batch["pixel_values_videos"], batch["video_grid_thw"])
            out_typed = ours(**{k: v for k, v in batch.items()})
        _assert_close(ref, out, batch["attention_mask"])
        _assert_close(ref, out_typed, batch["attention_mask"])


def test_packed_batch_equals_each_sample_alone(models):
    hf, ours = models
    g = torch.Generator().manual_seed(12)
    samples = [F.build_sample([2, ("image", (1, 4, 4)), 3], g), F.build_sample([3, ("video", (3, 2, 4)), 2], g)]
    packed = F.pack_samples(samples)
    with torch.no_grad():
        out = ours(**packed)
        cu = packed["cu_seqlens"].tolist()
        for s, lo, hi in zip(samples, cu[:-1], cu[1:]):
            _assert_close(hf(**F.batch_samples([s])).logits, out[:, lo:hi])


def test_gradients_of_router_and_experts_match(models):
    hf, ours = models
    g = torch.Generator().manual_seed(13)
    batch = F.batch_samples([F.build_sample([3, ("image", (1, 4, 4)), 6], g)])
    w = torch.randn(batch["input_ids"].shape + (F.VOCAB,), generator=g)
    hf.zero_grad(set_to_none=True)
    ours.zero_grad(set_to_none=True)
    (hf(**batch).logits * w).sum().backward()
    (ours(batch["input_ids"], pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"]) * w).sum().backward()
    ref_layer, our_layer = hf.model.language_model.layers[2].mlp, ours.language_model.layers[2].mlp
    pairs = [
        (ref_layer.gate.weight.grad, our_layer.gate.weight.grad),
        (ref_layer.experts.gate_up_proj.grad, our_layer.experts.gate_up_proj.grad),
        (ref_layer.experts.down_proj.grad, our_layer.experts.down_proj.grad),
    ]
    for ref, out in pairs:
        scale = ref.abs().max().item()
        assert scale > 0
        assert (ref - out).abs().max().item() <= 1e-4 * max(1.0, scale)
    hf.zero_grad(set_to_none=True)
    ours.zero_grad(set_to_none=True)
