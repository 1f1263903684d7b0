"""MoELoadBalancer / MoEConfig: the trainer-side driver of auxiliary-free balancing and reporting,
and load counting under activation checkpointing (the recomputed forward must not count twice)."""
import pytest
import torch

from megatron_vlm.models import build_model
from megatron_vlm.models.common.moe import MoE, MoEConfig, MoELoadBalancer, moe_layers
from megatron_vlm.parallel import apply_ac

TEXT = dict(
    model_type="nemotron_h", vocab_size=64, hidden_size=16, layers_block_type=["moe", "linear_attention", "moe"],
    num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=16, mamba_num_heads=2,
    mamba_head_dim=8, ssm_state_size=4, n_groups=1, chunk_size=4, n_routed_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=8, moe_shared_expert_intermediate_size=8,
)


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return build_model(dict(TEXT)).train()


def test_after_step_sums_ranks_updates_bias_and_reports_every_n():
    model = tiny_model()
    calls = []

    def fake_all_reduce(t):  # two identical ranks
        calls.append(t.shape)
        t.mul_(2)

    balancer = MoELoadBalancer(model, MoEConfig(bias_update_rate=0.01, n_step_per_workload_report=2), all_reduce=fake_all_reduce)
    ids = torch.randint(0, 64, (2, 5))
    model(ids)
    local = [layer.step_load.clone() for layer in balancer.layers]
    assert [int(x.sum()) for x in local] == [2 * 5 * 2] * 2
    assert balancer.after_step(1) is None
    for layer, load in zip(balancer.layers, local):
        delta = 0.01 * torch.sign((2 * load).double().mean() - 2 * load)
        torch.testing.assert_close(layer.gate.e_score_correction_bias, (delta - delta.mean()).float())
        assert int(layer.step_load.sum()) == 0
    model(ids)
    metrics, table = balancer.after_step(2)
    assert len(calls) == 3  # step loads twice, report loads once
    assert set(metrics) == {"moe/entropy_mean", "moe/max_fraction_max", "moe/tokens_per_layer_mean"}
    assert metrics["moe/tokens_per_layer_mean"] == pytest.approx(2 * 2 * 10)  # 2 steps x 10 tokens x 2 ranks
    assert len(table) == 2 and all(len(row) == 4 and sum(row) == 2 * 2 * 10 * 2 for row in table)


def test_balancing_off_leaves_bias_and_aux_loss_is_summed():
    model = tiny_model(1)
    balancer = MoELoadBalancer(model, MoEConfig(enable_moe_load_balancing_training=False, aux_loss_coef=0.5,
                                                n_step_per_workload_report=0))
    out = model(torch.randint(0, 64, (1, 6)))
    aux = balancer.aux_loss()
    assert aux is not None and aux.requires_grad and float(aux.detach()) > 0
    assert balancer.aux_loss() is None  # consumed
    (out.float().mean() + aux).backward()
    assert balancer.after_step(1) is None
    assert all(float(layer.gate.e_score_correction_bias.abs().sum()) == 0 for layer in balancer.layers)
    assert all(int(layer.step_load.sum()) == 0 for layer in balancer.layers)


def test_counts_are_not_doubled_by_activation_checkpointing():
    ids = torch.randint(0, 64, (2, 7))
    plain, ckpt = tiny_model(2), tiny_model(2)
    apply_ac(ckpt.transformer_blocks())
    # without early stop the recomputation re-runs each whole block, including the counting code
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        for model in (plain, ckpt):
            model(ids).float().square().mean().backward()
    for a, b in zip(moe_layers(plain), moe_layers(ckpt)):
        assert torch.equal(a.step_load, b.step_load)
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"{name}: {m}")


def test_config_validation():
    with pytest.raises(ValueError, match="bias_update_rate"):
        MoEConfig(bias_update_rate=-1).validate()
    with pytest.raises(ValueError, match="n_step_per_workload_report"):
        MoEConfig(n_step_per_workload_report=-2).validate()
    assert isinstance(moe_layers(tiny_model())[0], MoE)
