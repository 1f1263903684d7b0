"""The critic's model: values at exactly the policy's log-prob positions (the family model's final hidden states
through the head), and its state saved beside the policy's in one checkpoint and loaded back exactly."""
from __future__ import annotations

import torch

from megatron_vlm.checkpoint.manager import CheckpointManager
from megatron_vlm.data.batch import IGNORE_INDEX
from megatron_vlm.rl.critic.value_model import ValueModel


def _tiny(tmp_path):
    from megatron_vlm.checkpoint.hf import load_hf_model
    from megatron_vlm.testing.synthesize import synthesize_model_folder

    synthesize_model_folder("tiny_qwen2_5_vl", tmp_path / "m", seed=0)
    return load_hf_model(tmp_path / "m")


def test_values_are_the_head_on_the_hidden_states_of_the_labelled_positions(tmp_path):
    backbone = _tiny(tmp_path)
    vm = ValueModel(backbone)
    assert float(vm.value_head.weight.detach().abs().sum()) == 0.0  # starts at V = 0
    torch.nn.init.normal_(vm.value_head.weight, std=0.1)
    ids = torch.randint(3, 100, (1, 12))
    labels = torch.full((1, 12), IGNORE_INDEX)
    labels[0, 4:7] = ids[0, 5:8]  # three labelled positions of the first sequence, one of the second
    labels[0, 9] = ids[0, 10]
    batch = {"input_ids": ids, "labels": labels, "cu_seqlens": torch.tensor([0, 8, 12], dtype=torch.int32)}
    values = vm(batch)
    hidden = backbone(input_ids=ids, cu_seqlens=batch["cu_seqlens"], return_hidden=True)[0]
    expect = (hidden[[4, 5, 6, 9]] @ vm.value_head.weight[0] + vm.value_head.bias[0]).float()
    torch.testing.assert_close(values, expect)
    assert values.shape == (4,)


def test_critic_state_round_trips_through_the_checkpoint(tmp_path):
    torch.manual_seed(0)
    policy, critic = torch.nn.Linear(4, 3), torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 1))
    p_opt, c_opt = torch.optim.AdamW(policy.parameters(), lr=1e-2), torch.optim.AdamW(critic.parameters(), lr=1e-3)
    for _ in range(3):
        x = torch.randn(8, 4)
        (policy(x).square().mean() + critic(x).square().mean()).backward()
        p_opt.step()
        c_opt.step()
        p_opt.zero_grad()
        c_opt.zero_grad()
    mgr = CheckpointManager(tmp_path, keep_last=0, rank=0)
    path = mgr.save(3, policy, p_opt, {"data": {}}, modules={"critic": (critic, c_opt)})
    fresh_p, fresh_c = torch.nn.Linear(4, 3), torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 1))
    fp_opt, fc_opt = torch.optim.AdamW(fresh_p.parameters(), lr=1e-2), torch.optim.AdamW(fresh_c.parameters(), lr=1e-3)
    CheckpointManager(tmp_path, keep_last=0, rank=0).load(path, fresh_p, fp_opt, modules={"critic": (fresh_c, fc_opt)})
    for a, b in zip(critic.state_dict().values(), fresh_c.state_dict().values()):
        assert torch.equal(a, b)
    for a, b in zip(c_opt.state.values(), fc_opt.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    # the next update of the resumed critic equals the uninterrupted one's
    x = torch.randn(8, 4)
    for m, o in ((critic, c_opt), (fresh_c, fc_opt)):
        m(x).square().mean().backward()
        o.step()
    for a, b in zip(critic.parameters(), fresh_c.parameters()):
        assert torch.equal(a, b)


def test_skipped_critic_updates_count_on_across_a_resume():
    """`critic/skipped_updates` counts "so far", like skipped_steps: a resumed process adds its skips to the
    checkpoint's total instead of logging from 0 again."""
    from megatron_vlm.rl.critic.ppo_critic import Critic
    from megatron_vlm.rl.data_shards import DataShards
    from megatron_vlm.training.running_totals import RunningTotals
    from tests.fixtures.rl_config import rl_config
    from tests.unit.rl.test_ppo_critic_ranks import _LinearValues, _samples

    samples = _samples()
    samples[0]._x[1, 2] = float("nan")  # type: ignore[attr-defined]  # a non-finite value: the update is skipped
    model = _LinearValues()
    critic = Critic(model, torch.optim.SGD(model.parameters(), lr=0.1), rl_config(advantage="gae"),  # type: ignore[arg-type]
                    shards=DataShards(rank=0, world=1, copies=1, device=torch.device("cpu")), max_grad_norm=1.0, seed=0)
    packs, to_batch = (lambda ss: [list(ss)]), (lambda grp: {"group": grp})
    critic.prepare(samples, packs, to_batch)
    metrics = critic.update(0, samples, packs, to_batch)
    assert metrics["critic/skipped_updates"] == 1.0
    totals = RunningTotals()  # the GRPO loop's (rl/trainer.py)
    totals.restore({"counters": {"critic/skipped_updates": 2.0}})  # the checkpoint of an earlier process
    assert totals.add_to(metrics)["critic/skipped_updates"] == 3.0
    assert totals.state()["counters"]["critic/skipped_updates"] == 3.0


def test_the_critic_checkpoints_its_blocks_as_the_policy_does(tmp_path):
    """train.activation_checkpointing applies to the critic's transformer blocks too (it held every activation):
    the blocks carry the policy's checkpointing, and values and gradients are those of the plain critic."""
    from megatron_vlm.parallel.apply import checkpoint_blocks

    ids = torch.randint(3, 100, (1, 12), generator=torch.Generator().manual_seed(1))
    labels = torch.full((1, 12), IGNORE_INDEX)
    labels[0, 3:11] = ids[0, 4:12]
    batch = {"input_ids": ids, "labels": labels, "cu_seqlens": torch.tensor([0, 7, 12], dtype=torch.int32)}
    results = {}
    for setting in (False, True, "selective"):
        torch.manual_seed(0)
        vm = ValueModel(_tiny(tmp_path / str(setting)))
        torch.nn.init.normal_(vm.value_head.weight, std=0.1)
        blocks = vm.backbone.transformer_blocks()
        checkpoint_blocks(blocks, setting)  # as rl/critic/build.py does
        assert [getattr(b, "_mvlm_ac", None) for b in blocks] == [{False: None, True: "full"}.get(setting, setting)] * len(blocks)
        values = vm(batch)
        values.square().sum().backward()
        results[setting] = (values.detach(), {n: p.grad for n, p in vm.named_parameters() if p.grad is not None})
    for setting in (True, "selective"):
        torch.testing.assert_close(results[setting][0], results[False][0], rtol=0, atol=0)
        for n, g in results[False][1].items():
            torch.testing.assert_close(results[setting][1][n], g, rtol=1e-6, atol=1e-7)
