"""Nemotron-3-Nano-VL (nemotron_h_omni without audio) vs transformers' NemotronH_Omni_Reasoning_V3:
RADIO encoder, pixel shuffle, projector and placeholders on a tiny random config (fp32)."""
import pytest
import torch
from transformers.models.nemotron_h_omni import NemotronH_Omni_Reasoning_V3, NemotronH_Omni_Reasoning_V3_Config

from megatron_vlm.checkpoint.hf import load_hf_model, save_hf_model

TOL = dict(rtol=1e-4, atol=1e-4)
IMG = 90  # image placeholder token id
TEXT = dict(
    vocab_size=96, hidden_size=32, layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=40,
    mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=2, chunk_size=4,
    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=12, moe_shared_expert_intermediate_size=16,
)
VISION = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, patch_size=4, max_img_size=32,
              num_cls_tokens=2, num_registers=1, video_temporal_patch_size=2, layer_norm_eps=1e-6)


def randomise_(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=g).log())
            elif "norm" in name and name.endswith("weight") or name.endswith("lambda1"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))  # norms and layer scales too
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.2)


def make_hf(mtp: bool):
    text = dict(TEXT, num_nextn_predict_layers=1 if mtp else 0)
    cfg = NemotronH_Omni_Reasoning_V3_Config(text_config=text, vision_config=VISION, vision_hidden_size=16,
                                             projector_hidden_size=24, image_token_id=IMG)
    torch.manual_seed(0)
    hf = NemotronH_Omni_Reasoning_V3(cfg).eval()
    randomise_(hf, seed=1 + mtp)
    return hf


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "mtp_vision_norm"])
def pair(request, tmp_path_factory):
    hf = make_hf(request.param)
    path = tmp_path_factory.mktemp("omni")
    hf.save_pretrained(path)
    return hf, load_hf_model(path).eval(), path


def images(seed, grids):
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(sum(h * w for h, w in grids), 3 * 4 * 4, generator=g)
    return pixels, torch.tensor(grids)


def prompt(seed, runs):
    """Text with runs of IMG placeholders: runs = [n_tokens_image_0, ...]."""
    g = torch.Generator().manual_seed(seed)
    parts = []
    for n in runs:
        parts += [torch.randint(1, 80, (3,), generator=g), torch.full((n,), IMG)]
    parts.append(torch.randint(1, 80, (4,), generator=g))
    return torch.cat(parts)[None]


def test_two_images_of_different_sizes_match_transformers(pair):
    hf, ours, _ = pair
    pixels, grid = images(2, [(4, 6), (6, 10)])  # 6 and 15 tokens after the 2x2 pixel shuffle
    ids = prompt(3, [6, 15])
    with torch.no_grad():
        ref = hf(input_ids=ids, pixel_values=pixels, image_grid_hw=grid).logits
        out = ours(ids, pixel_values=pixels, image_grid_hw=grid)
        # the Qwen-style [n, 3] grid with t = 1 is accepted too
        out_thw = ours(ids, pixel_values=pixels, image_grid_thw=torch.cat([torch.ones(2, 1, dtype=torch.long), grid], 1))
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(out_thw, out)


def test_single_image_and_text_only(pair):
    hf, ours, _ = pair
    pixels, grid = images(4, [(8, 8)])
    ids = prompt(5, [16])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, pixel_values=pixels, image_grid_hw=grid),
                                   hf(input_ids=ids, pixel_values=pixels, image_grid_hw=grid).logits, **TOL)
        text = torch.randint(1, 80, (2, 7))
        torch.testing.assert_close(ours(text), hf(input_ids=text).logits, **TOL)


def test_video_matches_transformers(pair):
    hf, ours, _ = pair
    frames = torch.randn(3, 3, 16, 24, generator=torch.Generator().manual_seed(6))  # 3 frames -> 2 groups of 2
    ids = prompt(7, [12])  # 2 groups x (4 x 6 patches / 4)
    with torch.no_grad():
        # transformers 5.23's forward cannot take pixel_values_videos (torch.cat over a tensor), so the
        # reference is its own video encoder + placeholder scatter + language model
        feats = hf.get_video_features(frames).pooler_output
        if isinstance(feats, tuple):  # transformers >= 5.24: one [tubelets x tokens, hidden] tensor per video
            (feats,) = feats
        feats = feats.reshape(-1, feats.shape[-1])
        assert feats.shape[0] == 2 * 6
        embeds = hf.get_input_embeddings()(ids)
        embeds[ids == IMG] = feats
        ref = hf(inputs_embeds=embeds).logits
        out = ours(ids, pixel_values_videos=frames)
    torch.testing.assert_close(out, ref, **TOL)


def test_packed_samples_with_images_equal_separate(pair):
    _, ours, _ = pair
    pix_a, grid_a = images(8, [(4, 4)])
    pix_b, grid_b = images(9, [(4, 6), (2, 2)])
    ids_a, ids_b = prompt(10, [4]), prompt(11, [6, 1])
    cu = torch.tensor([0, ids_a.shape[1], ids_a.shape[1] + ids_b.shape[1]], dtype=torch.int32)
    with torch.no_grad():
        packed = ours(torch.cat([ids_a, ids_b], 1), pixel_values=torch.cat([pix_a, pix_b]),
                      image_grid_hw=torch.cat([grid_a, grid_b]), cu_seqlens=cu)
        torch.testing.assert_close(packed[:, : cu[1]], ours(ids_a, pixel_values=pix_a, image_grid_hw=grid_a), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed[:, cu[1] :], ours(ids_b, pixel_values=pix_b, image_grid_hw=grid_b), rtol=1e-5, atol=1e-5)


def test_placeholder_mismatch_names_both_counts(pair):
    _, ours, _ = pair
    pixels, grid = images(12, [(4, 6)])
    with pytest.raises(ValueError, match=r"5 placeholder tokens .* 6 image features"):
        ours(prompt(13, [5]), pixel_values=pixels, image_grid_hw=grid)
    with pytest.raises(ValueError, match="image_grid_hw"):
        ours(prompt(13, [6]), pixel_values=pixels)


def test_export_round_trip_through_transformers(pair, tmp_path):
    hf, ours, _ = pair
    out = save_hf_model(ours, tmp_path / "export")
    from transformers import AutoModelForImageTextToText

    try:
        reloaded = AutoModelForImageTextToText.from_pretrained(out).eval()
    except ValueError:  # not registered with the auto class in this transformers version
        reloaded = NemotronH_Omni_Reasoning_V3.from_pretrained(out).eval()
    pixels, grid = images(14, [(4, 6)])
    ids = prompt(15, [6])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids, pixel_values=pixels, image_grid_hw=grid).logits,
                                   ours(ids, pixel_values=pixels, image_grid_hw=grid), **TOL)
    # every tensor transformers holds came from our export (nothing silently re-initialised)
    ref_state = hf.state_dict()
    for k, v in reloaded.state_dict().items():
        torch.testing.assert_close(v, ref_state[k], msg=lambda m: f"{k}: {m}")


def test_training_step_backward_reaches_vision_and_projector(pair):
    _, ours, path = pair
    model = load_hf_model(path).train()
    pixels, grid = images(16, [(4, 6)])
    ids = prompt(17, [6])
    logits = model(ids, pixel_values=pixels, image_grid_hw=grid)
    torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).backward()
    assert model.multi_modal_projector.linear_1.weight.grad.abs().sum() > 0
    assert model.vision_model.embeddings.patch_projection.weight.grad.abs().sum() > 0
    assert model.vision_model.encoder.layer[0].layer_scale1.lambda1.grad is not None


def test_bf16_export_says_bfloat16_and_loads_in_bf16(pair, tmp_path):
    """A bf16 export keeps the router weight and score-correction bias fp32 (as transformers does); its config.json
    must still say bfloat16, or transformers' dtype="auto" (and vLLM) load the whole model in fp32."""
    import json

    from safetensors import safe_open

    _, ours, _ = pair
    out = save_hf_model(ours, tmp_path / "export", dtype=torch.bfloat16)
    with safe_open(str(out / "model.safetensors"), "pt") as r:
        dtypes = {k: r.get_slice(k).get_dtype() for k in r.keys()}  # noqa: SIM118 -- safe_open handles are not iterable
    assert "F32" in dtypes.values() and "BF16" in dtypes.values()  # the mix this test is about
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    assert config["text_config"].get("dtype", "bfloat16") == "bfloat16"  # no sub-config names another dtype
    reloaded = NemotronH_Omni_Reasoning_V3.from_pretrained(out, dtype="auto")
    assert reloaded.get_input_embeddings().weight.dtype == torch.bfloat16
