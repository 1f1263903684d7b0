"""`lora.target_modules = ["all-linear"]`, PEFT's shorthand (and ms-swift's default `--target_modules all-linear`):
every adaptable linear layer in scope, never the LM head. It was taken as a regex that matches no module name, so a
config copied from PEFT / ms-swift stopped with "match no adaptable linear layer". Reference: the layers PEFT itself
adapts for target_modules="all-linear" on transformers' model (those of the language model; with include_vision the
vision tower's too, but for its q/k/v, fused into one `qkv` in transformers, which has no single counterpart here)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402

from megatron_vlm.models import build_model  # noqa: E402
from megatron_vlm.training.lora import select_lora_targets  # noqa: E402
from tests.fixtures import tiny_qwen2_5_vl as FQ  # noqa: E402


def _peft_all_linear() -> set[str]:
    hf = get_peft_model(FQ.hf_reference_model(seed=0), LoraConfig(r=2, target_modules="all-linear"))
    prefix = "base_model.model."
    return {n[len(prefix):] for n, m in hf.named_modules() if hasattr(m, "lora_A") and isinstance(m.lora_A, torch.nn.ModuleDict)}


def test_all_linear_adapts_what_peft_adapts():
    cfg = FQ.tiny_qwen2_5_vl_config_dict()
    model = build_model(cfg)
    peft = _peft_all_linear()
    ours = set(select_lora_targets(model, cfg, ["all-linear"], include_vision=False).values())
    assert ours == {n for n in peft if n.startswith("model.language_model.")} and ours
    with_vision = set(select_lora_targets(model, cfg, ["all-linear"], include_vision=True).values())
    assert with_vision - ours and with_vision <= peft
    assert peft - with_vision == {n for n in peft if n.endswith(".attn.qkv")}  # fused in transformers: no twin here
