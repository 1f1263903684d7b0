"""LoRA on Nemotron-3-Nano-VL (nemotron_h_omni) against `peft` on transformers' NemotronH_Omni_Reasoning_V3:
the default targets (attention q/k/v/o, the relu^2 MLP and shared-expert up/down) get PEFT names, the adapter
we write loads through `PeftModel.from_pretrained` and gives our logits. Why a test of its own: the family's
export adds a constant tensor (RADIO's `summary_idxs`) to every conversion, which once left every layer
without a PEFT name, so `[lora]` on this family was refused with "match no adaptable linear layer"."""
import pytest
import torch

pytest.importorskip("peft")
from peft import PeftModel  # noqa: E402

from megatron_vlm.checkpoint.peft_format import read_peft_adapter  # noqa: E402
from megatron_vlm.config.sections import LoRAConfig  # noqa: E402
from megatron_vlm.models.common.lora import lora_modules  # noqa: E402
from megatron_vlm.training.lora import setup_lora, write_adapter  # noqa: E402
from tests.unit.models.test_nemotron_vl import TOL, images, make_hf, prompt  # noqa: E402


def test_default_targets_load_in_peft_with_equal_logits(tmp_path):
    import json

    from megatron_vlm.checkpoint.hf import load_hf_model

    hf = make_hf(False)
    hf.save_pretrained(tmp_path / "base")
    ours = load_hf_model(tmp_path / "base").eval()
    cfg = json.loads((tmp_path / "base" / "config.json").read_text())
    lora_cfg = LoRAConfig(r=4, alpha=8.0)
    targets = setup_lora(ours, lora_cfg, cfg)
    hf_linear = {n for n, m in hf.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(targets.values()) <= hf_linear
    suffixes = {n.rsplit(".", 1)[1] for n in targets.values()}
    assert suffixes == {"q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"}, suffixes
    assert all(n.startswith("language_model.") for n in targets)  # the vision tower is left alone by default
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in lora_modules(ours).values():
            m.lora_A.weight.copy_(torch.randn(m.lora_A.weight.shape, generator=g) * 0.2)
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.2)
    write_adapter(tmp_path / "adapter", ours.state_dict(), cfg, lora_cfg)
    _, factors = read_peft_adapter(tmp_path / "adapter", cfg)  # init_from / eval.adapter read it back by name
    assert set(factors) == set(targets)
    peft_model = PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
    pixels, grid = images(2, [(4, 6)])
    ids = prompt(3, [6])
    with torch.no_grad():
        with peft_model.disable_adapter():
            base = peft_model(input_ids=ids, pixel_values=pixels, image_grid_hw=grid).logits
        ref = peft_model(input_ids=ids, pixel_values=pixels, image_grid_hw=grid).logits
        out = ours(ids, pixel_values=pixels, image_grid_hw=grid)
    assert (ref - base).abs().max() > 1e-2  # the adapters change the output
    torch.testing.assert_close(out, ref, **TOL)
