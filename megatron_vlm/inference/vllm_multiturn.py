"""Multi-turn rollouts through the vLLM back end: each model turn is one vLLM request on the whole history.

vLLM's request API has no "append to this sequence" call, so a conversation's next turn is a new request whose
prompt is everything so far, as our token ids: the prompt, the model's turns and the environment's turns (the
`TurnChunk`s rendered by the chat template, rl/env/turns.py), with every image and video so far attached (the
prompt's, then the environment's in the order they arrived) and the runs of image / video placeholders collapsed
as for a single-turn prompt (vllm_engine.py). vLLM's prefix caching finds the earlier turns' KV blocks (the key of a
block covers its tokens and the images in it), so only the new tokens are prefilled; the images of earlier turns
are looked up in the encoder cache too. `stats["cached_tokens"]` counts what was reused.

Continuous batching: all conversations' first requests go in at once; vLLM's scheduler batches whatever is
running (conversations at different turns share every engine step); when a request finishes, its environment
is stepped (all conversations that finished in the same engine step in one batch) and the next request is
submitted at once, without waiting for the others.

Every turn's prompt is checked: the expanded ids vLLM reports must equal ours token for token (a ValueError
naming the conversation, the turn and both lengths otherwise), so the environment's images are expanded as
the training forward will see them. M-RoPE positions are vLLM's own over the whole history, which are the
training forward's.

Sampling: one request per conversation and turn (n = 1) with its own seed drawn from the conversation's
generator (seed, conversation index), so a conversation's tokens do not depend on the others. Log-probs as in
the single-turn back end (processed: after temperature; greedy: at temperature 1). Limits and finish reasons
are the built-in loop's (multiturn.py): a turn's `max_tokens` is min(max_new_tokens, what max_total_tokens
leaves), and a turn cut by the second is "max_total_tokens".

Asynchronous GRPO: the loop steps the engine itself, so `paused()` (a weight push from another thread) and
`interrupt()` work as in `VLLMRolloutEngine.generate`; each model token carries the version that drew it
(`Trajectory.token_versions`; a pushed engine recomputes the running requests' prefix with the new weights).
An interrupted conversation ends with finish reason "interrupted" (not trained).

A stop signal (`generate(..., abandon=check)`): the single-turn back end's rule (`VLLMRolloutEngine.give_up_at_step`,
the built-in loop's: between engine steps, `WaitAbandoned` "generation" once the check has said stop for
`ABANDON_GRACE_S`), the requests in flight aborted; the environment's own waits ask the check through `source`. The
ranks of a tensor-parallel engine agree at every step, so a rank that gave up an environment wait (between two
steps: its `WaitAbandoned`) says stop at the others' next agreement before it leaves (`leave_together`); a loop
that ends agrees once more after its last step, so a rank whose requests all ended still leaves with it.

An error on one rank only (its environment runner raised rather than answering with an error reply, a record or
image of its own that fails, one of the loop's checks): the ranks agree at every step even without a stop check,
and the failing rank says "failed" at the others' next agreement before its error leaves `generate`; they raise
`RankFailed` there (vllm_engine.py), so every rank raises together instead of the others waiting in the next
forward's collective. An environment's own failures (reset / step raised, hung, a bad observation) are no such
error: the session answers them as error replies, the trajectory ends as "env_error" and the ranks stay in step.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from megatron_vlm.abandon import Patience, WaitAbandoned
from megatron_vlm.inference.engine import RolloutPrompt, SamplingParams
from megatron_vlm.inference.multiturn import (
    MultiTurnLimits,
    MultiTurnRollout,
    Trajectory,
    TurnSource,
    _Conv,
    _conversation_generator,
)
from megatron_vlm.inference.stopping import StopChecker

__all__ = ["VLLMMultiTurnRollout"]


def _never() -> bool:
    """The stop check of a call given none: the ranks still agree at every step (one may fail between two)."""
    return False


@dataclasses.dataclass
class _Turn:
    """The request in flight of one conversation."""

    conv: _Conv
    number: int
    history: list[int]
    max_tokens: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    checked: bool = False
    reason: Optional[str] = None


class VLLMMultiTurnRollout(MultiTurnRollout):
    """`generate(prompts, params, source, limits, seed) -> [Trajectory]` (group-major, `params.n` per prompt) on a
    `VLLMRolloutEngine` (module docstring): the built-in loop's interface, records and finish reasons."""

    def __init__(self, engine: Any, tokenizer: Any = None):  # not super().__init__: that one needs a KV-cache model
        self.engine = engine
        self.tokenizer = tokenizer
        """Decodes the turns (stop rules, the text the environment gets): the data pipeline's, as the built-in loop's
        (None: vLLM's own, loaded from the same folder)."""
        self.stats: dict[str, float] = {}
        self.images: dict[int, list] = {}
        self.videos: dict[int, list] = {}
        self._in_step = False

    takes_abandon = True
    """`generate` takes `abandon` (module docstring: a stop signal)."""

    def generate(self, prompts: Sequence[RolloutPrompt], params: SamplingParams, source: TurnSource,
                 limits: MultiTurnLimits, *, seed: int = 0,
                 abandon: Optional[Callable[[], bool]] = None) -> list[Trajectory]:
        """The trajectories; `abandon`: the stop check, asked between engine steps (module docstring)."""
        self._in_step = True  # until the loop's last agreement: an error of this rank is told to the others
        try:
            return self._generate_agreeing(prompts, params, source, limits, seed, abandon)
        except (Exception, WaitAbandoned) as err:
            if self._in_step and not getattr(err, "left_together", False):  # the engine's other ranks leave with it
                self.engine.leave_together(failed=not isinstance(err, WaitAbandoned))
            raise

    def _generate_agreeing(self, prompts: Sequence[RolloutPrompt], params: SamplingParams, source: TurnSource,
                           limits: MultiTurnLimits, seed: int, abandon: Optional[Callable[[], bool]]) -> list[Trajectory]:
        e = self.engine
        # the ranks of a tensor-parallel engine agree at every step with or without a stop check (module docstring)
        give_up = Patience(abandon) if abandon is not None else _never
        t0 = time.perf_counter()
        self.stats = {k: 0.0 for k in ("requests", "prompt_tokens", "cached_tokens", "engine_steps", "env_calls")}
        n, total = params.n, len(prompts) * params.n
        longest = max(len(p) for p in prompts)
        if longest >= limits.max_total_tokens:
            raise ValueError(f"rl.env.max_total_tokens: {limits.max_total_tokens} leaves no room after a prompt of "
                             f"{longest} tokens")
        if limits.max_total_tokens > e.max_model_len:
            raise ValueError(f"rl.env.max_total_tokens: {limits.max_total_tokens} exceeds the vLLM engine's max_model_len "
                             f"= {e.max_model_len}")
        checker = StopChecker(self.tokenizer or e.llm.get_tokenizer(), e.eos_token_ids, params.stop)
        convs = [_Conv(i, prompts[i // n], _conversation_generator(seed, i, "cpu")) for i in range(total)]
        self.images = {c.index: [] for c in convs}
        self.videos = {c.index: [] for c in convs}
        live: dict[str, _Turn] = {}
        done: list[_Conv] = []
        with e.generating() as engine:
            try:
                self._loop(engine, convs, params, source, limits, checker, live, done, give_up)
            finally:
                if live:  # an error, or the call given up for a stop: leave nothing of this call in the engine
                    engine.abort_request(list(live))
        self.stats["seconds"] = time.perf_counter() - t0
        return [self._trajectory(c, n) for c in sorted(done, key=lambda c: c.index)]

    def _loop(self, engine: Any, convs: list[_Conv], params: SamplingParams, source: TurnSource,
              limits: MultiTurnLimits, checker: StopChecker, live: dict[str, _Turn], done: list[_Conv],
              give_up: Optional[Callable[[], bool]] = None) -> None:
        """Submit every conversation's first turn, then step the engine until no request is left (module docstring);
        `WaitAbandoned` when `give_up` gives the call up (the caller aborts what is in flight)."""
        e, n = self.engine, params.n
        for c in convs:
            self._submit(engine, c, params, limits, live)
        while live:
            if e.interrupt_requested():
                engine.abort_request(list(live))
                for turn in live.values():
                    self._keep_partial(turn, checker)
                    turn.conv.finish = "interrupted"
                    done.append(turn.conv)
                live.clear()
                break
            if e.step_aside():  # `paused()` from another thread: step aside at this step boundary
                continue
            e.give_up_at_step(give_up, int(self.stats["engine_steps"]))
            version = e.policy_version
            finished: list[_Turn] = []
            for out in engine.step():
                req = live.get(out.request_id)
                if req is None:
                    continue
                if not req.checked and out.prompt_token_ids is not None:
                    self._check_prompt(req, list(out.prompt_token_ids))
                    self.stats["cached_tokens"] += int(getattr(out, "num_cached_tokens", 0) or 0)
                for c in out.outputs:
                    req.tokens += list(c.token_ids)
                    req.logprobs += [float(d[t].logprob) for d, t in zip(c.logprobs or [], c.token_ids)]
                    req.versions += [version] * len(c.token_ids)
                    if c.finish_reason is not None:
                        req.reason = c.finish_reason
                if out.finished:
                    finished.append(live.pop(out.request_id))
            self.stats["engine_steps"] += 1
            to_env = []
            for turn in finished:
                if self._end_turn(turn, params, checker):
                    to_env.append(turn.conv)
                else:
                    done.append(turn.conv)
            if to_env:
                self.stats["env_calls"] += 1
                replies = source.step([(c.index, c.index // n, c.turn_texts[-1], list(c.turn),
                                       limits.max_total_tokens - len(c.prompt) - len(c.ids) - 1) for c in to_env])
                for c, r in zip(to_env, replies):
                    chunk = self._on_reply(c, r, limits)
                    c.turn = []
                    if chunk is None:
                        done.append(c)
                        continue
                    self._record(c, chunk)
                    self.images[c.index] += list(chunk.images)
                    self.videos[c.index] += list(chunk.videos)
                    self._submit(engine, c, params, limits, live)  # its next turn, at once
        # a rank of a tensor-parallel engine that gave its environments up after this rank's last step leaves with it
        e.give_up_at_step(give_up, int(self.stats["engine_steps"]), finished=True)
        self._in_step = False  # the other ranks have left the loop: nothing more to agree on

    def leave_together(self, *, failed: bool = False) -> None:
        """This rank gave up a wait before the loop (the environments' reset: rl/env/rollout.py), or failed there
        (`failed`), and will not run it: the other ranks of a tensor-parallel engine leave at their loop's first step
        (`VLLMRolloutEngine.leave_together`)."""
        self.engine.leave_together(failed=failed)

    # ------------------------------------------------------------------ requests
    def _submit(self, engine: Any, c: _Conv, params: SamplingParams, limits: MultiTurnLimits,
                live: dict[str, _Turn]) -> None:
        e = self.engine
        history = [int(t) for t in c.prompt.input_ids.tolist()] + c.ids
        room = limits.max_total_tokens - len(history)
        turn = _Turn(c, len(c.turn_texts), history, max_tokens=min(params.max_new_tokens, room))
        prompt_images = list(getattr(c.prompt, "images", None) or [])
        prompt_videos = list(getattr(c.prompt, "videos", None) or [])
        p = dataclasses.replace(c.prompt, input_ids=torch.tensor(history, dtype=torch.long),
                                images=(prompt_images + self.images[c.index]) or None,
                                videos=(prompt_videos + self.videos[c.index]) or None)
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=c.gen))
        rid = f"mt{id(self)}-{c.index}-{turn.number}-{time.monotonic_ns()}"
        e.add_request(engine, rid, p, dataclasses.replace(params, n=1, max_new_tokens=turn.max_tokens), seed)
        live[rid] = turn
        self.stats["requests"] += 1
        self.stats["prompt_tokens"] += len(history)

    def _check_prompt(self, turn: _Turn, theirs: list[int]) -> None:
        """vLLM's expanded prompt of every turn must be ours, token for token (module docstring)."""
        turn.checked = True
        ours = turn.history
        if theirs != ours:
            first = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            raise ValueError(f"vLLM multi-turn rollout: conversation {turn.conv.index}, turn {turn.number + 1}: vLLM's "
                             f"expanded prompt has {len(theirs)} tokens, ours {len(ours)} (first difference at token "
                             f"{first}): the image processor / placeholder expansion of vLLM and of the data pipeline "
                             "disagree (an environment image?)")

    def _keep_partial(self, turn: _Turn, checker: StopChecker) -> None:
        """An interrupted turn's tokens so far go into its conversation (the trajectory is not trained)."""
        c = turn.conv
        k = min(len(turn.tokens), len(turn.logprobs))
        c.ids += turn.tokens[:k]
        c.mask += [True] * k
        c.logps += turn.logprobs[:k]
        c.versions += turn.versions[:k]
        c.turn_texts.append(checker.final_text(turn.tokens[:k], "length"))

    def _end_turn(self, turn: _Turn, params: SamplingParams, checker: StopChecker) -> bool:
        """Record a finished turn in its conversation; True when the environment answers next (the model closed
        its turn), False when a limit ended the trajectory (`finish` set)."""
        c = turn.conv
        if len(turn.logprobs) != len(turn.tokens) or not turn.tokens:
            raise RuntimeError(f"vLLM multi-turn rollout: conversation {c.index}: {len(turn.logprobs)} log-probs for "
                               f"{len(turn.tokens)} tokens")
        c.ids += turn.tokens
        c.mask += [True] * len(turn.tokens)
        c.logps += turn.logprobs
        c.turn = list(turn.tokens)
        c.versions += turn.versions
        why = checker.check(turn.tokens)
        if why is None:  # vLLM stopped at max_tokens (or a stop string its detokenizer saw across tokens)
            why = "stop" if turn.reason == "stop" else None
        if why is None:
            c.finish = "length" if len(turn.tokens) >= params.max_new_tokens else "max_total_tokens"
            c.turn_texts.append(checker.final_text(turn.tokens, "length"))
            return False
        c.turn_texts.append(checker.final_text(turn.tokens, why))
        return True
