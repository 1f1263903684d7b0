"""Qwen2.5-VL args from both config.json layouts, unsupported settings, and the model-type registry."""
import pytest

from megatron_vlm.models import build_model, get_family
from megatron_vlm.models.qwen2_5_vl.args import Qwen2_5_VLArgs
from tests.fixtures import tiny_qwen2_5_vl as F

# the published Qwen/Qwen2.5-VL-3B-Instruct config.json (transformers 4.x layout)
HUB_3B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "vision_token_id": 151654, "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 11008, "max_position_embeddings": 128000,
    "max_window_layers": 70, "model_type": "qwen2_5_vl", "num_attention_heads": 16, "num_hidden_layers": 36,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.41.2", "use_cache": True,
    "use_sliding_window": False,
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                      "num_heads": 16, "in_chans": 3, "out_hidden_size": 2048, "patch_size": 14,
                      "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2},
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "vocab_size": 151936,
}


def test_hub_layout_3b():
    a = Qwen2_5_VLArgs.from_hf_config(HUB_3B)
    assert (a.text.hidden_size, a.text.num_hidden_layers, a.text.num_key_value_heads) == (2048, 36, 2)
    assert a.text.mrope_section == [16, 24, 24] and a.text.rope_theta == 1e6 and a.text.rms_norm_eps == 1e-6
    assert a.tie_word_embeddings and a.image_token_id == 151655
    assert a.vision.fullatt_block_indexes == [7, 15, 23, 31] and a.vision.out_hidden_size == 2048


def test_transformers5_layout_equals_what_transformers_reads():
    from transformers import Qwen2_5_VLConfig

    d = F.tiny_qwen2_5_vl_config_dict(tie_word_embeddings=True)
    a = Qwen2_5_VLArgs.from_hf_config(d)
    ref = Qwen2_5_VLConfig(**{k: v for k, v in d.items() if k not in ("architectures",)})
    assert a.text.hidden_size == ref.text_config.hidden_size
    assert a.text.mrope_section == ref.text_config.rope_parameters["mrope_section"]
    assert a.vision.window_size == ref.vision_config.window_size
    assert a.tie_word_embeddings == ref.tie_word_embeddings is True


def test_hub_flat_layout_matches_transformers_parsing():
    from transformers import Qwen2_5_VLConfig

    ref = Qwen2_5_VLConfig(**{k: v for k, v in HUB_3B.items() if k != "architectures"})
    a = Qwen2_5_VLArgs.from_hf_config(HUB_3B)
    assert a.text.num_attention_heads == ref.text_config.num_attention_heads
    assert a.text.rope_theta == ref.text_config.rope_parameters["rope_theta"]
    assert a.text.mrope_section == ref.text_config.rope_parameters["mrope_section"]
    assert a.vision.in_channels == ref.vision_config.in_channels == 3
    assert a.tie_word_embeddings == ref.tie_word_embeddings


@pytest.mark.parametrize("patch, message", [
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0, "mrope_section": [16, 24, 24]}}, "rope_type"),
    ({"rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 20]}}, "mrope_section"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
])
def test_unsupported_settings_name_the_key(patch, message):
    with pytest.raises(ValueError, match=message):
        Qwen2_5_VLArgs.from_hf_config({**HUB_3B, **patch})


def test_bad_vision_settings():
    with pytest.raises(ValueError, match="fullatt_block_indexes"):
        Qwen2_5_VLArgs.from_hf_config({**HUB_3B, "vision_config": {**HUB_3B["vision_config"], "fullatt_block_indexes": [40]}})


def test_registry():
    assert get_family("qwen2_5_vl").name == "qwen2_5_vl"
    with pytest.raises(ValueError, match=r"model_type 'llava' is not supported; known: .*qwen2_5_vl"):
        get_family("llava")


def test_build_model_structure():
    model = build_model(F.tiny_qwen2_5_vl_config_dict(tie_word_embeddings=True))
    assert model.lm_head.weight is model.language_model.embed_tokens.weight
    blocks = model.transformer_blocks()
    assert len(blocks) == 3 + 2 and blocks[0] is model.visual.blocks[0] and blocks[-1] is model.language_model.layers[-1]
    untied = build_model(Qwen2_5_VLArgs.from_hf_config(F.tiny_qwen2_5_vl_config_dict()))
    assert untied.lm_head.weight is not untied.language_model.embed_tokens.weight
    assert untied.hf_config["model_type"] == "qwen2_5_vl"
