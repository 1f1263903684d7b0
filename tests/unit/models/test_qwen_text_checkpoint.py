"""Checkpoint paths of the text-only Qwen family: a transformers `save_pretrained` folder loads through
`load_hf_model` (also sharded, Qwen3-MoE experts split over shards), our export loads in
`AutoModelForCausalLM.from_pretrained` with equal logits, the tiny synthesizer's folder is a real
checkpoint folder, and unsupported config settings are errors naming the key."""
import json

import pytest
import torch

from megatron_vlm.checkpoint.hf import load_hf_model, save_hf_model
from megatron_vlm.models import build_model, supported_model_types
from megatron_vlm.models.qwen_text.args import QwenTextArgs
from megatron_vlm.models.qwen_text.state_dict_adapter import QwenTextStateDictAdapter
from megatron_vlm.testing.tiny_text_model import tiny_qwen_text_hf_config
from tests.fixtures.parity import assert_logits_close
from tests.unit.models.test_qwen_text_parity import VOCAB, hf_reference


def test_model_types_are_registered():
    assert {"qwen2", "qwen3", "qwen3_moe"} <= set(supported_model_types())


@pytest.mark.parametrize("model_type,tie", [("qwen2", True), ("qwen3", False), ("qwen3_moe", False)])
def test_transformers_folder_loads_and_export_round_trips(tmp_path, model_type, tie):
    from transformers import AutoModelForCausalLM

    hf, _ = hf_reference(model_type, seed=5, tie=tie)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="20KB")  # many shards: a MoE layer's experts span several
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 3
    ours = load_hf_model(tmp_path / "hf").eval()
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
        assert_logits_close(ref, ours(ids))
    save_hf_model(ours, tmp_path / "out")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert_logits_close(ref, back(ids).logits)
    if tie:
        assert "lm_head.weight" not in json.dumps(sorted(QwenTextStateDictAdapter(ours.args).to_hf(ours.state_dict())))


def test_moe_experts_wait_for_their_whole_layer():
    """One tensor at a time, as load_hf_weights feeds them: a layer's experts stay pending until all 3 x E came."""
    cfg = tiny_qwen_text_hf_config("qwen3_moe", vocab_size=VOCAB, hidden=64)
    adapter = QwenTextStateDictAdapter(QwenTextArgs.from_hf_config(cfg))
    pending, converted = {}, {}
    hub = adapter.to_hf(build_model(cfg).state_dict())
    expert_keys = [k for k in hub if ".experts." in k]
    assert len(expert_keys) == 3 * 4  # layer 0 only (layer 1 is dense), per-expert hub layout
    for key in sorted(hub):
        out, pending = adapter.from_hf({**pending, key: hub[key]})
        converted.update(out)
        if key == expert_keys[0]:
            assert pending and not any(".experts." in k for k in out)
    assert not pending
    gate_up = converted["language_model.layers.0.mlp.experts.gate_up_proj"]
    assert gate_up.shape == (4, 2 * 32, 64)
    assert torch.equal(gate_up[2, :32], hub["model.layers.0.mlp.experts.2.gate_proj.weight"])
    assert torch.equal(gate_up[2, 32:], hub["model.layers.0.mlp.experts.2.up_proj.weight"])


def test_tiny_synthesized_folder_is_a_checkpoint_folder(tmp_path):
    from transformers import AutoModelForCausalLM

    from megatron_vlm.data.processor import load_processor
    from megatron_vlm.data.processor_text import TextProcessor
    from megatron_vlm.testing.synthesize import synthesize_model_folder

    folder = synthesize_model_folder("tiny_qwen2", tmp_path / "tiny", seed=0)
    proc = load_processor(folder)
    assert isinstance(proc, TextProcessor) and proc.image_token_id is None
    ours = load_hf_model(folder).eval()
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = proc.tokenizer(proc.render([{"role": "user", "content": "What is 3 + 4?"}], add_generation_prompt=True),
                         return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert_logits_close(hf(ids).logits, ours(ids))


@pytest.mark.parametrize("change,match", [
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"head_dim": 8}, "head_dim"),
    ({"num_hidden_layers": None}, "num_hidden_layers"),
])
def test_unsupported_settings_are_errors(change, match):
    cfg = {**tiny_qwen_text_hf_config("qwen2", vocab_size=VOCAB, hidden=64), **change}
    with pytest.raises(ValueError, match=match):
        QwenTextArgs.from_hf_config(cfg)
