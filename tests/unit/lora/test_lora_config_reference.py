"""`[lora]` as configured and used outside the adapter file: refused combinations (exit-2 config
errors), target selection errors, GRPO's reference (the policy with its adapters switched off equals
a separate copy of the base model, and leaves the policy's adapters and train mode as they were), and
a training step that changes the adapters only."""
import copy
from pathlib import Path

import pytest
import torch

from megatron_vlm.config import ConfigError, load_config
from megatron_vlm.config.mode_keys import check_keys_for_mode
from megatron_vlm.config.sections import LoRAConfig
from megatron_vlm.models import build_model
from megatron_vlm.models.common.lora import lora_modules
from megatron_vlm.rl.reference import BaseModelReference, ReferencePolicy
from megatron_vlm.training.lm_loss import TokenLogprobModel
from megatron_vlm.training.lora import select_lora_targets, setup_lora
from tests.fixtures import tiny_qwen2_5_vl as FQ

CONFIGS = Path(__file__).resolve().parents[3] / "launch" / "configs"


def test_config_refusals():
    cfg = load_config(CONFIGS / "demo_sft.toml", ["lora.r=4", "train.train_layers=[]"])
    assert cfg.lora == LoRAConfig(r=4)
    with pytest.raises(ConfigError, match="train_layers"):  # the demo trains listed layers in full
        load_config(CONFIGS / "demo_sft.toml", ["lora.r=4"])
    with pytest.raises(ConfigError, match="lora.r"):
        load_config(CONFIGS / "demo_sft.toml", ["lora.r=0", "train.train_layers=[]"])
    grpo = load_config(CONFIGS / "demo_math_grpo.toml", ["lora.r=4", "rl.update.ref_offload=true"])
    with pytest.raises(ConfigError, match="rl.update.ref_offload"):
        check_keys_for_mode(grpo)


def test_target_selection_errors():
    cfg = FQ.tiny_qwen2_5_vl_config_dict()
    model = build_model(cfg)
    with pytest.raises(ValueError, match="nope"):
        select_lora_targets(model, cfg, ["q_proj", "nope"], include_vision=False)
    # gate_proj exists in the vision tower too, but only decoder layers are candidates by default
    only = select_lora_targets(model, cfg, ["gate_proj"], include_vision=False)
    assert sorted(only) == [f"language_model.layers.{i}.mlp.gate_proj" for i in range(2)]
    both = select_lora_targets(model, cfg, ["gate_proj"], include_vision=True)
    assert len(both) == 2 + 3  # + the vision blocks' MLPs (their q/k/v are fused in transformers: never names)
    with pytest.raises(ValueError, match="fused"):
        select_lora_targets(model, cfg, [r"model\.visual\.blocks\.0\.attn\.qkv"], include_vision=True)


def _packed_batch(g):
    ids = torch.randint(0, 250, (20,), generator=g)
    labels = torch.cat([ids[1:], torch.tensor([-100])])
    labels[:5] = -100
    return {"input_ids": ids[None], "labels": labels[None], "cu_seqlens": torch.tensor([0, 9, 20], dtype=torch.int32)}


def test_grpo_reference_is_the_base_model_and_one_step_trains_adapters_only():
    cfg = FQ.tiny_qwen2_5_vl_config_dict()
    torch.manual_seed(0)
    model = build_model(cfg)
    base_copy = ReferencePolicy(copy.deepcopy(model), device=torch.device("cpu"), offload=False, temperature=0.7)
    setup_lora(model, LoRAConfig(r=4, alpha=8.0, dropout=0.2), cfg)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.weight.normal_(0, 0.3)
    wrapper = TokenLogprobModel(model).train()
    ref = BaseModelReference(wrapper, model, temperature=0.7)
    batch = _packed_batch(torch.Generator().manual_seed(1))
    with ref.on_device():
        got = ref.token_logprobs(batch)
    assert torch.allclose(got, base_copy.token_logprobs(batch), atol=1e-6, rtol=0)
    assert wrapper.training and all(m.lora_enabled for m in lora_modules(model).values())
    with torch.no_grad():
        wrapper.eval()
        policy = wrapper(batch, temperature=0.7)
    assert (policy - got).abs().max() > 1e-3  # the policy does use its adapters

    wrapper.train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = [p for p in wrapper.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    (-wrapper(batch).sum()).backward()
    opt.step()
    for n, p in model.named_parameters():
        changed = not torch.equal(before[n], p.detach())
        assert changed == (".lora_" in n), n
