"""The tiny Nemotron-VL folder of the demo: loads in our loader and in transformers with equal logits."""
import json

import torch
from transformers import AutoConfig, AutoTokenizer
from transformers.models.nemotron_h_omni import NemotronH_Omni_Reasoning_V3

from megatron_vlm.checkpoint.hf import load_hf_model
from megatron_vlm.models.common.moe import moe_layers
from megatron_vlm.testing.tiny_nemotron_vl import build_tiny_nemotron_vl_folder


def test_tiny_folder_round_trip(tmp_path):
    path = build_tiny_nemotron_vl_folder(tmp_path / "tiny-nemotron-vl", seed=0)
    cfg = json.loads((path / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.convert_tokens_to_ids("<image>") == cfg["image_token_id"]
    assert cfg["text_config"]["vocab_size"] >= len(tok)
    assert AutoConfig.from_pretrained(path).model_type == "nemotron_h_omni"
    text = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "how many circles"}]}],
        tokenize=False, add_generation_prompt=True,
    )
    assert text.count("<image>") == 1 and text.endswith("<|im_start|>assistant\n")

    ours = load_hf_model(path).eval()
    assert [layer.block_type for layer in ours.language_model.layers] == ["linear_attention", "moe", "full_attention", "mlp"]
    assert len(moe_layers(ours)) == 1
    hf = NemotronH_Omni_Reasoning_V3.from_pretrained(path).eval()
    grid = torch.tensor([[4, 6]])
    pixels = torch.randn(24, 3 * 16 * 16)
    image = cfg["image_token_id"]
    ids = torch.tensor([[5, 6, 7] + [image] * 6 + [8, 9]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, pixel_values=pixels, image_grid_hw=grid),
                                   hf(input_ids=ids, pixel_values=pixels, image_grid_hw=grid).logits, rtol=1e-4, atol=1e-4)
    # deterministic: same seed, same weights
    again = build_tiny_nemotron_vl_folder(tmp_path / "again", seed=0)
    assert (again / "model.safetensors").read_bytes() == (path / "model.safetensors").read_bytes()
