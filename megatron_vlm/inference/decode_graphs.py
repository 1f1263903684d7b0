"""Decode steps on static buffers, one batch-size bucket each, captured as CUDA graphs on CUDA.

Why: a decoding step of a small batch is bound by the launch of its hundreds of small kernels, not
by the GPU's work; a CUDA graph replays all of them with one launch. A graph replays fixed kernels on
fixed addresses and shapes, so a step must read only static tensors and make no host decision on
tensor values. `DecodeStepRunner` gives it that form:

* buckets of batch size (1, 2, 4, ... up to the slot count, which is a bucket too); a step of n rows
  runs the smallest bucket >= n. Each bucket owns static buffers: the token ids `[b, 1]` and the slot
  ids `[b]`; rows beyond n take the pad token on the cache's scratch slot (whose length and Mamba2
  states are rewound inside the step, so padding never runs the slot full);
* the step reads positions from the cache's device lengths (`SlotCache.set_active_static`: attention
  over the whole slot capacity, a constant `max_seqlen_k`, masked by the lengths; nothing read back);
  the host lengths of the real slots are advanced here, outside the step;
* on CUDA (`capture=True`) each bucket is captured on its first use: two warm-up runs on a side
  stream, then `torch.cuda.CUDAGraph` capture, all buckets in one memory pool; the warm-up and the
  capture run on scratch rows only, so no sequence's cache is touched. Later steps copy their inputs
  into the buffers and replay. Elsewhere the SAME static step runs eagerly (what the CPU tests run);
  with `probe=True` its first two runs per bucket are traced (`GraphSafetyProbe`): a host read of a
  tensor value (`.item()`, `bool()`, `int()`, `nonzero`, ...) or an op sequence that changes with the
  data is reported as `GraphUnsafeError`, the case a capture would fail (or, worse, bake in).

A graph holds raw pointers: the parameters and the cache must keep their storage while it lives.
`load_state_dict` copies into the parameters in place (same storage), which a replay then reads; the
runner records the parameters' addresses at its first step and, after each `weights_loaded()` (the
engine's `load_weights`), drops the graphs for a re-capture if one moved. It lives as long as its
slot cache (the engine keeps both across `generate` calls of the same slot shape until
`release_memory`); `drop()` frees the graphs.

The logits a step returns are a view of the bucket's output buffer, valid until the next step.
"""
from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_vlm.models.common.moe_static import static_routing
from megatron_vlm.models.common.routing_replay import recording_routes
from megatron_vlm.models.common.slot_cache import SlotCache, hint_dtype

__all__ = ["DecodeStepRunner", "GraphUnsafeError", "GraphSafetyProbe", "bucket_sizes"]

log = logging.getLogger(__name__)

# aten ops that read a tensor's value on the host or size their output by values: a sync, not capturable
_HOST_READS = ("_local_scalar_dense", "is_nonzero", "nonzero", "masked_select", "unique", "_unique", "item")


class GraphUnsafeError(RuntimeError):
    """A decode step that cannot be captured as a CUDA graph (host reads of values, data-dependent shapes)."""


def bucket_sizes(num_slots: int) -> list[int]:
    """Powers of two below `num_slots`, then `num_slots` itself."""
    if num_slots < 1:
        raise ValueError(f"bucket_sizes: num_slots must be >= 1, got {num_slots}")
    out, b = [], 1
    while b < num_slots:
        out.append(b)
        b *= 2
    return out + [num_slots]


def _caller() -> str:
    """file:line of the innermost project frame (what to fix), else the innermost frame."""
    frames = traceback.extract_stack()[:-3]
    ours = [f for f in frames if "megatron_vlm" in f.filename or "/kernels/" in f.filename]
    f = (ours or frames)[-1]
    return f"{'/'.join(f.filename.rsplit('/', 3)[-3:])}:{f.lineno}"


class GraphSafetyProbe(TorchDispatchMode):
    """Records (op, output shapes) of everything dispatched inside it; `host_reads` lists the ops of `_HOST_READS`."""

    def __init__(self) -> None:
        super().__init__()
        self.trace: list[tuple] = []
        self.host_reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in _HOST_READS:
            self.host_reads.append(f"{func} at {_caller()}")
        shapes = tuple(tuple(t.shape) for t in (out if isinstance(out, (tuple, list)) else (out,))
                       if isinstance(t, torch.Tensor))
        self.trace.append((str(func), shapes))
        return out


class _Bucket:
    def __init__(self, size: int, device, pad_token_id: int, scratch: int) -> None:
        self.size = size
        self.ids = torch.full((size, 1), pad_token_id, dtype=torch.long, device=device)
        self.slots = torch.full((size,), scratch, dtype=torch.long, device=device)
        self.logits: Optional[torch.Tensor] = None
        self.routes: Optional[torch.Tensor] = None  # [size, layers, k] recorded experts (record_routes)
        # the shared-prompt hint of the step's rows (SlotCache.share_prefix_reads): the group's first row and the
        # prompt length; a row of no group (padding included) points at itself with length 0
        dtype = hint_dtype(torch.device(device))
        self.own_rows = torch.arange(size, dtype=dtype)  # the template: never written (each step clones it)
        self.prefix_rows = self.own_rows.to(device, copy=True)  # copy: on the CPU `.to` would alias the template
        self.prefix_lens = torch.zeros(size, dtype=dtype, device=device)
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.traces: list[list[tuple]] = []


class DecodeStepRunner:
    def __init__(self, forward: Callable[..., torch.Tensor], cache: SlotCache, *, pad_token_id: int,
                 capture: bool, probe: bool = False,
                 params: Union[Sequence[torch.Tensor], Callable[[], Sequence[torch.Tensor]]] = (), record_routes: bool = False,
                 sizes: Optional[Sequence[int]] = None, agree: Optional[Callable[[bool], Any]] = None) -> None:
        """`forward(input_ids=..., kv_cache=...)` -> logits `[B, T, V]` (the engine's own model); `cache`: the
        batch's `SlotCache` (slot layout) or `PagedSlotCache` (block table); `capture`: CUDA graphs (the cache must be on CUDA); `probe`: trace
        the first eager runs of each bucket for graph safety; `params`: tensors whose addresses a graph bakes in, or a
        function giving the model's current ones (read at each check: Parameters assigned anew are seen, and the
        runner keeps no replaced tensor alive);
        `record_routes`: each step also leaves the MoE experts of its rows in `last_routes` (routing replay; a
        view of a static output of the graph, like the logits: valid until the next step); `sizes`: the batch-size buckets (default `bucket_sizes`;
        lock-stepped ranks whose steps exchange rows take one, the slot count); `agree(failed) -> any rank failed`
        (lock-stepped ranks: a collective): a capture or probe that fails on one rank fails on every rank, before
        any replays, so that all of them fall back to eager steps (and their collectives) together."""
        if capture and cache.device.type != "cuda":
            raise ValueError(f"DecodeStepRunner: CUDA graphs need a CUDA cache, got {cache.device}")
        cache.set_active_static(torch.zeros(1, dtype=torch.long, device=cache.device))  # checks the cache can
        self.forward, self.cache = forward, cache
        self.pad_token_id = int(pad_token_id)
        self.capture, self.probe = capture, probe
        self.params = params if callable(params) else list(params)
        self.sizes = sorted(sizes) if sizes else bucket_sizes(cache.num_slots)
        if self.sizes[-1] < cache.num_slots or self.sizes[0] < 1:
            raise ValueError(f"DecodeStepRunner: buckets {self.sizes} must be >= 1 and cover the {cache.num_slots} slots")
        self.buckets: dict[int, _Bucket] = {}
        self._pool: Optional[Any] = None  # a CUDA graph memory pool handle
        self._addresses: Optional[list[int]] = None
        self._weights_loaded = True  # check the addresses before the next replay
        self.captures = 0
        self.record_routes = record_routes
        self.last_routes: Optional[torch.Tensor] = None
        self.agree = agree

    # ------------------------------------------------------------------ the step
    def _step(self, bucket: _Bucket) -> torch.Tensor:
        """The static step: reads bucket.ids / bucket.slots and the cache, no host value read."""
        self.cache.reset_scratch_state()
        self.cache.set_active_static(bucket.slots, shared_prefix=(bucket.prefix_rows, bucket.prefix_lens))
        if not self.record_routes:
            with static_routing():  # MoE experts without host-sized GEMMs
                return self.forward(input_ids=bucket.ids, kv_cache=self.cache)[:, -1]
        with static_routing(), recording_routes() as rec:
            logits = self.forward(input_ids=bucket.ids, kv_cache=self.cache)[:, -1]
        bucket.routes = rec.stacked()
        return logits

    def bucket_for(self, n: int) -> int:
        for b in self.sizes:
            if b >= n:
                return b
        raise ValueError(f"DecodeStepRunner: {n} rows exceed the {self.cache.num_slots} slots")

    def step(self, slots: Sequence[int], input_ids: torch.Tensor) -> torch.Tensor:
        """One token (`input_ids` `[n]`) for each slot of `slots` -> logits `[n, V]` (valid until the next step)."""
        n = len(slots)
        if n == 0 or input_ids.shape != (n,):
            raise ValueError(f"DecodeStepRunner.step: {n} slots, input_ids of shape {tuple(input_ids.shape)}")
        cache = self.cache
        cache.check_rows(slots)  # the host checks the static step cannot make (full slots, a paged slot past its blocks)
        if self.capture and self._weights_loaded:
            self._check_addresses()
        size = self.bucket_for(n)
        bucket = self.buckets.get(size)
        if bucket is None:
            bucket = self.buckets[size] = _Bucket(size, cache.device, self.pad_token_id, cache.scratch_slot)
        bucket.ids[:n, 0].copy_(input_ids)
        bucket.ids[n:].fill_(self.pad_token_id)
        bucket.slots[:n].copy_(torch.as_tensor(list(slots), dtype=torch.long), non_blocking=True)  # no wait
        bucket.slots[n:].fill_(cache.scratch_slot)
        if cache.share_prefix_reads:
            self._fill_prefix_hint(bucket, slots)
        if self.capture:
            if bucket.graph is None:
                self._together(bucket, lambda: self._capture(bucket, n, input_ids, slots))
            assert bucket.graph is not None
            bucket.graph.replay()
        elif self.probe and len(bucket.traces) < 2:
            self._together(bucket, lambda: self._probed_step(bucket))
        else:
            bucket.logits = self._step(bucket)
        for s in slots:
            cache.host_lengths[s] += 1
        assert bucket.logits is not None
        self.last_routes = bucket.routes[:n] if bucket.routes is not None else None
        return bucket.logits[:n]

    def _probed_step(self, bucket: _Bucket) -> None:
        with GraphSafetyProbe() as probe:
            bucket.logits = self._step(bucket)
        self._check_probe(bucket, probe)

    def _together(self, bucket: _Bucket, attempt: Callable[[], None]) -> None:
        """Run a capture / probed step; with `agree`, fail here too when it failed on another rank."""
        failure: Optional[GraphUnsafeError] = None
        try:
            attempt()
        except GraphUnsafeError as e:
            failure = e
        if self.agree is not None and self.agree(failure is not None) and failure is None:
            failure = GraphUnsafeError(f"decode step (bucket {bucket.size}): another lock-stepped rank could not "
                                       "capture it")
        if failure is not None:
            raise failure

    def _fill_prefix_hint(self, bucket: _Bucket, slots: Sequence[int]) -> None:
        """Write this step's shared-prompt hint (`SlotCache.prefix_hint_for`) into the bucket's static buffers."""
        hint = self.cache.prefix_hint_for(slots)
        rows, lens = bucket.own_rows.clone(), torch.zeros_like(bucket.own_rows)
        if hint is not None:
            rows[: len(slots)] = torch.as_tensor(hint[0], dtype=rows.dtype).to(rows.device, non_blocking=True)
            lens[: len(slots)] = torch.as_tensor(hint[1], dtype=rows.dtype).to(rows.device, non_blocking=True)
        bucket.prefix_rows.copy_(rows)
        bucket.prefix_lens.copy_(lens)

    # ------------------------------------------------------------------ graph safety
    def _check_probe(self, bucket: _Bucket, probe: GraphSafetyProbe) -> None:
        if probe.host_reads:
            raise GraphUnsafeError(f"decode step (bucket {bucket.size}) reads tensor values on the host: "
                                   f"{sorted(set(probe.host_reads))}")
        bucket.traces.append(probe.trace)
        if len(bucket.traces) == 2 and bucket.traces[0] != bucket.traces[1]:
            first = next(i for i, (a, b) in enumerate(zip(*bucket.traces)) if a != b) if (
                len(bucket.traces[0]) == len(bucket.traces[1])) else min(len(t) for t in bucket.traces)
            raise GraphUnsafeError(f"decode step (bucket {bucket.size}) runs different ops / shapes on different "
                                   f"data (first difference at op {first})")

    # ------------------------------------------------------------------ CUDA graphs
    def _param_addresses(self) -> list[int]:
        return [p.data_ptr() for p in (self.params() if callable(self.params) else self.params)]

    def weights_loaded(self) -> None:
        """New weights were written (`load_weights`): check before the next replay that none was reallocated."""
        self._weights_loaded = True

    def _check_addresses(self) -> None:
        self._weights_loaded = False
        now = self._param_addresses()
        if self._addresses is not None and now != self._addresses:
            log.warning("decode graphs: parameters were reallocated since the capture; capturing again")
            self.drop()
        self._addresses = now

    def _capture(self, bucket: _Bucket, n: int, input_ids: torch.Tensor, slots: Sequence[int]) -> None:
        """Warm-up and capture on scratch rows only (no sequence's cache is touched), then restore the inputs."""
        bucket.ids.fill_(self.pad_token_id)
        bucket.slots.fill_(self.cache.scratch_slot)
        hint = bucket.prefix_rows.clone(), bucket.prefix_lens.clone()
        bucket.prefix_rows.copy_(bucket.own_rows)
        bucket.prefix_lens.zero_()
        with torch.cuda.device(self.cache.device):  # the cache's GPU, whichever is current
            self._capture_on_device(bucket)
        self.captures += 1
        bucket.ids[:n, 0].copy_(input_ids)
        bucket.slots[:n].copy_(torch.as_tensor(list(slots), dtype=torch.long), non_blocking=True)  # no wait
        bucket.prefix_rows.copy_(hint[0])
        bucket.prefix_lens.copy_(hint[1])

    def _capture_on_device(self, bucket: _Bucket) -> None:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._step(bucket)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):  # other threads may use CUDA
                bucket.logits = self._step(bucket)
        except RuntimeError as e:
            self.cache._pending, self.cache._step_states = False, {}  # a step interrupted by the failure
            raise GraphUnsafeError(f"decode step (bucket {bucket.size}) could not be captured: {e}") from e
        bucket.graph = graph

    def drop(self) -> None:
        """Free every graph and buffer (re-captured on the next use)."""
        for bucket in self.buckets.values():
            bucket.graph = None
            bucket.logits = None
            bucket.routes = None
        self.buckets.clear()
        self._pool = None
