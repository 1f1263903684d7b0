"""Per-sample token lengths for planning packs, computed cheaply and cached.

Every rank plans the same global sequence of packs, so every rank needs every sample's length —
but not its pixels: `estimate_length` renders the chat template, tokenises the text and adds the
image / video token counts from file headers and the processor's resize rule. Records that fail
here (malformed structure, missing image, unreadable header, ...) get length -1 and are logged. The same
headers give each record's pack class (`processing.pack_class`: 0 for most records; a Nemotron-VL video's tile
size otherwise), which the planner uses to keep videos whose tensors would not concatenate in separate packs.

With a cache folder the result is stored under a key made of the source's identity (each file's
path, size and mtime, the column mapping and the image root), the processor (tokenizer, chat template,
the family's size settings: `VLProcessor.identity()`) and the options (max_frames, fps, generation
prompts, pixel caps); a later run (or another rank) loads it instead of recomputing. The key does not
cover the image files themselves, so on a cache hit the records cached as bad (length -1) are estimated
again: an image that was missing (an unfinished copy, a wrong `data.image_root`) and is there now makes
its record usable, instead of the cache skipping it for good. The rest comes from the cache; the cache
is rewritten when a record changed.

At a million records the pass costs minutes of a core (about a millisecond per record: template
rendering, tokenisation and image headers in roughly equal parts), so it is spread out: over
`data.num_workers` worker processes (chunks of records in order, results concatenated), and, where all
ranks build the loader together (the trainers' train loaders: `split_over_ranks`), over the ranks, each
estimating 1 / world of the records before an all-gather of the lengths and bad records. Either way
the array and the bad-record list equal the serial pass's, so a bad record is still found once per
rank's log and counted once (`bad_records.keep_planning_records`). The cache stays one file, read by
global rank 0 (its view is broadcast so every rank computes the same remainder) and written by it
alone, atomically. A pool worker that dies mid-chunk (the out-of-memory killer, a stop signal sent to every
process) stops the pass with `LengthEstimateError` naming `data.num_workers`, rather than leaving the rank
waiting for that chunk forever.

The pass's workers start from the DataLoader workers' fork server (worker_start.py), not forked from the rank: the
process group's threads are up by now, and a child forked beside them can deadlock inside fork itself, leaving the
rank waiting at start. So the source and processor reach each worker pickled (an unpicklable one is an error
naming `data.num_workers`), and a worker ends when its rank does.

A record that raises something other than an Exception (a Rust tokenizer's panic arrives as pyo3's
PanicException, a BaseException) is no bad record to count: it stops the pass as `LengthEstimateError`
naming the record. In the split pass each rank's share ends in the all-gather either way, carrying the
error, so every rank raises the same error at once, instead of the others waiting in the gather for a
rank that is gone.
"""
from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing as mp
import os
import pickle
import signal
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Optional

import numpy as np

from megatron_vlm.data.bad_records import BadRecordError, BadRecordLog, unexpected
from megatron_vlm.data.media import DEFAULT_LIMITS, MediaLimits
from megatron_vlm.data.processing import estimate_length_and_class
from megatron_vlm.data.processor import VLProcessor
from megatron_vlm.data.worker_env import adopt_rank_state, rank_state
from megatron_vlm.data.worker_start import exit_with_rank, worker_context
from megatron_vlm.durable import write_text_durably
from megatron_vlm.stop_signals import leave_stop_signals_to_the_rank

__all__ = ["compute_lengths", "compute_lengths_and_classes", "compute_length_slice", "lengths_cache_key", "LengthEstimateError",
           "planning_settings", "IMAGE_SIZE_KEYS"]

log = logging.getLogger("megatron_vlm")


class LengthEstimateError(RuntimeError):
    """A record stopped the length pass with something that is not a bad record (module docstring)."""


def _source_identity(source) -> dict:
    """The source's files (resolved path, size, mtime) and column mapping: `source.identity()`."""
    return {"name": source.name, "n": len(source), **source.identity()}


def _processor_identity(proc: VLProcessor) -> dict:
    backend = getattr(proc.tokenizer, "backend_tokenizer", None)
    tok = backend.to_str() if backend is not None else repr(sorted(proc.tokenizer.get_vocab().items()))
    return {
        "tokenizer": hashlib.sha256(tok.encode()).hexdigest(),
        "chat_template": hashlib.sha256(proc.chat_template.encode()).hexdigest(),
        "template_kwargs": json.dumps(getattr(proc, "template_kwargs", {}), sort_keys=True, default=str),
        "vision": proc.identity(),
    }


IMAGE_SIZE_KEYS = ("data.min_pixels / data.max_pixels / data.video_min_pixels / data.video_max_pixels "
                   "(or model.path's preprocessor config)")
"""The keys of the processor's image / video size settings (else the model folder's preprocessor config)."""


def planning_settings(proc: VLProcessor, *, max_frames: int, fps: float = 2.0,
                      limits: MediaLimits = DEFAULT_LIMITS) -> dict[str, str]:
    """What the planning lengths are a function of besides the records (the length cache key's processor and
    options), by the config key that sets each, as short text: a data state records them, so a resume whose lengths
    differ can say which setting changed."""
    ident = _processor_identity(proc)
    return {"model.path (its tokenizer)": ident["tokenizer"][:16],
            "model.path (its chat template)": ident["chat_template"][:16],
            "data.chat_template_kwargs": ident["template_kwargs"],
            IMAGE_SIZE_KEYS: json.dumps(ident["vision"], sort_keys=True, default=str),
            "data.max_frames": str(int(max_frames)), "data.fps": str(float(fps)),
            "data.max_image_pixels": str(limits.max_image_pixels), "data.max_video_pixels": str(limits.max_video_pixels)}


def lengths_cache_key(source, proc: VLProcessor, *, max_frames: int, for_generation: bool, fps: float = 2.0,
                      limits: MediaLimits = DEFAULT_LIMITS) -> str:
    blob = json.dumps({"source": _source_identity(source), "processor": _processor_identity(proc),
                       "max_frames": max_frames, "for_generation": for_generation, "fps": float(fps),
                       "limits": limits.identity(), "version": 8},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def compute_length_slice(source, proc: VLProcessor, indices, *, max_frames: int, for_generation: bool = False,
                         fps: float = 2.0, limits: MediaLimits = DEFAULT_LIMITS) -> tuple[np.ndarray, list]:
    """(int64 lengths of the records `indices`, -1 for a bad one; the bad records as (file, index, category,
    detail) in `indices` order): one rank's or one worker's share of `compute_lengths`."""
    out, bad = _estimate(source, proc, list(indices), max_frames=max_frames, for_generation=for_generation, fps=fps,
                         limits=limits)
    return out[:, 0].copy(), [b for _, b in bad]


def _estimate(source, proc: VLProcessor, indices: list, **options) -> tuple[np.ndarray, list]:
    """([len(indices), 2] int64: each record's length (-1: bad) and pack class (`processing.pack_class`), each bad
    record as (position in `indices`, record))."""
    out = np.zeros((len(indices), 2), dtype=np.int64)
    out[:, 0] = -1
    bad = []
    for k, i in enumerate(indices):
        where: tuple = ("(record not located)", int(i))  # until locate answers
        try:
            where = source.locate(i)  # (file, line / row): where a bad record is counted
            rec = source.get(i)
            out[k] = estimate_length_and_class(rec, proc, **options)
        except BadRecordError as e:
            bad.append((k, (*where, e.category, e.detail)))
        except Exception as e:  # a bug or an unexpected file problem must not stop planning the run
            err = unexpected(e, f"{where[0]}:{where[1]}")
            bad.append((k, (*where, err.category, err.detail)))
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # not a record's fault to count: stop, naming the record (module docstring)
            raise LengthEstimateError(f"planning lengths: record {where[0]}:{where[1]} raised {type(e).__name__}: "
                                      f"{e}".rstrip(": ")) from e
    return out, bad


_POOL_CHUNK = 256
"""Records per task of the worker pool: big enough that the pickled results cost little, small enough to balance."""

_pool_job: Optional[tuple] = None  # (source, proc, options), set in each pool worker by `_pool_init`


def _pool_init(job: tuple, rank_pid: int, rank: Optional[dict] = None) -> None:
    """First thing in a worker of the pass: keep the job (it came pickled, once per worker), take the rank's
    environment and logging (worker_env.py), end with the rank."""
    global _pool_job
    import torch

    adopt_rank_state(rank)
    # TERM ends a worker: the executor ends the others with it when one died, and before the first step there is no
    # checkpoint for a rank to save. Set explicitly: the worker server ignores TERM (worker_server.py) and a worker
    # it forks inherits that. USR1 (a SLURM stop request to every process) is the rank's; so is Ctrl-C.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    leave_stop_signals_to_the_rank(term=False)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_rank(rank_pid)  # forked by the server, not the rank: nothing else ends it when the rank is killed
    torch.set_num_threads(1)  # a worker renders and tokenises; one thread each
    _pool_job = job


def _pool_task(task: tuple[int, list]) -> tuple[np.ndarray, list]:
    assert _pool_job is not None
    source, proc, options = _pool_job
    start, indices = task
    out, bad = _estimate(source, proc, indices, **options)
    return out, [(start + k, b) for k, b in bad]


def _pool_context(job: tuple, num_workers: int) -> Optional[BaseContext]:
    """The worker server's context (worker_start.py: a child forked from a rank that runs threads can deadlock inside
    fork itself), plain fork where the platform has no server, None where it has neither. The job must pickle."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("fork") if "fork" in mp.get_all_start_methods() else None
    try:
        pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        raise LengthEstimateError(
            f"data.num_workers = {num_workers}: the length pass's workers start from a worker server and receive the "
            f"record source and processor pickled, and these cannot be ({type(e).__name__}: {e}); make what they hold "
            "picklable, or set data.num_workers = 0 to estimate the lengths in the rank's own process") from e
    return worker_context(job, "the record source and processor")


def _pooled_slice(source, proc: VLProcessor, indices: list, num_workers: int, options: dict) -> tuple[np.ndarray, list]:
    """`_estimate` over `num_workers` worker processes (chunks in order, so the result is identical)."""
    usable = (num_workers > 0 and len(indices) > _POOL_CHUNK
              and not mp.current_process().daemon)  # a daemonic process (a DataLoader worker) cannot have children
    job = (source, proc, options)
    ctx = _pool_context(job, num_workers) if usable else None
    if ctx is None:
        return _estimate(source, proc, indices, **options)
    chunks = [(s, indices[s:s + _POOL_CHUNK]) for s in range(0, len(indices), _POOL_CHUNK)]
    workers = min(num_workers, len(chunks))
    try:
        # an executor, not multiprocessing.Pool: Pool.map waits forever for the chunk of a worker that died (the
        # OOM killer, a stop signal sent to every process); the executor notices the death and raises
        pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_pool_init,
                                   initargs=(job, os.getpid(), rank_state()))
        try:
            parts = list(pool.map(_pool_task, chunks))
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)  # the other workers end after their current chunk
            raise
        pool.shutdown()
    except BrokenProcessPool:
        raise LengthEstimateError(
            f"planning lengths: a worker process of the pass (data.num_workers = {num_workers}) ended abruptly "
            "(killed by the out-of-memory killer, or by a stop signal sent to every process); set "
            "data.num_workers = 0 to estimate the lengths in the rank's own process") from None
    return np.concatenate([p[0] for p in parts]), [b for p in parts for b in p[1]]


def _failure_text(failure: Optional[BaseException], rank: int) -> Optional[str]:
    """What a rank's failed share of the split pass tells the others (None: its share is done)."""
    if failure is None:
        return None
    text = str(failure) if isinstance(failure, LengthEstimateError) else f"{type(failure).__name__}: {failure}"
    return f"{text} (on rank {rank}, which estimated a share of the lengths)"


def _read_cache(cache_file: Optional[Path], n: int) -> Optional[np.ndarray]:
    """The cached [n, 2] table (lengths, pack classes), or None."""
    if cache_file is None or not cache_file.is_file():
        return None
    try:
        saved = json.loads(cache_file.read_text())
        table = np.stack([np.asarray(saved["lengths"], dtype=np.int64), np.asarray(saved["classes"], dtype=np.int64)], 1)
        return table if table.shape == (n, 2) else None
    except (json.JSONDecodeError, KeyError, OSError, TypeError, ValueError):
        log.warning("ignoring unreadable length cache %s", cache_file)
        return None


def _default_group():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank(), dist.get_world_size()
    return None


def compute_lengths(source, proc: VLProcessor, *, max_frames: int, for_generation: bool = False, fps: float = 2.0,
                    cache_dir: str | os.PathLike | None = None,
                    bad_records: Optional[BadRecordLog] = None, limits: MediaLimits = DEFAULT_LIMITS,
                    num_workers: int = 0, split_over_ranks: bool = False) -> np.ndarray:
    """int64 [len(source)]: token length of each record, -1 for records that cannot be used
    (`compute_lengths_and_classes` without the classes)."""
    return compute_lengths_and_classes(source, proc, max_frames=max_frames, for_generation=for_generation, fps=fps,
                                       cache_dir=cache_dir, bad_records=bad_records, limits=limits,
                                       num_workers=num_workers, split_over_ranks=split_over_ranks)[0]


def compute_lengths_and_classes(source, proc: VLProcessor, *, max_frames: int, for_generation: bool = False,
                                fps: float = 2.0, cache_dir: str | os.PathLike | None = None,
                                bad_records: Optional[BadRecordLog] = None, limits: MediaLimits = DEFAULT_LIMITS,
                                num_workers: int = 0, split_over_ranks: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(int64 [len(source)]: token length of each record, -1 for records that cannot be used; int64
    [len(source)]: each record's pack class, `processing.pack_class`: 0 joins any pack, records of two other
    classes cannot share one).

    `num_workers` > 0: the records are estimated by that many worker processes (`data.num_workers`).
    `split_over_ranks`: every rank of the default process group calls this together (a collective): each
    estimates 1 / world of the records, then the lengths and bad records are all-gathered, so every rank
    returns the same array and bad-record list as the serial pass; global rank 0 alone reads the cache
    (its view is broadcast, so all ranks agree on what is left to compute) and writes it."""
    group = _default_group() if split_over_ranks else None
    rank, world = group if group is not None else (0, 1)
    cache_file = None
    if cache_dir:
        key = lengths_cache_key(source, proc, max_frames=max_frames, for_generation=for_generation, fps=fps,
                                limits=limits)
        cache_file = Path(cache_dir) / f"lengths-{key}.json"
    cached = _read_cache(cache_file, len(source)) if rank == 0 else None
    if world > 1:
        import torch.distributed as dist

        box = [cached]
        dist.broadcast_object_list(box, src=0)
        cached = box[0]
    if cached is not None:
        table, todo = cached.copy(), np.nonzero(cached[:, 0] < 0)[0].tolist()  # the bad ones only (module docstring)
    else:
        table, todo = np.zeros((len(source), 2), dtype=np.int64), list(range(len(source)))
        table[:, 0] = -1
    options = {"max_frames": max_frames, "for_generation": for_generation, "fps": fps, "limits": limits}
    mine = todo[rank::world]
    if world == 1:
        got, bad = _pooled_slice(source, proc, mine, num_workers, options)
        table[np.asarray(mine, dtype=np.int64)] = got
    else:
        import torch.distributed as dist

        failure: Optional[BaseException] = None
        try:
            got, bad = _pooled_slice(source, proc, mine, num_workers, options)
        except BaseException as e:  # noqa: BLE001 - told to every rank in the gather below, then raised
            failure, got, bad = e, np.zeros((0, 2), dtype=np.int64), []
        parts: list = [None] * world
        dist.all_gather_object(parts, (got, bad, _failure_text(failure, rank)))
        errors = [p[2] for p in parts if p[2] is not None]
        if errors:  # the same error on every rank (the failing one chains its own exception)
            raise LengthEstimateError(errors[0]) from failure
        # rank r estimated todo[r::world]: put every share back in place, the bad records in `todo` order
        for r, (got_r, _, _) in enumerate(parts):
            table[np.asarray(todo[r::world], dtype=np.int64)] = got_r
        bad = sorted(((r + k * world, b) for r, (_, bad_r, _) in enumerate(parts) for k, b in bad_r))
    bad = [b for _, b in bad]
    if bad_records is not None:
        bad_records.extend(bad)
    if cache_file is not None and rank == 0 and (cached is None or not np.array_equal(cached, table)):
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        write_text_durably(cache_file, json.dumps({"lengths": table[:, 0].tolist(), "classes": table[:, 1].tolist(),
                                                   "bad": bad}))
    return table[:, 0].copy(), table[:, 1].copy()
