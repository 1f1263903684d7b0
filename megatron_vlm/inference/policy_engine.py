"""The built-in rollout engine: continuous batching over a slot KV cache, with the policy model itself.

`PolicyRolloutEngine(model, tokenizer, forward=...)` generates with `model`. Two ways to hold the
weights (see `load_weights`):

* its own inference copy (`forward=None`, the model is unsharded on the engine's device): the trainer
  refreshes it once per step with `load_weights(named_tensors, version)`; no collective runs while
  decoding, so sequences are batched continuously (below);
* the trainer's parameters (`forward=lambda **kw: wrapper(model_kwargs=kw)`: every call runs inside
  the FSDP root, parameters all-gathered per call). Cheaper on one device (no copy to keep), but every
  rank must make the same forward calls, so decoding runs in lock-step (below).

One `generate` call:

1. samples wait in a queue (group-major: the n samples of prompt p are p*n ... p*n+n-1);
2. admission: free slots of a pre-allocated `SlotCache` (`max_num_seqs` slots of prompt + budget
   tokens) take the next waiting samples. Their prompts, left-padded into one batch, are prefilled
   once with their images / videos into an ordinary padded cache; only the last position's logits are
   computed (`logits_to_keep`: hidden states, then the LM head on one row); each prompt's cache row is
   copied into the slots of its samples (the group shares one prefill; `share_prefix=False`, the
   benchmark baseline, prefills every sample);
3. decoding: the next token of every active slot is drawn in one batched call (`sampling.sample_tokens`:
   temperature, top-k, top-p, behaviour log-probs; the random numbers are drawn for every slot at every
   step, so a sample's draws depend on its slot and step only, not on which other rows still run) and
   written to device buffers; the only host sync
   per step is the stop check (EOS flags, plus the token ids when stop strings are set). Finished
   slots are freed; with continuous batching a freed slot takes the next waiting sample at once
   (step 2), so the batch stays full until the queue is empty. The tokens run through the model one
   step at a time, attention by `kernels.decode_attention` on the slots (no padding), the Mamba2
   state of the hybrid decoder per slot.

With `kv_block_size` > 0 (`rl.rollout.kv_block_size`) the keys live in a paged pool (`PagedSlotCache`;
attention-only models, a Mamba2 hybrid is refused: `paged_kv_blocker`), allocated on demand as vLLM does:
an admitted sample takes the blocks of its prompt and one more position, and a running one takes another
block when its sequence reaches the end of its blocks; a finished one returns them. A waiting sample is
admitted only when its prompt's blocks are free with a headroom of 1 % of the pool (at least one block) for
the running ones to grow. When a running sample needs a block and the pool has none, the sample admitted
last is preempted: its blocks are returned and it waits at the head of the queue with what it generated
(tokens, log-probs, versions, routes); re-admitted, its prompt + generated tokens are prefilled again
(recomputation; the cached keys of the tokens it had generated are then the current weights') and it
continues where it stopped. So a pool (`kv_cache_blocks`) far smaller than slots x longest sequence runs
many more sequences at once than reserving every sample's budget would, most completions being much
shorter than the budget (`stats["preemptions"]`, `metrics()`). Lock-stepped ranks (below) do the same, a
re-admission being part of their admission round's one prefill forward (with the round's new prompts). On
the CPU the paged cache is ~5-9 % slower, so off by default.

Lock-step (when `all_ranks_active` is given: the trainer's FSDP forward, or the expert-parallel copy whose MoE
blocks exchange tokens): every rank must make the same forward calls in the same order. The slots
(`max_prompts_per_batch` prompts x n, 0 = every sample of the call) are refilled as completions end, as in
continuous batching, with the prefills in step: after each token, a sample whose group's prompt is prefilled
already takes a free slot at once (no forward), and `all_ranks_active(needs_a_prefill)` (an all-reduce supplied
by the trainer: is it true on any rank?) says whether this is an admission round; in one, every rank makes
exactly one prefill forward, of the samples it admits or, with none, of one pad token
(`stats["dummy_prefills"]`). Then
`all_ranks_active(local_active)` decides whether another decode step runs, and a rank whose rows are all
finished steps one dummy row on the scratch slot until every rank is done. So a long completion on one rank
no longer holds the other slots idle until the batch ends (the tail of chunked batches); the caller gives
every rank the same number of prompts.

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
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from megatron_vlm.data.batch import VISION_KEYS
from megatron_vlm.errors import ConfigError
from megatron_vlm.inference.cpu_packed_experts import PackedExperts, fused_experts_available
from megatron_vlm.inference.cpu_packed_linear import PackedLinears, packing_available
from megatron_vlm.inference.decode_graphs import DecodeStepRunner, GraphUnsafeError
from megatron_vlm.inference.engine import RolloutEngine, RolloutPrompt, RolloutResult, RolloutSample, SamplingParams
from megatron_vlm.inference.sampling import same_device, sample_tokens
from megatron_vlm.inference.stopping import StopChecker, eos_token_ids_of
from megatron_vlm.models.common.fused_projections import fuse_qkv, fused_projections
from megatron_vlm.models.common.kv_cache import KVCache
from megatron_vlm.models.common.moe import MoE, moe_layers
from megatron_vlm.models.common.routing_replay import recording_routes, route_dtype
from megatron_vlm.models.common.slot_cache import PagedSlotCache, SlotCache
from megatron_vlm.models.common.vlm_base import VLMBase
from megatron_vlm.models.mcore.layer import native_state_dict

__all__ = ["PolicyRolloutEngine", "CUDA_GRAPH_MODES", "CudaGraphsConfigError", "cuda_graphs_blocker", "PagedKVConfigError",
           "paged_kv_blocker"]

log = logging.getLogger(__name__)

CUDA_GRAPH_MODES = ("auto", "on", "off")


def cuda_graphs_blocker(model, *, trainer_forward: bool = False) -> Optional[str]:
    """Why the decode step of `model` cannot be captured as a CUDA graph, or None. One function for the
    engine and `--check` (plan/check.py), so that the check refuses rl.rollout.cuda_graphs = "on" exactly
    where the job would (a model on the meta device is enough: only its layer kinds are read)."""
    if trainer_forward:
        return "the engine calls the trainer's model (forward=: rl.rollout.weights = 'shared'), not its own copy"
    foreign = [m for m in moe_layers(model) if not isinstance(m, MoE)]
    if foreign:  # native MoE blocks route graph-safely in static steps (models/common/moe_static.py)
        return (f"MoE layers of another backend ({type(foreign[0]).__name__}): their routing sizes the grouped GEMMs "
                "from the routed counts on the host, which a CUDA graph cannot replay")
    return None


class CudaGraphsConfigError(ConfigError):
    """`rl.rollout.cuda_graphs = "on"` where the decode step cannot be captured (a config error: exit 2)."""


def paged_kv_blocker(model) -> Optional[str]:
    """Why `model` cannot decode on the paged KV cache (`kv_block_size` > 0), or None. One function for the
    engine and `--check` (plan/check.py), like `cuda_graphs_blocker`: the pool holds keys / values only, so a
    decoder whose cache is more than a `KVCache` (the Mamba2 hybrid's per-sequence recurrent states) keeps
    the slot layout. Asks the model for a one-position cache on the meta device (no memory; a meta-device
    model is enough)."""
    probe = model.new_cache(1, 1, device="meta")
    if isinstance(probe, KVCache):
        return None
    return (f"{type(model).__name__}'s decoder keeps per-sequence recurrent (Mamba2) states besides its keys / values "
            f"({type(probe).__name__}), which stay in the slot layout; the paged cache is for attention-only decoders")


class PagedKVConfigError(ConfigError):
    """`rl.rollout.kv_block_size` > 0 with a model that cannot decode on the paged KV cache (a config error: exit 2)."""


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


def _vision_inputs(prompts: Sequence[RolloutPrompt]) -> dict:
    """Vision tensors of the prompts concatenated in prompt order."""
    out = {}
    for key in VISION_KEYS:
        parts = [getattr(p, key) for p in prompts if getattr(p, key) is not None]
        if parts:
            out[key] = torch.cat(parts)
    return out


def _vision_token_ids(model) -> list[int]:
    """The vision special tokens of a VLM (never sampled by a rollout engine); none for a text model."""
    args = getattr(model, "args", None)
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return [int(getattr(args, n)) for n in names if isinstance(getattr(args, n, None), int)]


vision_token_ids = _vision_token_ids  # public name for the other rollout engines (inference/vllm_engine.py)


def _full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with every sharded (DTensor) entry gathered to its full tensor."""
    out = {}
    for name, tensor in model.state_dict().items():
        full = getattr(tensor, "full_tensor", None)
        out[name] = full() if callable(full) else tensor
    return out


@dataclass
class _Batch:
    """What one batch of a `generate` call decodes: its prompts (from `offset` in the call's list), the sampling
    settings, stop criteria, random generator and the call's stats."""
    prompts: Sequence[RolloutPrompt]
    offset: int
    params: SamplingParams
    checker: StopChecker
    generator: Optional[torch.Generator]
    stats: dict


@dataclass
class _Slots:
    """The batch's KV cache and the decode state around it: waiting samples, prompt prefixes, CUDA-graph runner."""
    cache: Any
    queue: deque
    prefixes: dict
    num_slots: int
    runner: Optional[DecodeStepRunner]


class _Run:
    """Device buffers and bookkeeping of one batch of slots (one batch of a `generate` call)."""

    def __init__(self, num_slots: int, budget: int, device, routes_shape: Optional[tuple[int, int, int]] = None) -> None:
        """`routes_shape` (MoE layers, top-k, experts): record the experts of every fed token (routing replay)."""
        rows = num_slots + 1  # + the scratch slot
        self.routes: Optional[torch.Tensor] = None  # [rows, budget, layers, k]: routes of the generated tokens
        self.prompt_routes: dict[int, torch.Tensor] = {}  # slot -> its prompt's routes [prompt, layers, k]
        if routes_shape is not None:
            layers, k, experts = routes_shape
            self.routes = torch.full((rows, budget, layers, k), -1, dtype=route_dtype(experts), device=device)
        self.tokens = torch.zeros(rows, budget, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(rows, budget, dtype=torch.float32, device=device)
        self.versions = torch.zeros(rows, budget, dtype=torch.long, device=device)
        self.gen_len = torch.zeros(rows, dtype=torch.long, device=device)
        self.host_len = [0] * rows
        self.host_tokens: dict[int, list[int]] = {}  # slot -> tokens (only with stop strings)
        self.slot_sample: dict[int, int] = {}
        self.free = deque(range(num_slots))
        self.budget = budget
        self.release: Optional[Callable[[int], None]] = None  # the paged cache's: a finished slot's blocks
        self.finished_routes: dict[int, torch.Tensor] = {}  # sample -> its routes [prompt + generated - 1, layers, k]
        self.admitted: dict[int, int] = {}  # slot -> when its sample was admitted (the last admitted is preempted first)
        self.admissions = 0
        self.preempted: dict[int, _Preempted] = {}  # sample -> what it generated before it was preempted


@dataclass
class _Preempted:
    """A sample preempted for lack of KV blocks (on-demand paged cache): what it generated, kept for its re-admission
    (its prompt + these tokens prefilled again) or, if the call ends first, its result."""
    tokens: torch.Tensor  # [k] sampled tokens (the last one not yet fed to the model)
    logprobs: torch.Tensor
    versions: torch.Tensor
    host_tokens: list  # the stop-string checker's copy (empty without stop strings)
    prompt_routes: Optional[torch.Tensor]  # routing replay: the prompt's routes ...
    routes: Optional[torch.Tensor]  # ... and those of the k - 1 generated tokens fed so far


@dataclass(frozen=True)
class EngineOptions:
    """How the built-in engine decodes, as one value (`PolicyRolloutEngine(model, tokenizer, options, ...)`): built
    once from `[rl.rollout]` by the GRPO job (`rl/trainer.py`), the asynchronous rollout ranks and the
    evaluations, or by tests and benchmarks with the fields they vary."""
    eos_token_ids: Optional[Iterable[int]] = None
    """Tokens that end a completion (default: the tokenizer's / generation config's)."""
    pad_token_id: Optional[int] = None
    cache_dtype: Optional[torch.dtype] = None
    """Compute dtype of keys / values (bf16 under FSDP mixed precision; default the model's weight dtype)."""
    device: Optional[torch.device | str] = None
    max_prompts_per_batch: int = 0
    """Lock-step: slots for this many prompts' samples (x n) decoding at once, refilled as completions end (0 = all)."""
    max_num_seqs: int = 0
    """Slots of continuous batching (0 = max_prompts_per_batch * n, or every sample of the call)."""
    share_prefix: bool = True
    suppress_token_ids: Optional[Iterable[int]] = None
    """Tokens never generated (default: the model's vision placeholder / start / end tokens)."""
    kv_block_size: int = 0
    """> 0: a paged KV cache of blocks of this many positions (attention-only models)."""
    kv_cache_blocks: int = 0
    """Blocks of the paged KV cache (0 = enough for every slot at full length)."""
    cuda_graphs: str = "off"
    """"auto" | "on" | "off": decode steps on static buffers, captured as CUDA graphs (module docstring)."""
    record_routes: bool = False
    """MoE models: record the top-k experts of every prompt and generated token (`RolloutSample.routes`, routing
    replay: models/common/routing_replay.py); ignored for a model without MoE layers."""
    cpu_packed_gemm: bool = True
    """CPU, fp32, the engine's own weights: eager decode steps run the Linear layers on MKL-packed copies of the
    weights (inference/cpu_packed_linear.py; packed again whenever the weights change)."""
    cpu_fused_experts: bool = True
    """CPU, fp32, the engine's own weights: eager decode steps run each MoE layer's routed experts as one C++ call
    on MKL-packed expert weights (inference/cpu_packed_experts.py); routing is unchanged."""
    fuse_projections: bool = False
    """The engine's own copy of the weights: each attention layer's q / k / v run as one GEMM over one fused weight
    that the three layers view (models/common/fused_projections.py: fewer, wider GEMMs and no q / k concatenation
    per decode step; checkpoint names unchanged). Refused for the trainer's model (an optimizer holds its
    Parameters). Off by default: not yet measured on a GPU (benchmarks/e2e/profile_decode.py `:fused`)."""
    share_prefix_reads: Optional[bool] = None
    """Decode attention reads a GRPO group's shared prompt through one copy (`SlotCache.share_prefix_reads`: the CPU
    kernel reads it once per group, the Triton kernel from one copy for L2 reuse). None: the cache's default, on
    on the CPU (measured faster), off on CUDA (an H200's 3B decode step in CUDA graphs: within noise of per-row
    reads, 1.01x / 1.02x median at 16 / 32 sequences; benchmarks/e2e/profile_decode.py)."""


class PolicyRolloutEngine(RolloutEngine):
    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        options: Optional[EngineOptions] = None,
        *,
        forward: Optional[Callable[..., torch.Tensor]] = None,
        all_ranks_active: Optional[Callable[[bool], bool]] = None,
        sync_from: Optional[torch.nn.Module] = None,
    ):
        """`model`: the family model (a `VLMBase`: `new_cache`, forward with `kv_cache=`); `options`: how it decodes
        (`EngineOptions`); `forward`: how to call the model (default `model`: the engine's own copy, continuous
        batching); `all_ranks_active`: lock-step decoding with the other ranks (the trainer's FSDP forward);
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
                     f"{kv_cache_blocks} blocks" if kv_cache_blocks else "1 + slots x blocks per slot (derived per batch)")
        self.kv_block_size, self.kv_cache_blocks = kv_block_size, kv_cache_blocks
        if cuda_graphs not in CUDA_GRAPH_MODES:
            raise ValueError(f"cuda_graphs: must be one of {CUDA_GRAPH_MODES}, got {cuda_graphs!r}")
        why_not = cuda_graphs_blocker(model, trainer_forward=forward is not None)
        if cuda_graphs == "on" and why_not:
            raise CudaGraphsConfigError(f"rl.rollout.cuda_graphs: 'on' is not possible: {why_not}")
        if cuda_graphs == "auto" and why_not:
            log.info("rollout CUDA graphs off: %s", why_not)
            cuda_graphs = "off"
        self.cuda_graphs = cuda_graphs
        self._runner: Optional[DecodeStepRunner] = None  # with its slot cache, kept across calls (_kept_runner)
        self._runner_key: tuple = ()
        self.model = model
        self.tokenizer = tokenizer
        self.forward = forward or model
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
            suppress_token_ids = _vision_token_ids(model)
        self.suppress_token_ids = torch.tensor(sorted(set(int(i) for i in suppress_token_ids)), dtype=torch.long)
        if sync_from is not None and not self.owns_forward:
            raise ValueError("sync_from: only for an engine that generates with its own copy (forward=None)")
        if o.fuse_projections and (not self.owns_forward or self.lockstep):
            raise ValueError("fuse_projections: only for an engine that generates with its own copy of the weights "
                             "(it re-makes the q / k / v Parameters, which the trainer's optimizer holds)")
        self.sync_from = sync_from
        self.weight_sync_s = 0.0
        self.policy_version = 0
        self._packs: dict = {}  # MKL-packed weight copies of the CPU decode step (cpu_packed_linear.py)
        self._packer: Optional[PackedLinears] = None
        self._expert_packer: Optional[PackedExperts] = None  # the fused CPU experts (cpu_packed_experts.py)
        self._step_lock = threading.RLock()  # re-entrant: a forward hook may load weights
        self._interrupt = threading.Event()
        self._pause = threading.Event()  # set by `paused()`: the decode loop leaves the step lock to it
        self._preemptions = 0  # since the last `metrics()`

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
        if weights is None and self.sync_from is not None:
            # a trainer with megatron-core layers (parallel.backend = "mcore"): its weights under native names
            weights = native_state_dict(_full_state_dict(self.sync_from), self.sync_from)
        with self._step_lock:
            if weights is not None:
                missing, unexpected = self.model.load_state_dict(dict(weights), strict=False)
                if unexpected:
                    raise KeyError(f"load_weights: unknown parameter names {sorted(unexpected)[:5]}")
                if missing and len(missing) == len(self.model.state_dict()):
                    raise KeyError("load_weights: none of the names matches the model's parameters")
            self.policy_version = int(version)
            self._packs.clear()  # new weights: packed again at their next use
            if self._runner is not None:  # graphs hold the parameters' addresses
                self._runner.weights_loaded()
        if weights is not None:
            self.weight_sync_s += time.perf_counter() - t0

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
        process (~0.3-0.9 s per call with transformers / trl imported) for nothing."""
        self._drop_runner()  # the kept slot cache and graphs (memory pool) of the CUDA-graph decode steps
        self._packs.clear()
        if self._device().type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()

    def generate(self, prompts: Sequence[RolloutPrompt], params: SamplingParams, *,
                 generator: Optional[torch.Generator] = None) -> RolloutResult:
        # An engine-owned model decodes under inference mode (less per-op bookkeeping than no_grad: it
        # matters for small decode steps); the trainer's FSDP model under no_grad, since FSDP keeps
        # tensors of the forward for later training steps. The returned tensors are ordinary ones.
        with torch.inference_mode() if self.owns_forward else torch.no_grad():
            result = self._generate(prompts, params, generator)
        for s in result.samples:
            s.token_ids, s.logprobs = s.token_ids.clone(), s.logprobs.clone()
            s.token_versions = s.token_versions.clone() if s.token_versions is not None else None
            s.routes = s.routes.clone() if s.routes is not None else None
        return result

    def _generate(self, prompts: Sequence[RolloutPrompt], params: SamplingParams,
                  generator: Optional[torch.Generator]) -> RolloutResult:
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
                out, interrupted = self._run(prompts[start:end], start, num_slots, params, checker, generator, stats)
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
        ids, mask = _left_pad(prompts, self.pad_token_id)
        vision = {k: v.to(dev) for k, v in _vision_inputs(prompts).items()}
        cache = self.model.new_cache(ids.shape[0], ids.shape[1], dtype=self.cache_dtype, device=dev)
        kwargs = dict(input_ids=ids.to(dev), attention_mask=mask.to(dev), kv_cache=cache, **vision)
        if self.owns_forward:  # logits_to_keep = 1: the LM head runs on the last position only
            hidden = self.model(**kwargs, return_hidden=True)[:, -1]
            lm_head: Any = self.model.lm_head
            logits = lm_head(hidden)
        else:
            logits = self.forward(**kwargs)[:, -1]
        return cache, logits

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
        tensors = list(self.model.parameters()) + list(self.model.buffers())
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

    def _admit(self, queue: deque, run: _Run, cache: SlotCache, prompts: Sequence[RolloutPrompt], n: int, prefixes: dict,
               stats: dict, *, cached_only: bool = False) -> tuple[list[int], Optional[torch.Tensor]]:
        """Fill free slots with waiting samples: ([slots], logits [len, V]) or ([], None). `cached_only`: only those that
        need no prefill forward (their group's prompt is prefilled already), stopping at the first that would."""
        key_of = (lambda i: i // n) if self.share_prefix else (lambda i: i)
        take: list[tuple[int, int]] = []
        while queue and run.free:
            if cached_only and (queue[0] in run.preempted or key_of(queue[0]) not in prefixes):
                break
            if isinstance(cache, PagedSlotCache):  # on demand: its prompt (+ what it generated before a preemption)
                tokens, headroom = self._blocks_wanted(run, cache, prompts, n, queue[0], busy=bool(run.slot_sample or take))
                if not cache.can_reserve(tokens, headroom):
                    if not run.slot_sample and not take:  # nothing runs that could give blocks back
                        raise RuntimeError(f"kv_cache_blocks: the pool cannot hold one sample of {tokens} tokens "
                                           f"({len(cache.free_blocks)} free blocks of {cache.block_size})")
                    break
                cache.reserve(run.free[0], tokens)
            take.append((queue.popleft(), run.free.popleft()))
        if not take:
            return [], None
        for _sample, slot in take:
            run.admitted[slot] = run.admissions
            run.admissions += 1
        back = [(sample, slot) for sample, slot in take if sample in run.preempted]  # preempted, re-admitted
        take = [(sample, slot) for sample, slot in take if sample not in run.preempted]
        need = list(dict.fromkeys(key_of(i) for i, _ in take if key_of(i) not in prefixes))
        resumed: dict[int, torch.Tensor] = {}
        if need or back:  # one prefill forward: new prompts and the re-admitted samples' prompt + generated tokens
            t0 = time.perf_counter()
            batch = [prompts[k // (1 if self.share_prefix else n)] for k in need]
            batch += [self._resume_prompt(prompts[sample // n], run.preempted[sample]) for sample, _ in back]
            pcache, logits, routes = self._prefill(batch)
            uses = n if self.share_prefix else 1
            for row, key in enumerate(need):
                # the prompt's own positions of the left-padded row
                mine = routes[row, routes.shape[1] - len(batch[row]):] if routes is not None else None
                prefixes[key] = [pcache, row, logits[row], uses, mine]
            for j, (sample, slot) in enumerate(back):
                row = len(need) + j
                resumed[slot] = self._readmit(run, cache, sample, slot, pcache, row, logits[row],
                                              routes[row, -1] if routes is not None else None)
            stats["prefill_s"] += time.perf_counter() - t0
            stats["forward_calls"] += 1
            stats["prefill_calls"] += 1
        if not take:
            return list(resumed), torch.stack(list(resumed.values()))
        # one copy per prefilled row into all of its new slots (a group's G slots at once: the row's keys are
        # gathered once per layer, not once per slot)
        slots_of: dict = {}
        for sample, slot in take:
            slots_of.setdefault(key_of(sample), []).append(slot)
        for key, group in slots_of.items():
            cache.load_prefix(group, prefixes[key][0], prefixes[key][1])
        slots, rows = [], []
        for sample, slot in take:
            entry = prefixes[key_of(sample)]
            run.slot_sample[slot] = sample
            run.gen_len[slot] = 0
            run.host_len[slot] = 0
            run.host_tokens[slot] = []
            if entry[4] is not None:
                run.prompt_routes[slot] = entry[4]
            slots.append(slot)
            rows.append(entry[2])
            entry[3] -= 1
            if entry[3] == 0:
                del prefixes[key_of(sample)]
        return list(resumed) + slots, torch.stack(list(resumed.values()) + rows)

    def _lockstep_admit(self, queue: deque, run: _Run, cache, prompts: Sequence[RolloutPrompt], n: int, prefixes: dict,
                        stats: dict) -> tuple[list[int], Optional[torch.Tensor]]:
        """A lock-stepped rank's admissions after a token (module docstring): samples whose group's prompt is prefilled
        already join at once (no forward); then an admission round when any rank has a sample that needs a prefill,
        in which this rank makes exactly one prefill forward, real or of one pad token."""
        local = self._admit(queue, run, cache, prompts, n, prefixes, stats, cached_only=True)
        want = bool(queue and run.free)
        if want and isinstance(cache, PagedSlotCache):
            want = cache.can_reserve(*self._blocks_wanted(run, cache, prompts, n, queue[0], busy=bool(run.slot_sample)))
        if not self.all_ranks_active(want):
            return local
        calls = stats["prefill_calls"]
        out = self._admit(queue, run, cache, prompts, n, prefixes, stats) if want else ([], None)
        if stats["prefill_calls"] == calls:  # nothing to prefill here
            self._dummy_prefill(stats)
        if not local[0]:
            return out
        if not out[0]:
            return local
        assert local[1] is not None and out[1] is not None
        return local[0] + out[0], torch.cat([local[1], out[1]])

    def _dummy_prefill(self, stats: dict) -> None:
        """One prefill forward of a single pad token, whose output is dropped: keeps a lock-stepped rank's forward
        calls (and their collectives) in step with a rank that prefills."""
        self._prefill([RolloutPrompt(torch.tensor([self.pad_token_id]))])
        stats["forward_calls"] += 1
        stats["dummy_prefills"] += 1

    @staticmethod
    def _blocks_wanted(run: _Run, cache: PagedSlotCache, prompts: Sequence[RolloutPrompt], n: int, sample: int, *,
                       busy: bool) -> tuple[int, int]:
        """(positions a waiting sample's blocks must hold now, blocks to leave free) on the on-demand pool: its prompt,
        what it generated before a preemption and the next position; a headroom of 1 % of the pool (>= 1 block)
        while others run, for them to grow."""
        done = len(run.preempted[sample].tokens) if sample in run.preempted else 0
        return len(prompts[sample // n]) + done + 1, max(1, cache.num_blocks // 100) if busy else 0

    @staticmethod
    def _resume_prompt(prompt: RolloutPrompt, state: _Preempted) -> RolloutPrompt:
        """A preempted sample's prefill: its prompt (vision inputs included) followed by the tokens it generated."""
        return dataclasses.replace(prompt, input_ids=torch.cat([prompt.input_ids.to(torch.long), state.tokens.to("cpu", torch.long)]))

    def _readmit(self, run: _Run, cache, sample: int, slot: int, pcache, row: int, logits: torch.Tensor,
                 last_route: Optional[torch.Tensor]) -> torch.Tensor:
        """Re-admit a preempted sample into `slot` (its blocks reserved) from row `row` of a prefill of its prompt + the
        k tokens it generated (`_resume_prompt`): it continues at token k; returns that token's logits [V]."""
        state = run.preempted.pop(sample)
        k = int(state.tokens.numel())
        cache.load_prefix([slot], pcache, row)
        run.slot_sample[slot] = sample
        run.tokens[slot, :k] = state.tokens
        run.logprobs[slot, :k] = state.logprobs
        run.versions[slot, :k] = state.versions
        run.gen_len[slot] = k
        run.host_len[slot] = k
        run.host_tokens[slot] = list(state.host_tokens)
        if run.routes is not None and state.prompt_routes is not None and state.routes is not None and last_route is not None:
            # the routes recorded when the tokens were first fed; the last token's, fed only now, from this prefill
            run.prompt_routes[slot] = state.prompt_routes
            run.routes[slot, :k - 1] = state.routes
            run.routes[slot, k - 1] = last_route
        return logits

    def _grow(self, run: _Run, cache: PagedSlotCache, running: list[int], queue: deque, stats: dict) -> list[int]:
        """Give every running slot whose sequence reached the end of its blocks one more (on-demand paged cache),
        oldest admission first; with none free, preempt the last admitted (possibly the slot itself). Returns the
        rows of `running` that still run."""
        alive = set(running)
        for slot in sorted(running, key=run.admitted.__getitem__):
            while slot in alive and cache.host_lengths[slot] >= cache.slot_capacity[slot] and not cache.grow(slot):
                victim = max(alive, key=run.admitted.__getitem__)
                self._preempt(run, cache, victim, queue)
                alive.discard(victim)
                stats["preemptions"] += 1
        return [r for r, slot in enumerate(running) if slot in alive]

    @staticmethod
    def _preempt(run: _Run, cache: PagedSlotCache, slot: int, queue: deque) -> None:
        """Return a running slot's blocks and put its sample at the head of the queue with what it generated."""
        k = run.host_len[slot]
        sample = run.slot_sample.pop(slot)
        run.preempted[sample] = _Preempted(
            tokens=run.tokens[slot, :k].clone(), logprobs=run.logprobs[slot, :k].clone(),
            versions=run.versions[slot, :k].clone(), host_tokens=run.host_tokens.pop(slot, []),
            prompt_routes=run.prompt_routes.pop(slot, None),
            routes=run.routes[slot, :k - 1].clone() if run.routes is not None else None)
        run.admitted.pop(slot)
        cache.release(slot)
        run.free.append(slot)
        queue.appendleft(sample)

    def _run(self, prompts, offset: int, num_slots: int, params: SamplingParams, checker: StopChecker,
             generator: Optional[torch.Generator], stats: dict) -> tuple[list[RolloutSample], bool]:
        n, budget = params.n, params.max_new_tokens
        dev = self._device()
        # fused q / k / v: idempotent, and fuses again a layer whose views a `.to()` replaced (new addresses: the
        # kept graphs check theirs before the next replay)
        if self.options.fuse_projections:
            with self._step_lock:  # not while another thread writes weights in place (`paused()`)
                if fuse_qkv(self.model) and self._runner is not None:
                    self._runner.weights_loaded()
        total = len(prompts) * n
        max_len = max(len(p) for p in prompts) + budget
        runner = self._kept_runner(num_slots, max_len, dev)
        cache = runner.cache if runner is not None else self._new_cache(num_slots, max_len, dev)
        if isinstance(cache, PagedSlotCache):
            cache.release_all()  # a kept pool: a call that failed half-way may have left blocks taken
            if cache.blocks_for(max_len) > cache.num_blocks - 1:  # one block is the scratch row's
                raise RuntimeError(f"kv_cache_blocks: the pool of {cache.num_blocks} blocks of {cache.block_size} positions "
                                   f"cannot hold one sample of {max_len} tokens (the longest prompt + max_new_tokens) "
                                   "besides the scratch block")
        run = _Run(num_slots, budget, dev, self.routes_shape)
        if isinstance(cache, PagedSlotCache):
            run.release = cache.release
        queue = deque(range(total))
        prefixes: dict = {}
        packer = self._cpu_packer(num_slots, dev) if self._packer is None else None  # one batch patches the model
        if packer is not None:
            self._packer = packer
        experts = self._cpu_expert_packer(dev) if self._expert_packer is None else None
        if experts is not None:
            self._expert_packer = experts
        try:
            with fused_projections(self.options.fuse_projections):
                return self._loop(_Batch(prompts, offset, params, checker, generator, stats), run,
                                  _Slots(cache, queue, prefixes, num_slots, runner))
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
            fresh = self.all_ranks_active(fresh)
        if not fresh:
            return self._runner
        self._drop_runner()
        self._runner, self._runner_key = self._decode_runner(self._new_cache(num_slots, max_len, dev)), key
        return self._runner

    def _new_cache(self, num_slots: int, max_len: int, dev) -> SlotCache:
        """An empty slot cache of `num_slots` slots (+ the scratch one) of `max_len` positions, or with `kv_block_size`
        the paged pool (`kv_cache_blocks` blocks, or enough for every slot at full length)."""
        if self.kv_block_size:
            bs = self.kv_block_size
            blocks = self.kv_cache_blocks or 1 + num_slots * -(-max_len // bs)
            storage = self.model.new_cache(blocks, bs, dtype=self.cache_dtype, device=dev)
            return self.with_options(PagedSlotCache(storage, num_slots, max_len))
        return self.with_options(SlotCache(self.model.new_cache(num_slots + 1, max_len, dtype=self.cache_dtype, device=dev)))

    def _drop_runner(self) -> None:
        if self._runner is not None:
            self._runner.drop()
            self._runner = None

    def _loop(self, batch: _Batch, run: _Run, slots: _Slots) -> tuple[list[RolloutSample], bool]:
        """The admission / sampling / decode-step loop of one batch of slots (`_run`'s cache and buffers)."""
        prompts, offset, params, checker = batch.prompts, batch.offset, batch.params, batch.checker
        generator, stats = batch.generator, batch.stats
        cache, queue, prefixes, num_slots, runner = slots.cache, slots.queue, slots.prefixes, slots.num_slots, slots.runner
        n, budget = params.n, params.max_new_tokens
        dev = self._device()
        total = len(prompts) * n
        finished: dict[int, tuple] = {}
        eos = torch.tensor(sorted(self.eos_token_ids), dtype=torch.long, device=dev)
        suppress = self.suppress_token_ids.to(dev)
        stop_strings = bool(checker.stop)
        calls = stats["prefill_calls"]
        cur_slots, cur_logits = self._admit(queue, run, cache, prompts, n, prefixes, stats)
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
                    index = torch.as_tensor(cur_slots, dtype=torch.long, device=dev)
                    uniform = None
                    if params.temperature > 0:  # one draw per slot and step: a row's numbers do not depend on the others
                        if generator is not None and not same_device(generator.device, cur_logits.device):
                            raise ValueError(f"generator: on {generator.device}, logits on {cur_logits.device}")
                        uniform = torch.rand(num_slots + 1, device=dev, generator=generator).index_select(0, index)
                    tok, lp = sample_tokens(cur_logits, temperature=params.temperature, top_k=params.top_k,
                                            top_p=params.top_p, suppress_token_ids=suppress, uniform=uniform)
                    pos = run.gen_len.index_select(0, index)
                    run.tokens[index, pos] = tok
                    run.logprobs[index, pos] = lp.float()
                    run.versions[index, pos] = self.policy_version
                    run.gen_len.index_add_(0, index, torch.ones_like(index))
                    # the stop check: the step's one host sync, which also reads whether each log-prob is finite
                    # (a row without a distribution: the sampler raises on the CPU only, to add no sync elsewhere)
                    bad_lp = ~torch.isfinite(lp)
                    if stop_strings:
                        tok_l, bad = torch.stack([tok, bad_lp.long()]).tolist()
                        is_eos = [t in self.eos_token_ids for t in tok_l]
                    else:
                        flags = (torch.isin(tok, eos).long() + 2 * bad_lp.long()).tolist()
                        tok_l, is_eos, bad = None, [f & 1 for f in flags], [f >> 1 for f in flags]
                    if any(bad):
                        r = bad.index(1)
                        sample = run.slot_sample[cur_slots[r]]
                        raise ValueError(f"rollout: prompt {offset + sample // n} (sample {sample % n}), generated token "
                                         f"{int(pos[r])}: the logits have a NaN or +inf value, or only -inf ones outside "
                                         "the suppressed ids: no distribution to sample from")
                    keep = []
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
                            self._finish(run, slot, why, finished)
                    if keep:
                        feed = tok.index_select(0, torch.as_tensor(keep, dtype=torch.long, device=dev))
                if self._interrupt.is_set() and not self.lockstep:
                    for slot in running:
                        self._finish(run, slot, "interrupted", finished)
                    interrupted = True
                    break
                if running and isinstance(cache, PagedSlotCache):  # on-demand blocks
                    rows = self._grow(run, cache, running, queue, stats)
                    if len(rows) < len(running):
                        assert feed is not None
                        feed = feed.index_select(0, torch.as_tensor(rows, dtype=torch.long, device=dev)) if rows else None
                        running = [running[r] for r in rows]
                if self.lockstep:
                    admitted, new_logits = self._lockstep_admit(queue, run, cache, prompts, n, prefixes, stats)
                else:
                    admitted, new_logits = self._admit(queue, run, cache, prompts, n, prefixes, stats)
                if not self.all_ranks_active(bool(running or admitted)):
                    break
                logits_parts = []
                if running or self.lockstep:
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
                        index = torch.as_tensor(running, dtype=torch.long, device=dev)
                        run.routes[index, run.gen_len.index_select(0, index) - 1] = routes[:len(running)]
                    stats["forward_calls"] += 1
                    stats["decode_steps"] += 1
                    if running:
                        logits_parts.append(logits)
                if admitted:
                    logits_parts.append(new_logits)
                cur_slots = running + admitted
                cur_logits = torch.cat(logits_parts) if len(logits_parts) > 1 else (logits_parts[0] if logits_parts else None)
        stats["decode_s"] += time.perf_counter() - t1
        finished_routes = {i: r.cpu() for i, r in run.finished_routes.items()}
        out = []
        for i, state in run.preempted.items():  # interrupted while waiting for blocks: what they generated
            finished[i] = (state.tokens, state.logprobs, state.versions, "interrupted")
            if state.prompt_routes is not None and state.routes is not None:
                finished_routes[i] = torch.cat([state.prompt_routes, state.routes]).cpu()
        for i in range(total):
            if i not in finished:
                out.append(self._unstarted(prompts, offset, i, n))
                continue
            ids, logps, versions, why = finished[i]
            ids, versions = ids.cpu(), versions.cpu()
            out.append(RolloutSample(
                prompt_index=offset + i // n, sample_index=i % n, token_ids=ids, logprobs=logps.cpu(),
                text=checker.final_text(ids.tolist(), why), finish_reason=why, prompt_length=len(prompts[i // n]),
                policy_version=int(versions.min()) if versions.numel() else self.policy_version,
                token_versions=versions, routes=finished_routes.get(i),
            ))
        return out, interrupted

    @staticmethod
    def _finish(run: _Run, slot: int, why: str, finished: dict) -> None:
        """Keep the slot's tokens (device copies, no sync) and free the slot."""
        length = run.host_len[slot]
        sample = run.slot_sample.pop(slot)
        finished[sample] = (run.tokens[slot, :length].clone(), run.logprobs[slot, :length].clone(),
                            run.versions[slot, :length].clone(), why)
        prompt_routes = run.prompt_routes.pop(slot, None)
        if run.routes is not None and prompt_routes is not None:  # every token the model read (not the last one)
            run.finished_routes[sample] = torch.cat([prompt_routes, run.routes[slot, :max(length - 1, 0)]])
        run.host_tokens.pop(slot, None)
        run.admitted.pop(slot, None)
        if run.release is not None:
            run.release(slot)
        run.free.append(slot)
