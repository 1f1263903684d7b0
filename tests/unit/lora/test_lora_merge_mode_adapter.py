"""The adapter folder of a run with `lora.init_from_mode = "merge"` does not name the original base model.

Such an adapter was trained on base + the earlier adapter (merged in at start-up), a model no folder holds:
an `adapter_config.json` whose `base_model_name_or_path` named the original base would make
`AutoPeftModel*.from_pretrained(adapter)` silently build base + new adapter, without the earlier one."""
from __future__ import annotations

import json

import torch

from megatron_vlm.config.sections import LoRAConfig
from megatron_vlm.training.lora import write_adapter
from tests.fixtures import tiny_qwen2_5_vl as FQ


def test_merge_mode_adapter_names_no_base_model(tmp_path):
    cfg = FQ.tiny_qwen2_5_vl_config_dict()
    hidden = cfg["text_config"]["hidden_size"]
    layer = "language_model.layers.0.self_attn.q_proj"  # a run's factors, as its full state dict holds them
    sd = {f"{layer}.lora_A.weight": torch.randn(2, hidden), f"{layer}.lora_B.weight": torch.randn(hidden, 2)}
    plain = LoRAConfig(r=2, alpha=4.0, target_modules=["q_proj"])
    write_adapter(tmp_path / "continue", sd, cfg, plain, base_model_name_or_path="/models/base")
    # the state dict of a run that merged an earlier adapter looks the same; only the section differs
    merged = LoRAConfig(r=2, alpha=4.0, target_modules=["q_proj"], init_from=str(tmp_path / "continue"),
                        init_from_mode="merge")
    write_adapter(tmp_path / "merge", sd, cfg, merged, base_model_name_or_path="/models/base")
    read = lambda name: json.loads((tmp_path / name / "adapter_config.json").read_text())  # noqa: E731
    assert read("continue")["base_model_name_or_path"] == "/models/base"
    assert read("merge")["base_model_name_or_path"] is None
