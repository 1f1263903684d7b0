"""The asynchronous weight push after a step must carry every tensor that training changes, not only the trainable
parameters: an MoE router's score-correction bias (`moe.enable_moe_load_balancing_training`) is a buffer the load
balancer moves after every update, and it picks the experts the rollout ranks route through. Pushed once at start and
never again, the rollout ranks would route with the start bias for the whole run, while the trainer's proximal
log-probs use the moved one."""
from __future__ import annotations

import torch

from megatron_vlm.models import build_model
from megatron_vlm.models.common.moe import moe_layers
from megatron_vlm.rl.asynchronous.weights import push_weights, receive_weights, trainable_names
from megatron_vlm.training.moe_balancing import update_correction_bias
from tests.unit.rl.test_async_weights import LoopbackBridge

TEXT = dict(
    model_type="nemotron_h", vocab_size=64, hidden_size=16, layers_block_type=["moe", "linear_attention", "moe"],
    num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=16, mamba_num_heads=2,
    mamba_head_dim=8, ssm_state_size=4, n_groups=1, chunk_size=4, n_routed_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=8, moe_shared_expert_intermediate_size=8,
)


def test_a_push_after_a_step_carries_the_moved_router_bias():
    torch.manual_seed(0)
    trainer = build_model(dict(TEXT)).train()
    rollout = build_model(dict(TEXT)).eval().requires_grad_(False)
    rollout.load_state_dict(trainer.state_dict())
    layers = moe_layers(trainer)
    assert layers and all(layer.gate.e_score_correction_bias is not None for layer in layers)
    for layer in layers:  # the load balancer's update after a step with a skewed expert load
        update_correction_bias(layer.gate.e_score_correction_bias, torch.tensor([40.0, 30.0, 2.0, 0.0]), 1e-2)
    bridge = LoopbackBridge()
    push_weights(trainer, bridge, 1, trainable_names(trainer))  # as AsyncGRPOLoopStep pushes after every step
    bridge.replaying = True
    receive_weights(rollout, bridge, bridge.broadcast_object())
    want, got = trainer.state_dict(), rollout.state_dict()
    for name in want:
        if name.endswith("e_score_correction_bias"):
            assert torch.equal(got[name], want[name]), f"{name} not pushed"
    assert any(n.endswith("e_score_correction_bias") for n in want)
