"""A multi-turn trajectory as one training sample: its whole conversation, the loss on the model's tokens only.

One trajectory is one sample (as one completion is in single-turn GRPO): the response is everything after the
prompt — model turns and environment turns in order — with `response_mask` marking the model's tokens and
the environment's images / videos packed after the prompt's (rl/batching.py). The packed training forward over
it therefore sees what the rollout saw (every turn's images at their positions, M-RoPE positions continuous),
and its log-probs of the masked tokens are the rollout's behaviour log-probs. The advantage is the
trajectory's (group advantages over the G trajectories of a prompt), the same for each of its model tokens.
"""
from __future__ import annotations

from megatron_vlm.inference.engine import RolloutPrompt
from megatron_vlm.inference.multiturn import Trajectory
from megatron_vlm.rl.batching import TrainSample

__all__ = ["trajectory_train_sample"]


def trajectory_train_sample(prompt: RolloutPrompt, t: Trajectory, advantage: float) -> TrainSample:
    return TrainSample(prompt=prompt, response_ids=t.token_ids, behav_logp=t.logprobs, advantage=advantage,
                       old_logp=t.logprobs, response_mask=t.model_mask, response_vision=dict(t.vision) or None)
