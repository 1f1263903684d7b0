"""The built-in rollout engine: generation with the policy model itself.

`PolicyRolloutEngine(model, tokenizer, forward=...)` generates with the very parameters the trainer
updates (no weight copy on one device): `forward` defaults to `model(**kwargs)`; the GRPO trainer
passes `lambda **kw: job.wrapper(model_kwargs=kw)` so that every call runs inside the FSDP root's
forward (parameters all-gathered per call, mixed precision applied).

One `generate` call, per batch of prompts (`max_prompts_per_batch`, 0 = all at once):

1. prefill: the prompts, left-padded into one batch, run once with their images / videos (each image
   encoded once) into a KV cache of prompt + max_new_tokens slots; M-RoPE rope deltas are stored in
   the cache so decoding continues the 3-D positions;
2. the cache is expanded to n rows per prompt (`KVCache.expand`): the group shares the prefix; with
   `share_prefix=False` (the benchmark baseline) every prompt is instead repeated n times and
   prefilled n times;
3. decode: the next token of every unfinished row is drawn (`sampling.sample_tokens`), the rows are
   checked for EOS / stop strings / budget, and the new tokens run through the model one step at a
   time. When at most `compact_ratio` of the cached rows are still generating, finished rows are
   dropped from the cache so later steps do not pay for them (attention-only `KVCache`; other
   caches, e.g. the hybrid Mamba cache, keep their rows and step them with padding).

Lock-step across ranks: under FSDP every rank must make the same number of forward calls.
`all_ranks_active(local_active) -> bool` (an all-reduce supplied by the trainer) decides whether
another decode step runs; a rank whose rows are all finished keeps stepping one dummy row until
every rank is done. The caller gives every rank the same number of prompts (padding with dummies).
"""
from __future__ import annotations

import gc
import time
from typing import Callable, Iterable, Mapping, Optional, Sequence

import torch

from megatron_vlm.data.batch import VISION_KEYS
from megatron_vlm.models.common.kv_cache import KVCache
from megatron_vlm.models.common.vlm_base import VLMBase
from megatron_vlm.rl.rollout.engine import RolloutEngine, RolloutPrompt, RolloutResult, RolloutSample, SamplingParams
from megatron_vlm.rl.rollout.sampling import sample_tokens
from megatron_vlm.rl.rollout.stopping import StopChecker, eos_token_ids_of

__all__ = ["PolicyRolloutEngine"]


def _left_pad(prompts: Sequence[RolloutPrompt], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for i, p in enumerate(prompts):
        n = len(p)
        if n == 0:
            raise ValueError(f"prompts[{i}]: empty prompt")
        ids[i, longest - n:] = p.input_ids.to(torch.long)
        mask[i, longest - n:] = 1
    return ids, mask


def _vision_inputs(prompts: Sequence[RolloutPrompt], repeat: int = 1) -> dict:
    """Vision tensors of the prompts concatenated in prompt order (each prompt's `repeat` times)."""
    out = {}
    for key in VISION_KEYS:
        parts = [getattr(p, key) for p in prompts for _ in range(repeat) if getattr(p, key) is not None]
        if parts:
            out[key] = torch.cat(parts)
    return out


def _vision_token_ids(model) -> list[int]:
    args = getattr(model, "args", None)
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return [int(getattr(args, n)) for n in names if isinstance(getattr(args, n, None), int)]


class PolicyRolloutEngine(RolloutEngine):
    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        forward: Optional[Callable[..., torch.Tensor]] = None,
        eos_token_ids: Optional[Iterable[int]] = None,
        pad_token_id: Optional[int] = None,
        cache_dtype: Optional[torch.dtype] = None,
        device: Optional[torch.device | str] = None,
        max_prompts_per_batch: int = 0,
        share_prefix: bool = True,
        compact_ratio: float = 0.5,
        all_ranks_active: Optional[Callable[[bool], bool]] = None,
        suppress_token_ids: Optional[Iterable[int]] = None,
    ):
        """`model`: the family model (a `VLMBase`: `new_cache`, forward with `kv_cache=`); `forward`: how to call
        it (default `model`); `cache_dtype`: the compute dtype of keys / values (bf16 under FSDP
        mixed precision; default the model's weight dtype); `suppress_token_ids`: tokens never
        generated (default: the model's vision placeholder / start / end tokens, `model.args.*_token_id`)."""
        if not isinstance(model, VLMBase):
            raise TypeError(f"{type(model).__name__} is not a family model (VLMBase): cached decoding needs its new_cache()")
        if max_prompts_per_batch < 0:
            raise ValueError(f"max_prompts_per_batch: must be >= 0, got {max_prompts_per_batch}")
        if not 0 <= compact_ratio <= 1:
            raise ValueError(f"compact_ratio: must be in [0, 1], got {compact_ratio}")
        self.model = model
        self.tokenizer = tokenizer
        self.forward = forward or model
        gen_cfg = getattr(model, "hf_generation_config", None)
        self.eos_token_ids = set(eos_token_ids) if eos_token_ids is not None else eos_token_ids_of(tokenizer, gen_cfg)
        if pad_token_id is None:
            pad_token_id = getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id = int(pad_token_id if pad_token_id is not None else min(self.eos_token_ids))
        self.cache_dtype = cache_dtype
        self.device = torch.device(device) if device is not None else None
        self.max_prompts_per_batch = max_prompts_per_batch
        self.share_prefix = share_prefix
        self.compact_ratio = compact_ratio
        self.all_ranks_active = all_ranks_active or (lambda active: active)
        if suppress_token_ids is None:
            suppress_token_ids = _vision_token_ids(model)
        self.suppress_token_ids = torch.tensor(sorted(set(int(i) for i in suppress_token_ids)), dtype=torch.long)
        self.policy_version = 0

    # ------------------------------------------------------------------ interface
    def load_weights(self, weights: Optional[Mapping[str, torch.Tensor]] = None, *, version: int) -> None:
        """The engine generates with the model it was given, so an update by the optimizer is already
        visible: only the version moves. `weights` (the model's own state-dict names) are copied in
        for an engine that holds a separate copy of the policy."""
        if weights is not None:
            self.model.load_state_dict(dict(weights), strict=True)
        self.policy_version = int(version)

    def release_memory(self) -> None:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    @torch.no_grad()
    def generate(self, prompts: Sequence[RolloutPrompt], params: SamplingParams, *,
                 generator: Optional[torch.Generator] = None) -> RolloutResult:
        if not prompts:
            raise ValueError("prompts: nothing to generate from")
        t0 = time.perf_counter()
        checker = StopChecker(self.tokenizer, self.eos_token_ids, params.stop)
        stats = {"prefill_s": 0.0, "decode_s": 0.0, "forward_calls": 0.0, "decode_steps": 0.0}
        step = self.max_prompts_per_batch or len(prompts)
        samples: list[RolloutSample] = []
        for start in range(0, len(prompts), step):
            samples += self._generate_batch(prompts[start:start + step], start, params, checker, generator, stats)
        n_tokens = sum(int(s.token_ids.numel()) for s in samples)
        return RolloutResult(samples=samples, num_generated_tokens=n_tokens, seconds=time.perf_counter() - t0, stats=stats)

    # ------------------------------------------------------------------ internals
    def _device(self) -> torch.device:
        if self.device is not None:
            return self.device
        return next(self.model.parameters()).device

    def _new_cache(self, batch: int, max_len: int):
        return self.model.new_cache(batch, max_len, dtype=self.cache_dtype, device=self._device())

    def _prefill(self, prompts: Sequence[RolloutPrompt], n: int, max_len: int):
        dev = self._device()
        ids, mask = _left_pad(prompts, self.pad_token_id)
        repeat = 1 if (self.share_prefix or n == 1) else n
        if repeat > 1:
            ids, mask = ids.repeat_interleave(repeat, 0), mask.repeat_interleave(repeat, 0)
        vision = {k: v.to(dev) for k, v in _vision_inputs(prompts, repeat).items()}
        cache = self._new_cache(ids.shape[0], max_len)
        logits = self.forward(input_ids=ids.to(dev), attention_mask=mask.to(dev), kv_cache=cache, **vision)[:, -1]
        if repeat == 1 and n > 1:
            cache = cache.expand(n)
            logits = logits.repeat_interleave(n, 0)
        return cache, logits

    def _generate_batch(self, prompts, offset: int, params: SamplingParams, checker: StopChecker,
                        generator: Optional[torch.Generator], stats: dict) -> list[RolloutSample]:
        n, budget = params.n, params.max_new_tokens
        dev = self._device()
        t0 = time.perf_counter()
        cache, logits = self._prefill(prompts, n, max(len(p) for p in prompts) + budget)
        stats["prefill_s"] += time.perf_counter() - t0
        stats["forward_calls"] += 1
        t1 = time.perf_counter()
        total = len(prompts) * n
        suppress = self.suppress_token_ids.to(logits.device)
        tokens: list[list[int]] = [[] for _ in range(total)]
        logps: list[list[float]] = [[] for _ in range(total)]
        reason: list[Optional[str]] = [None] * total
        rows = list(range(total))  # cache row -> sample index
        for t in range(budget):
            tok, lp = sample_tokens(logits, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                    generator=generator, suppress_token_ids=suppress)
            tok_l, lp_l = tok.tolist(), lp.tolist()
            for r, i in enumerate(rows):
                if reason[i] is not None:
                    continue
                tokens[i].append(tok_l[r])
                logps[i].append(lp_l[r])
                why = checker.check(tokens[i])
                if why is None and len(tokens[i]) >= budget:
                    why = "length"
                reason[i] = why
            if t == budget - 1:
                break
            alive = [r for r, i in enumerate(rows) if reason[i] is None]
            if not self.all_ranks_active(bool(alive)):
                break
            if type(cache) is KVCache and len(alive) <= self.compact_ratio * len(rows) and len(rows) > 1:
                keep = alive or [0]  # a rank with nothing left steps one dummy row for the others
                index = torch.tensor(keep, device=cache.mask.device)
                cache = cache.select_rows(index)
                rows = [rows[r] for r in keep]
                tok = tok.index_select(0, index.to(tok.device))
            feed = tok.clone()
            done = torch.tensor([reason[i] is not None for i in rows], device=feed.device)
            feed[done] = self.pad_token_id
            logits = self.forward(input_ids=feed[:, None].to(dev), kv_cache=cache)[:, -1]
            stats["forward_calls"] += 1
            stats["decode_steps"] += 1
        stats["decode_s"] += time.perf_counter() - t1
        out = []
        for i in range(total):
            why = reason[i] or "length"
            ids = torch.tensor(tokens[i], dtype=torch.long)
            out.append(RolloutSample(
                prompt_index=offset + i // n, sample_index=i % n, token_ids=ids,
                logprobs=torch.tensor(logps[i], dtype=torch.float32), text=checker.final_text(tokens[i], why),
                finish_reason=why, prompt_length=len(prompts[i // n]), policy_version=self.policy_version,
            ))
        return out
