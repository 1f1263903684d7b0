"""InternVL checkpoints: a transformers `save_pretrained` folder and an OpenGVLab remote-code folder
(`internvl_chat` config + `vision_model.*` / `mlp1.*` / `language_model.*` keys, fused vision qkv)
both load through `load_hf_model` to transformers' logits; `save_hf_model` writes transformers'
checkpoint layout and an `internvl` config that `AutoModelForImageTextToText.from_pretrained` loads
back to equal logits (for the OpenGVLab source too); unsupported configs fail naming the key."""
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import megatron_vlm.testing.tiny_processor_internvl as F
from megatron_vlm.checkpoint import load_hf_model, save_hf_model
from megatron_vlm.models import supported_model_types
from megatron_vlm.models.internvl.args import InternVLArgs

TOL = 1e-4


def _batch(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return F.batch_samples([F.build_sample([3, ("image", 2), 4], g), F.build_sample([2, ("video", 2), 6], g)])


def _ours(model, batch):
    with torch.no_grad():
        return model(batch["input_ids"], batch["attention_mask"], batch["pixel_values"])


def _close(a, b, mask):
    m = mask.bool()
    err = (a[m] - b[m]).abs().max().item()
    assert err <= TOL, f"max |logits diff| = {err}"


def _opengvlab_config(hf_config: dict) -> dict:
    """The remote-code config.json of an original InternVL release describing the same model."""
    v, t = hf_config["vision_config"], dict(hf_config["text_config"])
    t["architectures"] = ["Qwen2ForCausalLM"]
    return {
        "architectures": ["InternVLChatModel"],
        "model_type": "internvl_chat",
        "auto_map": {"AutoModel": "modeling_internvl_chat.InternVLChatModel"},
        "downsample_ratio": 0.5, "select_layer": -1, "ps_version": "v2", "template": "internvl2_5",
        "force_image_size": F.TILE, "dynamic_image_size": True, "use_thumbnail": True, "max_dynamic_patch": 12,
        "img_context_token_id": F.IMAGE_TOKEN_ID, "tie_word_embeddings": False,
        "vision_config": {
            "model_type": "intern_vit_6b", "architectures": ["InternVisionModel"], "hidden_size": v["hidden_size"],
            "num_attention_heads": v["num_attention_heads"], "intermediate_size": v["intermediate_size"],
            "num_hidden_layers": v["num_hidden_layers"], "qkv_bias": True, "qk_normalization": False,
            "norm_type": "layer_norm", "layer_norm_eps": 1e-6, "image_size": F.TILE, "patch_size": 14,
            "hidden_act": "gelu", "num_channels": 3, "drop_path_rate": 0.0, "use_flash_attn": False,
        },
        "llm_config": t,
    }


def test_registered_model_types():
    assert {"internvl", "internvl_chat"} <= set(supported_model_types())


def test_transformers_folder_loads_and_export_round_trips(tmp_path):
    from transformers import AutoModelForImageTextToText

    hf = F.hf_reference_model(seed=3)
    hf.save_pretrained(tmp_path / "hf")
    batch = _batch(20)
    with torch.no_grad():
        ref = hf(**batch).logits
    ours = load_hf_model(tmp_path / "hf").eval()
    _close(ref, _ours(ours, batch), batch["attention_mask"])

    save_hf_model(ours, tmp_path / "export")
    with safe_open(str(tmp_path / "export" / "model.safetensors"), "pt") as r:
        keys = set(r.keys())
    assert keys == set(load_file(str(tmp_path / "hf" / "model.safetensors")))  # same layout as save_pretrained
    reloaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    with torch.no_grad():
        _close(ref, reloaded(**batch).logits, batch["attention_mask"])


def test_opengvlab_folder_loads_and_exports_to_transformers(tmp_path):
    from transformers import AutoModelForImageTextToText

    hf = F.hf_reference_model(seed=4)
    hf.save_pretrained(tmp_path / "hf")
    src = tmp_path / "opengvlab"
    src.mkdir()
    original = F.to_opengvlab_layout(load_file(str(tmp_path / "hf" / "model.safetensors")))
    save_file(original, str(src / "model.safetensors"))
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(_opengvlab_config(hf_config)))

    batch = _batch(21)
    with torch.no_grad():
        ref = hf(**batch).logits
    ours = load_hf_model(src).eval()
    assert ours.args.source_model_type == "internvl_chat"
    _close(ref, _ours(ours, batch), batch["attention_mask"])

    save_hf_model(ours, tmp_path / "export")
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported["model_type"] == "internvl" and exported["text_config"]["model_type"] == "qwen2"
    reloaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    with torch.no_grad():
        _close(ref, reloaded(**batch).logits, batch["attention_mask"])


def test_to_hf_config_reads_back_and_transformers_accepts_it():
    from transformers import InternVLConfig

    args = InternVLArgs.from_hf_config(F.tiny_internvl_config_dict(text_model="qwen3", norm_type="rms_norm",
                                                                   use_qk_norm=True))
    d = args.to_hf_config()
    cfg = InternVLConfig(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    assert cfg.vision_config.use_qk_norm and cfg.text_config.model_type == "qwen3"
    assert InternVLArgs.from_hf_config(json.loads(json.dumps(cfg.to_dict()))) == args
    assert args.tokens_per_tile == F.TOKENS_PER_TILE


def test_unsupported_configs_name_the_key():
    d = F.tiny_internvl_config_dict()
    d["text_config"]["model_type"] = "internlm2"
    with pytest.raises(ValueError, match="text_config.model_type 'internlm2'"):
        InternVLArgs.from_hf_config(d)
    d = F.tiny_internvl_config_dict()
    d["vision_feature_select_strategy"] = "full"
    with pytest.raises(ValueError, match="vision_feature_select_strategy"):
        InternVLArgs.from_hf_config(d)
    d = F.tiny_internvl_config_dict()
    d["text_config"]["use_sliding_window"] = True
    with pytest.raises(ValueError, match="use_sliding_window"):
        InternVLArgs.from_hf_config(d)
    chat = _opengvlab_config(F.tiny_internvl_config_dict())
    chat["ps_version"] = "v1"
    with pytest.raises(ValueError, match="ps_version"):
        InternVLArgs.from_hf_config(chat)
