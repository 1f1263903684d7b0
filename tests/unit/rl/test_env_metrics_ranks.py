"""Multi-turn GRPO's env/* metrics are the step's, over every data shard, not the logging rank's share.

`GRPOStep.train_on_rounds` computed them from this rank's trajectories only, and the loop logs rank 0's
dictionary: with 2 data shards `env/errors` counted half the step's failed environments, and the means covered
half its trajectories. They are now reduced over the shards like every other step metric.
"""
from __future__ import annotations

import torch
from test_review_grpo_update import TinyPolicy, _step

from megatron_vlm.inference.engine import RolloutPrompt, RolloutResult, RolloutSample
from megatron_vlm.inference.multiturn import Trajectory
from megatron_vlm.rl.algorithms.advantage_estimators import AdvantageSpec
from megatron_vlm.rl.env.trajectories import trajectory_metrics
from megatron_vlm.rl.metrics import PhaseTimer
from megatron_vlm.rl.prompts.shard import EncodedShard
from megatron_vlm.rl.rounds import shape_round


class _TwoShards:
    """Data shard 0 of 2: a gather returns [ours, shard 1's]; shard 1's trajectory numbers are those of `theirs`, the
    other step metrics mirror ours (not what is checked here)."""

    rank, world = 0, 2

    def __init__(self, theirs):
        self.theirs = theirs

    def gather(self, obj):
        if isinstance(obj, dict) and "trajectories" in obj:
            from megatron_vlm.rl.env.trajectories import trajectory_counts

            return [obj, trajectory_counts(self.theirs, untrained_env_errors=sum(t.finish_reason == "env_error"
                                                                                  for t in self.theirs))]
        return [obj, obj]


def _traj(i: int, finish: str, turns: int) -> Trajectory:
    return Trajectory(prompt_index=0, sample_index=i, token_ids=torch.tensor([3, 4, 5]),
                      model_mask=torch.tensor([True, False, True]), logprobs=torch.zeros(2), vision={}, text="t",
                      turn_texts=["a"] * turns, turn_rewards=[0.0] * turns, finish_reason=finish, prompt_length=2,
                      info={"tool_calls": float(turns)})


def _round(rl, trajs):
    samples = [RolloutSample(prompt_index=0, sample_index=i, token_ids=torch.tensor([3, 5]), logprobs=torch.zeros(2),
                             text="t", finish_reason="eos", prompt_length=2) for i in range(len(trajs))]
    rd = shape_round(rl, AdvantageSpec("grpo", True, False), EncodedShard([None], [RolloutPrompt(input_ids=torch.tensor([1, 2]))]),
                     RolloutResult(samples=samples), samples, [0.0, 1.0], {"acc": [0.0, 1.0]})
    rd.trajectories = trajs
    return rd


def test_env_metrics_cover_every_shards_trajectories():
    mine = [_traj(0, "env_error", 1), _traj(1, "done", 3)]
    theirs = [_traj(0, "env_error", 2), _traj(1, "max_turns", 2)]
    grpo = _step(TinyPolicy(), lambda s: 1.0, mini_batches=1)
    grpo.rounds.multiturn = object()  # an [rl.env] run
    grpo.shards = _TwoShards(theirs)
    out = grpo.train_on_rounds(0, [_round(grpo.rl, mine)], PhaseTimer())
    # the step's 4 trajectories as one rank would report them (its 2 environment errors were not trained)
    want = trajectory_metrics(mine + theirs, untrained_env_errors=2)
    assert want["env/errors"] == 2.0
    assert {k: out.get(k) for k in want} == want
