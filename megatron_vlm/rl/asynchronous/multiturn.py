"""Multi-turn rollouts ([rl.env]) in asynchronous GRPO: conversations on the rollout ranks, trajectories to the trainer.

A rollout rank runs its prompts' conversations with the engine's multi-turn loop (the built-in engine's
inference/multiturn.py or vLLM's inference/vllm_multiturn.py, through `MultiTurnRounds`, rl/env/rollout.py) and
its own environment worker pool, seeded as the synchronous loop seeds that (step, rank) (`multiturn_seed`), so
max_head_offpolicyness = 0 repeats the synchronous run. Weight pushes land between two steps of the loop; every
model token carries the version that drew it (`Trajectory.token_versions`), which the trainer's staleness check
reads as for single-turn completions. The payload of a step carries the trajectories (tokens, loss mask,
behaviour log-probs, the environment's images, turn rewards, finish reasons, counters) beside the single-turn
view of each (its model tokens and last turn's text: what the verifiers scored), and the total reward includes
the environment's turn rewards; the trainer rebuilds the synchronous `Round` with them (`round_trajectories`).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Optional

from megatron_vlm.inference.engine import RolloutPrompt, RolloutResult, SamplingParams
from megatron_vlm.rl.env.rollout import multiturn_seed
from megatron_vlm.rl.prompts.dataset import PromptSample
from megatron_vlm.rl.prompts.shard import EncodedShard

__all__ = ["generate_trajectories", "add_trajectories", "round_trajectories"]


def generate_trajectories(multiturn: Any, samples: Sequence[PromptSample], prompts: Sequence[RolloutPrompt],
                          params: SamplingParams, seed: int, step: int, rank: int, *,
                          abandon: Optional[Callable[[], bool]] = None) -> tuple[RolloutResult, dict]:
    """The rollout rank's conversations of step `step`: (the single-turn view, {"trajectories", "env" rewards});
    `abandon`: the environment waits' stop check (`WaitAbandoned`, rl/env/rollout.py)."""
    shard = EncodedShard(list(samples), list(prompts))
    wait = {"abandon": abandon} if abandon is not None else {}
    result, trajs = multiturn.generate(shard, params, multiturn_seed(seed, step, rank), **wait)
    return result, {"trajectories": trajs, "env": multiturn.rewards(trajs)}


def add_trajectories(payload: dict, mt: dict) -> None:
    """A scored step's payload + its trajectories and the environment's share of the reward (as the synchronous
    round adds it: verifiers + environment, before the overlong penalty)."""
    payload["trajectories"] = mt["trajectories"]
    payload["total"] = [a + b for a, b in zip(payload["total"], mt["env"])]
    payload["per_reward"] = {**payload["per_reward"], "env": list(mt["env"])}


def round_trajectories(groups: Sequence[Optional[list]]) -> Optional[list]:
    """The trainer's trajectories of its groups, in group order, each `prompt_index` the group's index in the
    trainer's shard (as its samples'); None for single-turn payloads."""
    if all(g is None for g in groups):
        return None
    if any(g is None for g in groups):
        raise RuntimeError("asynchronous GRPO: a step mixes multi-turn and single-turn groups")
    return [dataclasses.replace(t, prompt_index=gi) for gi, g in enumerate(groups) for t in (g or [])]
