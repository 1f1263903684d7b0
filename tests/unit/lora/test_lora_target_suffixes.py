"""`lora.target_modules` entries select the layers PEFT's `LoraConfig(target_modules=[...])` adapts, including its
dotted-suffix form ("self_attn.q_proj", "layers.1.self_attn.v_proj": the module name or its last parts). Reference:
the modules `peft.get_peft_model` wraps on the transformers model.

A dotted entry used to be read as a regex over the whole name, which matched no layer: exit 2 for a list PEFT takes
(and `eval.adapter` refused PEFT adapters written with such a list)."""
from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")

from megatron_vlm.checkpoint.hf import load_hf_model  # noqa: E402
from megatron_vlm.testing.synthesize import synthesize_model_folder  # noqa: E402
from megatron_vlm.training.lora import select_lora_targets  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return synthesize_model_folder("tiny_qwen2_5_vl", tmp_path_factory.mktemp("q") / "src", seed=3)


def _peft_targets(folder, targets):
    import transformers

    hf = transformers.AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.float32)
    model = peft.get_peft_model(hf, peft.LoraConfig(r=4, target_modules=targets))
    return sorted(n[len("base_model.model."):] for n, m in model.named_modules()
                  if isinstance(getattr(m, "lora_A", None), torch.nn.ModuleDict) and "default" in m.lora_A)


@pytest.mark.parametrize("targets", [["self_attn.q_proj", "mlp.down_proj"], ["layers.1.self_attn.v_proj", "o_proj"],
                                     ["model.language_model.layers.0.mlp.up_proj", "blocks.1.mlp.gate_proj"]])
def test_entries_select_what_peft_adapts(folder, targets):
    ours = load_hf_model(folder)
    selected = select_lora_targets(ours, ours.hf_config, targets, include_vision=True)
    assert sorted(selected.values()) == _peft_targets(folder, targets)


def test_a_regex_entry_still_matches_the_whole_name(folder):
    ours = load_hf_model(folder)
    selected = select_lora_targets(ours, ours.hf_config, [r"model\.language_model\.layers\.1\..*_proj"],
                                   include_vision=True)
    assert len(selected) == 7 and all(n.startswith("model.language_model.layers.1.") for n in selected.values())
