"""Nemotron-VL with the Qwen3-VL vision tower (nemotron_h_omni + vision_config.model_type qwen3_vl).

The reference is composed only of transformers classes, on tiny random configs in fp32: transformers'
`Qwen3VLVisionModel` (merger + DeepStack mergers) and `NemotronHForCausalLM` (Mamba2, MoE, attention
and MLP blocks). The reference embeds the tokens, scatters the vision output into the placeholder
positions, adds the DeepStack features after decoder blocks 0 .. len(deepstack) - 1 (forward hooks on
the reference blocks, as Qwen3-VL's text model does) and runs the rest with `inputs_embeds`. Both
models hold the same weights: the checkpoint folder is written from the transformers modules'
own state dicts in the layout the family reads (`vision_model.*`, `language_model.backbone.*`).
"""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import NemotronHConfig, NemotronHForCausalLM
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel as HFQwen3VLVisionModel

from megatron_vlm.checkpoint.hf import load_hf_model, save_hf_model
from megatron_vlm.models.nemotron_vl.args import NemotronVLArgs
from megatron_vlm.training.freeze import apply_train_layers

TOL = dict(rtol=1e-4, atol=1e-4)
IMG, VID = 90, 91  # placeholder token ids
PATCH = 4
PATCH_DIM = 3 * 2 * PATCH * PATCH
TEXT = dict(
    vocab_size=96, hidden_size=32,
    layers_block_type=["linear_attention", "moe", "full_attention", "mlp", "linear_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=40,
    mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=2, conv_kernel=4, chunk_size=4,
    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=12, moe_shared_expert_intermediate_size=16,
    n_group=1, topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=True, layer_norm_epsilon=1e-5,
    pad_token_id=0, tie_word_embeddings=False,
)
VISION = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=32, patch_size=PATCH,
              spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16, deepstack_visual_indexes=[0, 2])


def randomise_(model, seed):
    """Every parameter random (norm weights around 1, Mamba A_log / dt_bias in range), MoE correction bias too."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.2)


def hf_config() -> dict:
    return {
        "architectures": ["NemotronVLForConditionalGeneration"], "model_type": "nemotron_h_omni",
        "text_config": dict(TEXT, model_type="nemotron_h"), "vision_config": dict(VISION, model_type="qwen3_vl"),
        "image_token_id": IMG, "video_token_id": VID,
    }


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers vision tower, transformers NemotronH LM, our model loaded from the folder, folder)."""
    torch.manual_seed(0)
    vis = HFQwen3VLVisionModel._from_config(Qwen3VLVisionConfig(**VISION), attn_implementation="eager").eval()
    lm = NemotronHForCausalLM(NemotronHConfig(**TEXT)).eval()
    randomise_(vis, 1)
    randomise_(lm, 2)
    path = tmp_path_factory.mktemp("nemotron_qwen3_vision")
    lm.save_pretrained(path / "lm")  # the released per-expert layout: backbone.*, lm_head.weight
    tensors = {"language_model." + k: v for k, v in load_file(str(path / "lm" / "model.safetensors")).items()}
    tensors.update({"vision_model." + k: v.contiguous() for k, v in vis.state_dict().items()})
    folder = path / "model"
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(hf_config()))
    return vis, lm, load_hf_model(folder).eval(), folder


def vision_inputs(seed, grids):
    g = torch.Generator().manual_seed(seed)
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, PATCH_DIM, generator=g), torch.tensor(grids)


def prompt(seed, runs, token=IMG):
    """Text with runs of placeholders: runs = [n_tokens_item_0, ...] (token per run: int or list)."""
    g = torch.Generator().manual_seed(seed)
    tokens = token if isinstance(token, list) else [token] * len(runs)
    parts = []
    for n, tok in zip(runs, tokens):
        parts += [torch.randint(1, 80, (3,), generator=g), torch.full((n,), tok)]
    parts.append(torch.randint(1, 80, (4,), generator=g))
    return torch.cat(parts)[None]


@torch.no_grad()
def reference(vis, lm, ids, images=None, videos=None):
    """transformers-only composition: embed, scatter vision features, DeepStack hooks, inputs_embeds."""
    embeds = lm.get_input_embeddings()(ids)
    visual = torch.zeros_like(ids, dtype=torch.bool)
    levels = None
    for inputs, token in ((images, IMG), (videos, VID)):
        if inputs is None:
            continue
        out = vis(inputs[0], grid_thw=inputs[1])
        mask = ids == token
        embeds = embeds.masked_scatter(mask[..., None], out.pooler_output)
        # joint DeepStack tensor over all visual positions in sequence order (as Qwen3VLModel builds it)
        joint_visual = visual | mask
        new_levels = []
        for j, feat in enumerate(out.deepstack_features):
            joint = embeds.new_zeros(int(joint_visual.sum()), embeds.shape[-1])
            if levels is not None:
                joint[visual[joint_visual]] = levels[j]
            joint[mask[joint_visual]] = feat
            new_levels.append(joint)
        levels, visual = new_levels, joint_visual
    hooks = []
    for j, feat in enumerate(levels or []):
        def add(module, args, output, feat=feat):
            hidden = output[0] if isinstance(output, tuple) else output
            hidden = hidden.clone()
            hidden[visual] = hidden[visual] + feat
            return (hidden, *output[1:]) if isinstance(output, tuple) else hidden
        hooks.append(lm.model.layers[j].register_forward_hook(add))
    try:
        return lm(inputs_embeds=embeds).logits
    finally:
        for h in hooks:
            h.remove()


def test_config_and_structure(pair):
    _, _, ours, _ = pair
    assert ours.args.vision_tower == "qwen3_vl"
    assert ours.multi_modal_projector is None
    blocks = ours.transformer_blocks()
    assert blocks[:3] == list(ours.vision_model.blocks) and blocks[3:] == list(ours.language_model.layers)
    with pytest.raises(ValueError, match="out_hidden_size 24 != text_config.hidden_size 32"):
        NemotronVLArgs.from_hf_config({**hf_config(), "vision_config": dict(VISION, out_hidden_size=24, model_type="qwen3_vl")})
    with pytest.raises(ValueError, match=r"\['downsample_ratio'\] describe the RADIO projector"):
        NemotronVLArgs.from_hf_config({**hf_config(), "downsample_ratio": 0.5})
    pixels, grid = vision_inputs(0, [(1, 4, 4)])
    with pytest.raises(ValueError, match="image_grid_thw"):
        ours(prompt(0, [4]), pixel_values=pixels)
    with pytest.raises(ValueError, match=r"5 placeholder tokens .* 4 image features"):
        ours(prompt(0, [5]), pixel_values=pixels, image_grid_thw=grid)


def test_one_image_matches_transformers(pair):
    vis, lm, ours, _ = pair
    pixels, grid = vision_inputs(1, [(1, 4, 6)])  # 6 merged tokens
    ids = prompt(2, [6])
    with torch.no_grad():
        out = ours(ids, pixel_values=pixels, image_grid_thw=grid)
    ref = reference(vis, lm, ids, images=(pixels, grid))
    torch.testing.assert_close(out, ref, **TOL)


def test_deepstack_changes_logits(pair):
    """Guard on the reference itself: dropping the DeepStack hooks gives different logits."""
    vis, lm, ours, _ = pair
    pixels, grid = vision_inputs(1, [(1, 4, 6)])
    ids = prompt(2, [6])
    with torch.no_grad():
        embeds = lm.get_input_embeddings()(ids).masked_scatter((ids == IMG)[..., None], vis(pixels, grid_thw=grid).pooler_output)
        no_deepstack = lm(inputs_embeds=embeds).logits
        out = ours(ids, pixel_values=pixels, image_grid_thw=grid)
    assert (out - no_deepstack).abs().max() > 1e-3


def test_two_images_of_different_sizes_and_a_video(pair):
    vis, lm, ours, _ = pair
    pixels, grid = vision_inputs(3, [(1, 4, 4), (1, 6, 8)])  # 4 and 12 tokens
    vpix, vgrid = vision_inputs(4, [(2, 4, 4)])  # 2 temporal patches x 4 tokens
    ids = prompt(5, [4, 12])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, pixel_values=pixels, image_grid_thw=grid),
                                   reference(vis, lm, ids, images=(pixels, grid)), **TOL)
        mixed = prompt(6, [4, 8, 12], token=[IMG, VID, IMG])
        torch.testing.assert_close(
            ours(mixed, pixel_values=pixels, image_grid_thw=grid, pixel_values_videos=vpix, video_grid_thw=vgrid),
            reference(vis, lm, mixed, images=(pixels, grid), videos=(vpix, vgrid)), **TOL)


def test_text_only_matches_transformers(pair):
    _, lm, ours, _ = pair
    ids = torch.randint(1, 80, (2, 9), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), lm(input_ids=ids).logits, **TOL)


def test_packed_and_padded_mixed_batch_equal_per_sample(pair):
    _, _, ours, _ = pair
    pix_a, grid_a = vision_inputs(8, [(1, 4, 4)])
    pix_c, grid_c = vision_inputs(9, [(1, 4, 6), (1, 2, 2)])
    ids_a, ids_b, ids_c = prompt(10, [4]), prompt(11, []), prompt(12, [6, 1])
    lens = [ids_a.shape[1], ids_b.shape[1], ids_c.shape[1]]
    cu = torch.tensor([0, lens[0], lens[0] + lens[1], sum(lens)], dtype=torch.int32)
    pixels, grid = torch.cat([pix_a, pix_c]), torch.cat([grid_a, grid_c])
    with torch.no_grad():
        alone = [ours(ids_a, pixel_values=pix_a, image_grid_thw=grid_a), ours(ids_b),
                 ours(ids_c, pixel_values=pix_c, image_grid_thw=grid_c)]
        packed = ours(torch.cat([ids_a, ids_b, ids_c], 1), pixel_values=pixels, image_grid_thw=grid, cu_seqlens=cu)
        width = max(lens)
        padded_ids = torch.zeros(3, width, dtype=torch.long)
        mask = torch.zeros(3, width, dtype=torch.long)
        for i, x in enumerate((ids_a, ids_b, ids_c)):
            padded_ids[i, : x.shape[1]] = x[0]
            mask[i, : x.shape[1]] = 1
        padded = ours(padded_ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grid)
    for i, ref in enumerate(alone):
        torch.testing.assert_close(packed[:, cu[i] : cu[i + 1]], ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(padded[i : i + 1, : lens[i]], ref, rtol=1e-5, atol=1e-5)


def test_step_decoding_with_cache_equals_full_forward(pair):
    _, _, ours, _ = pair
    pixels, grid = vision_inputs(13, [(1, 4, 6)])
    ids = prompt(14, [6])  # 13 tokens
    nxt = torch.randint(1, 80, (1, 4), generator=torch.Generator().manual_seed(15))
    with torch.no_grad():
        full = ours(torch.cat([ids, nxt], 1), pixel_values=pixels, image_grid_thw=grid)
        cache = ours.new_cache(batch_size=1, max_len=20)
        steps = [ours(ids, pixel_values=pixels, image_grid_thw=grid, kv_cache=cache)]
        steps += [ours(nxt[:, t : t + 1], kv_cache=cache) for t in range(4)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)
    assert cache.seq_len == ids.shape[1] + 4


def test_export_then_load_round_trip(pair, tmp_path):
    vis, _, ours, src = pair
    out = save_hf_model(ours, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert config["vision_config"]["model_type"] == "qwen3_vl" and config["image_token_id"] == IMG
    written = load_file(str(out / "model.safetensors"))
    source = load_file(str(src / "model.safetensors"))
    assert set(written) == set(source)  # the same checkpoint layout as the folder we read
    for k, v in source.items():
        torch.testing.assert_close(written[k], v, rtol=0, atol=0, msg=lambda m: f"{k}: {m}")
    reloaded = load_hf_model(out).eval()
    pixels, grid = vision_inputs(16, [(1, 4, 6)])
    ids = prompt(17, [6])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids, pixel_values=pixels, image_grid_thw=grid),
                                   ours(ids, pixel_values=pixels, image_grid_thw=grid), rtol=0, atol=0)
    # Qwen3-VL's own vision key spelling (model.visual.*) is read as an alias of vision_model.*
    alias = tmp_path / "alias"
    alias.mkdir()
    save_file({("model.visual." + k[len("vision_model."):] if k.startswith("vision_model.") else k): v
               for k, v in source.items()}, str(alias / "model.safetensors"))
    (alias / "config.json").write_text((src / "config.json").read_text())
    again = load_hf_model(alias)
    for k, v in ours.state_dict().items():
        torch.testing.assert_close(again.state_dict()[k], v, rtol=0, atol=0)
    # an export written from args alone (no original config.json) declares the same layout
    args_cfg = ours.args.to_hf_config()
    assert NemotronVLArgs.from_hf_config(args_cfg) == ours.args
    assert args_cfg["vision_config"]["model_type"] == "qwen3_vl_vision"
    from transformers import AutoConfig

    (tmp_path / "args").mkdir()
    (tmp_path / "args" / "config.json").write_text(json.dumps(args_cfg))
    parsed = AutoConfig.from_pretrained(tmp_path / "args")  # transformers parses the layout we write
    assert type(parsed.vision_config).__name__ == "Qwen3VLVisionConfig" and parsed.vision_config.depth == 3


def test_train_layers_selects_exactly_the_patch_mergers(pair):
    _, _, _, folder = pair
    model = load_hf_model(folder)
    trainable, total = apply_train_layers(model, ["Qwen3VLVisionPatchMerger"])
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    # transformers' class name covers the main merger and the DeepStack mergers (same class there too)
    expected = {n for n, _ in model.named_parameters()
                if n.startswith("vision_model.merger.") or n.startswith("vision_model.deepstack_merger_list.")}
    assert names == expected and len(expected) == 3 * 6
    assert trainable == sum(p.numel() for n, p in model.named_parameters() if n in expected) < total


def test_tiny_folder_with_the_qwen3_vl_processor(tmp_path):
    """`tiny_nemotron_qwen3_vision`: the folder's processor is Qwen3-VL's; its output drives the model."""
    from PIL import Image

    from megatron_vlm.data.processor import load_processor
    from megatron_vlm.testing.synthesize import synthesize_model_folder

    path = synthesize_model_folder("tiny_nemotron_qwen3_vision", tmp_path / "tiny", seed=0)
    proc = load_processor(path)
    assert proc.family == "qwen_vl"
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["vision_config"]["model_type"] == "qwen3_vl_vision" and proc.image_token_id == cfg["image_token_id"]
    assert proc.video_token_id == cfg["video_token_id"]
    text = proc.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "how many circles"}]}],
        tokenize=False, add_generation_prompt=True)
    image = Image.fromarray((torch.rand(64, 96, 3) * 255).to(torch.uint8).numpy())
    batch = proc(text=text, images=[image])
    assert batch["image_grid_thw"].tolist() == [[1, 4, 6]]  # 64 x 96 px at patch 16
    assert int((batch["input_ids"] == cfg["image_token_id"]).sum()) == 6
    model = load_hf_model(path).eval()
    with torch.no_grad():
        logits = model(batch["input_ids"], attention_mask=batch["attention_mask"], pixel_values=batch["pixel_values"],
                       image_grid_thw=batch["image_grid_thw"], mm_token_type_ids=batch["mm_token_type_ids"])
    assert logits.shape == (1, batch["input_ids"].shape[1], cfg["text_config"]["vocab_size"])
    assert torch.isfinite(logits).all()
    again = synthesize_model_folder("tiny_nemotron_qwen3_vision", tmp_path / "again", seed=0)
    assert (again / "model.safetensors").read_bytes() == (path / "model.safetensors").read_bytes()
