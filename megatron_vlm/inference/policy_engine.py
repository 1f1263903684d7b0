"""The built-in rollout engine: continuous batching over a slot KV cache, with the policy model itself.

`PolicyRolloutEngine(model, tokenizer, options, forward=...)` generates with `model`. Two ways to hold the
weights (see `load_weights`):

* its own inference copy (`forward=None`, the model is unsharded on the engine's device): the trainer
  refreshes it once per step with `load_weights(named_tensors, version)`; no collective runs while
  decoding, so sequences are batched continuously (below);
* the trainer's parameters (`forward=lambda **kw: wrapper(model_kwargs=kw)`: every call runs inside
  the FSDP root, parameters all-gathered per call). Cheaper on one device (no copy to keep), but every
  rank must make the same forward calls, so decoding runs in lock-step (below).

One `generate` call:

1. samples wait in a queue and take free slots of a pre-allocated `SlotCache` (`max_num_seqs` slots of prompt +
   budget tokens), their prompts prefilled once per GRPO group (inference/admission.py; with `kv_block_size` > 0 a
   paged pool whose blocks are taken on demand, a sample preempted when it runs out and re-admitted later);
2. decoding: the next token of every active slot is drawn in one batched call (`sampling.sample_tokens`:
   temperature, top-k, top-p, behaviour log-probs; the random numbers are drawn for every slot at every
   step, so a sample's draws depend on its slot and step only, not on which other rows still run) and
   written to device buffers (inference/slot_run.py); the only host sync per step is the stop check (EOS flags,
   plus the token ids when stop strings are set). Finished slots are freed and take the next waiting samples at
   once, so the batch stays full until the queue is empty. The tokens run through the model one step at a time,
   attention by `kernels.decode_attention` on the slots (no padding), the Mamba2 state of the hybrid decoder per
   slot. On the CPU the paged cache is ~5-9 % slower than the slot layout, so off by default.

Lock-step (when `all_ranks_active` is given: the trainer's FSDP forward, or the expert-parallel copy whose MoE
blocks exchange tokens): every rank must make the same forward calls in the same order. The slots
(`max_prompts_per_batch` prompts x n, 0 = every sample of the call) are refilled as completions end, the prefills
in admission rounds that every rank makes together (`Admission.lockstep_admit`: one prefill forward per rank and
round, of one pad token on a rank with nothing to admit, `stats["dummy_prefills"]`). Then
`all_ranks_active(local_active)` decides whether another decode step runs, and a rank whose rows are all
finished steps one dummy row on the scratch slot until every rank is done. The caller gives every rank the same
number of prompts.

CUDA graphs (`cuda_graphs`, inference/decode_graphs.py): the decode steps run on static buffers per
batch-size bucket, captured once per bucket and replayed on CUDA. "auto": on for a CUDA device, else off;
"on": also on the CPU, where the same static step runs eagerly (tests; its first runs per bucket are
checked for graph safety, a failure raised). Needs the engine's own weights copy and a decode step without
host reads (the slot layout or the paged pool, whose block table is a static buffer rewritten between
steps; MoE blocks route graph-safely there: models/common/moe_static.py). Lock-stepped ranks with their own
copy (the expert-parallel copy, inference/ep_rollout.py) run one bucket, the slot count, on every rank:
their MoE blocks exchange the step's rows with fixed-size collectives (`static_forward`,
parallel/expert_parallel.py). "on" with `forward=` (the trainer's FSDP model) is refused; "auto"
falls back to eager steps with a logged reason (also when a capture fails; on one lock-stepped rank: on every
rank at the same step, `DecodeStepRunner(agree=...)`). The slot cache (or pool) and its
graphs are kept for the next call of the same slot shape, until `release_memory()`.

Interruption and versions: `interrupt()` (from another thread) stops `generate` at the next token
boundary; the result holds the partial completions (reason "interrupted"). `load_weights` from
another thread waits for the current step and applies to the next one, so the cached prefix of a
running completion keeps the older version's keys; every token records the version that drew it
(`RolloutSample.token_versions`). Lock-stepped ranks are not interrupted (a rank leaving alone would
stall the others' collectives).

A stop signal while generating (`generate(..., abandon=check)`, the training rank's stop flag): the check is asked
between decode steps (one Python call; no host sync, no collective of its own) and, once it has said stop for
`ABANDON_GRACE_S` of the call (abandon.py `Patience`), `WaitAbandoned` ("generation") ends the call with nothing
returned; the GRPO round then agrees with the other ranks to abandon the step (rl/rounds.py). Lock-stepped ranks must
leave at the same step: the stop travels in the decode step's `all_ranks_active` all-reduce as the `STOPPING` bit, so
every rank raises at that step (the callable must then return the max of the ranks' ints, not a bool). What one
decode step does (a kernel, a collective that hangs) is not cut short.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from megatron_vlm.abandon import Patience, WaitAbandoned
from megatron_vlm.host_copies import move
from megatron_vlm.inference.admission import Admission, pool_for_every_slot
from megatron_vlm.inference.cpu_packed_experts import PackedExperts, fused_experts_available
from megatron_vlm.inference.cpu_packed_linear import PackedLinears, packing_available
from megatron_vlm.inference.decode_graphs import DecodeStepRunner, GraphUnsafeError
from megatron_vlm.inference.engine import RolloutEngine, RolloutPrompt, RolloutResult, RolloutSample, SamplingParams
from megatron_vlm.inference.engine_options import (
    CUDA_GRAPH_MODES,
    CudaGraphsConfigError,
    EngineOptions,
    PagedKVConfigError,
    cuda_graphs_blocker,
    paged_kv_blocker,
)
from megatron_vlm.inference.prompt_batch import left_pad, vision_inputs, vision_token_ids
from megatron_vlm.inference.sampling import same_device, sample_tokens
from megatron_vlm.inference.slot_run import SlotRun
from megatron_vlm.inference.stopping import StopChecker, eos_token_ids_of
from megatron_vlm.models.common.fused_projections import fuse_qkv, fused_projections
from megatron_vlm.models.common.moe import moe_layers
from megatron_vlm.models.common.routing_replay import recording_routes
from megatron_vlm.models.common.slot_cache import PagedSlotCache, SlotCache
from megatron_vlm.models.common.vlm_base import VLMBase
from megatron_vlm.models.mcore.layer import native_state_dict
from megatron_vlm.parallel.device_cache import empty_device_cache
from megatron_vlm.parallel.full_weights import block_groups, full_tensor

__all__ = ["PolicyRolloutEngine", "EngineOptions", "CUDA_GRAPH_MODES", "CudaGraphsConfigError", "cuda_graphs_blocker",
           "PagedKVConfigError", "paged_kv_blocker", "vision_token_ids"]

STOPPING = 2
"""The bit a lock-stepped rank adds to its `all_ranks_active` flag when it gives its generation up for a stop."""

log = logging.getLogger(__name__)


@dataclass
class _Batch:
    """What one batch of a `generate` call decodes: its prompts (from `offset` in the call's list), the sampling
    settings, stop criteria, random generator, the call's stats, and the end-of-sequence / suppressed token ids on
    the device."""
    prompts: Sequence[RolloutPrompt]
    offset: int
    params: SamplingParams
    checker: StopChecker
    generator: Optional[torch.Generator]
    stats: dict
    eos: torch.Tensor
    suppress: torch.Tensor
    give_up: Optional[Callable[[], bool]] = None
    """The call's stop check with its grace (`Patience`), asked between decode steps; None: never given up."""


def eager_calls(forward: Callable[..., Any]) -> Callable[..., Any]:
    """`forward` run with dynamo's stance "force_eager": the trainer's blocks compiled for training
    (`parallel.compile`) decode eagerly. Traced, every layer index (the KV cache's key, an int) and every new
    cache length is a graph of its own: the compiled code of one block class hit dynamo's recompile limit within
    the first decode call (compiling for minutes on a GPU, then eager anyway, with a warning)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        with torch.compiler.set_stance("force_eager"):
            return forward(*args, **kwargs)

    return call


def _to_device(values: list[int], dev: torch.device) -> torch.Tensor:
    """A host list of row / slot indices as a long tensor on `dev`, copied without waiting for the device (a
    `torch.tensor(..., device=...)` of a list is a blocking upload: on CUDA it waits for every queued kernel)."""
    return torch.as_tensor(values, dtype=torch.long).to(dev, non_blocking=True)


def _finished_on_host(finished: dict) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """{sample: (token ids int64, log-probs float32, versions int64)} of the finished samples' device copies, on the
    host in one read (float64 holds the ids, versions and float32 log-probs exactly), not three per sample."""
    if not finished:
        return {}
    order = list(finished)
    parts = [t.double() for i in order for t in (finished[i][0], finished[i][1], finished[i][2])]
    flat = torch.cat(parts).cpu()
    out, start = {}, 0
    for i in order:
        ids, logps, versions = finished[i][:3]
        a, b, c = ids.numel(), logps.numel(), versions.numel()
        out[i] = (flat[start:start + a].to(ids.dtype), flat[start + a:start + a + b].to(torch.float32),
                  flat[start + a + b:start + a + b + c].to(versions.dtype))
        start += a + b + c
    return out


class PolicyRolloutEngine(RolloutEngine):
    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        options: Optional[EngineOptions] = None,
        *,
        forward: Optional[Callable[..., torch.Tensor]] = None,
        all_ranks_active: Optional[Callable[[int], Any]] = None,
        sync_from: Optional[torch.nn.Module] = None,
    ):
        """`model`: the family model (a `VLMBase`: `new_cache`, forward with `kv_cache=`); `options`: how it decodes
        (`EngineOptions`); `forward`: how to call the model (default `model`: the engine's own copy, continuous
        batching); `all_ranks_active`: lock-step decoding with the other ranks (the trainer's FSDP forward): the
        max over the ranks of an int flag (0 / 1: whether the rank has work; `STOPPING` added by a rank that gives
        its generation up, only in a call given `abandon`; a bool any-rank serves a caller that passes none);
        `sync_from`: the trainer's model (possibly FSDP-sharded) whose full weights `load_weights(None, ...)`
        copies into `model` (the engine's own copy). A paged KV cache with a Mamba2 hybrid decoder is refused
        (`PagedKVConfigError`), as are CUDA graphs "on" where a decode step cannot be captured."""
        o = options if options is not None else EngineOptions()
        eos_token_ids, pad_token_id, cache_dtype, device = o.eos_token_ids, o.pad_token_id, o.cache_dtype, o.device
        max_prompts_per_batch, max_num_seqs, share_prefix = o.max_prompts_per_batch, o.max_num_seqs, o.share_prefix
        suppress_token_ids, kv_block_size, kv_cache_blocks = o.suppress_token_ids, o.kv_block_size, o.kv_cache_blocks
        cuda_graphs = o.cuda_graphs
        self.options = o
        moes = moe_layers(model)
        # (MoE layers, top-k, experts) of the recorded routes, or None (not recorded)
        self.routes_shape = (len(moes), int(moes[0].top_k), int(moes[0].num_experts)) if o.record_routes and moes else None
        if not isinstance(model, VLMBase):
            raise TypeError(f"{type(model).__name__} is not a family model (VLMBase): cached decoding needs its new_cache()")
        if max_prompts_per_batch < 0:
            raise ValueError(f"max_prompts_per_batch: must be >= 0, got {max_prompts_per_batch}")
        if max_num_seqs < 0:
            raise ValueError(f"max_num_seqs: must be >= 0, got {max_num_seqs}")
        if kv_block_size < 0 or kv_cache_blocks < 0 or kv_block_size == 1:
            raise ValueError(f"kv_block_size (0 or >= 2) / kv_cache_blocks (>= 0): got {kv_block_size} / {kv_cache_blocks}")
        if kv_block_size:
            why_not_paged = paged_kv_blocker(model)
            if why_not_paged:
                raise PagedKVConfigError(f"rl.rollout.kv_block_size: {kv_block_size} (the paged KV cache) is not possible: {why_not_paged}")
            log.info("rollout KV cache: paged, %d positions per block, pool of %s", kv_block_size,
                     f"{kv_cache_blocks} blocks" if kv_cache_blocks else "every slot at full length + the admission headroom (derived per batch)")
        self.kv_block_size, self.kv_cache_blocks = kv_block_size, kv_cache_blocks
        if cuda_graphs not in CUDA_GRAPH_MODES:
            raise ValueError(f"cuda_graphs: must be one of {CUDA_GRAPH_MODES}, got {cuda_graphs!r}")
        why_not = cuda_graphs_blocker(model, trainer_forward=forward is not None)
        if cuda_graphs == "on" and why_not:
            raise CudaGraphsConfigError(f"rl.rollout.cuda_graphs: 'on' is not possible: {why_not}")
        if cuda_graphs == "auto" and why_not:
            if self._on_cuda(model, device):  # elsewhere "auto" means eager steps anyway: nothing to report
                log.info("rollout CUDA graphs off: %s", why_not)
            cuda_graphs = "off"
        self.cuda_graphs = cuda_graphs
        if cuda_graphs != "off" and self._on_cuda(model, device):
            log.info("rollout CUDA graphs %s: decode steps captured per batch-size bucket and replayed", cuda_graphs)
        self._runner: Optional[DecodeStepRunner] = None  # with its slot cache, kept across calls (_kept_runner)
        self._runner_key: tuple = ()
        self.model = model
        self.tokenizer = tokenizer
        self.forward = eager_calls(forward or model)
        self._model_eager = eager_calls(model)  # the own copy's prefill (last position through the LM head)
        self.owns_forward = forward is None
        gen_cfg = getattr(model, "hf_generation_config", None)
        self.eos_token_ids = set(eos_token_ids) if eos_token_ids is not None else eos_token_ids_of(tokenizer, gen_cfg)
        if pad_token_id is None:
            pad_token_id = getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id = int(pad_token_id if pad_token_id is not None else min(self.eos_token_ids))
        self.cache_dtype = cache_dtype
        self.device = torch.device(device) if device is not None else None
        self.max_prompts_per_batch = max_prompts_per_batch
        self.max_num_seqs = max_num_seqs
        self.share_prefix = share_prefix
        self.lockstep = all_ranks_active is not None
        self.all_ranks_active = all_ranks_active or (lambda active: active)
        if suppress_token_ids is None:
            suppress_token_ids = vision_token_ids(model)
        self.suppress_token_ids = torch.tensor(sorted(set(int(i) for i in suppress_token_ids)), dtype=torch.long)
        if sync_from is not None and not self.owns_forward:
            raise ValueError("sync_from: only for an engine that generates with its own copy (forward=None)")
        own_copy = self.owns_forward and not self.lockstep
        if o.fuse_projections and not own_copy:
            raise ValueError("fuse_projections: only for an engine that generates with its own copy of the weights "
                             "(it re-makes the q / k / v Parameters, which the trainer's optimizer holds)")
        self.fuse_projections = (bool(o.fuse_projections) if o.fuse_projections is not None
                                 else own_copy and self._on_cuda(model, device))
        self.sync_from = sync_from
        self._refreshed_version: Optional[int] = None  # the trainer's version the own copy holds (`sync_to_version`)
        self.weight_sync_s = 0.0
        self.policy_version = 0
        self._packs: dict = {}  # MKL-packed weight copies of the CPU decode step (cpu_packed_linear.py)
        self._packer: Optional[PackedLinears] = None
        self._expert_packer: Optional[PackedExperts] = None  # the fused CPU experts (cpu_packed_experts.py)
        self._step_lock = threading.RLock()  # re-entrant: a forward hook may load weights
        self._interrupt = threading.Event()
        self._pause = threading.Event()  # set by `paused()`: the decode loop leaves the step lock to it
        self._preemptions = 0  # since the last `metrics()`

    @staticmethod
    def _on_cuda(model: torch.nn.Module, device) -> bool:
        """Whether the engine decodes on a CUDA device (its `device` option, else where the model's weights are)."""
        if device is not None:
            return torch.device(device).type == "cuda"
        first = next(model.parameters(), None)
        return first is not None and first.device.type == "cuda"

    def metrics(self) -> dict[str, float]:
        """Rollout counters since the last call, for the step's metrics: `rollout/preemptions` (samples preempted for
        lack of KV blocks, on-demand paged cache; none without it)."""
        out = {"rollout/preemptions": float(self._preemptions)} if self.kv_block_size else {}
        self._preemptions = 0
        return out

    # ------------------------------------------------------------------ interface
    def load_weights(self, weights: Optional[Mapping[str, torch.Tensor]] = None, *, version: int) -> None:
        """`weights` (the model's own state-dict names, full tensors) are copied into the engine's model.
        None: with `sync_from`, its full weights are gathered (a collective for a sharded model: every rank
        calls this together) and copied; otherwise the engine shares the trainer's parameters (an optimizer
        update is already visible) and only the version moves. Waits for a running decode step (another
        thread) to finish. The time of the copy is reported as `weight_sync_s` in the next result's stats."""
        t0 = time.perf_counter()
        refresh = weights is None and self.sync_from is not None
        with self._step_lock:
            if refresh:
                self._copy_from_trainer()
            elif weights is not None:
                missing, unexpected = self.model.load_state_dict(dict(weights), strict=False)
                if unexpected:
                    raise KeyError(f"load_weights: unknown parameter names {sorted(unexpected)[:5]}")
                if missing and len(missing) == len(self.model.state_dict()):
                    raise KeyError("load_weights: none of the names matches the model's parameters")
            self.policy_version = int(version)
            self._packs.clear()  # new weights: packed again at their next use
            # graphs hold the parameters' addresses. One read: the generating thread replaces the kept runner
            # outside this lock (`_kept_runner`); a new one records the addresses at its first step anyway
            runner = self._runner
            if runner is not None:
                runner.weights_loaded()
        if refresh or weights is not None:
            self.weight_sync_s += time.perf_counter() - t0
        if weights is None and self.refreshes_from_trainer:
            self._refreshed_version = int(version)

    def _copy_from_trainer(self) -> None:
        """Copy the trainer's (`sync_from`) current weights into the engine's own, one block's tensors gathered at a
        time (for a sharded trainer each gather is a collective, made by every rank in the same state-dict order).
        Why by block: gathering the whole state dict first held a second full model in the trainer's master dtype
        (fp32: twice the bf16 copy) on every rank for the refresh. A trainer with megatron-core layers
        (parallel.backend = "mcore") gives its blocks under their native names (`native_state_dict`)."""
        assert self.sync_from is not None
        state = self.sync_from.state_dict()
        for owner, names in block_groups(state).items():
            full = native_state_dict({n: full_tensor(state[n]) for n in names}, self.sync_from)
            prefix = f"{owner}." if owner else ""
            unknown = sorted(n for n in full if not n.startswith(prefix))
            try:
                module = self.model.get_submodule(owner)
            except AttributeError:
                unknown = sorted(full)
            if not unknown:
                _, unexpected = module.load_state_dict({n[len(prefix):]: t for n, t in full.items()}, strict=False)
                unknown = sorted(prefix + n for n in unexpected)
            if unknown:
                raise KeyError(f"load_weights: the trainer's parameters {unknown[:5]} are not the engine model's")
            del full

    @property
    def refreshes_from_trainer(self) -> bool:
        """Whether `load_weights(None, ...)` copies the trainer's current weights into the engine's own (`sync_from`)."""
        return self.sync_from is not None

    def sync_to_version(self, version: int) -> None:
        """The held-out evaluation after `version` optimizer steps (eval/grpo_accuracy.py): an own copy refreshed from
        the trainer takes its current weights first. Why: the step refreshes the copy at its start, before its update,
        so between steps the copy is one update behind the trainer. Nothing for the trainer's own parameters
        (rl.rollout.weights = "shared") or when the copy holds that version; a collective for a sharded trainer, as
        the step's refresh (every rank evaluates together)."""
        if self.refreshes_from_trainer and self._refreshed_version != int(version):
            self.load_weights(None, version=version)

    def interrupt(self) -> None:
        self._interrupt.set()

    @contextlib.contextmanager
    def paused(self):
        """Context manager (from another thread): decoding stops at the next token boundary and waits
        until the block ends, so the caller can write new weights into `self.model` in place — the
        asynchronous trainer's weight push without a staging copy — and set the version with
        `load_weights(None, version=...)` inside the block. The decoding thread steps aside at its next
        token boundary (a plain lock would let it re-take the lock at once, step after step)."""
        self._pause.set()
        try:
            with self._step_lock:
                try:
                    yield
                finally:
                    self._packs.clear()  # the block may have written new weights in place
        finally:
            self._pause.clear()

    def release_memory(self) -> None:
        """The caches of a `generate` call are freed when it returns (no reference cycle holds them); on
        CUDA the collector and the allocator's cache then give the memory back to the training step. On
        the CPU there is nothing to give back: a full `gc.collect()` walks every Python object of the
        process (~0.3-0.9 s per call with transformers / trl imported) for nothing. An NPU's allocator
        (torch_npu) keeps its own cache, emptied the same way."""
        self._drop_runner()  # the kept slot cache and graphs (memory pool) of the CUDA-graph decode steps
        self._packs.clear()
        device = self._device()
        if device.type != "cpu":
            gc.collect()
            empty_device_cache(device)

    takes_abandon = True
    """`generate` takes `abandon` (module docstring: a stop while generating)."""

    def generate(self, prompts: Sequence[RolloutPrompt], params: SamplingParams, *,
                 generator: Optional[torch.Generator] = None,
                 abandon: Optional[Callable[[], bool]] = None) -> RolloutResult:
        """The completions of `prompts`; `abandon`: the stop check (training/signals.py `StopFlag.pending`), asked
        between decode steps: once it has said stop for `ABANDON_GRACE_S` of the call, `WaitAbandoned` ("generation")
        is raised and nothing of the call is returned (module docstring)."""
        # An engine-owned model decodes under inference mode (less per-op bookkeeping than no_grad: it
        # matters for small decode steps); the trainer's FSDP model under no_grad, since FSDP keeps
        # tensors of the forward for later training steps. The returned tensors are ordinary ones.
        with torch.inference_mode() if self.owns_forward else torch.no_grad():
            result = self._generate(prompts, params, generator, Patience(abandon) if abandon is not None else None)
        for s in result.samples:
            s.token_ids, s.logprobs = s.token_ids.clone(), s.logprobs.clone()
            s.token_versions = s.token_versions.clone() if s.token_versions is not None else None
            s.routes = s.routes.clone() if s.routes is not None else None
        return result

    def _generate(self, prompts: Sequence[RolloutPrompt], params: SamplingParams,
                  generator: Optional[torch.Generator], give_up: Optional[Callable[[], bool]] = None) -> RolloutResult:
        if not prompts:
            raise ValueError("prompts: nothing to generate from")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompts[{i}]: empty prompt")
        t0 = time.perf_counter()
        checker = StopChecker(self.tokenizer, self.eos_token_ids, params.stop)
        stats = {"prefill_s": 0.0, "decode_s": 0.0, "forward_calls": 0.0, "decode_steps": 0.0, "prefill_calls": 0.0,
                 "preemptions": 0.0, "dummy_prefills": 0.0, "weight_sync_s": self.weight_sync_s}
        self.weight_sync_s = 0.0
        n = params.n
        if self.lockstep:  # one batch: its slots are refilled in admission rounds all ranks make together
            batches = [(0, len(prompts), min(self.max_prompts_per_batch or len(prompts), len(prompts)) * n)]
        else:
            slots = self.max_num_seqs or (self.max_prompts_per_batch * n) or len(prompts) * n
            batches = [(0, len(prompts), min(slots, len(prompts) * n))]
        samples: list[RolloutSample] = []
        interrupted = False
        try:
            for start, end, num_slots in batches:
                if interrupted:
                    samples += [self._unstarted(prompts, start, i, n) for i in range((end - start) * n)]
                    continue
                out, interrupted = self._run(prompts[start:end], start, num_slots, params, checker, generator, stats,
                                             give_up)
                samples += out
        finally:
            self._interrupt.clear()
        self._preemptions += int(stats["preemptions"])
        n_tokens = sum(int(s.token_ids.numel()) for s in samples)
        return RolloutResult(samples=samples, num_generated_tokens=n_tokens, seconds=time.perf_counter() - t0,
                             stats=stats, interrupted=interrupted)

    # ------------------------------------------------------------------ internals
    def _device(self) -> torch.device:
        if self.device is not None:
            return self.device
        return next(self.model.parameters()).device

    def _unstarted(self, prompts, offset: int, i: int, n: int) -> RolloutSample:
        empty = torch.zeros(0, dtype=torch.long)
        return RolloutSample(
            prompt_index=offset + i // n, sample_index=i % n, token_ids=empty, logprobs=torch.zeros(0),
            text="", finish_reason="interrupted", prompt_length=len(prompts[i // n]),
            policy_version=self.policy_version, token_versions=empty,
        )

    def _prefill(self, prompts: Sequence[RolloutPrompt]):
        """(padded prefill cache, logits of the last position [P, V], routes [P, T, layers, k] or None) of a batch of
        prompts (left-padded to T positions)."""
        if self.routes_shape is None:
            return (*self._prefill_forward(prompts), None)
        with recording_routes() as rec:
            cache, logits = self._prefill_forward(prompts)
        routes = rec.stacked()
        assert routes is not None  # a MoE model records every forward
        return cache, logits, routes.view(len(prompts), -1, *routes.shape[1:])

    def _prefill_forward(self, prompts: Sequence[RolloutPrompt]):
        dev = self._device()
        ids, mask = left_pad(prompts, self.pad_token_id)
        # copied without waiting for the device, keeping the host tensors (the grids', the mask's) for the model's
        # bookkeeping to read there (megatron_vlm/host_copies.py)
        vision = {k: move(v, dev) for k, v in vision_inputs(prompts).items()}
        cache = self.model.new_cache(ids.shape[0], ids.shape[1], dtype=self.cache_dtype, device=dev)
        kwargs = dict(input_ids=move(ids, dev), attention_mask=move(mask, dev), kv_cache=cache, **vision)
        if self.owns_forward:  # logits_to_keep = 1: the LM head runs on the last position only
            hidden = self._model_eager(**kwargs, return_hidden=True)[:, -1]
            lm_head: Any = self.model.lm_head
            logits = lm_head(hidden)
        else:
            logits = self.forward(**kwargs)[:, -1]
        return cache, logits

    def _dummy_prefill(self, stats: dict) -> None:
        """One prefill forward of a single pad token, whose output is dropped: keeps a lock-stepped rank's forward
        calls (and their collectives) in step with a rank that prefills."""
        self._prefill([RolloutPrompt(torch.tensor([self.pad_token_id]))])
        stats["forward_calls"] += 1
        stats["dummy_prefills"] += 1

    def with_options(self, cache: SlotCache) -> SlotCache:
        """A new slot cache set up as the options say (`share_prefix_reads`)."""
        if self.options.share_prefix_reads is not None:
            cache.share_prefix_reads = bool(self.options.share_prefix_reads)
        return cache

    def _decode_runner(self, cache) -> Optional[DecodeStepRunner]:
        """The static-buffer step runner of this batch's cache, or None (eager steps)."""
        dev_type = cache.device.type
        if self.cuda_graphs == "off" or (self.cuda_graphs == "auto" and dev_type != "cuda"):
            return None
        model = self.model

        def tensors() -> list[torch.Tensor]:  # the model's current ones at each check (Parameters may be assigned anew)
            return [*model.parameters(), *model.buffers()]
        # lock-step ranks (the expert-parallel copy) step one batch size, the slot count, so that every rank's
        # static step gathers the same number of rows (parallel/expert_parallel.py `static_forward`)
        sizes = [cache.num_slots] if self.lockstep else None
        return DecodeStepRunner(self.forward, cache, pad_token_id=self.pad_token_id, capture=dev_type == "cuda",
                                probe=dev_type != "cuda", params=tensors, record_routes=self.routes_shape is not None,
                                sizes=sizes, agree=self.all_ranks_active if self.lockstep else None)

    def _graph_step(self, runner: DecodeStepRunner, cache, slots: list[int], feed: torch.Tensor):
        """Logits of one static step, or None when "auto" gives up on graphs (the step then runs eagerly)."""
        try:
            return runner.step(slots, feed)
        except GraphUnsafeError as e:
            if self.cuda_graphs == "on":
                raise
            log.warning("rollout CUDA graphs off for this engine: %s", e)
            self.cuda_graphs = "off"
            runner.drop()
            return None

    def _run(self, prompts, offset: int, num_slots: int, params: SamplingParams, checker: StopChecker,
             generator: Optional[torch.Generator], stats: dict,
             give_up: Optional[Callable[[], bool]] = None) -> tuple[list[RolloutSample], bool]:
        n, budget = params.n, params.max_new_tokens
        dev = self._device()
        # fused q / k / v: idempotent, and fuses again a layer whose views a `.to()` replaced (new addresses: the
        # kept graphs check theirs before the next replay)
        if self.fuse_projections:
            with self._step_lock:  # not while another thread writes weights in place (`paused()`)
                if fuse_qkv(self.model) and self._runner is not None:
                    self._runner.weights_loaded()
        max_len = max(len(p) for p in prompts) + budget
        runner = self._kept_runner(num_slots, max_len, dev)
        cache = runner.cache if runner is not None else self._new_cache(num_slots, max_len, dev)
        run = SlotRun(num_slots, budget, dev, self.routes_shape)
        if isinstance(cache, PagedSlotCache):
            cache.release_all()  # a kept pool: a call that failed half-way may have left blocks taken
            if cache.blocks_for(max_len) > cache.num_blocks - 1:  # one block is the scratch row's
                raise RuntimeError(f"kv_cache_blocks: the pool of {cache.num_blocks} blocks of {cache.block_size} positions "
                                   f"cannot hold one sample of {max_len} tokens (the longest prompt + max_new_tokens) "
                                   "besides the scratch block")
            run.release = cache.release
        admission = Admission(run, cache, prompts, n, share_prefix=self.share_prefix, prefill=self._prefill, stats=stats)
        packer = self._cpu_packer(num_slots, dev) if self._packer is None else None  # one batch patches the model
        if packer is not None:
            self._packer = packer
        experts = self._cpu_expert_packer(dev) if self._expert_packer is None else None
        if experts is not None:
            self._expert_packer = experts
        try:
            with fused_projections(self.fuse_projections):
                batch = _Batch(prompts, offset, params, checker, generator, stats,
                               eos=_to_device(sorted(self.eos_token_ids), dev),
                               suppress=self.suppress_token_ids.to(dev, non_blocking=True), give_up=give_up)
                return self._loop(batch, run, admission, runner)
        except BaseException:  # a step that failed half-way: nothing of this cache is kept
            self._drop_runner()
            raise
        finally:
            if packer is not None:
                packer.restore()
                self._packer = None
            if experts is not None:
                experts.restore()
                self._expert_packer = None
            if self.cuda_graphs == "off":  # "auto" gave up on graphs during the call
                self._drop_runner()

    def _cpu_packer(self, num_slots: int, dev: torch.device) -> Optional[PackedLinears]:
        """The packed-weight Linear layers of this batch's CPU decode steps, or None where they do not apply
        (option off, not the CPU, not the engine's own fp32 weights, no MKL)."""
        if not self.options.cpu_packed_gemm or dev.type != "cpu" or not self.owns_forward or self.lockstep:
            return None
        weight = getattr(getattr(self.model, "lm_head", None), "weight", None)
        if weight is None or weight.dtype != torch.float32 or not packing_available():
            return None
        if any(getattr(m, "_compiled_call_impl", None) is not None for m in self.model.modules()):
            return None  # compiled blocks (parallel.compile): their graphs call the layers' own forward
        return PackedLinears(self.model, num_slots, self._packs)

    def _cpu_expert_packer(self, dev: torch.device) -> Optional[PackedExperts]:
        """The fused routed experts of this batch's CPU decode steps, or None where they do not apply (option off, not
        the CPU, not the engine's own weights, no MoE layer, compiled blocks, an extension without the op)."""
        if not self.options.cpu_fused_experts or dev.type != "cpu" or not self.owns_forward or self.lockstep:
            return None
        if not moe_layers(self.model) or not fused_experts_available():
            return None
        if any(getattr(m, "_compiled_call_impl", None) is not None for m in self.model.modules()):
            return None
        experts = PackedExperts(self.model, self._packs)
        return experts if experts.num_modules else None

    def _kept_runner(self, num_slots: int, max_len: int, dev) -> Optional[DecodeStepRunner]:
        """With graphs on: the slot cache and graphs of an earlier call when the slot count and the slot length
        (rounded up to 64 positions, so calls with similar lengths match) are the same, else new ones (kept
        for the next call until `release_memory`). Stale keys of an earlier call lie beyond each slot's length
        (masked); `load_prefix` rewrites the lengths, Mamba2 states and M-RoPE deltas of an admitted slot.
        Lock-stepped ranks start new runners together (one all-reduce per batch): a new runner captures its bucket
        at its first step, which on CUDA runs the step twice more (warm-up), collectives included, so a rank whose
        slot length changed alone would step out of line with the others' collectives."""
        if self.cuda_graphs == "off" or (self.cuda_graphs == "auto" and dev.type != "cuda"):
            return None
        max_len = -(-max_len // 64) * 64
        key = (num_slots, max_len, str(dev))
        fresh = self._runner is None or self._runner_key != key
        if self.lockstep:  # the prompts, hence the slot lengths, differ between ranks
            fresh = bool(self.all_ranks_active(fresh))
        if not fresh:
            return self._runner
        self._drop_runner()
        self._runner, self._runner_key = self._decode_runner(self._new_cache(num_slots, max_len, dev)), key
        return self._runner

    def _new_cache(self, num_slots: int, max_len: int, dev) -> SlotCache:
        """An empty slot cache of `num_slots` slots (+ the scratch one) of `max_len` positions, or with `kv_block_size`
        the paged pool (`kv_cache_blocks` blocks, or `pool_for_every_slot`: every slot at full length, admitted as into
        the slot cache)."""
        if self.kv_block_size:
            bs = self.kv_block_size
            blocks = self.kv_cache_blocks or pool_for_every_slot(num_slots, -(-max_len // bs))
            storage = self.model.new_cache(blocks, bs, dtype=self.cache_dtype, device=dev)
            return self.with_options(PagedSlotCache(storage, num_slots, max_len))
        return self.with_options(SlotCache(self.model.new_cache(num_slots + 1, max_len, dtype=self.cache_dtype, device=dev)))

    def _drop_runner(self) -> None:
        if self._runner is not None:
            self._runner.drop()
            self._runner = None

    def _loop(self, batch: _Batch, run: SlotRun, admission: Admission,
              runner: Optional[DecodeStepRunner]) -> tuple[list[RolloutSample], bool]:
        """The admission / sampling / decode-step loop of one batch of slots (`_run`'s cache and buffers)."""
        stats, cache = batch.stats, admission.cache
        calls = stats["prefill_calls"]
        cur_slots, cur_logits = admission.admit()
        if self.lockstep and stats["prefill_calls"] == calls:  # every rank prefills once in each admission round
            self._dummy_prefill(stats)
        interrupted = False
        t1 = time.perf_counter()
        while True:
            while self._pause.is_set():  # `paused()` from another thread: let it take the lock (no starvation)
                time.sleep(0.0005)
            with self._step_lock:
                running: list[int] = []
                feed = None
                if cur_slots:
                    assert cur_logits is not None  # admitted or running slots come with their logits
                    running, feed = self._sample(batch, run, cur_slots, cur_logits)
                if self._interrupt.is_set() and not self.lockstep:
                    for slot in running:
                        run.finish(slot, "interrupted")
                    interrupted = True
                    break
                if running and admission.paged:  # on-demand blocks
                    rows = admission.grow(running)
                    if len(rows) < len(running):
                        assert feed is not None
                        feed = feed.index_select(0, _to_device(rows, feed.device)) if rows else None
                        running = [running[r] for r in rows]
                if self.lockstep:
                    admitted, new_logits = admission.lockstep_admit(self.all_ranks_active, lambda: self._dummy_prefill(stats))
                else:
                    admitted, new_logits = admission.admit()
                if not self._go_on(batch, bool(running or admitted)):
                    break
                logits_parts = []
                if running or self.lockstep:
                    logits = self._decode(run, cache, runner, running, feed)
                    stats["forward_calls"] += 1
                    stats["decode_steps"] += 1
                    if running:
                        logits_parts.append(logits)
                if admitted:
                    assert new_logits is not None  # admitted slots come with their first logits
                    logits_parts.append(new_logits)
                cur_slots = running + admitted
                cur_logits = torch.cat(logits_parts) if len(logits_parts) > 1 else (logits_parts[0] if logits_parts else None)
        stats["decode_s"] += time.perf_counter() - t1
        run.interrupted_waiting()
        return self._collect(batch, run), interrupted

    def _go_on(self, batch: _Batch, active: bool) -> bool:
        """Whether another decode step runs (a rank with work, on any rank when lock-stepped); `WaitAbandoned` when
        the call is given up for a stop: on this rank alone, or, lock-stepped, on every rank at this same step (the
        stop travels in the step's own all-reduce: no collective of its own)."""
        stopping = batch.give_up is not None and batch.give_up()
        if not self.lockstep:
            if stopping:
                raise WaitAbandoned(f"generation given up after {int(batch.stats['decode_steps'])} decode steps: the "
                                    "rank is stopping", waited_for="generation")
            return active
        if batch.give_up is None:
            return bool(self.all_ranks_active(active))
        agreed = int(self.all_ranks_active(int(active) | (STOPPING if stopping else 0)))
        if agreed & STOPPING:
            raise WaitAbandoned(f"generation given up after {int(batch.stats['decode_steps'])} decode steps: the "
                                "rank is stopping" if stopping else "generation given up: another rank is stopping",
                                waited_for="generation")
        return bool(agreed & 1)

    def _sample(self, batch: _Batch, run: SlotRun, cur_slots: list[int],
                cur_logits: torch.Tensor) -> tuple[list[int], Optional[torch.Tensor]]:
        """Draw the next token of every slot in `cur_slots` from its logits, record it, and end the slots it
        finishes; returns (the slots still running, their tokens to feed [len] or None)."""
        params, checker, generator = batch.params, batch.checker, batch.generator
        n, budget = params.n, params.max_new_tokens
        dev = run.tokens.device
        index = _to_device(cur_slots, dev)
        uniform = None
        if params.temperature > 0:  # one draw per slot and step: a row's numbers do not depend on the others
            if generator is not None and not same_device(generator.device, dev):
                raise ValueError(f"generator: on {generator.device}, logits on {dev}")
            uniform = torch.rand(run.tokens.shape[0], device=dev, generator=generator).index_select(0, index)
        heavy: list = []  # the rows whose suppressed ids hold most of the mass: found with this step's read
        tok, lp = sample_tokens(cur_logits, temperature=params.temperature, top_k=params.top_k,
                                top_p=params.top_p, suppress_token_ids=batch.suppress, uniform=uniform,
                                heavy_rows=heavy)
        pos = run.gen_len.index_select(0, index)
        run.tokens[index, pos] = tok
        run.logprobs[index, pos] = lp.float()
        run.versions[index, pos] = self.policy_version
        run.gen_len.index_add_(0, index, torch.ones_like(index))
        # the stop check: the step's one host sync (EOS and stop strings need the sampled tokens on the host), which
        # also reads whether each log-prob is finite (a row without a distribution: the sampler raises on the CPU
        # only, to add no sync elsewhere) and which rows' log-probs the sampler left to be made exact
        bits = (~torch.isfinite(lp)).long()
        if heavy:
            bits = bits + 2 * heavy[0][0].long()
        stop_strings = bool(checker.stop)
        if stop_strings:
            tok_l, flags = torch.stack([tok, bits]).tolist()
            is_eos = [t in self.eos_token_ids for t in tok_l]
        else:
            flags = (torch.isin(tok, batch.eos).long() + 2 * bits).tolist()
            tok_l, is_eos, flags = None, [f & 1 for f in flags], [f >> 1 for f in flags]
        bad = [f & 1 for f in flags]
        exact_rows = [r for r, f in enumerate(flags) if f & 2]
        if exact_rows:  # rare: exact log-probs from those rows' whole logits (`sample_tokens`' heavy_rows)
            exact = heavy[0][1](exact_rows)
            rows_dev = _to_device(exact_rows, dev)
            run.logprobs[index.index_select(0, rows_dev), pos.index_select(0, rows_dev)] = exact.float()
            for r, v in zip(exact_rows, exact.tolist()):  # (a second read, in these rare steps only) the exact value
                bad[r] = int(not math.isfinite(v))  # decides: the approximate one is -inf where the rest underflowed
        if any(bad):
            r = bad.index(1)
            sample = run.slot_sample[cur_slots[r]]
            raise ValueError(f"rollout: prompt {batch.offset + sample // n} (sample {sample % n}), generated token "
                             f"{int(pos[r])}: the logits have a NaN or +inf value, or only -inf ones outside "
                             "the suppressed ids: no distribution to sample from")
        running, keep = [], []
        for r, slot in enumerate(cur_slots):
            run.host_len[slot] += 1
            why = "eos" if is_eos[r] else None
            if why is None and stop_strings:
                assert tok_l is not None  # the tokens are read on the host when stop strings are set
                run.host_tokens[slot].append(tok_l[r])
                why = checker.check(run.host_tokens[slot])
            if why is None and run.host_len[slot] >= budget:
                why = "length"
            if why is None:
                running.append(slot)
                keep.append(r)
            else:
                run.finish(slot, why)
        feed = tok.index_select(0, _to_device(keep, dev)) if keep else None
        return running, feed

    def _decode(self, run: SlotRun, cache, runner: Optional[DecodeStepRunner], running: list[int],
                feed: Optional[torch.Tensor]) -> torch.Tensor:
        """One decode step of the running slots (a lock-stepped rank with none steps one dummy row on the scratch
        slot, to keep its calls in step): their next logits [len(running), V]; the fed tokens' routes recorded."""
        dev = run.tokens.device
        if not running:  # lock-step: a dummy row on the scratch slot keeps this rank's calls in step
            cache.reset_scratch()
            slots_now = [cache.scratch_slot]
            feed = torch.full((1,), self.pad_token_id, dtype=torch.long, device=dev)
        else:
            slots_now = running
        assert feed is not None  # the running slots' sampled tokens, or the scratch row's pad
        logits, routes = None, None
        if runner is not None and self.cuda_graphs != "off":
            logits = self._graph_step(runner, cache, slots_now, feed)
            routes = runner.last_routes
        if logits is None:
            cache.set_active(slots_now)
            packed = self._packer.decoding() if self._packer is not None else contextlib.nullcontext()
            fused = self._expert_packer.decoding() if self._expert_packer is not None else contextlib.nullcontext()
            with recording_routes() if run.routes is not None else contextlib.nullcontext() as rec, packed, fused:
                logits = self.forward(input_ids=feed[:, None], kv_cache=cache)[:, -1]
            routes = rec.stacked() if rec is not None else None
        if running and run.routes is not None:  # the fed tokens' experts, at their positions
            assert routes is not None  # a MoE model records every forward
            index = _to_device(running, dev)
            run.routes[index, run.gen_len.index_select(0, index) - 1] = routes[:len(running)]
        return logits

    def _collect(self, batch: _Batch, run: SlotRun) -> list[RolloutSample]:
        """The batch's samples in call order: the finished ones' tokens (one copy to the host each), the others
        unstarted (an interrupted call)."""
        prompts, offset, n, checker = batch.prompts, batch.offset, batch.params.n, batch.checker
        on_host = _finished_on_host(run.finished)
        out = []
        for i in range(len(prompts) * n):
            if i not in run.finished:
                out.append(self._unstarted(prompts, offset, i, n))
                continue
            ids, logps, versions = on_host[i]
            why = run.finished[i][3]
            routes = run.finished_routes.get(i)
            out.append(RolloutSample(
                prompt_index=offset + i // n, sample_index=i % n, token_ids=ids, logprobs=logps,
                text=checker.final_text(ids.tolist(), why), finish_reason=why, prompt_length=len(prompts[i // n]),
                policy_version=int(versions.min()) if versions.numel() else self.policy_version,
                token_versions=versions, routes=routes.cpu() if routes is not None else None,
            ))
        return out
