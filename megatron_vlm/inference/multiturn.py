"""Multi-turn rollouts in the built-in engine: conversations whose KV cache lives on across turns.

A trajectory alternates model turns and environment turns (an observation: text, images, video frames).
Re-prefilling the history every turn would cost O(turns^2) prefill; here each conversation keeps its slot of
a `SlotCache` for its whole life: after a model turn ends (EOS or a stop string), the environment's reply is
encoded (`TurnSource.step`, rl/env/session.py: chat template, images through the processor) and only those
new tokens are prefilled into the slot (`_append_batch`: the slots' keys are viewed as rows of a padded cache,
the chunks run through the model with their images — the vision tower sees only the new images — in one
forward for all replies of a loop iteration, and the new keys are written after the old ones). Decoding is
continuously batched across conversations at different turns: one decode step serves every conversation that is generating, whatever its turn, and a conversation whose reply
was just prefilled joins the next step; a finished trajectory frees its slot for the next waiting one. With the
engine's `cuda_graphs` the decode steps are its static steps (inference/decode_graphs.py; the runner and its
slot cache are the engine's kept ones, `_kept_runner`), the appends and prefills stay eager.

Positions: M-RoPE families (Qwen2.5-VL, Qwen3-VL) place a chunk with images as the whole-sequence index
would (the original Qwen2.5-VL get_rope_index, mrope_index.py: text continues at the previous maximum + 1, a
vision grid starts there): the chunk's own index (from 0, its grids) is shifted by the slot's next text position (cached tokens
+ rope delta) and the slot's rope delta becomes the chunk's. So the positions of a trajectory are continuous
across turns and equal to those of the packed training forward over the whole trajectory, which therefore
gives the log-probs the rollout saw. 1-D RoPE families continue at the cached token count.

Randomness: every conversation draws from its own generator (seed, conversation index), one uniform per
token, so its tokens depend neither on which others share the batch nor on when its environment answered.

MoE routes (routing replay, models/common/routing_replay.py; an engine built with `record_routes`): every forward
records the experts of the tokens it feeds (the prompt's prefill, each decode step's token, each appended
chunk with the turn's last token before it) in the conversation's token order, so a trajectory carries
`routes` `[prompt + L - 1, MoE layers, k]` over the model's and the environment's tokens alike, as a
single-turn sample does (the final token is never fed).

Limits end a trajectory with a finish reason: a model turn at `max_new_tokens` "length"; the environment
done "done"; `max_turns` model turns "max_turns"; a trajectory that would grow past `max_total_tokens`
"max_total_tokens"; an environment failure "env_error" (counted by the caller).
"""
from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import torch

from megatron_vlm.abandon import Patience, WaitAbandoned
from megatron_vlm.data.batch import VISION_KEYS
from megatron_vlm.errors import ConfigError
from megatron_vlm.inference.engine import RolloutPrompt, SamplingParams
from megatron_vlm.inference.sampling import sample_tokens
from megatron_vlm.inference.stopping import StopChecker
from megatron_vlm.models.common.kv_cache import KVCache
from megatron_vlm.models.common.routing_replay import recording_routes
from megatron_vlm.models.common.slot_cache import SlotCache

__all__ = ["TurnChunk", "TurnReply", "TurnSource", "Trajectory", "MultiTurnRollout", "MultiTurnLimits"]


@dataclass
class TurnChunk:
    """Tokens appended to a conversation after a model turn (the environment's turn, rendered by the chat
    template, ending with the next assistant header), with the vision inputs of its new images / videos."""

    input_ids: torch.Tensor
    vision: dict[str, torch.Tensor] = field(default_factory=dict)
    images: list = field(default_factory=list)
    """The new images as loaded (PIL), for engines that process them themselves (vLLM, vllm_multiturn.py)."""
    videos: list = field(default_factory=list)
    """The new videos as loaded (`data.media.VideoClip`), for engines that process them themselves (vLLM)."""


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
    finished turns at once: items = [(conversation index, prompt index, turn text, turn token ids, room)], room =
    the most tokens the appended turn may have (max_total_tokens less the conversation so far and one model token):
    a longer chunk ends the trajectory at "max_total_tokens", so the source may cut a huge observation to a bound
    derived from it before tokenizing it."""

    def step(self, items: list[tuple[int, int, str, list[int], int]]) -> list[TurnReply]: ...


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
    routes: Optional[torch.Tensor] = None
    """[prompt + L - 1, MoE layers, k] the experts of every fed token (module docstring); None unless recorded."""
    token_versions: Optional[torch.Tensor] = None
    """[M] the policy version that drew each model token (engines whose weights change while they generate: the
    rollout ranks of asynchronous GRPO); None: all `policy_version`."""

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
    versions: list[int] = field(default_factory=list)
    turn: list[int] = field(default_factory=list)
    turn_texts: list[str] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    vision: dict[str, list[torch.Tensor]] = field(default_factory=lambda: {k: [] for k in VISION_KEYS})
    info: dict[str, float] = field(default_factory=dict)
    logits: Optional[torch.Tensor] = None
    finish: str = ""
    error: str = ""
    routes: list[torch.Tensor] = field(default_factory=list)  # [n, layers, k] per fed chunk, in token order


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
        if getattr(engine, "kv_block_size", 0):
            raise ConfigError("rl.rollout.kv_block_size: the paged KV cache is not used by multi-turn rollouts ([rl.env]: "
                              "a conversation keeps its slot across turns); set kv_block_size = 0")
        cache = getattr(engine.model, "new_cache", None)
        probe = cache(1, 1, device="meta") if cache is not None else None
        if not isinstance(probe, KVCache):
            raise ConfigError(f"rl.env: multi-turn rollouts need an attention-only decoder (a KV cache); "
                              f"{type(engine.model).__name__} keeps another decoding state")
        self.engine = engine
        self.model = engine.model
        self.record = getattr(engine, "routes_shape", None) is not None  # MoE routes (module docstring)
        self.reprefill_history = reprefill_history
        """The benchmark baseline (benchmarks/e2e/bench_multiturn.py): after each environment turn the whole
        history is prefilled again from an empty cache, as an engine without a cache across turns does."""
        self.stats: dict[str, float] = {}

    # ------------------------------------------------------------------ model calls
    def _device(self) -> torch.device:
        return self.engine._device()

    def _logits(self, ids: torch.Tensor, cache, **kw) -> torch.Tensor:
        return self.engine.forward(input_ids=ids, kv_cache=cache, **kw)[:, -1].float()

    def _routes_of(self, rec, rows: int) -> Optional[torch.Tensor]:
        """The recorded experts of a forward of `rows` rows, `[rows, tokens per row, layers, k]` (None: not recorded)."""
        routes = rec.stacked() if rec is not None else None
        return None if routes is None else routes.view(rows, -1, *routes.shape[1:])

    def _recording(self):
        return recording_routes() if self.record else contextlib.nullcontext()

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
        with self._recording() as rec:
            conv.logits = self._logits(p.input_ids.to(dev)[None], tmp, **vision)[0]
        if (routes := self._routes_of(rec, 1)) is not None:
            conv.routes.append(routes[0])
        cache.load_prefix([conv.slot], tmp, 0)
        self.stats["prefill_calls"] += 1

    def _append_batch(self, cache: SlotCache, appends: list[tuple[_Conv, TurnChunk]]) -> None:
        """Prefill only the new tokens of several conversations into their slots in one forward (module docstring):
        each turn's last sampled token (never fed: the turn ended on it) and its chunk. Row i holds its slot's L_i
        cached keys right-aligned in the first Lmax positions, then its n_i new tokens right-aligned in the next
        Nmax (padding masked in between), positions given explicitly; `load_prefix` copies the real positions
        back, contiguous."""
        dev = self._device()
        rows = []
        for conv, chunk in appends:
            ids = torch.cat([torch.tensor(conv.ids[-1:], dtype=torch.long), chunk.input_ids.to(torch.long)]).to(dev)
            rows.append((conv, ids, {k: v.to(dev) for k, v in chunk.vision.items()}, cache.host_lengths[conv.slot]))
        lmax = max(r[3] for r in rows)
        nmax = max(int(r[1].numel()) for r in rows)
        b = len(rows)
        tmp = self.model.new_cache(b, lmax + nmax, dtype=self.engine.cache_dtype, device=dev)
        ids = torch.full((b, nmax), self.engine.pad_token_id, dtype=torch.long, device=dev)
        new_mask = torch.zeros(b, nmax, dtype=torch.bool, device=dev)
        pos: Optional[torch.Tensor] = None
        deltas, new_deltas = [], []
        vision: dict[str, list[torch.Tensor]] = {}
        for i, (conv, row_ids, row_vision, length) in enumerate(rows):
            n = int(row_ids.numel())
            for layer in range(len(tmp.keys)):
                tmp.keys[layer][i, lmax - length:lmax] = cache.keys[layer][conv.slot, :length]
                tmp.values[layer][i, lmax - length:lmax] = cache.values[layer][conv.slot, :length]
            tmp.mask[i, lmax - length:lmax] = True
            ids[i, nmax - n:] = row_ids
            new_mask[i, nmax - n:] = True
            delta = int(cache.slot_rope_deltas[conv.slot, 0])
            row_pos, new_delta = self._positions(row_ids[None], row_vision, length, delta)
            if row_pos is not None:
                if pos is None:
                    pos = torch.zeros(3, b, nmax, dtype=torch.long, device=dev)
                pos[:, i, nmax - n:] = row_pos[:, 0]
            deltas.append(delta)
            new_deltas.append(new_delta)
            for k, v in row_vision.items():
                vision.setdefault(k, []).append(v)
        tmp.seq_len = lmax
        tmp.set_rope_deltas(torch.tensor(deltas, dtype=torch.long)[:, None])
        kw: dict = {k: torch.cat(v) for k, v in vision.items()}
        if pos is not None:
            kw["position_ids"] = pos
        with self._recording() as rec:
            logits = self.engine.forward(input_ids=ids, attention_mask=new_mask, kv_cache=tmp, **kw)[:, -1].float()
        if (routes := self._routes_of(rec, b)) is not None:  # each row's new tokens, right-aligned
            for i, (conv, row_ids, _, _) in enumerate(rows):
                conv.routes.append(routes[i, nmax - int(row_ids.numel()):])
        tmp.set_rope_deltas(torch.tensor(new_deltas, dtype=torch.long)[:, None])
        self.stats["append_padded_rows"] += sum(r[3] < lmax or int(r[1].numel()) < nmax for r in rows)
        for i, (conv, row_ids, _, _) in enumerate(rows):
            conv.logits = logits[i]
            cache.load_prefix([conv.slot], tmp, i)
            self.stats["append_tokens"] += int(row_ids.numel())
        self.stats["append_calls"] += b
        self.stats["append_forwards"] += 1

    def _reprefill_batch(self, cache: SlotCache, appends: list[tuple[_Conv, TurnChunk]]) -> None:
        """The baseline of `reprefill_history`: for each conversation the prompt + everything so far + the chunk,
        left-padded into one batch and prefilled from an empty cache (as the single-turn engine prefills prompts)."""
        dev = self._device()
        seqs: list[torch.Tensor] = []
        vision: dict[str, list[torch.Tensor]] = {}
        for conv, chunk in appends:
            p = conv.prompt
            seqs.append(torch.cat([p.input_ids.to(torch.long), torch.tensor(conv.ids, dtype=torch.long),
                                   chunk.input_ids.to(torch.long)]))
            for k in VISION_KEYS:
                for t in (getattr(p, k, None), *conv.vision[k], chunk.vision.get(k)):
                    if t is not None:
                        vision.setdefault(k, []).append(t)
        longest = max(int(x.numel()) for x in seqs)
        ids = torch.full((len(seqs), longest), self.engine.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(seqs), longest, dtype=torch.long)
        for i, x in enumerate(seqs):
            ids[i, longest - x.numel():] = x
            mask[i, longest - x.numel():] = 1
        tmp = self.model.new_cache(len(seqs), longest, dtype=self.engine.cache_dtype, device=dev)
        kw = {k: torch.cat(v).to(dev) for k, v in vision.items()}
        with self._recording() as rec:
            logits = self._logits(ids.to(dev), tmp, attention_mask=mask.to(dev), **kw)
        if (routes := self._routes_of(rec, len(seqs))) is not None:  # the whole history, fed again
            for i, (conv, _) in enumerate(appends):
                conv.routes = [routes[i, longest - int(seqs[i].numel()):]]
        for i, (conv, _) in enumerate(appends):
            conv.logits = logits[i]
            cache.load_prefix([conv.slot], tmp, i)
            self.stats["append_tokens"] += int(seqs[i].numel())
        self.stats["append_calls"] += len(appends)
        self.stats["append_forwards"] += 1

    # ------------------------------------------------------------------ the loop
    takes_abandon = True
    """`generate` takes `abandon`."""

    def generate(self, prompts: Sequence[RolloutPrompt], params: SamplingParams, source: TurnSource,
                 limits: MultiTurnLimits, *, seed: int = 0,
                 abandon: Optional[Callable[[], bool]] = None) -> list[Trajectory]:
        """The trajectories; `abandon`: the stop check, asked between decode steps (the built-in engine's rule:
        `WaitAbandoned`, "generation", once it has said stop for `ABANDON_GRACE_S`; the environment's own waits ask
        it through `source`)."""
        lock = getattr(self.engine, "_step_lock", None)  # asynchronous GRPO: weight pushes wait for a step boundary
        give_up = Patience(abandon) if abandon is not None else None
        try:
            with torch.inference_mode() if self.engine.owns_forward else torch.no_grad(), lock or contextlib.nullcontext():
                return self._generate(prompts, params, source, limits, seed, give_up)
        except BaseException:  # a step that failed half-way leaves the kept cache mid-step: nothing of it is kept
            self._drop_runner()
            raise
        finally:
            if getattr(self.engine, "_interrupt", None) is not None:
                self.engine._interrupt.clear()  # as the single-turn `generate`: the next call starts afresh
            if getattr(self.engine, "cuda_graphs", "off") == "off":  # "auto" gave up on graphs during the call
                self._drop_runner()

    def _drop_runner(self) -> None:
        """Drop the engine's kept runner and its slot cache (as the single-turn engine does), which later calls would
        not use but would hold besides a cache of their own."""
        drop = getattr(self.engine, "_drop_runner", None)
        if drop is not None:
            drop()

    def _step_boundary(self) -> bool:
        """Between two loop iterations (the generating thread holds the engine's step lock): a weight push from
        another thread (`engine.paused()`, asynchronous GRPO) takes the lock now and the loop goes on with the new
        weights, each later token labelled with the new version (the cached keys stay the older version's, as in
        the single-turn engine). True when `engine.interrupt()` asks the loop to stop."""
        pause = getattr(self.engine, "_pause", None)
        if pause is not None and pause.is_set():
            lock = self.engine._step_lock
            lock.release()
            try:
                while pause.is_set():
                    time.sleep(0.0005)
            finally:
                lock.acquire()
        interrupt = getattr(self.engine, "_interrupt", None)
        return interrupt is not None and interrupt.is_set() and not getattr(self.engine, "lockstep", False)

    def _generate(self, prompts, params: SamplingParams, source: TurnSource, limits: MultiTurnLimits,
                  seed: int, give_up: Optional[Callable[[], bool]] = None) -> list[Trajectory]:
        t0 = time.perf_counter()
        self.stats = {k: 0.0 for k in ("prefill_calls", "append_calls", "append_forwards", "append_padded_rows",
                                       "append_tokens", "decode_steps", "env_calls")}
        e, dev = self.engine, self._device()
        n, total = params.n, len(prompts) * params.n
        longest = max(len(p) for p in prompts)
        if longest >= limits.max_total_tokens:
            raise ValueError(f"rl.env.max_total_tokens: {limits.max_total_tokens} leaves no room after a prompt of "
                             f"{longest} tokens")
        num_slots = max(1, min(e.max_num_seqs or total, total))
        # the engine's kept static-step runner (CUDA graphs) and its slot cache, or None: eager steps (the paged cache
        # is refused here, so it is the slot layout; slots of max_total_tokens rounded up, the limit kept below)
        runner = e._kept_runner(num_slots, limits.max_total_tokens, dev)
        cache = runner.cache if runner is not None else e.with_options(
            SlotCache(self.model.new_cache(num_slots + 1, limits.max_total_tokens, dtype=e.cache_dtype, device=dev)))
        checker = StopChecker(e.tokenizer, e.eos_token_ids, params.stop)
        suppress = e.suppress_token_ids.to(dev)
        convs = [_Conv(i, prompts[i // n], _conversation_generator(seed, i, dev)) for i in range(total)]
        queue, free = deque(range(total)), deque(range(num_slots))
        done: list[_Conv] = []
        decoding: list[_Conv] = []
        while queue or decoding:
            if self._step_boundary():  # the rank stops: what is in flight ends "interrupted" (not trained)
                for c in [*decoding, *(convs[i] for i in queue)]:
                    c.finish = "interrupted"
                    done.append(c)
                break
            if give_up is not None and give_up():  # never lock-stepped (refused above): this rank leaves alone
                raise WaitAbandoned(f"generation given up after {int(self.stats['decode_steps'])} decode steps: the "
                                    "rank is stopping", waited_for="generation")
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
                if not math.isfinite(logp):  # no distribution (the sampler raises on the CPU only: sampling.py)
                    raise ValueError(f"rollout: trajectory {c.index}, generated token {len(c.ids)}: the logits have "
                                     "a NaN or +inf value, or only -inf ones outside the suppressed ids")
                c.ids.append(t)
                c.mask.append(True)
                c.logps.append(logp)
                c.versions.append(e.policy_version)
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
                feed = torch.tensor([c.ids[-1] for c in running], dtype=torch.long).to(dev, non_blocking=True)
                step_logits, routes = None, None
                if runner is not None and e.cuda_graphs != "off":  # the static (CUDA-graph) step; None: fell back
                    graph_logits = e._graph_step(runner, cache, [c.slot for c in running], feed)
                    if graph_logits is not None:  # views of the bucket's buffers: copied before the next step
                        step_logits = graph_logits.float().clone()
                        routes = runner.last_routes[:, None].clone() if runner.last_routes is not None else None
                if step_logits is None:
                    cache.set_active([c.slot for c in running])
                    with self._recording() as rec:
                        step_logits = self._logits(feed[:, None], cache)
                    routes = self._routes_of(rec, len(running))
                for i, (c, row) in enumerate(zip(running, step_logits)):
                    c.logits = row
                    if routes is not None:
                        c.routes.append(routes[i])
                self.stats["decode_steps"] += 1
            to_env = [c for c in ended if not c.finish]
            if to_env:
                self.stats["env_calls"] += 1
                replies = source.step([(c.index, c.index // n, c.turn_texts[-1], list(c.turn),
                                       limits.max_total_tokens - len(c.prompt) - len(c.ids) - 1) for c in to_env])
                appends = []
                for c, r in zip(to_env, replies):
                    chunk = self._on_reply(c, r, limits)
                    if chunk is not None:
                        appends.append((c, chunk))
                if appends and self.reprefill_history:
                    self._reprefill_batch(cache, appends)
                elif appends:  # the replies of this iteration in one forward
                    self._append_batch(cache, appends)
                for c, chunk in appends:
                    self._record(c, chunk)
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

    def _on_reply(self, c: _Conv, r: TurnReply, limits: MultiTurnLimits) -> Optional[TurnChunk]:
        """Record an environment reply; the chunk to append (None: the trajectory ends here, `c.finish` set)."""
        for k, v in r.info.items():
            c.info[k] = c.info.get(k, 0.0) + float(v)
        if r.error:
            c.finish, c.error = "env_error", r.error
            return None
        c.rewards.append(float(r.reward))
        if r.done:
            c.finish = "done"
            return None
        if len(c.turn_texts) >= limits.max_turns:
            c.finish = "max_turns"
            return None
        assert r.chunk is not None, "a reply that is not done carries the next turn's tokens"
        # the chunk and at least one model token must fit
        if len(c.prompt) + len(c.ids) + int(r.chunk.input_ids.numel()) + 1 > limits.max_total_tokens:
            c.finish = "max_total_tokens"
            return None
        return r.chunk

    @staticmethod
    def _record(c: _Conv, chunk: TurnChunk) -> None:
        """The appended chunk in the conversation's tokens (after its prefill: that reads the turn's last token)."""
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
            prompt_length=len(c.prompt), error=c.error, info=dict(c.info),
            policy_version=min(c.versions) if c.versions else self.engine.policy_version,
            token_versions=torch.tensor(c.versions, dtype=torch.long),
            routes=torch.cat(c.routes).cpu() if c.routes else None,
        )
