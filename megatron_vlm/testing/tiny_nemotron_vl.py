"""A tiny, deterministic, offline Nemotron-3-Nano-VL folder (config + random weights + tokenizer +
processor files) for the CPU demo and tests; the loaders that read a downloaded checkpoint read it.

The model is a `nemotron_h_omni` (no audio) with every decoder layer kind (Mamba2, MoE, attention,
MLP) and a 2-layer RADIO encoder. The tokenizer is the project's tiny byte-level BPE
(`megatron_vlm.testing.tiny_processor`) plus Nemotron-VL's image tokens: `<image>` (the
placeholder, one per LLM image token after the 2x2 pixel shuffle) framed by `<img>` / `</img>`; the
chat template is ChatML with one `<image>` per image (the processor expands it to
`<img>` + `<image>` * (grid_h * grid_w / 4) + `</img>`, as transformers' Nemotron-H Omni
processor does). preprocessor_config.json names transformers' Nemotron-H Omni image processor
with a small patch budget (patch 16, 16..64 patches per image).

`build_tiny_nemotron_qwen3_vision_folder` writes the Qwen3-VL-vision variant (the Nemotron-3-Nano-VL
layout with a Qwen3-VL vision tower): the same hybrid decoder with a 2-block Qwen3-VL vision tower
(patch 16, merge 2, DeepStack from block 0) and the tiny Qwen3-VL processor files (`Qwen2VLImageProcessorFast` in
preprocessor_config.json, so `load_processor` picks the Qwen-VL processor; `<|image_pad|>` /
`<|video_pad|>` placeholders framed by `<|vision_start|>` / `<|vision_end|>`).
"""
from __future__ import annotations

from pathlib import Path

from megatron_vlm.testing.folders import chatml_template, save_random_model, write_json
from megatron_vlm.testing.tiny_processor import build_tiny_tokenizer
from megatron_vlm.testing.tiny_processor_qwen3_vl import build_tiny_qwen3_vl_processor, tiny_qwen3_vl_token_ids

IMAGE_TOKENS = ("<image>", "<img>", "</img>")
NEMOTRON_VL_CHAT_TEMPLATE = chatml_template(
    "{% if item['type'] == 'image' or 'image' in item or 'image_url' in item %}<image>\n"
    "{% elif 'text' in item %}{{ item['text'] }}"
    "{% endif %}"
)
TINY_MIN_NUM_PATCHES = 16
TINY_MAX_NUM_PATCHES = 64


def build_tiny_nemotron_vl_tokenizer():
    tok = build_tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": list(IMAGE_TOKENS)})
    tok.chat_template = NEMOTRON_VL_CHAT_TEMPLATE
    return tok


def _tiny_text_config(hidden: int, vocab_size: int, eos_token_id: int, pad_token_id: int) -> dict:
    """The tiny NemotronH decoder both tiny variants share: one layer of each kind (mamba, moe,
    attention, mlp)."""
    return dict(
        model_type="nemotron_h", vocab_size=vocab_size, hidden_size=hidden,
        layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, intermediate_size=2 * hidden,
        mamba_num_heads=4, mamba_head_dim=hidden // 4, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=64,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=hidden, moe_shared_expert_intermediate_size=hidden,
        n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True, layer_norm_epsilon=1e-5,
        mlp_hidden_act="relu2", tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
    )


def tiny_nemotron_vl_hf_config(tokenizer, *, hidden: int = 64) -> dict:
    """config.json dict of the tiny model (vocab padded to a multiple of 64, as real checkpoints do)."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<image>", "<|im_end|>", "<|endoftext|>")}
    text = _tiny_text_config(hidden, (len(tokenizer) + 63) // 64 * 64, ids["<|im_end|>"], ids["<|endoftext|>"])
    vision = dict(
        model_type="radio", hidden_size=32, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2.0,
        patch_size=16, max_img_size=256, num_cls_tokens=2, num_registers=2, video_temporal_patch_size=2,
        hidden_act="gelu", layer_norm_eps=1e-6, qkv_bias=True,
    )
    return {
        "architectures": ["NemotronH_Omni_Reasoning_V3"],
        "model_type": "nemotron_h_omni",
        "text_config": text,
        "vision_config": vision,
        "audio_config": None,
        "downsample_ratio": 0.5,
        "projector_hidden_size": 2 * hidden,
        "vision_hidden_size": 32,
        "image_token_id": ids["<image>"],
        "video_token_id": None,
        "video_temporal_patch_size": 2,
        "video_pruning_rate": 0.0,
    }


def tiny_nemotron_qwen3_vision_hf_config(token_ids: dict, *, hidden: int = 64) -> dict:
    """config.json dict of the tiny Qwen3-VL-vision variant; `token_ids` from `tiny_qwen3_vl_token_ids`."""
    text = _tiny_text_config(hidden, token_ids["vocab_size"], token_ids["eos_token_id"], token_ids["pad_token_id"])
    vision = dict(
        model_type="qwen3_vl_vision", depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden,
        patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
        deepstack_visual_indexes=[0], hidden_act="gelu_pytorch_tanh", video_temporal_patch_size=2,
    )
    return {
        "architectures": ["NemotronVLForConditionalGeneration"],
        "model_type": "nemotron_h_omni",
        "text_config": text,
        "vision_config": vision,
        "video_temporal_patch_size": 2,  # with the vision_config copy: lets transformers' AutoConfig parse the file
        **{k: token_ids[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")},
    }


def build_tiny_nemotron_qwen3_vision_folder(out_dir: str | Path, *, seed: int = 0) -> Path:
    """The Qwen3-VL-vision variant's folder (written to a temporary sibling, then renamed); returns it."""
    from transformers import AutoTokenizer

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    build_tiny_qwen3_vl_processor(tmp)
    token_ids = tiny_qwen3_vl_token_ids(AutoTokenizer.from_pretrained(tmp))
    hf_config = tiny_nemotron_qwen3_vision_hf_config(token_ids)
    save_random_model(hf_config, tmp, seed)
    write_json(tmp / "generation_config.json", {
        "eos_token_id": token_ids["eos_token_id"], "pad_token_id": token_ids["pad_token_id"],
    })
    tmp.rename(out_dir)
    return out_dir



def build_tiny_nemotron_vl_folder(out_dir: str | Path, *, seed: int = 0) -> Path:
    """Create `out_dir` (written to a temporary sibling, then renamed) and return it."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_nemotron_vl_tokenizer()
    tokenizer.save_pretrained(tmp)
    (tmp / "chat_template.jinja").write_text(NEMOTRON_VL_CHAT_TEMPLATE)
    clip_mean, clip_std = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
    write_json(tmp / "preprocessor_config.json", {
        "image_processor_type": "NemotronH_Omni_Reasoning_V3ImageProcessor",
        "processor_class": "NemotronH_Omni_Reasoning_V3Processor",
        "patch_size": 16, "downsample_ratio": 0.5, "min_num_patches": TINY_MIN_NUM_PATCHES,
        "max_num_patches": TINY_MAX_NUM_PATCHES, "max_model_len": 1024,
        "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "do_convert_rgb": True, "resample": 3, "image_mean": clip_mean, "image_std": clip_std,
    })
    write_json(tmp / "processor_config.json", {"processor_class": "NemotronH_Omni_Reasoning_V3Processor"})
    hf_config = tiny_nemotron_vl_hf_config(tokenizer)
    save_random_model(hf_config, tmp, seed)
    write_json(tmp / "generation_config.json", {
        "eos_token_id": hf_config["text_config"]["eos_token_id"], "pad_token_id": hf_config["text_config"]["pad_token_id"],
    })
    tmp.rename(out_dir)
    return out_dir


NEMOTRON_VL_VIDEO_CHAT_TEMPLATE = chatml_template(
    "{% if item['type'] == 'image' %}<image>\n"
    "{% elif item['type'] == 'video' %}<video>\n"
    "{% elif 'text' in item %}{{ item['text'] }}"
    "{% endif %}"
)


def add_tiny_video_processing(folder: str | Path, *, target_patches: int = 20) -> Path:
    """Give a tiny Nemotron-VL folder videos: a chat template that renders `<video>` and a video processor with a small
    tile (`target_patches` patches, the aspect ratio kept: frames of another shape get another tile size)."""
    import json

    folder = Path(folder)
    (folder / "chat_template.jinja").write_text(NEMOTRON_VL_VIDEO_CHAT_TEMPLATE)
    pre = json.loads((folder / "preprocessor_config.json").read_text())
    write_json(folder / "video_preprocessor_config.json", {
        "video_processor_type": "NemotronH_Omni_Reasoning_V3VideoProcessor", "norm_mean": pre["image_mean"],
        "norm_std": pre["image_std"], "patch_size": 16, "downsample_ratio": 0.5, "video_target_num_patches": target_patches})
    return folder
