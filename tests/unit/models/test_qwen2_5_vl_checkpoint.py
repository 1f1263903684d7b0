"""Hugging Face folders <-> our Qwen2.5-VL: loading transformers' own save_pretrained output (single
file, sharded, the 4.x hub layout), exporting and reloading with transformers' from_pretrained."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_vlm.checkpoint import save_hf_model
from megatron_vlm.checkpoint.hf import load_hf_model
from megatron_vlm.models import build_model
from tests.fixtures import tiny_qwen2_5_vl as F

TOL = 1e-4


@pytest.fixture(scope="module")
def batch():
    """An image and a video; the reference gets the original rule's positions (`position_ids`), since transformers
    5.3+ place the text after a video elsewhere (test_qwen2_5_vl_parity.py::test_video_with_second_per_grid_ts)."""
    g = torch.Generator().manual_seed(11)
    b = F.batch_samples([F.build_sample([4, ("image", (1, 4, 6)), 3, ("video", (2, 4, 4)), 5], g)])
    return dict(b, position_ids=F.original_position_ids(b))


def _hf_logits(model, batch):
    with torch.no_grad():
        return model(**batch).logits


def _our_logits(model, batch):
    with torch.no_grad():
        return model(batch["input_ids"], pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                     pixel_values_videos=batch["pixel_values_videos"], video_grid_thw=batch["video_grid_thw"])


def _max_diff(a, b):
    assert a.shape == b.shape
    return (a - b).abs().max().item()


@pytest.mark.parametrize("tied", [False, True])
def test_load_transformers_save_pretrained(tmp_path, batch, tied):
    hf = F.hf_reference_model(seed=1, tie_word_embeddings=tied)
    hf.save_pretrained(tmp_path)
    ours = load_hf_model(tmp_path)
    assert next(ours.parameters()).device.type == "cpu"
    assert _max_diff(_hf_logits(hf, batch), _our_logits(ours, batch)) <= TOL
    assert (ours.lm_head.weight is ours.language_model.embed_tokens.weight) == tied


def test_load_sharded_checkpoint(tmp_path, batch):
    hf = F.hf_reference_model(seed=2)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    ours = load_hf_model(tmp_path)
    assert _max_diff(_hf_logits(hf, batch), _our_logits(ours, batch)) <= TOL


def test_load_bfloat16(tmp_path, batch):
    hf = F.hf_reference_model(seed=3)
    hf.save_pretrained(tmp_path)
    ours = load_hf_model(tmp_path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    ref = hf.state_dict()["model.language_model.layers.0.mlp.up_proj.weight"].to(torch.bfloat16)
    assert torch.equal(ours.language_model.layers[0].mlp.up_proj.weight, ref)


def _to_flat_hub_config(src, dst):
    """Rewrite a transformers-5 folder's config into the original Qwen2.5-VL hub config.json (flat text
    fields, rope_scaling "mrope", vision `in_chans`); the weights already use the hub key layout."""
    cfg = json.loads((src / "config.json").read_text())
    text = cfg.pop("text_config")
    rope = text.pop("rope_parameters")
    for k in ("model_type", "layer_types", "dtype"):
        text.pop(k, None)
    flat = {**cfg, **text, "rope_theta": rope["rope_theta"],
            "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}
    vision = dict(flat["vision_config"])
    vision["in_chans"] = vision.pop("in_channels")
    vision["model_type"] = "qwen2_5_vl"
    vision.pop("rope_parameters", None)
    flat["vision_config"] = vision
    flat["torch_dtype"] = flat.pop("dtype", "float32")
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(flat))
    (dst / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())


def test_load_original_hub_config(tmp_path, batch):
    from transformers import AutoModelForImageTextToText

    hf = F.hf_reference_model(seed=4)
    hf.save_pretrained(tmp_path / "v5")
    keys = load_file(str(tmp_path / "v5" / "model.safetensors")).keys()
    assert any(k.startswith("visual.") for k in keys) and any(k.startswith("model.layers.") for k in keys)
    _to_flat_hub_config(tmp_path / "v5", tmp_path / "hub")
    ref = _hf_logits(hf, batch)
    # transformers itself reads the rewritten folder as the same model (so the config is a faithful one)
    reloaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "hub", attn_implementation="eager").eval()
    assert _max_diff(ref, _hf_logits(reloaded, batch)) <= TOL
    ours = load_hf_model(tmp_path / "hub")
    assert _max_diff(ref, _our_logits(ours, batch)) <= TOL
    # export keeps the original (flat) config dict
    save_hf_model(ours, tmp_path / "export")
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    original = json.loads((tmp_path / "hub" / "config.json").read_text())
    assert exported["rope_scaling"] == original["rope_scaling"] and "text_config" not in exported
    assert exported["vision_config"] == original["vision_config"]


def test_load_module_key_layout(tmp_path, batch):
    """Checkpoints written from a raw transformers-5 state_dict(): model.visual.* / model.language_model.*."""
    hf = F.hf_reference_model(seed=9)
    hf.save_pretrained(tmp_path)
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.startswith("model.language_model.") for k in sd)
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    ours = load_hf_model(tmp_path)
    assert _max_diff(_hf_logits(hf, batch), _our_logits(ours, batch)) <= TOL


@pytest.mark.parametrize("tied", [False, True])
def test_export_loads_in_transformers(tmp_path, batch, tied):
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(5)
    ours = build_model(F.tiny_qwen2_5_vl_config_dict(tie_word_embeddings=tied))
    F.randomize_constants_(ours, seed=5)
    save_hf_model(ours, tmp_path)
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(loaded).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert _max_diff(_our_logits(ours, batch), _hf_logits(loaded, batch)) <= TOL


def test_export_sharded_with_tokenizer_files_and_roundtrip(tmp_path, batch):
    from transformers import AutoModelForImageTextToText

    src = tmp_path / "src"
    hf = F.hf_reference_model(seed=6)
    hf.save_pretrained(src)
    for name, text in [("tokenizer_config.json", "{}"), ("chat_template.jinja", "{{ messages }}"),
                       ("preprocessor_config.json", "{}"), ("README.md", "not copied")]:
        (src / name).write_text(text)
    ours = load_hf_model(src)
    out = save_hf_model(ours, tmp_path / "out", max_shard_size="100KB", copy_from=src)
    names = {p.name for p in out.iterdir()}
    assert {"tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json", "generation_config.json",
            "model.safetensors.index.json", "config.json"} <= names
    assert "README.md" not in names and "model.safetensors" not in names
    # same tensor names as transformers' own save_pretrained (the hub checkpoint layout)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(load_file(str(src / "model.safetensors")))
    ref = _hf_logits(hf, batch)
    assert _max_diff(ref, _our_logits(load_hf_model(out), batch)) <= TOL
    loaded = AutoModelForImageTextToText.from_pretrained(out, attn_implementation="eager").eval()
    assert _max_diff(ref, _hf_logits(loaded, batch)) <= TOL


def test_missing_and_misshaped_tensors_are_named(tmp_path):
    hf = F.hf_reference_model(seed=7)
    hf.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    dropped = dict(tensors)
    del dropped["model.layers.1.mlp.down_proj.weight"]
    save_file(dropped, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"language_model\.layers\.1\.mlp\.down_proj\.weight"):
        load_hf_model(tmp_path)
    bad = dict(tensors)
    bad["model.norm.weight"] = torch.ones(7)
    save_file(bad, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.norm\.weight -> language_model\.norm\.weight .*\(7,\).*\(64,\)"):
        load_hf_model(tmp_path)
    extra = dict(tensors)
    extra["model.layers.9.mlp.up_proj.weight"] = torch.ones(2)
    save_file(extra, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"no place in the model.*layers\.9\.mlp\.up_proj"):
        load_hf_model(tmp_path)
