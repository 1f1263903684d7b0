"""The environment a multi-turn rollout talks to: `reset(sample) -> Observation`, `step(action) -> StepResult`.

Why an object with two methods, as gym / verl / TRL write it: a user's task (a tool box, a game, a grader
that answers back) is a small class, not a change to the trainer. The rollout calls `reset` once per
trajectory with the prompt's sample (its question, reference answer and metadata) and `step` after every
model turn with that turn's text; the observation it returns (text, and images or video frames arriving in
the middle of the conversation) is appended to the conversation as the next user / tool turn, and the model
answers it, until `done` or a limit (`[rl.env]` max_turns / max_total_tokens).

Environments run in the sandboxed worker processes (rl/env/pool.py: a deadline per turn, a memory cap), so
an instance must be picklable: its state travels between the worker calls of one trajectory. A hang, a
crash or an exception ends that trajectory with finish reason "env_error", counted, never the job.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = ["Observation", "StepResult", "Environment", "EnvSample"]


@dataclass
class Observation:
    """What the environment shows the model: text, and optional images / video (each video a list of frames).

    `role` is the chat role of the turn ("user", or "tool" for tool replies: the chat template wraps those in
    the family's tool-response markup). Images and frames are PIL images or HxWx3 uint8 arrays."""

    text: str = ""
    images: list[Any] = field(default_factory=list)
    videos: list[list[Any]] = field(default_factory=list)
    role: str = "user"
    parts: Optional[list[dict]] = None
    """Several turns at once (e.g. one tool reply per call of a turn): [{"role", "text", "images": n, "videos": n}],
    each part taking the next n images / videos (placed before its text); `text` is then unused."""
    video_fps: float = 2.0
    """Frame rate of the videos' frames (Qwen-VL positions and timestamps count time from it): a finite number > 0
    (another value ends the trajectory as env_error, naming it)."""


@dataclass
class StepResult:
    observation: Observation
    reward: float = 0.0
    """This turn's reward (summed or discounted into the trajectory's: `[rl.env]` turn_rewards)."""
    done: bool = False
    """The trajectory ends here: the observation is not shown."""
    info: dict[str, Any] = field(default_factory=dict)
    """Counters the environment reports (e.g. {"tool_errors": 1}): summed into the step metrics as env/<key>. String
    keys; numbers (Python's or numpy's scalars) must be finite (other values are left out of the metrics)."""


@dataclass
class EnvSample:
    """The prompt sample `reset` receives: the dataset's question, reference answer and extra fields."""

    problem: str
    answer: Any = None
    metadata: dict = field(default_factory=dict)
    images: list[Any] = field(default_factory=list)
    """The prompt's images (loaded), for environments that work on them (a crop / zoom tool)."""


class Environment:
    """Subclass and implement `step` (and `reset` when the first turn needs more than the prompt).

    `reset` returns the observation appended after the prompt before the model's first turn; the default
    (empty text) appends nothing, so the model answers the dataset's prompt as in single-turn GRPO. `tools()`:
    the JSON-schema tool specs shown in the system prompt (rl/env/tools.py builds them from functions)."""

    def reset(self, sample: EnvSample) -> Observation:
        self.sample = sample
        return Observation()

    def step(self, action: str) -> StepResult:
        raise NotImplementedError(f"{type(self).__name__} does not implement step(action)")

    gives_rewards: bool = True
    """Whether `step` may return a reward; False (the tool environments without a reward function): the trajectory's
    reward is the [[rl.rewards]] verifiers' only, so a run without a [[rl.rewards]] table is refused."""

    def tools(self) -> list[dict]:
        return []
