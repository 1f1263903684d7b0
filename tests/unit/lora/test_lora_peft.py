"""LoRA in PEFT's format against `peft` itself (fp32, tiny random models): an adapter we write loads into
transformers through `PeftModel.from_pretrained` and gives our logits; the merged export loaded by
transformers gives the same logits; gradients reach the adapter factors only, and equal PEFT's; an
adapter PEFT writes loads into our model; disabling the adapters gives the base model exactly."""
import pytest
import torch

pytest.importorskip("peft")
from peft import PeftModel  # noqa: E402

import megatron_vlm.testing.tiny_processor_internvl as FI  # noqa: E402
from megatron_vlm.checkpoint.hf import save_hf_model  # noqa: E402
from megatron_vlm.checkpoint.peft_format import read_peft_adapter  # noqa: E402
from megatron_vlm.config.sections import LoRAConfig  # noqa: E402
from megatron_vlm.models import build_model  # noqa: E402
from megatron_vlm.models.common.lora import lora_disabled, lora_modules  # noqa: E402
from megatron_vlm.models.internvl.state_dict_adapter import InternVLStateDictAdapter  # noqa: E402
from megatron_vlm.models.qwen2_5_vl.state_dict_adapter import Qwen2_5_VLStateDictAdapter  # noqa: E402
from megatron_vlm.training.lora import setup_lora, write_adapter  # noqa: E402
from tests.fixtures import tiny_qwen2_5_vl as FQ  # noqa: E402
from tests.fixtures.parity import TOL, assert_logits_close  # noqa: E402


def _qwen():
    hf = FQ.hf_reference_model(seed=0)
    cfg = FQ.tiny_qwen2_5_vl_config_dict()
    ours = build_model(cfg)
    conv, _ = Qwen2_5_VLStateDictAdapter(ours.args).from_hf(hf.state_dict())
    ours.load_state_dict(conv, strict=True)
    batch = FQ.batch_samples([FQ.build_sample([5, ("image", (1, 4, 6)), 7], torch.Generator().manual_seed(2))])
    run = lambda m, b: m(b["input_ids"], b.get("attention_mask"), b.get("pixel_values"), b.get("image_grid_thw"),  # noqa: E731
                         None, None, None, b["mm_token_type_ids"])
    return hf, ours, cfg, batch, run


def _internvl():
    hf = FI.hf_reference_model(seed=0)
    cfg = FI.tiny_internvl_config_dict()
    ours = build_model(cfg)
    conv, _ = InternVLStateDictAdapter(ours.args).from_hf(hf.state_dict())
    ours.load_state_dict(conv, strict=False)
    ours.tie_weights()
    batch = FI.batch_samples([FI.build_sample([5, ("image", 2), 7], torch.Generator().manual_seed(2))])
    run = lambda m, b: m(b["input_ids"], b.get("attention_mask"), b.get("pixel_values"))  # noqa: E731
    return hf, ours, cfg, batch, run


# Qwen2.5-VL: decoder only (its vision q/k/v are one fused `qkv` in transformers); InternVL: vision tower too,
# rsLoRA and a regex entry
CASES = {
    "qwen2_5_vl": (_qwen, LoRAConfig(r=4, alpha=8.0)),
    "internvl": (_internvl, LoRAConfig(r=4, alpha=6.0, use_rslora=True, include_vision=True,
                                      target_modules=["q_proj", "v_proj", "down_proj", r"model\.vision_tower\..*\.fc2"])),
}


def _randomize_adapters(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_A.weight.copy_(torch.randn(m.lora_A.weight.shape, generator=g) * 0.2)
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.2)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    build, lora_cfg = CASES[request.param]
    hf, ours, cfg, batch, run = build()
    ours.eval()
    with torch.no_grad():
        base_logits = run(ours, batch)
    targets = setup_lora(ours, lora_cfg, cfg)
    _randomize_adapters(ours)
    folder = tmp_path_factory.mktemp(request.param) / "adapter"
    write_adapter(folder, ours.state_dict(), cfg, lora_cfg)
    peft_model = PeftModel.from_pretrained(hf, str(folder), is_trainable=True).eval()
    return dict(name=request.param, hf=peft_model, ours=ours, cfg=cfg, lora=lora_cfg, batch=batch, run=run,
                base_logits=base_logits, targets=targets, folder=folder, tmp=folder.parent)


def test_targets(case):
    names = set(case["targets"].values())
    if case["name"] == "qwen2_5_vl":  # the seven projections of both decoder layers, nothing in the vision tower
        assert len(names) == 14 and all(n.startswith("model.language_model.layers.") for n in names)
    else:
        assert any(n.startswith("model.vision_tower.") and n.endswith("attention.q_proj") for n in names)
        assert any(n.endswith("mlp.fc2") for n in names) and not any(n.endswith("k_proj") for n in names)


def test_peft_loads_our_adapter_with_equal_logits(case):
    b = case["batch"]
    with torch.no_grad():
        ref = case["hf"](**b).logits
        out = case["run"](case["ours"], b)
    assert (ref - case["base_logits"]).abs().max() > 100 * TOL  # the adapters change the output
    assert_logits_close(ref, out)


def test_disabled_adapters_give_the_base_model(case):
    with torch.no_grad(), lora_disabled(case["ours"]):
        out = case["run"](case["ours"], case["batch"])
    assert torch.equal(out, case["base_logits"])


def test_merged_export_loads_in_transformers(case):
    from transformers import AutoModelForImageTextToText

    out_dir = save_hf_model(case["ours"], case["tmp"] / "merged")
    merged = AutoModelForImageTextToText.from_pretrained(str(out_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = case["hf"](**case["batch"]).logits
        got = merged(**case["batch"]).logits
    assert_logits_close(ref, got)


def test_only_adapters_get_gradients_equal_to_peft(case):
    ours, hf, b = case["ours"], case["hf"], case["batch"]
    ours.zero_grad(set_to_none=True)
    hf.zero_grad(set_to_none=True)
    w = torch.randn(case["base_logits"].shape, generator=torch.Generator().manual_seed(3))
    (case["run"](ours, b) * w).sum().backward()
    (hf(**b).logits * w).sum().backward()
    for name, p in ours.named_parameters():
        is_lora = ".lora_A." in name or ".lora_B." in name
        assert p.requires_grad == is_lora, name
        assert (p.grad is not None) == is_lora, name
    theirs = {n: p for n, p in hf.named_parameters() if p.requires_grad}
    assert len(theirs) == 2 * len(case["targets"])
    for ours_name, peft_name in case["targets"].items():
        m = lora_modules(ours)[ours_name]
        for part in ("lora_A", "lora_B"):
            g_ref = theirs[f"base_model.model.{peft_name}.{part}.default.weight"].grad
            g = getattr(m, part).weight.grad
            assert torch.allclose(g, g_ref, atol=1e-4, rtol=1e-3), (ours_name, part)


def test_adapter_round_trip_and_continue_from_it(case):
    """init_from: a fresh model given the adapter folder computes the same logits (continue) — and so
    does one that merges it into the base weights (merge; its new adapter starts at B = 0)."""
    _, factors = read_peft_adapter(case["folder"], case["cfg"])
    assert set(factors) == set(case["targets"])
    ref = None
    for mode in ("continue", "merge"):
        hf, fresh, cfg, batch, run = {"qwen2_5_vl": _qwen, "internvl": _internvl}[case["name"]]()
        lora = LoRAConfig(r=case["lora"].r, alpha=case["lora"].alpha, use_rslora=case["lora"].use_rslora,
                          init_from=str(case["folder"]), init_from_mode=mode)
        setup_lora(fresh.eval(), lora, cfg)
        with torch.no_grad():
            out = run(fresh, batch)
        ref = case["run"](case["ours"], batch).detach() if ref is None else ref
        assert_logits_close(ref, out)
    bad = LoRAConfig(r=case["lora"].r * 2, alpha=case["lora"].alpha, init_from=str(case["folder"]))
    with pytest.raises(ValueError, match="r = "):
        setup_lora(build_model(case["cfg"]), bad, case["cfg"])
