"""`[rl.env]`: the environment of multi-turn rollouts (absent: single-turn GRPO)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

__all__ = ["RLEnvConfig"]


@dataclass(kw_only=True)
class RLEnvConfig:
    """`[rl.env]`: Multi-turn rollouts: the environment the model talks to, and the limits of a trajectory."""

    name: str
    """A built-in environment ("calculator", "zoom": megatron_vlm/rl/env/builtin.py) or the dotted path of a
    user's `Environment` subclass, "package.module:ClassName" (importable in the worker processes)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the environment's constructor."""
    max_turns: int = 4
    """Model turns per trajectory; a trajectory still going after this many ends with finish reason "max_turns"."""
    max_total_tokens: int = 0
    """Tokens of a whole trajectory (prompt, model turns, environment turns); one that would grow past it ends with
    finish reason "max_total_tokens". 0 = data.max_tokens_per_pack (a trajectory is trained as one sample)."""
    turn_timeout_s: float = 30.0
    """Deadline of one environment call (reset or step) in its worker process; past it the worker is killed and
    the trajectory ends with finish reason "env_error" (counted in env/errors). With tool environments the last
    resort: a tool call is stopped at tool_timeout_s first."""
    tool_timeout_s: Optional[float] = None
    """Deadline of one tool call of a tool environment (rl/env/tools.py: `ToolRegistry`, the built-in "calculator" and
    "zoom"): a call still running then is stopped and answered with an error reply ("... timed out"), counted in
    env/tool_timeouts, and the conversation goes on; the calls of one turn also share turn_timeout_s (less a fifth
    kept for the reply). Unset = turn_timeout_s / 2; 0 = none (a hanging tool then ends its trajectory at
    turn_timeout_s); below turn_timeout_s. A tool blocked inside C code is stopped only when it
    returns to Python, so turn_timeout_s stays the last resort (docs/environments.md)."""
    batch_timeout_s: float = 0.0
    """Deadline of one environment turn of all its trajectories together (the calls of one loop iteration), from
    its first call; the calls not done by then end their trajectories as "env_error" (counted). 0 = none: with
    more hanging environments than [rl.reward_pool] workers a turn can take ceil(calls / workers) x
    turn_timeout_s. Needs sandbox = true (the in-process runner cannot stop a call)."""
    turn_rewards: Literal["sum", "discounted"] = "sum"
    """How the environment's per-turn rewards enter the trajectory's reward: "sum" = their sum; "discounted" =
    sum_t discount**t * r_t (t = 0 for the first turn). Added to the [[rl.rewards]] verifiers' score of the final
    model turn (without a [[rl.rewards]] table, the whole reward); group advantages as in single-turn GRPO. With an
    environment that gives no reward of its own (a tool environment without a reward function) only "sum" (exit 2)."""
    discount: float = 1.0
    """The factor of turn_rewards = "discounted"."""
    sandbox: bool = True
    """Run the environment in the reward pool's worker processes ([rl.reward_pool] workers, memory_limit_mb;
    the deadline is turn_timeout_s). false = in the trainer process (debugging only: a hang stops the job, no
    deadline; a stop signal still gives up a hung call on the main thread, docs/environments.md)."""

    def validate(self) -> None:
        if not self.name:
            raise ValueError("name: give a built-in environment or a dotted path 'package.module:ClassName'")
        if self.max_turns < 1:
            raise ValueError(f"max_turns: must be >= 1, got {self.max_turns}")
        if self.max_total_tokens < 0:
            raise ValueError(f"max_total_tokens: must be >= 0 (0 = data.max_tokens_per_pack), got {self.max_total_tokens}")
        if self.turn_timeout_s <= 0:
            raise ValueError(f"turn_timeout_s: must be > 0, got {self.turn_timeout_s}")
        if not self.batch_timeout_s >= 0 or self.batch_timeout_s == float("inf"):
            raise ValueError(f"batch_timeout_s: must be finite and >= 0 (0 = none), got {self.batch_timeout_s}")
        if self.tool_timeout_s is not None and not 0 <= self.tool_timeout_s < self.turn_timeout_s:
            raise ValueError(f"tool_timeout_s: must be >= 0 (0 = none) and below turn_timeout_s = {self.turn_timeout_s} "
                             f"(the turn's deadline would come first), got {self.tool_timeout_s}")
        if self.batch_timeout_s and not self.sandbox:
            raise ValueError("batch_timeout_s: needs sandbox = true (the in-process runner cannot stop a call)")
        if not 0.0 < self.discount <= 1.0:
            raise ValueError(f"discount: must be in (0, 1], got {self.discount}")
        if self.discount != 1.0 and self.turn_rewards != "discounted":
            raise ValueError("discount: only read with turn_rewards = 'discounted'")

    def tool_deadline_s(self) -> float:
        """The deadline of one tool call in seconds (0: none): tool_timeout_s, unset = half of turn_timeout_s."""
        return self.turn_timeout_s / 2 if self.tool_timeout_s is None else float(self.tool_timeout_s)

    def trajectory_return(self, rewards: list[float]) -> float:
        """The environment's share of a trajectory's reward from its per-turn rewards."""
        if self.turn_rewards == "sum":
            return float(sum(rewards))
        return float(sum(r * self.discount**t for t, r in enumerate(rewards)))
