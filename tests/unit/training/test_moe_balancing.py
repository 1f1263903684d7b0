"""MoE load-balancing policy (`training/moe_balancing.py`): the bias update rule on a skewed router, the
load metrics / table, the Switch auxiliary loss, the `MoELoadBalancer` driver (rank sums, bias
updates, reports) and load counting under activation checkpointing (the recomputed forward must not
count twice)."""
import math

import pytest
import torch

from megatron_vlm.models import build_model
from megatron_vlm.models.common.moe import MoE, moe_layers
from megatron_vlm.parallel import apply_ac
from megatron_vlm.training.moe_balancing import (
    MoEConfig,
    MoELoadBalancer,
    moe_load_metrics,
    moe_load_table,
    switch_aux_loss,
    uncounted_expert_load,
    update_correction_bias,
)

TEXT = dict(
    model_type="nemotron_h", vocab_size=64, hidden_size=16, layers_block_type=["moe", "linear_attention", "moe"],
    num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=16, mamba_num_heads=2,
    mamba_head_dim=8, ssm_state_size=4, n_groups=1, chunk_size=4, n_routed_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=8, moe_shared_expert_intermediate_size=8,
)


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return build_model(dict(TEXT)).train()


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
        history.append(balance(moe.expert_load.clone()))
        update_correction_bias(moe.gate.e_score_correction_bias, moe.expert_load, 0.02)
        moe.reset_expert_load()
    first_max, first_entropy = history[0]
    assert first_max > 3.5 and first_entropy < 0.5, f"router not skewed enough for the test: {history[0]}"
    late = history[-10:]
    mean_max = sum(m for m, _ in late) / len(late)
    mean_entropy = sum(e for _, e in late) / len(late)
    assert mean_max < 2.5 and mean_entropy > 0.9, f"load did not move toward uniform: {history[0]} -> {late}"
    bias = moe.gate.e_score_correction_bias
    assert bias[:2].max() < bias[2:].min()  # the favoured experts were pushed down
    assert abs(float(bias.mean())) < 1e-6  # centred updates


def test_load_metrics_and_table_hand_computed():
    a, b = torch.tensor([2, 2, 0, 4]), torch.tensor([1, 1, 1, 1])
    m = moe_load_metrics([a, b], [2, 2])
    ent_a = -(2 * 0.25 * math.log(0.25) + 0.5 * math.log(0.5))
    assert m["moe/entropy_mean"] == pytest.approx((ent_a + math.log(4)) / 2)
    assert m["moe/max_fraction_max"] == pytest.approx(0.5)
    assert m["moe/tokens_per_layer_mean"] == pytest.approx((8 / 2 + 4 / 2) / 2)
    assert moe_load_table([a, b]) == [[2, 2, 0, 4], [1, 1, 1, 1]]
    assert moe_load_metrics([torch.zeros(4), torch.zeros(4)], [2, 2]) == {}


def test_aux_loss_matches_formula_and_has_grad():
    moe = make_skewed_moe()
    moe.record_router_stats = True
    x = torch.randn(10, 16)
    moe(x)
    stats = moe.router_stats
    loss = 0.1 * switch_aux_loss(stats.scores, stats.tokens_per_expert, stats.top_k)
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


def test_aux_loss_of_a_forward_without_tokens_is_zero_not_nan():
    """A block that routed no token this forward has no load to balance: its term is 0 (mean of nothing would be
    NaN and poison the whole loss), and the other blocks' terms and gradients are kept."""
    moe, empty = make_skewed_moe(), make_skewed_moe()
    bal = MoELoadBalancer(torch.nn.ModuleList([moe, empty]), MoEConfig(aux_loss_coef=0.1))
    x = torch.randn(10, 16)
    moe(x)
    empty(torch.randn(0, 16))
    loss = bal.aux_loss()
    moe(x)
    alone = MoELoadBalancer(moe, MoEConfig(aux_loss_coef=0.1)).aux_loss()
    assert math.isfinite(float(loss)) and float(loss) == pytest.approx(float(alone), rel=1e-6)
    loss.backward()
    assert moe.gate.weight.grad.abs().sum() > 0


class _TwoRankGroup:
    """Stands in for `torch.distributed` with a 2-rank context-parallel group whose other rank's counts are
    known: all_reduce adds them (what the collective would), the group has 2 ranks."""

    def __init__(self, other_counts: torch.Tensor):
        self.other = other_counts

    def all_reduce(self, t, group=None):  # noqa: ARG002
        t += self.other.to(t.dtype)

    def get_world_size(self, group=None):  # noqa: ARG002
        return 2


def test_aux_loss_with_context_parallel_chunks_is_the_whole_packs(monkeypatch):
    """Under cp each rank routes its chunks of the pack: the average of the two ranks' gradients (what FSDP gives
    over the cp group) must be the gradient of the aux loss of the whole pack routed in one process, not the mean
    of two half-pack losses (f and P of a half are not the whole's)."""
    import megatron_vlm.training.moe_balancing as mb

    moe = make_skewed_moe()
    x = torch.randn(24, 16, generator=torch.Generator().manual_seed(5))
    x[:12] = x[:12].abs()  # the halves route differently: a per-half loss would differ from the whole's
    scores, _, ids = moe.gate(x)
    tpe = torch.bincount(ids.reshape(-1), minlength=8)
    moe.gate.weight.grad = None
    switch_aux_loss(scores, tpe, 2).backward()
    whole = moe.gate.weight.grad.clone()

    halves = (torch.arange(0, 6).tolist() + torch.arange(18, 24).tolist(), torch.arange(6, 18).tolist())
    counts = []
    for rows in halves:
        tpe_h = torch.bincount(ids[rows].reshape(-1), minlength=8).double()
        counts.append(torch.cat([tpe_h, torch.tensor([float(len(rows))], dtype=torch.float64)]))
    grads = []
    for r, rows in enumerate(halves):
        monkeypatch.setattr(mb, "dist", _TwoRankGroup(counts[1 - r]))
        moe.gate.weight.grad = None
        s_r, _, ids_r = moe.gate(x[rows])
        mb.switch_aux_loss(s_r, torch.bincount(ids_r.reshape(-1), minlength=8), 2, token_group=object()).backward()
        grads.append(moe.gate.weight.grad.clone())
    torch.testing.assert_close((grads[0] + grads[1]) / 2, whole, rtol=1e-5, atol=1e-7)


def test_after_step_sums_ranks_updates_bias_and_reports_every_n():
    model = tiny_model()
    calls = []

    def fake_all_reduce(t):  # two identical ranks
        calls.append(t.shape)
        t.mul_(2)

    balancer = MoELoadBalancer(model, MoEConfig(bias_update_rate=0.01, n_step_per_workload_report=2), all_reduce=fake_all_reduce)
    ids = torch.randint(0, 64, (2, 5))
    model(ids)
    local = [layer.expert_load.clone() for layer in balancer.layers]
    assert [int(x.sum()) for x in local] == [2 * 5 * 2] * 2
    assert balancer.after_step(1) is None
    for layer, load in zip(balancer.layers, local):
        delta = 0.01 * torch.sign((2 * load).double().mean() - 2 * load)
        torch.testing.assert_close(layer.gate.e_score_correction_bias, (delta - delta.mean()).float())
        assert int(layer.expert_load.sum()) == 0
    model(ids)
    metrics, table = balancer.after_step(2)
    assert len(calls) == 2  # one all-reduce per step; the report sums the already-reduced step loads
    assert set(metrics) == {"moe/entropy_mean", "moe/max_fraction_max", "moe/tokens_per_layer_mean"}
    assert metrics["moe/tokens_per_layer_mean"] == pytest.approx(2 * 2 * 10)  # 2 steps x 10 tokens x 2 ranks
    assert len(table) == 2 and all(len(row) == 4 and sum(row) == 2 * 2 * 10 * 2 for row in table)


def test_report_loads_continue_from_a_checkpoint():
    """A workload report spans n steps; a run resumed in the middle continues the loads its checkpoint saved
    (`report_state`, by layer name), so the report equals the uninterrupted run's, not the steps since the resume."""
    cfg = MoEConfig(enable_moe_load_balancing_training=False, n_step_per_workload_report=4)
    ids = [torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    straight_model = tiny_model()
    straight = MoELoadBalancer(straight_model, cfg)
    first_model = tiny_model()
    first = MoELoadBalancer(first_model, cfg)
    for step in (1, 2):
        straight_model(ids[step - 1])
        first_model(ids[step - 1])
        assert straight.after_step(step) is None and first.after_step(step) is None
    saved = first.report_state()
    assert set(saved) == {"language_model.layers.0.mixer", "language_model.layers.2.mixer"}
    resumed_model = tiny_model()
    resumed = MoELoadBalancer(resumed_model, cfg)
    resumed.load_report_state(saved)
    for step in (3, 4):
        straight_model(ids[step - 1])
        resumed_model(ids[step - 1])
        out, ref = resumed.after_step(step), straight.after_step(step)
    assert out == ref and ref is not None and ref[0]["moe/tokens_per_layer_mean"] == pytest.approx(4 * 7)


def test_a_frozen_router_keeps_its_bias():
    """LoRA (and train.train_layers) freeze the base model, routers included: the score-correction bias is part of
    that base (the PEFT adapter does not hold it, and GRPO's reference is the policy without its adapters), so a
    frozen router's bias must not move. A trained router's bias still does; the loads are reported either way."""
    from megatron_vlm.models.common.lora import apply_lora

    model = tiny_model(2)
    apply_lora(model, ["language_model.layers.0.mixer.shared_experts.up_proj"], r=2, alpha=4)
    trained = model.language_model.layers[2].mixer.gate
    trained.weight.requires_grad_(True)  # train.train_layers naming this router: its bias keeps balancing
    balancer = MoELoadBalancer(model, MoEConfig(bias_update_rate=0.01, n_step_per_workload_report=1))
    model(torch.randint(0, 64, (2, 5)))
    metrics, table = balancer.after_step(1)
    frozen = model.language_model.layers[0].mixer.gate
    assert float(frozen.e_score_correction_bias.abs().sum()) == 0
    assert float(trained.e_score_correction_bias.abs().sum()) > 0
    assert [sum(row) for row in table] == [2 * 5 * 2] * 2 and metrics["moe/tokens_per_layer_mean"] == 10


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
    assert all(int(layer.expert_load.sum()) == 0 for layer in balancer.layers)
    assert all(layer.record_router_stats for layer in balancer.layers)


def test_counts_are_not_doubled_by_activation_checkpointing():
    ids = torch.randint(0, 64, (2, 7))
    plain, ckpt = tiny_model(2), tiny_model(2)
    apply_ac(ckpt.transformer_blocks())
    # without early stop the recomputation re-runs each whole block, including the counting code
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        for model in (plain, ckpt):
            model(ids).float().square().mean().backward()
    for a, b in zip(moe_layers(plain), moe_layers(ckpt)):
        assert torch.equal(a.expert_load, b.expert_load)
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"{name}: {m}")


def test_config_validation():
    with pytest.raises(ValueError, match="bias_update_rate"):
        MoEConfig(bias_update_rate=-1).validate()
    with pytest.raises(ValueError, match="n_step_per_workload_report"):
        MoEConfig(n_step_per_workload_report=-2).validate()
    assert isinstance(moe_layers(tiny_model())[0], MoE)


def test_filler_forwards_leave_the_expert_loads_as_they_were():
    """The RL update's filler pack (loss x 0, forwarded by a rank with fewer packs than another) is no one's data:
    inside `uncounted_expert_load` a training forward (and its backward) leaves every block's load unchanged."""
    model = tiny_model(3)
    ids = torch.randint(0, 64, (2, 7))
    model(ids).float().square().mean().backward()
    before = [layer.expert_load.clone() for layer in moe_layers(model)]
    assert all(int(b.sum()) == 2 * 7 * 2 for b in before)  # tokens x top-k per block
    with uncounted_expert_load(model):
        model(ids).float().square().mean().backward()
    assert all(torch.equal(a.expert_load, b) for a, b in zip(moe_layers(model), before))
    model(ids)
    assert all(torch.equal(a.expert_load, 2 * b) for a, b in zip(moe_layers(model), before))


def test_a_bias_rate_for_routers_that_are_all_frozen_is_refused():
    """With every router frozen the rate moves nothing: a key that does nothing is exit 2 naming it (the default
    rate is accepted: nothing was asked for)."""
    from megatron_vlm.errors import ConfigError
    from megatron_vlm.models.common.lora import apply_lora

    model = tiny_model(2)
    apply_lora(model, ["language_model.layers.0.mixer.shared_experts.up_proj"], r=2, alpha=4)
    with pytest.raises(ConfigError, match=r"^moe\.bias_update_rate: every MoE router of this run is frozen"):
        MoELoadBalancer(model, MoEConfig(bias_update_rate=0.01))
    MoELoadBalancer(model, MoEConfig())
    with pytest.raises(ValueError, match=r"^bias_update_rate: has no effect with enable_moe_load_balancing_training"):
        MoELoadBalancer(model, MoEConfig(bias_update_rate=0.01, enable_moe_load_balancing_training=False))


def test_grpo_checkpoints_carry_the_policy_and_critic_reports(tmp_path):
    """GRPO's data state holds the loads of the report in progress of the policy's and of PPO's critic's balancers,
    and a resumed run's loop step gives each balancer its own."""
    from types import SimpleNamespace as NS

    from megatron_vlm.rl.data_shards import DataShards
    from megatron_vlm.rl.trainer import GRPOLoopStep
    from tests.fixtures.rl_config import rl_config

    cfg = MoEConfig(enable_moe_load_balancing_training=False, n_step_per_workload_report=4)

    def loop_step():
        policy, critic = MoELoadBalancer(tiny_model(), cfg), MoELoadBalancer(tiny_model(1), cfg)
        grpo = NS(shards=DataShards(rank=0, world=1, copies=1, device=torch.device("cpu")),
                  policy=NS(bundle=NS(moe_balancer=policy), critic=NS(balancer=critic)))
        ctx = NS(cfg=NS(rl=rl_config(), train=NS(seed=0)), env=NS(is_main=True), run_dir=tmp_path)
        return GRPOLoopStep(ctx, list(range(8)), grpo), policy, critic

    before, policy, critic = loop_step()
    policy.layers[0].expert_load.add_(torch.arange(4))
    critic.layers[1].expert_load.add_(torch.arange(4) * 3)
    policy.after_step(1)
    critic.after_step(1)
    state = before.data_state(1)
    after, policy2, critic2 = loop_step()
    after.load_data_state(state, 1)
    assert policy2.report_state() == policy.report_state() != critic.report_state() == critic2.report_state()
