"""The GRPO step on multi-turn trajectories (a scripted multi-turn rollout, a tiny stand-in policy, no model or
workers), with every registered policy loss: one trajectory is one sample, its advantage the group's, the loss
on the model's tokens only — an environment token that precedes only environment tokens gets no gradient —
the environment's turn rewards are added to the verifiers' score, a trajectory ended by an environment error
is not trained, and the env/* metrics are reported."""
from __future__ import annotations

import pytest
import torch

from megatron_vlm.inference.engine import RolloutResult
from megatron_vlm.inference.multiturn import Trajectory
from megatron_vlm.rl.algorithms.policy_losses import POLICY_LOSSES
from megatron_vlm.rl.env.rollout import rollout_view
from megatron_vlm.rl.rewards.config import ExactMatchRewardConfig
from tests.fixtures.rl_config import rl_config
from tests.unit.rl.test_grpo_step_algorithms import NS, _grpo, _pool

ENV_ONLY, ENV_LAST = 9, 10  # env chunk [9, 10]: 9 is followed by an env token only, 10 by a model token


class ScriptedMultiTurn:
    """Trajectory j of a prompt: model tokens 0..j, environment [9, 10], model tokens [j + 1, 2]; the last trajectory
    of prompt 0 ends with an environment error. Turn rewards 0.1 per turn."""

    def __init__(self):
        self.calls = 0

    def generate(self, shard, params, seed):
        self.calls += 1
        trajs = []
        for p in range(shard.num_real):
            for j in range(params.n):
                model_a = list(range(j + 1))
                # after the environment's turn a model token that differs per trajectory: the gradient at ENV_LAST is
                # then never a sum that cancels (a group's advantages sum to 0 and the stand-in has no context)
                ids = model_a + [ENV_ONLY, ENV_LAST] + [j + 1, 2]
                mask = [True] * len(model_a) + [False, False] + [True, True]
                err = p == 0 and j == params.n - 1
                trajs.append(Trajectory(
                    prompt_index=p, sample_index=j, token_ids=torch.tensor(ids), model_mask=torch.tensor(mask),
                    logprobs=torch.full((sum(mask),), -1.0), vision={}, text="w" * (j + 1), turn_texts=["a", "b"],
                    turn_rewards=[0.1, 0.1], finish_reason="env_error" if err else "done",
                    prompt_length=len(shard.prompts[p]), error="step: timeout" if err else ""))
        return RolloutResult(samples=[rollout_view(t) for t in trajs]), trajs

    def rewards(self, trajs):
        return [sum(t.turn_rewards) for t in trajs]


@pytest.mark.parametrize("loss", POLICY_LOSSES.names())
def test_grpo_step_on_trajectories(loss):
    pool = [p for p in _pool(40) if int(p.prompt_id[1:]) % 2][:2]  # graded rewards (tests' Manager)
    rl = rl_config(validate=True, group_size=3, max_new_tokens=4, prompts_per_step=2, rewards=[ExactMatchRewardConfig()],
                   policy_loss=loss)
    mt = ScriptedMultiTurn()
    engine = NS(load_weights=lambda *a, **k: None, release_memory=lambda: None)
    grpo, _, seen = _grpo(rl, pool, engine=engine, multiturn=mt)
    policy = grpo.policy.bundle.wrapper
    before = policy.embed.weight.detach().clone()
    m = grpo.run(0, pool, prompt_pool=pool)
    assert mt.calls == 1
    samples = seen["samples"]
    assert len(samples) == 2 * 3 - 1  # the env_error trajectory is not trained
    assert all(s.response_mask is not None and s.response_length == int(s.response_mask.sum()) for s in samples)
    assert m["env/errors"] == 1 and m["env/errors_untrained"] == 1 and m["env/turns_mean"] == 2
    # rewards: the verifiers' (len(text) / 10) + the turn rewards (0.2)
    assert m["reward/mean"] == pytest.approx(sum(0.1 * (j + 1) + 0.2 for j in range(3)) / 3)
    after = policy.embed.weight.detach()
    assert torch.equal(after[ENV_ONLY], before[ENV_ONLY])  # predicts only an environment token: no loss, no gradient
    assert not torch.equal(after[ENV_LAST], before[ENV_LAST])  # predicts a model token: trained
    assert not torch.equal(after[0], before[0])


def test_an_env_error_is_left_out_of_its_groups_advantages():
    """A trajectory ended by an environment error is not trained; its reward (the verifiers' score of a turn the
    failure cut short) must not move its group's mean and std either: the advantages of the other members are
    the group estimator's over them alone. It used to be counted: prompt 0's two good trajectories (rewards 0.3 and
    0.4) got the advantages of a group of three with the failed one's 0.5, -1 and 0, instead of -0.707 and 0.707."""
    import statistics

    pool = [p for p in _pool(40) if int(p.prompt_id[1:]) % 2][:2]
    rl = rl_config(validate=True, group_size=3, max_new_tokens=4, prompts_per_step=2, rewards=[ExactMatchRewardConfig()])
    engine = NS(load_weights=lambda *a, **k: None, release_memory=lambda: None)
    grpo, _, seen = _grpo(rl, pool, engine=engine, multiturn=ScriptedMultiTurn())
    grpo.run(0, pool, prompt_pool=pool)
    got = [s.advantage for s in seen["samples"]]
    ok = [0.1 * (j + 1) + 0.2 for j in range(2)]  # prompt 0 without its failed third trajectory
    full = [0.1 * (j + 1) + 0.2 for j in range(3)]
    ref = [(r - statistics.mean(g)) / (statistics.stdev(g) + 1e-6) for g in (ok, full) for r in g]
    assert got == pytest.approx(ref, abs=1e-5)
