"""Environments in the sandboxed worker processes of the reward pool: a deadline per turn, a memory cap.

Why the reward pool: an environment is user code on model output (a tool that runs what the model wrote,
a game engine, a grader), the same risk as a custom verifier. `EnvWorkerPool` is `RewardWorkerPool` with
another worker loop: the same spawn start, address-space cap, parent-death kill, process-group kill and
per-call / per-batch deadlines; a worker that hangs past `turn_timeout_s` or dies is replaced.

State between turns: a worker is not tied to a trajectory (any worker runs any call, and a replaced one
has lost everything), so the environment object itself travels: `reset` builds it in a worker and sends it
back pickled with the first observation, each `step` unpickles it, steps it and sends it back. An
environment must therefore be picklable (plain Python state). Every failure (the environment could not be
built, `reset` / `step` raised, `step` returned a NaN or infinite reward or `info` that is not a dict of named finite
numbers or an observation over the `[data]` media limits (observation_limits.py, applied here before the reply is
pickled), the worker hung or died, the result was not picklable) is an
`EnvReply` with `error` set: the rollout ends that trajectory with finish reason "env_error" and counts it.
"""
from __future__ import annotations

import importlib
import json
import math
import numbers
import os
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Optional

from megatron_vlm.rl.env.base import Environment, EnvSample, Observation, StepResult
from megatron_vlm.rl.env.interrupt import interruptible
from megatron_vlm.rl.env.observation_limits import ObservationLimits, limit_observation
from megatron_vlm.rl.env.tools import tool_deadline
from megatron_vlm.rl.rewards.pool import (
    CallResult,
    Patience,
    RewardWorkerPool,
    WaitAbandoned,
    _describe,
    isolate_worker,
    serve_calls,
)

__all__ = ["EnvCall", "EnvReply", "EnvWorkerPool", "build_environment", "BUILTIN_ENVIRONMENTS", "InlineEnvRunner"]

BUILTIN_ENVIRONMENTS = {
    "calculator": "megatron_vlm.rl.env.builtin:CalculatorEnv",
    "zoom": "megatron_vlm.rl.env.builtin:ZoomEnv",
}
"""Names `[rl.env] name` may give instead of a dotted path."""


def resolve_environment(name: str) -> Any:
    """The class (or factory) a built-in name or a dotted path "pkg.module:Name" / "pkg.module.Name" names."""
    path = BUILTIN_ENVIRONMENTS.get(name, name)
    module, sep, attr = path.partition(":")
    if not sep:
        module, _, attr = path.rpartition(".")
    if not module or not attr:
        raise ValueError(f"environment {name!r}: not a built-in name {sorted(BUILTIN_ENVIRONMENTS)} nor a dotted path "
                         "'package.module:ClassName'")
    obj = getattr(importlib.import_module(module), attr, None)
    if obj is None:
        raise ValueError(f"environment {name!r}: module {module} has no {attr}")
    return obj


def build_environment(name: str, kwargs: Optional[dict] = None) -> Environment:
    env = resolve_environment(name)(**(kwargs or {}))
    if not callable(getattr(env, "step", None)) or not callable(getattr(env, "reset", None)):
        raise TypeError(f"environment {name!r}: {type(env).__name__} has no reset(sample) / step(action)")
    return env


@dataclass(frozen=True)
class EnvCall:
    """One turn of one trajectory: op "reset" (name, kwargs, sample) or "step" (state, action)."""

    op: str
    name: str = ""
    kwargs: dict = field(default_factory=dict)
    sample: Optional[EnvSample] = None
    state: bytes = b""
    action: str = ""
    limits: Optional[ObservationLimits] = None
    """step: the `[data]` media limits its observation is held to before it is sent back (observation_limits.py);
    None: the `[data]` defaults."""
    tool_timeout_s: float = 0.0
    """step: the deadline of each of its tool calls (rl/env/tools.py `tool_deadline`; 0: none)."""
    turn_timeout_s: float = 0.0
    """step: its own deadline (the pool's per-call one), which its tool calls share (`tool_deadline`; 0: unbounded)."""


@dataclass
class EnvReply:
    state: bytes = b""
    """The pickled environment after this call (the next `step`'s input)."""
    result: Optional[StepResult] = None
    """reset: the first observation in `result.observation` (reward 0, not done)."""
    tools: list[dict] = field(default_factory=list)
    """reset: the environment's tool specs (rendered into the system prompt)."""
    error: str = ""
    """Why the call failed ("timeout: ...", "error: ..."); empty when it worked."""


def _float_range(v: numbers.Real) -> bool:
    """Whether `v` is a finite number a float holds with room to be summed (|v| < 1e300)."""
    try:
        f = float(v)
    except OverflowError:  # an int past the float range
        return False
    return math.isfinite(f) and abs(f) < 1e300


def _check_info(info: Any) -> None:
    """`StepResult.info` is summed into the step metrics (env/<key>) in the trainer: a dict of named counters whose
    numbers (Python's or numpy's scalars: `numbers.Real`) are finite floats, checked here so that a bad one ends its
    trajectory, not the rollout."""
    if not isinstance(info, dict):
        raise TypeError(f"step returned info of type {type(info).__name__}, not a dict of counters")
    for k, v in info.items():
        if not isinstance(k, str):
            raise TypeError(f"step returned info with the key {k!r}, not a string")
        if isinstance(v, numbers.Real) and not _float_range(v):  # NaN, inf, an int past float
            shown = f"an int of {int(v).bit_length()} bits" if isinstance(v, numbers.Integral) else repr(v)
            raise ValueError(f"step returned info[{k!r}] = {shown}, not a finite number of float range")


def _env_name(env: Any) -> str:
    """The environment's class as a dotted path ("package.module:ClassName"), for its error messages."""
    return f"{type(env).__module__}:{type(env).__qualname__}"


def _check_observation(obs: Any) -> None:
    """An observation the turn encoder can take (rl/env/turns.py): an `Observation` whose fields have their
    documented types. Checked here so that a user's environment returning a bare string, one image outside a list or
    a number as the text is told so, not shown an internal error of the encoder."""
    if not isinstance(obs, Observation):
        raise TypeError(f"observation of type {type(obs).__name__}, not an Observation (text: Observation(text=...))")
    for key, kinds, want in (("text", (str,), "a str"), ("images", (list, tuple), "a list"),
                             ("videos", (list, tuple), "a list of frame lists"), ("role", (str,), "a str"),
                             ("parts", (list, tuple, type(None)), "a list of dicts or None")):
        value = getattr(obs, key)
        if key in ("images", "videos") and getattr(value, "ndim", None) == {"images": 4, "videos": 5}[key]:
            continue  # stacked arrays: N images / N videos
        if not isinstance(value, kinds):
            raise TypeError(f"observation.{key} of type {type(value).__name__}, not {want}")
    if any(not isinstance(v, (list, tuple)) and getattr(v, "ndim", None) != 4 for v in obs.videos):
        raise TypeError("observation.videos: each video is a list of frames (or a T x H x W x 3 array)")
    if obs.parts is not None and any(not isinstance(p, dict) for p in obs.parts):
        raise TypeError("observation.parts: each part is a dict {\"role\", \"text\", \"images\", \"videos\"}")
    if len(obs.videos):  # the frames' rate sets the videos' time positions (Qwen-VL M-RoPE: 2 / fps per grid)
        fps = obs.video_fps
        if isinstance(fps, bool) or not isinstance(fps, numbers.Real):  # numpy's scalars are Real too
            raise TypeError(f"observation.video_fps of type {type(fps).__name__}, not a number")
        if not (math.isfinite(fps) and fps > 0):
            raise ValueError(f"observation.video_fps = {fps!r}, not a finite number of frames per second > 0")


def run_call(call: EnvCall) -> EnvReply:
    """Run one call in this process (the worker's body, and the in-process runner of tests). A return value of the
    wrong type is a TypeError naming the environment's class (`_env_name`)."""
    if call.op == "reset":
        env = build_environment(call.name, call.kwargs)
        obs = env.reset(call.sample if call.sample is not None else EnvSample(problem=""))
        if not isinstance(obs, Observation):
            raise TypeError(f"{_env_name(env)}: reset returned {type(obs).__name__}, not an Observation")
        result = StepResult(obs)
        tools = list(env.tools())
    elif call.op == "step":
        env = pickle.loads(call.state)
        with tool_deadline(call.tool_timeout_s, call.turn_timeout_s):
            result = env.step(call.action)
        if not isinstance(result, StepResult):
            raise TypeError(f"{_env_name(env)}: step returned {type(result).__name__}, not a StepResult")
        try:
            if not result.done:  # the observation is shown (one ending the trajectory is not: it may be None)
                _check_observation(result.observation)
                result.observation = limit_observation(result.observation, call.limits or ObservationLimits())
            try:
                result.reward = float(result.reward)  # numpy / 0-d tensor rewards are numbers too
            except (TypeError, ValueError):
                raise TypeError(f"reward of type {type(result.reward).__name__}, not a number") from None
            if not math.isfinite(result.reward):  # NaN / inf would poison the whole group's advantages
                raise ValueError(f"a non-finite reward {result.reward!r}")
        except (TypeError, ValueError) as e:
            raise type(e)(f"{_env_name(env)}: step returned a StepResult with {e}") from None
        _check_info(result.info)
        tools = []
    else:
        raise ValueError(f"unknown environment op {call.op!r}")
    return EnvReply(state=pickle.dumps(env), result=result, tools=tools)


def _env_worker_main(conn: Connection, preload: tuple = (), memory_limit_mb: int = 0, parent_pid: int = 0) -> None:
    """The reward worker's loop (rewards/pool.py) running `EnvCall`s; replies carry pickled `EnvReply`s."""
    memory = isolate_worker(memory_limit_mb, parent_pid)
    failed: dict[str, str] = {}
    for name in preload:
        try:
            resolve_environment(name)
        except BaseException as e:  # noqa: BLE001 - sys.exit at import too
            failed[name] = _describe(e)
    conn.send(("ready", os.getpid(), 0.0, json.dumps({"failed": failed, "params": {}, "memory": memory})))
    serve_calls(conn, lambda call: pickle.dumps(run_call(call)))


def _reply(r: CallResult) -> EnvReply:
    if r.status == "ok" and isinstance(r.value, bytes):
        try:
            out = pickle.loads(r.value)
        except Exception as e:  # noqa: BLE001 - e.g. a class the parent cannot import
            return EnvReply(error=f"error: the environment's reply could not be read: {_describe(e)}")
        if isinstance(out, EnvReply):
            return out
    return EnvReply(error=f"{r.status}: {r.detail}" if r.detail else r.status)


class EnvWorkerPool(RewardWorkerPool):
    """`run(calls) -> [EnvReply]`: one turn of many trajectories, each under `timeout_s` (the per-turn deadline);
    `preload`: environment names to import at worker start (a misspelt path is reported by `start`)."""

    worker_main = staticmethod(_env_worker_main)
    waits_for = "environments"

    def _checked(self, value: float, status: str, detail: str) -> CallResult:
        return CallResult(value, status, detail)  # the value is a pickled EnvReply: no numeric clipping

    def run(self, calls: Sequence[EnvCall], *, abandon: Optional[Callable[[], bool]] = None) -> list[EnvReply]:
        """`abandon`: the stop check of `map` (a stopping rank gives up a hung turn: `WaitAbandoned`)."""
        return [_reply(r) for r in self.map(calls, abandon=abandon)]  # type: ignore[arg-type]  # EnvCall, not RewardCall


class InlineEnvRunner:
    """The same `run(calls)` in this process, without a sandbox (tests, and debugging an environment): an
    exception (SystemExit included) is an error reply; a hang is not caught (no turn deadline), but a rank that is
    stopping gives up a hung call (`abandon`: rl/env/interrupt.py, on the main thread; elsewhere between calls)."""

    waits_for = "environments"

    def run(self, calls: Sequence[EnvCall], *, abandon: Optional[Callable[[], bool]] = None) -> list[EnvReply]:
        if abandon is None:
            return self._run(calls, None)
        give_up = Patience(abandon)
        with interruptible(give_up, lambda: WaitAbandoned.of(len(calls), self.waits_for)):
            return self._run(calls, give_up)

    def _run(self, calls: Sequence[EnvCall], give_up: Optional[Patience]) -> list[EnvReply]:
        out = []
        for c in calls:
            if give_up is not None and give_up():  # between calls too (off the main thread: only there)
                raise WaitAbandoned.of(len(calls), self.waits_for)
            try:
                out.append(pickle.loads(pickle.dumps(run_call(c))))  # the same round trip as the worker's
            except (Exception, SystemExit) as e:  # noqa: BLE001 - sys.exit in user code must not end the job
                out.append(EnvReply(error=f"error: {_describe(e)}"))
        return out

    def close(self) -> None:
        pass
