"""MoE block: parity with transformers' NemotronHMoE and Qwen3-VL-MoE sparse block, the score-correction
bias (selection only, fp32) and the load statistics a balancing policy reads (`expert_load`,
`router_stats`). The policy itself is tested in tests/unit/training/test_moe_balancing.py."""

import pytest
import torch
from torch import nn

from megatron_vlm.models.common.moe import MoE, moe_layers, relu2


class Relu2MLP(nn.Module):  # NemotronH's shared expert: down(relu(up x)^2), no bias
    def __init__(self, h, f):
        super().__init__()
        self.up_proj, self.down_proj = nn.Linear(h, f, bias=False), nn.Linear(f, h, bias=False)

    def forward(self, x):
        return self.down_proj(relu2(self.up_proj(x)))


def randomise_(module, scale=0.5):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * scale)


@pytest.mark.parametrize("n_group,topk_group,latent", [(1, 1, None), (4, 2, None), (2, 1, 12)])
def test_nemotron_h_moe_parity(n_group, topk_group, latent):
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE

    cfg = NemotronHConfig(
        hidden_size=16, n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=10,
        moe_shared_expert_intermediate_size=14, n_group=n_group, topk_group=topk_group, routed_scaling_factor=2.5,
        norm_topk_prob=True, moe_latent_size=latent, layers_block_type=["moe"],
    )
    torch.manual_seed(0)
    hf = NemotronHMoE(cfg).eval()
    randomise_(hf)
    with torch.no_grad():
        hf.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.3)
    ours = MoE(16, num_experts=8, top_k=3, moe_intermediate_size=10, activation="relu2", gated_experts=False,
               n_group=n_group, topk_group=topk_group, routed_scaling_factor=2.5, latent_size=latent,
               shared_experts=Relu2MLP(16, 14)).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    x = torch.randn(2, 9, 16)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x), rtol=1e-5, atol=1e-5)


def test_qwen3_vl_moe_softmax_gated_parity():
    from transformers import Qwen3VLMoeTextConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextSparseMoeBlock

    cfg = Qwen3VLMoeTextConfig(hidden_size=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=8, hidden_act="silu")
    torch.manual_seed(1)
    hf = Qwen3VLMoeTextSparseMoeBlock(cfg).eval()
    randomise_(hf)
    ours = MoE(16, num_experts=6, top_k=2, moe_intermediate_size=8, activation="silu", gated_experts=True,
               score_func="softmax", norm_topk_prob=True, score_correction_bias=False).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    x = torch.randn(3, 5, 16)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x), rtol=1e-5, atol=1e-5)


def make_skewed_moe(num_experts=8, top_k=2, hidden=16):
    torch.manual_seed(2)
    moe = MoE(hidden, num_experts=num_experts, top_k=top_k, moe_intermediate_size=4, activation="relu2",
              gated_experts=False)
    moe.reset_parameters()
    with torch.no_grad():  # a router that strongly prefers experts 0 and 1
        moe.gate.weight.copy_(torch.randn(num_experts, hidden) * 0.1)
        moe.gate.weight[:2] += 0.6
    return moe.train()


def test_bias_update_does_not_change_outputs_weights_only_selection():
    """The bias picks experts but the combine weights stay the unbiased scores."""
    moe = make_skewed_moe().eval()
    x = torch.randn(5, 16)
    with torch.no_grad():
        scores, w0, ids0 = moe.gate(x)
        moe.gate.e_score_correction_bias.copy_(torch.linspace(-1, 1, 8))
        _, w1, ids1 = moe.gate(x)
    torch.testing.assert_close(w1, scores.gather(1, ids1) / scores.gather(1, ids1).sum(-1, keepdim=True))


def test_forward_counts_tokens_and_respects_token_mask():
    moe = make_skewed_moe()
    x = torch.randn(2, 6, 16)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, :4] = False
    with torch.no_grad():
        moe(x, token_mask=mask)
        _, _, ids = moe.gate(x.reshape(-1, 16))
    expected = torch.bincount(ids[mask.reshape(-1)].reshape(-1), minlength=8)
    assert torch.equal(moe.expert_load, expected)
    assert moe.router_stats is None  # not recorded unless a policy asks
    moe.eval()
    with torch.no_grad():
        moe(x)
    assert torch.equal(moe.expert_load, expected)  # eval forwards do not count
    moe.reset_expert_load()
    assert int(moe.expert_load.sum()) == 0
    assert moe_layers(nn.Sequential(moe, nn.Linear(2, 2))) == [moe]


def test_router_stats_when_recorded():
    moe = make_skewed_moe()
    moe.record_router_stats = True
    x = torch.randn(10, 16)
    moe(x)
    stats = moe.router_stats
    with torch.no_grad():
        scores, _, ids = moe.gate(x)
    torch.testing.assert_close(stats.scores.detach(), scores)
    assert torch.equal(stats.tokens_per_expert, torch.bincount(ids.reshape(-1), minlength=8))
    assert stats.top_k == 2 and stats.scores.requires_grad  # graph kept for an auxiliary loss


def test_bias_stays_fp32_and_counters_follow_the_device():
    moe = make_skewed_moe().to(torch.bfloat16)
    assert moe.gate.e_score_correction_bias.dtype == torch.float32
    assert moe.gate.weight.dtype == torch.bfloat16
    with torch.no_grad():
        moe(torch.randn(4, 16, dtype=torch.bfloat16))
    assert moe.expert_load.dtype == torch.int64 and int(moe.expert_load.sum()) == 8
    with torch.no_grad():
        moe.gate.e_score_correction_bias += 1e-4  # an update far below bf16's resolution near 1 survives
    assert moe.gate.e_score_correction_bias.dtype == torch.float32
    assert float(moe.gate.e_score_correction_bias[0]) == pytest.approx(1e-4)


def test_router_config_errors():
    with pytest.raises(ValueError, match="n_group"):
        MoE(8, num_experts=6, top_k=2, moe_intermediate_size=4, activation="relu2", gated_experts=False, n_group=4)
    with pytest.raises(ValueError, match="top_k"):
        MoE(8, num_experts=4, top_k=5, moe_intermediate_size=4, activation="relu2", gated_experts=False)
    with pytest.raises(ValueError, match="activation"):
        MoE(8, num_experts=4, top_k=2, moe_intermediate_size=4, activation="tanh", gated_experts=False)
