"""Qwen3-VL / Qwen3-VL-MoE checkpoints: a transformers `save_pretrained` folder loads through
`load_hf_model` (registry by model_type) to the reference logits; `save_hf_model` writes the hub
layout (fused vision qkv, Conv3d patch embed, MoE experts transposed as on the hub) that
transformers' `AutoModelForImageTextToText.from_pretrained` loads back to equal logits; sharded
folders load; `to_hf_config` is a config transformers accepts and reads back to the same args."""
import json

import pytest
import torch
from safetensors import safe_open

import megatron_vlm.testing.tiny_processor_qwen3_vl as F
from megatron_vlm.checkpoint import load_hf_model, save_hf_model
from megatron_vlm.models import build_model, supported_model_types
from megatron_vlm.models.qwen3_vl.args import Qwen3VLArgs

TOL = 1e-4


def _batch(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return F.batch_samples(
        [F.build_sample([3, ("image", (1, 4, 6)), 4], g), F.build_sample([2, ("video", (2, 4, 4)), 5], g)],
        padding_side="left",
    )


def _ours(model, batch):
    with torch.no_grad():
        return model(batch["input_ids"], batch["attention_mask"], batch["pixel_values"], batch["image_grid_thw"],
                     batch["pixel_values_videos"], batch["video_grid_thw"])


def _close(a, b, mask):
    m = mask.bool()
    err = (a[m] - b[m]).abs().max().item()
    assert err <= TOL, f"max |logits diff| = {err}"


def _keys(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as r:
            out.update({k: tuple(r.get_slice(k).get_shape()) for k in r.keys()})  # noqa: SIM118 -- safe_open handles are not iterable
    return out


def test_registered_model_types():
    assert {"qwen3_vl", "qwen3_vl_moe"} <= set(supported_model_types())


@pytest.mark.parametrize("moe,tie", [(False, True), (True, False)])
def test_transformers_folder_loads_and_export_round_trips(tmp_path, moe, tie):
    from transformers import AutoModelForImageTextToText

    hf = F.hf_reference_model(seed=3, moe=moe, tie_word_embeddings=tie)
    hf.save_pretrained(tmp_path / "hf")
    batch = _batch(20)
    with torch.no_grad():
        ref = hf(**batch).logits

    ours = load_hf_model(tmp_path / "hf").eval()
    assert ours.args.model_type == ("qwen3_vl_moe" if moe else "qwen3_vl")
    assert (ours.lm_head.weight is ours.language_model.embed_tokens.weight) == tie
    _close(ref, _ours(ours, batch), batch["attention_mask"])

    save_hf_model(ours, tmp_path / "export", max_shard_size=40_000)  # several shards + index
    assert (tmp_path / "export" / "model.safetensors.index.json").is_file()
    keys = _keys(tmp_path / "export")
    assert "model.visual.blocks.0.attn.qkv.weight" in keys
    assert keys["model.visual.patch_embed.proj.weight"] == (32, 3, 2, 16, 16)
    assert ("lm_head.weight" in keys) == (not tie)
    if moe:  # hub layout: [E, hidden, 2 * moe_intermediate] and [E, moe_intermediate, hidden]
        assert keys["model.language_model.layers.0.mlp.experts.gate_up_proj"] == (4, 64, 48)
        assert keys["model.language_model.layers.0.mlp.experts.down_proj"] == (4, 24, 64)
        assert "model.language_model.layers.1.mlp.gate_proj.weight" in keys
    reloaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    assert type(reloaded).__name__ == type(hf).__name__
    with torch.no_grad():
        _close(ref, reloaded(**batch).logits, batch["attention_mask"])
    again = load_hf_model(tmp_path / "export").eval()
    _close(ref, _ours(again, batch), batch["attention_mask"])


def test_to_hf_config_is_accepted_by_transformers_and_reads_back():
    from transformers import Qwen3VLMoeConfig

    args = Qwen3VLArgs.from_hf_config(F.tiny_qwen3_vl_config_dict(moe=True))
    d = args.to_hf_config()
    cfg = Qwen3VLMoeConfig(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    assert cfg.text_config.num_experts == 4 and cfg.vision_config.deepstack_visual_indexes == [0, 2]
    assert Qwen3VLArgs.from_hf_config(json.loads(json.dumps(cfg.to_dict()))) == args
    model = build_model(d)  # a config dict builds the family's model directly
    assert model.args == args


def test_hub_4x_style_rope_scaling_and_errors():
    d = F.tiny_qwen3_vl_config_dict()
    tc = d["text_config"]
    params = tc.pop("rope_parameters")
    tc["rope_theta"] = params["rope_theta"]
    tc["rope_scaling"] = {"rope_type": "default", "mrope_section": params["mrope_section"], "mrope_interleaved": True}
    args = Qwen3VLArgs.from_hf_config(d)
    assert args.text.mrope_section == [2, 3, 3] and args.text.rope_theta == 10000.0
    tc["rope_scaling"]["mrope_section"] = [2, 3, 4]
    with pytest.raises(ValueError, match="mrope_section"):
        Qwen3VLArgs.from_hf_config(d)
    with pytest.raises(ValueError, match="model_type"):
        Qwen3VLArgs.from_hf_config({**F.tiny_qwen3_vl_config_dict(), "model_type": "qwen2_5_vl"})
    bad = F.tiny_qwen3_vl_config_dict()
    bad["vision_config"]["deepstack_visual_indexes"] = [0, 7]
    with pytest.raises(ValueError, match="deepstack_visual_indexes: 7"):
        Qwen3VLArgs.from_hf_config(bad)
