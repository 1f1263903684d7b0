"""Deterministic tiny models (config + random weights + tokenizer + processor) written as real
Hugging Face folders, offline. Used by the demo (`[model] synthesize = "tiny_qwen2_5_vl"`) and by
tests; the same loaders that read a downloaded checkpoint read these.
"""
from __future__ import annotations

from pathlib import Path

from megatron_vlm.testing.folders import save_random_model
from megatron_vlm.testing.tiny_processor import build_tiny_qwen2_5_vl_processor, tiny_qwen2_5_vl_text_config_ids


def tiny_qwen2_5_vl_hf_config(token_ids: dict, *, hidden: int = 128, layers: int = 2, vision_depth: int = 2) -> dict:
    from transformers import Qwen2_5_VLConfig

    text = dict(
        vocab_size=token_ids["vocab_size"], hidden_size=hidden, intermediate_size=hidden * 3,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=4096, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
        bos_token_id=token_ids.get("bos_token_id"), eos_token_id=token_ids["eos_token_id"],
        pad_token_id=token_ids.get("pad_token_id"), tie_word_embeddings=True,
    )
    vision = dict(
        depth=vision_depth, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=hidden,
        patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
        fullatt_block_indexes=[vision_depth - 1], tokens_per_second=2,
    )
    cfg = Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=token_ids["image_token_id"],
        video_token_id=token_ids["video_token_id"], vision_start_token_id=token_ids["vision_start_token_id"],
        vision_end_token_id=token_ids.get("vision_end_token_id", token_ids["vision_start_token_id"] + 1),
        tie_word_embeddings=True,
    )
    d = cfg.to_dict()
    d["architectures"] = ["Qwen2_5_VLForConditionalGeneration"]
    return d


def build_tiny_model_folder(kind: str, out_dir: str | Path, *, seed: int = 0) -> Path:
    """Create `out_dir` with config.json, model.safetensors, tokenizer and processor files."""
    if kind != "tiny_qwen2_5_vl":
        raise ValueError(f"model.synthesize: unknown tiny model {kind!r}; known: 'tiny_qwen2_5_vl'")

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    processor = build_tiny_qwen2_5_vl_processor(tmp)
    hf_config = tiny_qwen2_5_vl_hf_config(tiny_qwen2_5_vl_text_config_ids(processor))
    save_random_model(hf_config, tmp, seed)
    tmp.rename(out_dir)
    return out_dir
