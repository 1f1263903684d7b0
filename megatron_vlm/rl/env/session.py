"""The environment side of a multi-turn rollout: `EnvSession` answers the engine's finished turns.

The engine (inference/multiturn.py) knows tokens; this side knows environments and chat turns. At the start
every trajectory's environment is built and reset in the runner (the sandboxed pool, rl/env/pool.py); after
each model turn `step` sends that turn's text to its environment (all conversations that finished a turn in
the same engine iteration in one batch, each under the per-turn deadline) and encodes the observation into
the tokens to append (rl/env/turns.py). A failure of either (the environment raised, hung or died; the
observation could not be encoded) is an error reply: the engine ends that trajectory ("env_error") and
`errors` counts it.

`ToolPromptEncoder` puts the environment's tool specs into the system turn of every prompt (the chat turns
the engine continues are the same ones).
"""
from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Sequence
from typing import Any, Optional

from megatron_vlm.data.bad_records import BadRecordError
from megatron_vlm.inference.engine import RolloutPrompt
from megatron_vlm.inference.multiturn import TurnReply
from megatron_vlm.rl.env.base import EnvSample
from megatron_vlm.rl.env.observation_limits import ObservationLimits
from megatron_vlm.rl.env.pool import EnvCall
from megatron_vlm.rl.env.turns import TurnEncoder, cut_observation, with_tools
from megatron_vlm.rl.prompts.dataset import PromptSample

__all__ = ["EnvSession", "ToolPromptEncoder", "env_sample"]


def env_sample(sample: PromptSample, prompt: Optional[RolloutPrompt] = None) -> EnvSample:
    """What `Environment.reset` receives for a prompt (its loaded images from the encoded prompt)."""
    images = list(prompt.images) if prompt is not None and prompt.images else []
    return EnvSample(problem=sample.problem, answer=sample.answer, metadata=dict(sample.metadata), images=images)


class ToolPromptEncoder:
    """A prompt encoder (rl/prompts/encoder.py) whose prompts carry `tools` in their system turn and fit a
    trajectory: with `max_total_tokens`, a prompt of that many tokens or more (no room for a model token; the
    multi-turn loop refuses such a round) is skipped and counted by the wrapped encoder as too long, as prompts
    over data.max_tokens_per_pack are (`[rl.env] max_total_tokens` may be the lower limit, and the tool specs
    lengthen every prompt after the run's first length filter)."""

    def __init__(self, encoder: Any, tools: list[dict], *, max_total_tokens: int = 0, processor: Any = None):
        self.inner, self.tools, self.max_total_tokens = encoder, tools, max_total_tokens
        self.processor = processor if processor is not None else getattr(encoder, "processor", None)
        """Whose chat template writes the specs when it renders `tools=` (turns.with_tools)."""

    def messages(self, sample: PromptSample) -> list[dict]:
        return with_tools(sample.messages, self.tools, self.processor)

    def encode(self, sample: PromptSample) -> Optional[RolloutPrompt]:
        prompt = self.inner.encode(dataclasses.replace(sample, messages=self.messages(sample)) if self.tools else sample)
        if prompt is None or not self.max_total_tokens or len(prompt) < self.max_total_tokens:
            return prompt
        why = (f"prompt of {len(prompt)} tokens (tool specs included) leaves no room under rl.env.max_total_tokens = "
               f"{self.max_total_tokens}")
        skip = getattr(self.inner, "_skip", None)  # PromptEncoder's count / bad-record log / warning
        if skip is None:
            raise ValueError(f"prompt {sample.prompt_id}: {why}")
        skip(sample, BadRecordError("too_long", why))
        return None

    def __getattr__(self, name: str) -> Any:  # skipped, last_skip, bad_records of the wrapped encoder
        return getattr(self.inner, name)


def _tool_name(spec: Any) -> str:
    f = spec.get("function") if isinstance(spec, dict) else None
    return str(f.get("name")) if isinstance(f, dict) else "?"


class EnvSession:
    """One rollout's environments: `n` trajectories per prompt, conversation i = prompt i // n (group-major).

    `runner`: `EnvWorkerPool` or `InlineEnvRunner`; `name`, `kwargs`: the environment; `samples`: one
    `EnvSample` per prompt; `histories`: the chat turns of each prompt (with the tool specs); `eos_token_ids`:
    the engine's (a turn ended by one is closed by the model itself); `tools`: the specs the prompts' system turns
    show (None: not checked), which every environment must still give after its reset (`tools()` is read once, before
    any reset: per-sample tools would not be the ones the model sees); `limits`: the `[data]` media limits every
    observation is held to in the worker (observation_limits.py; None: the `[data]` defaults); `tool_timeout_s`: the
    deadline of each tool call of a step (rl/env/tools.py; 0: none), `turn_timeout_s` the step's, which its tool
    calls share (0: unbounded); `abandon`: the stop check of the runner's waits (rewards/pool.py `map`)."""

    def __init__(self, runner: Any, encoder: TurnEncoder, *, name: str, kwargs: dict, samples: Sequence[EnvSample],
                 histories: Sequence[list[dict]], n: int, eos_token_ids: Sequence[int],
                 tools: Optional[list[dict]] = None, limits: Optional[ObservationLimits] = None,
                 tool_timeout_s: float = 0.0, turn_timeout_s: float = 0.0,
                 abandon: Optional[Callable[[], bool]] = None):
        self.runner, self.encoder, self.n = runner, encoder, n
        self._run_kw = {"abandon": abandon} if abandon is not None else {}
        """The runner's stop check (a stopping rank gives up a hung turn: `WaitAbandoned` out of the rollout)."""
        self.limits, self.tool_timeout_s, self.turn_timeout_s = limits, tool_timeout_s, turn_timeout_s
        self.eos = frozenset(int(t) for t in eos_token_ids)
        self.errors = 0
        self.last_error = ""
        total = len(samples) * n
        self.history = [list(histories[i // n]) for i in range(total)]
        self.state: list[bytes] = [b""] * total
        self.failed: dict[int, str] = {}
        self.reset_errors: dict[int, str] = {}
        """Conversations whose environment failed at reset (`settle` ends their trajectories as env_error)."""
        replies = runner.run([EnvCall("reset", name=name, kwargs=dict(kwargs), sample=samples[i // n])
                              for i in range(total)], **self._run_kw)
        for i, r in enumerate(replies):
            if r.error:
                self._fail(i, f"reset: {r.error}")
                self.reset_errors[i] = self.failed[i]
                continue
            obs = r.result.observation if r.result is not None else None
            if obs is not None and (obs.text or obs.images or obs.videos or obs.parts):
                self._fail(i, "reset: a non-empty first observation is not shown yet; put the first turn's content "
                              "in the prompt (the dataset's messages) and return Observation() from reset")
                self.reset_errors[i] = self.failed[i]
                continue
            # by name: a spec rebuilt in a worker may list the same things in another order (a set under another
            # hash seed), which is no difference the model would see in kind
            if tools is not None and sorted(map(_tool_name, r.tools)) != sorted(map(_tool_name, tools)):
                self._fail(i, f"reset: tools() after reset gives {[_tool_name(t) for t in r.tools]}, the prompt's system "
                              f"turn shows {[_tool_name(t) for t in tools]} (read once, before any reset): per-sample "
                              "tools are not supported; give every sample the same tools() and answer the ones a "
                              "sample does not take with an error")
                self.reset_errors[i] = self.failed[i]
                continue
            self.state[i] = r.state

    def settle(self, trajectories: Sequence[Any]) -> None:
        """End as env_error (not trained, in env/errors) every trajectory whose environment failed at reset, however
        its first model turn ended. Why: `step` reports that failure, and a first turn cut by a limit ("length",
        "max_total_tokens") never reaches it; the trajectory would be trained as if its environment had run. Already
        counted in `errors`; an "interrupted" one is not trained anyway."""
        for t in trajectories:
            why = self.reset_errors.get(t.prompt_index * self.n + t.sample_index)
            if why and t.finish_reason not in ("env_error", "interrupted"):
                t.finish_reason, t.error = "env_error", why

    def _closed_turn(self, ids: list[int]) -> bool:
        """The model's turn wrote the template's end-of-turn token itself (its last token is that token, an EOS id).
        A turn that ended on another EOS id (e.g. `<|endoftext|>`) left its chat turn open: the environment's appended
        turn then starts with the end-of-turn token, as the template renders the conversation."""
        if not ids or ids[-1] not in self.eos:
            return False
        turn_end = getattr(self.encoder, "turn_end_id", None)
        return turn_end is None or ids[-1] == turn_end

    def _encode(self, conv: int, text: str, ids: list[int], obs: Any, room: Optional[int],
                info: dict[str, float]) -> tuple[Any, list[dict]]:
        """The observation's chunk; with `room`, its text first cut to (room + 1) x the characters a token can cover
        (more would be more than `room` tokens: the engine refuses the turn whatever the cut), counted in
        info["observation_truncated"]. A cut text whose chunk fits after all is encoded whole: nothing that fits is
        cut."""
        closed = self._closed_turn(ids)
        per_token = getattr(self.encoder, "max_chars_per_token", None)
        if room is not None and per_token is not None:
            short, cut = cut_observation(obs, (max(room, 0) + 1) * int(per_token))
            if cut:
                chunk, history = self.encoder.encode(self.history[conv], text, closed, short)
                if int(chunk.input_ids.numel()) > room:
                    info["observation_truncated"] = info.get("observation_truncated", 0.0) + 1.0
                    return chunk, history
        return self.encoder.encode(self.history[conv], text, closed, obs)

    def _fail(self, i: int, why: str) -> None:
        self.failed[i] = why
        self.errors += 1
        self.last_error = why

    def step(self, items: list[tuple]) -> list[TurnReply]:
        """Items (conversation, prompt index, turn text, turn ids[, room]): `room`, the most tokens the appended turn
        may have (TurnSource), bounds the observation's text before it is encoded (`_encode`)."""
        out: dict[int, TurnReply] = {}
        live = [it for it in items if it[0] not in self.failed]
        for conv, *_ in items:
            if conv in self.failed:
                out[conv] = TurnReply(error=self.failed.pop(conv))  # counted when it failed
        replies = self.runner.run([EnvCall("step", state=self.state[it[0]], action=it[2], limits=self.limits,
                                            tool_timeout_s=self.tool_timeout_s, turn_timeout_s=self.turn_timeout_s) for it in live],
                                   **self._run_kw)
        for (conv, _, text, ids, *room), r in zip(live, replies):
            if r.error or r.result is None:
                self._fail(conv, f"step: {r.error or 'no result'}")
                out[conv] = TurnReply(error=self.failed.pop(conv))
                continue
            self.state[conv] = r.state
            res = r.result
            info = {k: float(v) for k, v in res.info.items() if isinstance(v, numbers.Real)}  # numpy's too
            if res.done:
                out[conv] = TurnReply(reward=res.reward, done=True, info=info)
                continue
            try:
                chunk, self.history[conv] = self._encode(conv, text, ids, res.observation, room[0] if room else None,
                                                         info)
            except Exception as e:  # noqa: BLE001 - an observation the processor cannot take ends its trajectory
                self._fail(conv, f"observation: {type(e).__name__}: {e}"[:300])
                out[conv] = TurnReply(error=self.failed.pop(conv), info=info)
                continue
            out[conv] = TurnReply(chunk=chunk, reward=res.reward, info=info)
        return [out[conv] for conv, *_ in items]
