"""MoE block: parity with transformers' NemotronHMoE and Qwen3-VL-MoE sparse block, auxiliary-free
load balancing (bias update) on a skewed router, load metrics and the auxiliary loss."""
import math

import pytest
import torch
from torch import nn

from megatron_vlm.models.common.moe import MoE, moe_layers, moe_load_metrics, moe_load_report, moe_load_table, relu2


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


def balance(load):
    """(max share * E, entropy / log E): (1, 1) is perfectly uniform."""
    frac = load / load.sum()
    nz = frac[frac > 0]
    return float(frac.max() * len(frac)), float(-(nz * nz.log()).sum() / math.log(len(frac)))


def test_bias_update_moves_load_toward_uniform():
    moe = make_skewed_moe()
    gen = torch.Generator().manual_seed(3)
    history = []
    for _ in range(50):
        x = torch.randn(256, 16, generator=gen).abs()  # positive inputs keep the skew
        with torch.no_grad():
            moe(x)
        history.append(balance(moe.step_load.clone()))
        moe.update_bias(0.02)
        assert moe.step_load.sum() == 0  # reset after each update
    first_max, first_entropy = history[0]
    assert first_max > 3.5 and first_entropy < 0.5, f"router not skewed enough for the test: {history[0]}"
    late = history[-10:]
    mean_max = sum(m for m, _ in late) / len(late)
    mean_entropy = sum(e for _, e in late) / len(late)
    assert mean_max < 2.5 and mean_entropy > 0.9, f"load did not move toward uniform: {history[0]} -> {late}"
    bias = moe.gate.e_score_correction_bias
    assert bias[:2].max() < bias[2:].min()  # the favoured experts were pushed down
    assert abs(float(bias.mean())) < 1e-6  # centred updates


def test_bias_update_does_not_change_outputs_weights_only_selection():
    """The bias picks experts but the combine weights stay the unbiased scores."""
    moe = make_skewed_moe().eval()
    x = torch.randn(5, 16)
    with torch.no_grad():
        scores, w0, ids0 = moe.gate(x)
        moe.gate.e_score_correction_bias.copy_(torch.linspace(-1, 1, 8))
        _, w1, ids1 = moe.gate(x)
    torch.testing.assert_close(w1, scores.gather(1, ids1) / scores.gather(1, ids1).sum(-1, keepdim=True))


def test_load_metrics_and_table_hand_computed():
    a, b = make_skewed_moe(num_experts=4), make_skewed_moe(num_experts=4)
    a.report_load.copy_(torch.tensor([2.0, 2.0, 0.0, 4.0]))
    b.report_load.copy_(torch.tensor([1.0, 1.0, 1.0, 1.0]))
    m = moe_load_metrics([a, b])
    ent_a = -(2 * 0.25 * math.log(0.25) + 0.5 * math.log(0.5))
    assert m["moe/entropy_mean"] == pytest.approx((ent_a + math.log(4)) / 2)
    assert m["moe/max_fraction_max"] == pytest.approx(0.5)
    assert m["moe/tokens_per_layer_mean"] == pytest.approx((8 / 2 + 4 / 2) / 2)
    assert moe_load_table([a, b]) == [[2, 2, 0, 4], [1, 1, 1, 1]]
    metrics, table = moe_load_report([a, b])
    assert table == [[2, 2, 0, 4], [1, 1, 1, 1]] and metrics == m
    assert a.report_load.sum() == 0 and moe_load_metrics([a, b]) == {}


def test_forward_counts_tokens_and_respects_token_mask():
    moe = make_skewed_moe()
    x = torch.randn(2, 6, 16)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, :4] = False
    with torch.no_grad():
        moe(x, token_mask=mask)
        _, _, ids = moe.gate(x.reshape(-1, 16))
    expected = torch.bincount(ids[mask.reshape(-1)].reshape(-1), minlength=8)
    assert torch.equal(moe.step_load, expected) and torch.equal(moe.report_load, expected)
    moe.eval()
    with torch.no_grad():
        moe(x)
    assert torch.equal(moe.step_load, expected)  # eval forwards do not count
    assert moe_layers(nn.Sequential(moe, nn.Linear(2, 2))) == [moe]


def test_aux_loss_matches_formula_and_has_grad():
    moe = make_skewed_moe()
    moe.aux_loss_coef = 0.1
    x = torch.randn(10, 16)
    moe(x)
    loss = moe.last_aux_loss
    with torch.no_grad():
        scores, _, ids = moe.gate(x)
    probs = scores / scores.sum(-1, keepdim=True)
    expected = 0.0
    for e in range(8):
        f_e = float((ids == e).sum()) / (10 * 2)
        expected += f_e * float(probs[:, e].mean())
    assert float(loss.detach()) == pytest.approx(0.1 * 8 * expected, rel=1e-5)
    loss.backward()
    assert moe.gate.weight.grad is not None and moe.gate.weight.grad.abs().sum() > 0


def test_bias_stays_fp32_and_counters_follow_the_device():
    moe = make_skewed_moe().to(torch.bfloat16)
    assert moe.gate.e_score_correction_bias.dtype == torch.float32
    assert moe.gate.weight.dtype == torch.bfloat16
    with torch.no_grad():
        moe(torch.randn(4, 16, dtype=torch.bfloat16))
    assert moe.step_load.dtype == torch.int64 and int(moe.step_load.sum()) == 8
    moe.update_bias(1e-3)
    assert moe.gate.e_score_correction_bias.abs().max() > 0


def test_router_config_errors():
    with pytest.raises(ValueError, match="n_group"):
        MoE(8, num_experts=6, top_k=2, moe_intermediate_size=4, activation="relu2", gated_experts=False, n_group=4)
    with pytest.raises(ValueError, match="top_k"):
        MoE(8, num_experts=4, top_k=5, moe_intermediate_size=4, activation="relu2", gated_experts=False)
    with pytest.raises(ValueError, match="activation"):
        MoE(8, num_experts=4, top_k=2, moe_intermediate_size=4, activation="tanh", gated_experts=False)
