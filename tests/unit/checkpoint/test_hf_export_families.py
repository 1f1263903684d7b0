"""`save_hf_model(..., dtype=torch.bfloat16)` for every family's tiny synthesized folder (the `model.synthesize`
names): config.json says bfloat16 (the dtype transformers' `dtype="auto"` and vLLM load in), every floating tensor
is bf16 but those the model keeps fp32 on purpose, transformers' class on the folder gives the logits of ours on
it (fp32 compute of the same bf16 values), and our loader reads back exactly the bf16-rounded weights. The fp32
round trips with images and videos are each family's own checkpoint test (tests/unit/models/)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from megatron_vlm.checkpoint.hf import _fp32_by_design, load_hf_model, save_hf_model
from megatron_vlm.testing.synthesize import synthesize_model_folder

FAMILIES = ["tiny_qwen2_5_vl", "tiny_qwen3_vl", "tiny_qwen3_vl_moe", "tiny_internvl", "tiny_nemotron_vl",
            "tiny_qwen2", "tiny_qwen3", "tiny_qwen3_moe"]
"""`tiny_nemotron_qwen3_vision` is left out: transformers has no class for that composition."""


@pytest.mark.parametrize("name", FAMILIES)
def test_bf16_export_loads_in_transformers_and_back(tmp_path, name):
    import transformers

    src = synthesize_model_folder(name, tmp_path / "src", seed=1)
    ours = load_hf_model(src).eval()
    out = save_hf_model(ours, tmp_path / "bf16", dtype=torch.bfloat16, copy_from=src)

    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), "pt") as r:
        dtypes = {str(r.get_slice(k).get_dtype()) for k in r.keys()}  # noqa: SIM118 -- safe_open handles are not iterable
    assert "BF16" in dtypes and not dtypes - {"BF16", "F32", "I64"}, dtypes
    assert transformers.AutoTokenizer.from_pretrained(out).pad_token_id is not None  # tokenizer files copied

    kept = _fp32_by_design(ours)
    expected = {k: v if k in kept or not v.is_floating_point() else v.to(torch.bfloat16)
                for k, v in ours.state_dict().items()}
    back = load_hf_model(out, dtype=torch.bfloat16).state_dict()
    assert back.keys() == expected.keys()
    assert all(torch.equal(back[k], expected[k]) for k in expected)

    causal = ours.hf_config.get("architectures", [""])[0].endswith("ForCausalLM")
    auto = transformers.AutoModelForCausalLM if causal else transformers.AutoModelForImageTextToText
    hf = auto.from_pretrained(out, dtype=torch.float32).eval()
    again = load_hf_model(out, dtype=torch.float32).eval()
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(again(ids), hf(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
