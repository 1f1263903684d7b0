"""Our PEFT adapter folder loads with PEFT's one-liner `AutoPeftModel*.from_pretrained(adapter)`, which builds the
base model named by `base_model_name_or_path` itself: a text family's through `AutoPeftModelForCausalLM` (the
adapter says task_type = "CAUSAL_LM"), a vision-language family's through `AutoPeftModel` (its `auto_mapping`
names transformers' class), each with the logits of our adapted model. The adapter used to name neither, and
both raised "Cannot infer the auto class from the config"."""
from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")

from megatron_vlm.checkpoint.hf import load_hf_model  # noqa: E402
from megatron_vlm.config.sections import LoRAConfig  # noqa: E402
from megatron_vlm.testing.synthesize import synthesize_model_folder  # noqa: E402
from megatron_vlm.training.lora import setup_lora, write_adapter  # noqa: E402


def _adapted(name, tmp_path):
    src = synthesize_model_folder(name, tmp_path / "src", seed=3)
    model = load_hf_model(src).eval()
    cfg = LoRAConfig(r=4, alpha=8.0)
    setup_lora(model, cfg, model.hf_config)
    with torch.no_grad():  # trained: B != 0
        g = torch.Generator().manual_seed(0)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    adapter = write_adapter(tmp_path / "adapter", model.state_dict(), model.hf_config, cfg,
                            base_model_name_or_path=str(src))
    return model, adapter


@pytest.mark.parametrize("name,auto", [("tiny_qwen3", "AutoPeftModelForCausalLM"), ("tiny_qwen2_5_vl", "AutoPeftModel")])
def test_auto_peft_model_loads_our_adapter_with_our_logits(tmp_path, name, auto):
    model, adapter = _adapted(name, tmp_path)
    theirs = getattr(peft, auto).from_pretrained(str(adapter), dtype=torch.float32).eval()
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(theirs(input_ids=ids).logits, model(ids), rtol=1e-4, atol=1e-4)
