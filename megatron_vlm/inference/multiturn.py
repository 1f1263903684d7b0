"""Multi-turn rollouts in the built-in engine: conversations whose KV cache lives on across turns.

A trajectory alternates model turns and environment turns (an observation: text, images, video frames).
Re-prefilling the history every turn would cost O(turns^2) prefill; here each conversation keeps its slot of
a `SlotCache` for its whole life: after a model turn ends (EOS or a stop string), the environment's reply is
encoded (`TurnSource.step`, rl/env/session.py: chat template, images through the processor) and only those
new tokens are prefilled into the slot (`_append`: the slot's keys are viewed as a one-row cache, the chunk
runs through the model with its images — the vision tower sees only the new images — and the new keys are
written after the old ones). Decoding is continuously batched across conversations at different turns: one
decode step serves every conversation that is generating, whatever its turn, and a conversation whose reply
was just prefilled joins the next step; a finished trajectory frees its slot for the next waiting one.

Positions: M-RoPE families (Qwen2.5-VL, Qwen3-VL) place a chunk with images as the whole-sequence index
would (transformers' get_rope_index: text continues at the previous maximum + 1, an image grid starts
there): the chunk's own index (from 0, its grids) is shifted by the slot's next text position (cached tokens
+ rope delta) and the slot's rope delta becomes the chunk's. So the positions of a trajectory are continuous
across turns and equal to those of the packed training forward over the whole trajectory, which therefore
gives the log-probs the rollout saw. 1-D RoPE families continue at the cached token count.

Randomness: every conversation draws from its own generator (seed, conversation index), one uniform per
token, so its tokens depend neither on which others share the batch nor on when its environment answered.

Limits end a trajectory with a finish reason: a model turn at `max_new_tokens` "length"; the environment
done "done"; `max_turns` model turns "max_turns"; a trajectory that would grow past `max_total_tokens`
"max_total_tokens"; an environment failure "env_error" (counted by the caller).
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import torch

from megatron_vlm.data.batch import VISION_KEYS
from megatron_vlm.errors import ConfigError
from megatron_vlm.inference.engine import RolloutPrompt, SamplingParams
from megatron_vlm.inference.sampling import sample_tokens
from megatron_vlm.inference.stopping import StopChecker
from megatron_vlm.models.common.kv_cache import KVCache
from megatron_vlm.models.common.slot_cache import SlotCache

__all__ = ["TurnChunk", "TurnReply", "TurnSource", "Trajectory", "MultiTurnRollout", "MultiTurnLimits"]


@dataclass
class TurnChunk:
    """Tokens appended to a conversation after a model turn (the environment's turn, rendered by the chat
    template, ending with the next assistant header), with the vision inputs of its new images / videos."""

    input_ids: torch.Tensor
    vision: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class TurnReply:
    chunk: Optional[TurnChunk] = None
    """None with `done` or `error`."""
    reward: float = 0.0
    done: bool = False
    error: str = ""
    info: dict[str, float] = field(default_factory=dict)


class TurnSource(Protocol):
    """The environment side of the rollout (rl/env/session.py): `step(items)` answers several conversations'
    finished turns at once: items = [(conversation index, prompt index, turn text, turn token ids)]."""

    def step(self, items: list[tuple[int, int, str, list[int]]]) -> list[TurnReply]: ...


@dataclass(frozen=True)
class MultiTurnLimits:
    max_turns: int
    max_total_tokens: int


@dataclass
class Trajectory:
    prompt_index: int
    sample_index: int
    token_ids: torch.Tensor
    """[L] everything after the prompt: model turns and environment turns, in order."""
    model_mask: torch.Tensor
    """[L] bool: True on the model's tokens (the only ones trained)."""
    logprobs: torch.Tensor
    """[M] behaviour log-probs of the model's tokens (M = model_mask.sum())."""
    vision: dict[str, torch.Tensor]
    """Vision inputs of the environment's images / videos, in order (after the prompt's)."""
    text: str
    """The last model turn's text (what the verifiers score)."""
    turn_texts: list[str]
    turn_rewards: list[float]
    finish_reason: str
    prompt_length: int
    error: str = ""
    info: dict[str, float] = field(default_factory=dict)
    policy_version: int = 0

    @property
    def truncated(self) -> bool:
        return self.finish_reason in ("length", "max_total_tokens")

    @property
    def num_turns(self) -> int:
        return len(self.turn_texts)


@dataclass
class _Conv:
    index: int
    prompt: RolloutPrompt
    gen: torch.Generator
    slot: int = -1
    ids: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    turn: list[int] = field(default_factory=list)
    turn_texts: list[str] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    vision: dict[str, list[torch.Tensor]] = field(default_factory=lambda: {k: [] for k in VISION_KEYS})
    info: dict[str, float] = field(default_factory=dict)
    logits: Optional[torch.Tensor] = None
    finish: str = ""
    error: str = ""


def _conversation_generator(seed: int, index: int, device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((int(seed) * 1_000_003 + index * 7919 + 12_345) % (2**63 - 1))
    return g


class MultiTurnRollout:
    """`generate(prompts, params, source, limits, seed) -> [Trajectory]` (group-major, `params.n` per prompt) with
    the model, stop rules and settings of a `PolicyRolloutEngine` that generates with its own weights copy."""

    def __init__(self, engine: Any, *, reprefill_history: bool = False):
        if getattr(engine, "lockstep", False):
            raise ConfigError("rl.env: multi-turn rollouts need the engine's own weights copy (rl.rollout.weights = "
                              "'copy'); lock-step decoding through the trainer's sharded model is not supported")
        cache = getattr(engine.model, "new_cache", None)
        probe = cache(1, 1, device="meta") if cache is not None else None
        if not isinstance(probe, KVCache):
            raise ConfigError(f"rl.env: multi-turn rollouts need an attention-only decoder (a KV cache); "
                              f"{type(engine.model).__name__} keeps another decoding state")
        self.engine = engine
        self.model = engine.model
        self.reprefill_history = reprefill_history
        """The benchmark baseline (benchmarks/e2e/bench_multiturn.py): after each environment turn the whole
        history is prefilled again from an empty cache, as an engine without a cache across turns does."""
        self.stats: dict[str, float] = {}

    # ------------------------------------------------------------------ model calls
    def _device(self) -> torch.device:
        return self.engine._device()

    def _logits(self, ids: torch.Tensor, cache, **kw) -> torch.Tensor:
        return self.engine.forward(input_ids=ids, kv_cache=cache, **kw)[:, -1].float()

    def _positions(self, ids: torch.Tensor, vision: dict, start: int, delta: int) -> tuple[Optional[torch.Tensor], int]:
        """M-RoPE positions [3, 1, n] of a chunk appended after `start` cached tokens with rope delta `delta`, and
        the new delta; (None, delta) for 1-D RoPE families (they continue at the cached count)."""
        rope_index = getattr(self.model, "_rope_index", None)
        if rope_index is None:
            return None, delta
        pos, _ = rope_index(ids, None, None, vision)
        pos = pos + (start + delta)
        return pos, int(pos.max()) + 1 - (start + ids.shape[1])

    def _prefill(self, cache: SlotCache, conv: _Conv) -> None:
        dev = self._device()
        p = conv.prompt
        tmp = self.model.new_cache(1, len(p), dtype=self.engine.cache_dtype, device=dev)
        vision = {k: getattr(p, k).to(dev) for k in VISION_KEYS if getattr(p, k, None) is not None}
        conv.logits = self._logits(p.input_ids.to(dev)[None], tmp, **vision)[0]
        cache.load_prefix([conv.slot], tmp, 0)
        self.stats["prefill_calls"] += 1

    def _append(self, cache: SlotCache, conv: _Conv, chunk: TurnChunk) -> None:
        """Prefill only the new tokens into the conversation's slot (module docstring): the turn's last sampled token
        (never fed: the turn ended on it) and the chunk."""
        dev = self._device()
        if self.reprefill_history:
            self._reprefill(cache, conv, chunk)
            return
        slot, length = conv.slot, cache.host_lengths[conv.slot]
        ids = torch.cat([torch.tensor(conv.ids[-1:], dtype=torch.long), chunk.input_ids.to(torch.long)]).to(dev)[None]
        tmp = self.model.new_cache(1, length + ids.shape[1], dtype=self.engine.cache_dtype, device=dev)
        for layer in range(len(tmp.keys)):
            tmp.keys[layer][0, :length] = cache.keys[layer][slot, :length]
            tmp.values[layer][0, :length] = cache.values[layer][slot, :length]
        tmp.mask[0, :length] = True
        tmp.seq_len = length
        delta = int(cache.slot_rope_deltas[slot, 0])
        tmp.set_rope_deltas(torch.tensor([[delta]]))
        vision = {k: v.to(dev) for k, v in chunk.vision.items()}
        pos, new_delta = self._positions(ids, vision, length, delta)
        kw = dict(vision, position_ids=pos) if pos is not None else vision
        conv.logits = self._logits(ids, tmp, **kw)[0]
        tmp.set_rope_deltas(torch.tensor([[new_delta]]))
        cache.load_prefix([slot], tmp, 0)
        self.stats["append_calls"] += 1
        self.stats["append_tokens"] += ids.shape[1]

    def _reprefill(self, cache: SlotCache, conv: _Conv, chunk: TurnChunk) -> None:
        """The baseline of `reprefill_history`: prompt + everything so far + the chunk, prefilled from scratch."""
        dev = self._device()
        p = conv.prompt
        ids = torch.cat([p.input_ids.to(torch.long), torch.tensor(conv.ids, dtype=torch.long),
                         chunk.input_ids.to(torch.long)]).to(dev)[None]
        vision = {}
        for k in VISION_KEYS:
            parts = [t for t in (getattr(p, k, None), *conv.vision[k], chunk.vision.get(k)) if t is not None]
            if parts:
                vision[k] = torch.cat(parts).to(dev)
        tmp = self.model.new_cache(1, ids.shape[1], dtype=self.engine.cache_dtype, device=dev)
        conv.logits = self._logits(ids, tmp, **vision)[0]
        cache.load_prefix([conv.slot], tmp, 0)
        self.stats["append_calls"] += 1
        self.stats["append_tokens"] += ids.shape[1]

    # ------------------------------------------------------------------ the loop
    def generate(self, prompts: Sequence[RolloutPrompt], params: SamplingParams, source: TurnSource,
                 limits: MultiTurnLimits, *, seed: int = 0) -> list[Trajectory]:
        with torch.inference_mode() if self.engine.owns_forward else torch.no_grad():
            return self._generate(prompts, params, source, limits, seed)

    def _generate(self, prompts, params: SamplingParams, source: TurnSource, limits: MultiTurnLimits,
                  seed: int) -> list[Trajectory]:
        t0 = time.perf_counter()
        self.stats = {k: 0.0 for k in ("prefill_calls", "append_calls", "append_tokens", "decode_steps", "env_calls")}
        e, dev = self.engine, self._device()
        n, total = params.n, len(prompts) * params.n
        longest = max(len(p) for p in prompts)
        if longest >= limits.max_total_tokens:
            raise ValueError(f"rl.env.max_total_tokens: {limits.max_total_tokens} leaves no room after a prompt of "
                             f"{longest} tokens")
        num_slots = max(1, min(e.max_num_seqs or total, total))
        cache = SlotCache(self.model.new_cache(num_slots + 1, limits.max_total_tokens, dtype=e.cache_dtype, device=dev))
        checker = StopChecker(e.tokenizer, e.eos_token_ids, params.stop)
        suppress = e.suppress_token_ids.to(dev)
        convs = [_Conv(i, prompts[i // n], _conversation_generator(seed, i, dev)) for i in range(total)]
        queue, free = deque(range(total)), deque(range(num_slots))
        done: list[_Conv] = []
        decoding: list[_Conv] = []
        while queue or decoding:
            while queue and free:  # admission: a free slot takes the next waiting trajectory
                conv = convs[queue.popleft()]
                conv.slot = free.popleft()
                self._prefill(cache, conv)
                decoding.append(conv)
            logits = torch.stack([c.logits for c in decoding if c.logits is not None])
            uniform = None
            if params.temperature > 0:
                uniform = torch.cat([torch.rand(1, device=dev, generator=c.gen) for c in decoding])
            tok, lp = sample_tokens(logits, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                    suppress_token_ids=suppress, uniform=uniform)
            running, ended = [], []
            for c, t, logp in zip(decoding, tok.tolist(), lp.float().tolist()):
                c.ids.append(t)
                c.mask.append(True)
                c.logps.append(logp)
                c.turn.append(t)
                why = checker.check(c.turn)
                if why is None and len(c.turn) >= params.max_new_tokens:
                    c.finish = "length"
                elif why is None and len(c.prompt) + len(c.ids) >= limits.max_total_tokens:
                    c.finish = "max_total_tokens"
                if c.finish:
                    c.turn_texts.append(checker.final_text(c.turn, "length"))
                    ended.append(c)
                elif why is not None:
                    c.turn_texts.append(checker.final_text(c.turn, why))
                    ended.append(c)
                else:
                    running.append(c)
            if running:  # one decode step for every generating conversation, whatever its turn
                cache.set_active([c.slot for c in running])
                feed = torch.tensor([c.ids[-1] for c in running], dtype=torch.long, device=dev)
                step_logits = self._logits(feed[:, None], cache)
                for c, row in zip(running, step_logits):
                    c.logits = row
                self.stats["decode_steps"] += 1
            to_env = [c for c in ended if not c.finish]
            if to_env:
                self.stats["env_calls"] += 1
                replies = source.step([(c.index, c.index // n, c.turn_texts[-1], list(c.turn)) for c in to_env])
                for c, r in zip(to_env, replies):
                    self._on_reply(cache, c, r, limits)
            decoding = running
            for c in ended:
                c.turn = []
                if c.finish:
                    done.append(c)
                    free.append(c.slot)
                else:
                    decoding.append(c)
        self.stats["seconds"] = time.perf_counter() - t0
        return [self._trajectory(c, n) for c in sorted(done, key=lambda c: c.index)]

    def _on_reply(self, cache: SlotCache, c: _Conv, r: TurnReply, limits: MultiTurnLimits) -> None:
        for k, v in r.info.items():
            c.info[k] = c.info.get(k, 0.0) + float(v)
        if r.error:
            c.finish, c.error = "env_error", r.error
            return
        c.rewards.append(float(r.reward))
        if r.done:
            c.finish = "done"
            return
        if len(c.turn_texts) >= limits.max_turns:
            c.finish = "max_turns"
            return
        assert r.chunk is not None, "a reply that is not done carries the next turn's tokens"
        chunk = r.chunk
        # the chunk and at least one model token must fit
        if len(c.prompt) + len(c.ids) + int(chunk.input_ids.numel()) + 1 > limits.max_total_tokens:
            c.finish = "max_total_tokens"
            return
        self._append(cache, c, chunk)
        c.ids.extend(int(t) for t in chunk.input_ids.tolist())
        c.mask.extend([False] * int(chunk.input_ids.numel()))
        for key, tensor in chunk.vision.items():
            c.vision[key].append(tensor)

    def _trajectory(self, c: _Conv, n: int) -> Trajectory:
        return Trajectory(
            prompt_index=c.index // n, sample_index=c.index % n, token_ids=torch.tensor(c.ids, dtype=torch.long),
            model_mask=torch.tensor(c.mask, dtype=torch.bool), logprobs=torch.tensor(c.logps, dtype=torch.float32),
            vision={k: torch.cat(v) for k, v in c.vision.items() if v}, text=c.turn_texts[-1] if c.turn_texts else "",
            turn_texts=list(c.turn_texts), turn_rewards=list(c.rewards), finish_reason=c.finish,
            prompt_length=len(c.prompt), error=c.error, info=dict(c.info), policy_version=self.engine.policy_version,
        )
