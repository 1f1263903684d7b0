"""Environments for the multi-turn GRPO job tests (imported by dotted path in the environment workers)."""
import numpy as np

from megatron_vlm.rl.env.base import Environment, Observation, StepResult


class ShowImage(Environment):
    """Answers turn 1 with a new image and a short question, ends at turn 2; the turn reward is the number of
    distinct characters of the model's turn / 10 (a graded signal a random policy already spreads)."""

    def step(self, action):
        self.t = getattr(self, "t", 0) + 1
        reward = len(set(action)) / 10.0
        if self.t >= 2:
            return StepResult(Observation(), reward=reward, done=True)
        seed = sum(map(ord, self.sample.problem)) % 1000
        img = np.random.default_rng(seed).integers(0, 255, size=(56, 56, 3), dtype=np.uint8)
        return StepResult(Observation(text="and now", images=[img]), reward=reward)


class AlwaysFails(Environment):
    """An environment with a bug: every step raises (every trajectory ends "env_error")."""

    def step(self, action):
        raise RuntimeError("environment bug")
