"""The data loaders the trainers use.

    loader = build_sft_dataloader(cfg.data, processor, seed=seed, dp_rank=rank, dp_size=dp)
    for pack in loader: ...            # endless; epochs advance by themselves
    loader.state_dict() / loader.load_state_dict(sd)   # exact resume position
    loader.epoch, loader.stats(), loader.bad_records

Each item is one pack (see packing.py): input_ids / labels [1, T] (labels shifted), cu_seqlens,
the vision tensors, num_samples, num_label_tokens. Planning happens in the main process from the
cached per-sample lengths (computed by `data.num_workers` worker processes, and with `split_over_ranks`
1 / world of them on each rank) (plan.py: the global pack stream is the same for any world size, rank r
takes packs r, r + dp, ...); the worker processes of a torch DataLoader (batch_size=None) only
load and process the samples of this rank's packs (`[data] loader_timeout_s` is their DataLoader
`timeout`: a stuck worker stops the run with an error naming that key instead of hanging it;
`max_image_pixels`, `max_video_pixels` and `video_decode_timeout_s` are applied by the media
reader, see media.py). Videos whose frames keep their own tile size (Nemotron-VL) are planned into packs of
their tile size only (the length pass's pack classes, plan.py), so no sample is lost to a pack it cannot join.
Records that fail in a worker (or, should processing disagree with the planning estimate, whose video frames
have a size the pack's other videos do not) are dropped from their pack and reported back with it; a pack whose
samples all failed becomes a one-token empty pack so that every rank still runs the same number of steps.
The position a checkpoint saves (`state_dict`) comes with what it means: the record count, pack size, seed, the
files' contents and a fingerprint of the planning lengths (plan_lengths.py); a resume whose plan would differ is
refused (`load_state_dict`), so a position never continues silently in another plan.

`build_eval_dataloader` iterates once over the eval split, sharded by rank with the same number of
items on every rank: packs (for validation loss) or padded prompt batches with reference answers
(for generation accuracy).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import math
import os
import pickle
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from megatron_vlm.data.bad_records import BadRecordError, BadRecordLog, keep_planning_records, unexpected
from megatron_vlm.data.config import DataConfig
from megatron_vlm.data.data_files import changed_data_file, content_signatures, source_files
from megatron_vlm.data.lengths import compute_lengths_and_classes, planning_settings
from megatron_vlm.data.media import MediaLimits, PyAVDecoder, VideoDecoder, set_video_decoder, video_decoder
from megatron_vlm.data.packing import collate_pack, collate_padded, empty_pack, vision_shape_conflict
from megatron_vlm.data.plan import PackPlanner
from megatron_vlm.data.plan_lengths import plan_lengths_refusal, plan_lengths_state, warn_unrecorded_lengths
from megatron_vlm.data.processing import ProcessedSample, process_record
from megatron_vlm.data.processor import VLProcessor, as_vl_processor
from megatron_vlm.data.sources import open_split
from megatron_vlm.data.worker_env import adopt_rank_state, rank_state
from megatron_vlm.data.worker_start import exit_with_rank, worker_context
from megatron_vlm.errors import ConfigError
from megatron_vlm.stop_signals import leave_stop_signals_to_the_rank

__all__ = ["SFTDataLoader", "EvalDataLoader", "build_sft_dataloader", "build_eval_dataloader", "build_processor"]

log = logging.getLogger("megatron_vlm")


def _identity(x):
    return x


def _worker_init(_worker_id: int, decoder: Optional[VideoDecoder] = None, rank_pid: Optional[int] = None,
                 rank: Optional[dict] = None) -> None:
    """First thing in a DataLoader worker. `decoder`: the rank's `set_video_decoder` choice, and `rank`: its
    environment and logging (worker_env.py), which a worker started by the worker server (not forked from the rank)
    would not otherwise see; `rank_pid`: the rank, whose end ends the worker (worker_start.py `exit_with_rank`)."""
    adopt_rank_state(rank)
    if rank_pid is not None:
        exit_with_rank(rank_pid)
    if decoder is not None:
        set_video_decoder(decoder)
    torch.set_num_threads(1)  # workers tokenise / resize; leave the cores to the main process
    # SLURM sends its stop request (TERM / USR1) to every process of a job step, worker grandchildren
    # included; the rank handles it by saving a checkpoint, and a worker dying first would crash that save.
    leave_stop_signals_to_the_rank()
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _worker_init_fn() -> Callable[[int], None]:
    """`_worker_init` with this rank's pid, environment and logging, and its video decoder when it is not the
    default."""
    decoder = video_decoder()
    return functools.partial(_worker_init, rank_pid=os.getpid(), rank=rank_state(),
                             decoder=None if isinstance(decoder, PyAVDecoder) else decoder)


LIVENESS_CHECK_S = 5.0
"""Longest single wait on the workers' queue: between waits the rank checks that its workers are alive. Forked by
the worker server (worker_start.py), they are not the rank's children, so no SIGCHLD tells it of a death; torch
checks only when a wait ends, and one wait of `data.loader_timeout_s` would leave a dead worker unseen for that
long."""


def _worker_kwargs(dataset: Dataset, num_workers: int, prefetch_factor: int, timeout_s: float) -> dict:
    """The DataLoader arguments of a loader with workers (none without): started from the worker server, each with
    this rank's init, and a `timeout` of one slice of the wait (0: torch slices the endless wait itself)."""
    if not num_workers:
        return {}
    init = _worker_init_fn()
    return {"prefetch_factor": prefetch_factor, "worker_init_fn": init,
            "timeout": min(float(timeout_s), LIVENESS_CHECK_S) if timeout_s else 0.0,
            "multiprocessing_context": worker_context((dataset, init), "the dataset and the video decoder")}


def _explain_timeout(loader: DataLoader, timeout_s: float, split: str) -> Iterator:
    """Iterate `loader`, waiting up to `timeout_s` for each item in slices of its own `timeout` (a dead worker is
    named at the end of a slice); the last slice's "DataLoader timed out" error gets the config key that set it. A
    dataset that cannot be pickled to its workers (they start from the worker server, worker_start.py) is an error
    naming data.num_workers."""
    try:
        it = iter(loader)
    except Exception as e:
        if not (loader.num_workers and (isinstance(e, pickle.PicklingError) or "pickle" in str(e).lower())):
            raise
        raise RuntimeError(f"data.num_workers = {loader.num_workers}: the DataLoader workers start from a worker server "
                           f"and receive the dataset pickled, and this one cannot be ({type(e).__name__}: {e}); make "
                           "what it holds picklable, or set data.num_workers = 0 to read the data in the training "
                           "process") from e
    while True:
        began = time.monotonic()
        while True:
            try:
                item = next(it)
                break
            except StopIteration:
                return
            except RuntimeError as e:
                if not (timeout_s and "timed out" in str(e)):
                    raise
                waited = time.monotonic() - began
                if waited + 1e-3 < timeout_s:
                    continue  # one slice ended with the workers alive: wait on for the same item
                raise RuntimeError(f"data[{split}]: no pack from the DataLoader workers within data.loader_timeout_s = "
                                   f"{timeout_s:g} s (a worker is stuck; waited {waited:.0f} s)") from e
        yield item


def build_processor(data_cfg: DataConfig, processor: Any) -> VLProcessor:
    """The processor (a VLProcessor, a model folder or a transformers processor) with [data]'s pixel limits."""
    return as_vl_processor(processor).with_overrides(
        min_pixels=data_cfg.min_pixels, max_pixels=data_cfg.max_pixels,
        video_min_pixels=data_cfg.video_min_pixels, video_max_pixels=data_cfg.video_max_pixels)


class _Processor:
    """Turns sample indices into ProcessedSamples inside a worker, collecting bad records."""

    def __init__(self, source, proc: VLProcessor, cfg: DataConfig, for_generation: bool = False):
        self.source, self.proc, self.for_generation = source, proc, for_generation
        self.max_frames, self.fps = cfg.max_frames, cfg.fps
        self.limits = MediaLimits.from_config(cfg)

    def __call__(self, i: int, bad: list) -> Optional[ProcessedSample]:
        where = self.source.locate(i)  # (file, line / row): where a bad record is counted
        try:
            rec = self.source.get(i)
            return process_record(rec, self.proc, max_frames=self.max_frames, fps=self.fps,
                                  for_generation=self.for_generation, limits=self.limits)
        except BadRecordError as e:
            bad.append((*where, e.category, e.detail))
        except Exception as e:  # keep the run going; the summary names the record and the exception
            err = unexpected(e, f"{where[0]}:{where[1]}")
            bad.append((*where, err.category, err.detail))
        return None


class _PackDataset(Dataset):
    """key = (global index, epoch, index in epoch, sample indices) -> pack dict (+ "_meta")."""

    def __init__(self, processor: _Processor, capacity: int, pad_token_id: int):
        self.processor, self.capacity, self.pad_token_id = processor, capacity, pad_token_id

    def __len__(self) -> int:  # the stream is endless; the sampler decides what is asked for
        raise TypeError("a pack stream has no length")

    def __getitem__(self, key) -> dict:
        g, epoch, j, sample_ids = key
        bad: list = []
        samples, total = [], 0
        for i in sample_ids:
            s = self.processor(i, bad)
            if s is None:
                continue
            if total + len(s) > self.capacity:
                bad.append((s.source, s.index, "length_mismatch",
                            f"{len(s)} tokens do not fit the {self.capacity - total} left in pack {g} "
                            "(planned lengths disagree with processing)"))
                continue
            conflict = vision_shape_conflict(samples, s)
            if conflict:
                bad.append((s.source, s.index, "video", f"{conflict} in pack {g}"))
                continue
            samples.append(s)
            total += len(s)
        pack = collate_pack(samples) if samples else empty_pack(self.pad_token_id)
        pack["_meta"] = {"global_index": g, "epoch": epoch, "index_in_epoch": j, "bad_records": bad,
                         "num_tokens": total}
        return pack


class _RankSampler(Sampler):
    """Endless keys for rank r: global packs r + k * dp for k = start, start + 1, ..."""

    def __init__(self, planner: PackPlanner, rank: int, world: int, start: int):
        self.planner, self.rank, self.world, self.start = planner, rank, world, start

    def __iter__(self) -> Iterator[tuple]:
        k = self.start
        while True:
            g = self.rank + k * self.world
            epoch, j = self.planner.locate(g)
            yield g, epoch, j, tuple(int(i) for i in self.planner.plan(epoch)[j])
            k += 1


class SFTDataLoader:
    """Endless, resumable, rank-sharded iterator of packs (module docstring)."""

    def __init__(self, dataset: _PackDataset, planner: PackPlanner, *, dp_rank: int, dp_size: int,
                 num_workers: int, prefetch_factor: int, bad_records: BadRecordLog, split: str,
                 timeout_s: float = 0.0, data_files: Optional[dict] = None,
                 plan_settings: Optional[Callable[[], dict]] = None):
        self.dataset, self.planner = dataset, planner
        self.data_files = data_files
        """`content_signatures` of the files read (None: records in memory): a resume refuses other content."""
        self._plan_settings = plan_settings
        """`lengths.planning_settings` of this loader (computed when first saved: it hashes the tokenizer)."""
        self._plan_lengths: Optional[dict] = None
        self.timeout_s = timeout_s
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.num_workers, self.prefetch_factor = num_workers, prefetch_factor
        self.bad_records, self.split = bad_records, split
        self._consumed = 0
        self._epoch: Optional[int] = None
        self._tokens = 0
        self._packs_seen = 0
        self._samples = 0
        self._logged_epochs: set[int] = set()
        self._mark: Optional[tuple] = None
        """(position and counts) at the last `mark()`; None: no mark (nothing to rewind to)."""
        self._bad_since_mark: list = []
        """The records skipped in the packs yielded since the mark (taken back by `rewind`)."""
        self._iteration = 0
        """Counts `rewind`s: an iterator made before one is spent (its position is no longer the loader's)."""

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[dict]:
        iteration = self._iteration
        sampler = _RankSampler(self.planner, self.dp_rank, self.dp_size, self._consumed)
        kwargs = _worker_kwargs(self.dataset, self.num_workers, self.prefetch_factor, self.timeout_s)
        # generator: each DataLoader iterator draws its base seed from it instead of the global torch RNG,
        # so creating the iterator after a resume does not shift the RNG that training dropout draws from
        loader = DataLoader(self.dataset, batch_size=None, sampler=sampler, num_workers=self.num_workers,
                            collate_fn=_identity, generator=torch.Generator().manual_seed(self._consumed), **kwargs)
        for pack in _explain_timeout(loader, self.timeout_s, self.split):
            if iteration != self._iteration:
                raise RuntimeError(f"data[{self.split}]: an iterator made before the loader was rewound (iterate anew)")
            meta = pack.pop("_meta")
            self.bad_records.extend(meta["bad_records"])
            if self._mark is not None:
                self._bad_since_mark.extend(meta["bad_records"])
            self._consumed += 1
            self._epoch = meta["epoch"]
            self._tokens += meta["num_tokens"]
            self._packs_seen += 1
            self._samples += int(pack["num_samples"])
            if self._epoch not in self._logged_epochs:
                self._logged_epochs.add(self._epoch)
                log.info("data[%s] epoch %d: %d packs of <= %d tokens, planned packing efficiency %.3f",
                         self.split, self._epoch, self.planner.num_packs(self._epoch), self.planner.capacity,
                         self.planner.efficiency(self._epoch))
            yield pack

    def mark(self) -> None:
        """Remember the position (and the counts of `stats()`) for `rewind`: a training step marks before it fetches
        its packs."""
        self._mark = (self._consumed, self._epoch, self._tokens, self._packs_seen, self._samples)
        self._bad_since_mark = []

    def rewind(self) -> None:
        """Put back the packs yielded since `mark()` as if never read: the position, the counts and the records
        skipped in them (`BadRecordLog.remove`) are the mark's again, so the data state saved now is the mark's and a
        resumed run reads those packs (and counts their bad records) once. A step does this when it is given up before
        it used its packs (a stop agreed at its start: training/sft.py). The iterator that yielded them is spent; a
        new one yields them again."""
        if self._mark is None:
            raise RuntimeError(f"data[{self.split}]: rewind without a mark")
        self._consumed, self._epoch, self._tokens, self._packs_seen, self._samples = self._mark
        self.bad_records.remove(self._bad_since_mark)
        self._bad_since_mark = []
        self._iteration += 1

    def __len__(self) -> int:
        """This rank's packs in epoch 0 (for steps-per-epoch arithmetic)."""
        return math.ceil(self.planner.num_packs(0) / self.dp_size)

    @property
    def packs_per_epoch(self) -> int:
        """Global packs in epoch 0 (all ranks together; later epochs differ by a pack or so)."""
        return self.planner.num_packs(0)

    @property
    def epoch(self) -> int:
        """Epoch of the last pack yielded (of the next one before the first)."""
        if self._epoch is not None:
            return self._epoch
        return self.planner.locate(self.dp_rank + self._consumed * self.dp_size)[0]

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict:
        return {"global_packs_consumed": self._consumed * self.dp_size, "packs_consumed_on_rank": self._consumed,
                "dp_size": self.dp_size, "epoch": self.epoch, "seed": self.planner.seed, "shuffle": self.planner.shuffle,
                "num_records": int(self.planner.lengths.size), "capacity": self.planner.capacity,
                "pack_classes": self._pack_classes_digest(), "plan_lengths": self.plan_lengths(),
                **({"data_files": self.data_files} if self.data_files is not None else {})}

    def plan_lengths(self) -> dict:
        """`plan_lengths.plan_lengths_state` of this loader's plan (computed once)."""
        if self._plan_lengths is None:
            settings = self._plan_settings() if self._plan_settings is not None else None
            self._plan_lengths = plan_lengths_state(self.planner.lengths, self.planner.capacity, settings)
        return self._plan_lengths

    def _pack_classes_digest(self) -> Optional[str]:
        """A digest of the records' pack classes (videos of one tile size pack together), None when every record is
        class 0: the plan depends on them, so a resume must see the same ones."""
        classes = self.planner.classes
        return None if classes is None else hashlib.sha256(np.ascontiguousarray(classes).tobytes()).hexdigest()[:16]

    def load_state_dict(self, state: dict) -> None:
        """Resume after `global_packs_consumed` packs of the global stream (any former world size
        whose position divides evenly into the current one)."""
        if "global_packs_consumed" not in state:  # another job kind's data state (a GRPO run's prompt order)
            raise ValueError(f"data state: no packed-data position (its fields: {', '.join(sorted(state)) or 'none'})")
        g = int(state["global_packs_consumed"])
        if g % self.dp_size:
            raise ValueError(f"data state: {g} packs consumed globally cannot be split evenly over "
                             f"dp_size={self.dp_size}")
        for key, mine in (("seed", self.planner.seed), ("num_records", int(self.planner.lengths.size)),
                          ("capacity", self.planner.capacity)):
            if key in state and int(state[key]) != mine:
                raise ValueError(f"data state: {key}={state[key]} in the checkpoint but {mine} now; the pack "
                                 "order would differ")
        # data.shuffle: a position in the shuffled stream points elsewhere in the file-order one (None: not recorded)
        if state.get("shuffle") is not None and bool(state["shuffle"]) != self.planner.shuffle:
            raise ValueError(f"data state: shuffle={bool(state['shuffle'])} in the checkpoint but {self.planner.shuffle} "
                             "now; the pack order would differ")
        mine_classes = self._pack_classes_digest()
        if state.get("pack_classes") != mine_classes:  # a checkpoint from before pack classes has no key: None
            raise ValueError("data state: the records' video pack classes differ from the checkpoint's (videos of "
                             "different tile sizes are planned into separate packs since the length cache's version 8); "
                             "the pack order would differ")
        changed = changed_data_file(state.get("data_files"), getattr(self, "data_files", None))
        if changed:  # as many records, other ones: the position would point into other data
            raise ValueError(f"data state: {changed}")
        if "plan_lengths" not in state:  # written before the fingerprint: resumes unchecked
            warn_unrecorded_lengths()
        elif plan_lengths_refusal(state["plan_lengths"], self.plan_lengths()):  # the same records planned otherwise
            raise ValueError("data state: the samples' token lengths differ from the checkpoint's; the pack plan "
                             "would differ")
        self._consumed = g // self.dp_size
        self._epoch = None

    # ------------------------------------------------------------------ metrics
    def stats(self) -> dict:
        capacity = self.planner.capacity
        return {
            "epoch": self.epoch,
            "packs_consumed": self._consumed,
            "packing_efficiency": self._tokens / (self._packs_seen * capacity) if self._packs_seen else 0.0,
            "planned_packing_efficiency": self.planner.efficiency(self.epoch),
            "samples_seen": self._samples,
            "bad_records": len(self.bad_records),
        }


def _prepare(data_cfg: DataConfig, processor: Any, split: str, bad_records: Optional[BadRecordLog],
             for_generation: bool, source=None, split_over_ranks: bool = False):
    """(processor, the run's bad-record log, source, lengths, the bad records found while planning, pack classes).
    `split_over_ranks`: every rank calls this together and estimates 1 / world of the lengths (compute_lengths)."""
    data_cfg.validate()
    proc = build_processor(data_cfg, processor)
    bad_records = bad_records if bad_records is not None else BadRecordLog()
    found = BadRecordLog()  # what every rank finds alike: counted once (keep_planning_records)
    if source is None:
        source = open_split(data_cfg, split, found)
    if source is None:
        return None
    lengths, classes = compute_lengths_and_classes(
        source, proc, max_frames=data_cfg.max_frames, for_generation=for_generation,
        limits=MediaLimits.from_config(data_cfg), fps=data_cfg.fps, cache_dir=data_cfg.length_cache_dir or None,
        bad_records=found, num_workers=data_cfg.num_workers, split_over_ranks=split_over_ranks)
    too_long = np.nonzero(lengths > data_cfg.max_tokens_per_pack)[0]
    for i in too_long:
        file, idx = source.locate(int(i))
        found.add(file, idx, "too_long", f"{int(lengths[i])} tokens > max_tokens_per_pack={data_cfg.max_tokens_per_pack}")
    keep_planning_records(found, bad_records)
    return proc, bad_records, source, lengths, found, classes


def require_usable(lengths: np.ndarray, capacity: int, name: str, bad_records: BadRecordLog) -> None:
    """A split none of whose records can be trained on is a config / data mistake, not a crash: a
    ConfigError (exit 2, one line) naming the split, the pack budget and the first bad record's reason
    (e.g. a text-only model given image records), since the run dies before the summary is written."""
    if np.any((lengths > 0) & (lengths <= capacity)):
        return
    entries = bad_records.entries
    why = f"; bad records by category {bad_records.counts_by_category()}, first: {entries[0]}" if entries else ""
    raise ConfigError(f"{name}: no usable samples ({lengths.size} records, all bad or longer than "
                      f"data.max_tokens_per_pack={capacity}){why}")


def build_sft_dataloader(data_cfg: DataConfig, processor: Any, *, seed: int, dp_rank: int, dp_size: int,
                         split: str = "train", bad_records: Optional[BadRecordLog] = None,
                         split_over_ranks: bool = False) -> SFTDataLoader:
    """Endless packed loader for `split` on this rank (module docstring). `processor`: a VLProcessor,
    a model folder, or a transformers processor; the [data] pixel limits are applied to it.
    `split_over_ranks`: every rank of the default process group builds this loader together, each
    estimating 1 / world of the planning lengths (a collective; `data.lengths.compute_lengths`)."""
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
    prepared = _prepare(data_cfg, processor, split, bad_records, for_generation=False, split_over_ranks=split_over_ranks)
    if prepared is None:
        raise ValueError(f"data: no {split} split configured")
    proc, bad_records, source, lengths, found, classes = prepared
    require_usable(lengths, data_cfg.max_tokens_per_pack, f"data.{split}", found)
    planner = PackPlanner(lengths, data_cfg.max_tokens_per_pack, seed=seed,
                          shuffle=data_cfg.shuffle and split == "train", name=f"data.{split}", classes=classes)
    dataset = _PackDataset(_Processor(source, proc, data_cfg), data_cfg.max_tokens_per_pack, proc.pad_token_id)
    return SFTDataLoader(dataset, planner, dp_rank=dp_rank, dp_size=dp_size, num_workers=data_cfg.num_workers,
                         prefetch_factor=data_cfg.prefetch_factor, bad_records=bad_records, split=split,
                         timeout_s=data_cfg.loader_timeout_s, data_files=data_files_of(source),
                         plan_settings=plan_settings_of(proc, data_cfg))


def plan_settings_of(proc: VLProcessor, data_cfg: DataConfig) -> Callable[[], dict]:
    """The `lengths.planning_settings` of a loader's lengths, computed when called."""
    return functools.partial(planning_settings, proc, max_frames=data_cfg.max_frames, fps=data_cfg.fps,
                             limits=MediaLimits.from_config(data_cfg))


def data_files_of(source) -> Optional[dict]:
    """The `content_signatures` of the files `source` reads, or None for records held in memory."""
    files = source_files(source)
    return content_signatures(files) if files else None


class _GenerationDataset(Dataset):
    """key = list of sample indices (None = padding slot) -> padded prompt batch."""

    def __init__(self, processor: _Processor, proc: VLProcessor, padding_side: str):
        self.processor, self.proc, self.padding_side = processor, proc, padding_side

    def __len__(self) -> int:
        raise TypeError("keys come from the sampler")

    def __getitem__(self, key) -> dict:
        bad: list = []
        samples, valid, index, answers, meta = [], [], [], [], []
        for i in key:
            s = self.processor(i, bad) if i is not None else None
            if s is None:
                s = ProcessedSample(input_ids=torch.tensor([self.proc.pad_token_id]),
                                    label_mask=torch.zeros(1, dtype=torch.bool))
            samples.append(s)
            valid.append(i is not None and s.index >= 0)
            index.append(i if valid[-1] else -1)
            answers.append(s.answer if valid[-1] else None)
            meta.append(s.meta if valid[-1] else {})
        batch = collate_padded(samples, self.proc.pad_token_id, padding_side=self.padding_side,
                               image_token_id=self.proc.image_token_id, video_token_id=self.proc.video_token_id)
        batch.update({"sample_valid": torch.tensor(valid), "sample_index": torch.tensor(index),
                      "answers": answers, "meta": meta, "_bad_records": bad})
        return batch


class EvalDataLoader:
    """One pass over the eval split per `iter()`, the same number of items on every rank."""

    def __init__(self, dataset: Dataset, keys: list, *, num_workers: int, prefetch_factor: int,
                 bad_records: BadRecordLog, mode: str, timeout_s: float = 0.0):
        self.dataset, self.keys, self.mode = dataset, keys, mode
        self.timeout_s = timeout_s
        self.num_workers, self.prefetch_factor = num_workers, prefetch_factor
        self.bad_records = bad_records

    def __len__(self) -> int:
        return len(self.keys)

    def __iter__(self) -> Iterator[dict]:
        kwargs = _worker_kwargs(self.dataset, self.num_workers, self.prefetch_factor, self.timeout_s)
        loader = DataLoader(self.dataset, batch_size=None, sampler=self.keys,
                            num_workers=min(self.num_workers, max(1, len(self.keys))) if self.num_workers else 0,
                            collate_fn=_identity, **kwargs)
        for item in _explain_timeout(loader, self.timeout_s, "eval"):
            if self.mode == "packs":
                meta = item.pop("_meta")
                self.bad_records.extend(meta["bad_records"])
            else:
                self.bad_records.extend(item.pop("_bad_records"))
            yield item


def build_eval_dataloader(data_cfg: DataConfig, processor: Any, *, dp_rank: int, dp_size: int,
                          mode: str = "packs", batch_size: int = 8, padding_side: str = "right",
                          bad_records: Optional[BadRecordLog] = None, source=None) -> Optional[EvalDataLoader]:
    """Loader over the eval split for this rank, or None when there is no eval split. `source`: a
    record source (`sources.RecordSource`, e.g. a benchmark's rows) read instead of the eval split;
    `data_cfg` then only gives the processing limits and loader settings.

    mode "packs": the split packed in file order (no shuffle); rank r takes packs r, r + dp, ...,
      padded with empty packs (num_samples = 0) so every rank yields ceil(P / dp) packs.
    mode "generation": prompts (messages before the last assistant turn + generation prompt),
      `batch_size` per batch, padded on `padding_side`; keys "answers" (reference text),
      "sample_valid" (False for filler rows that even out the ranks), "sample_index", "meta".
    """
    if mode not in ("packs", "generation"):
        raise ValueError(f"mode must be 'packs' or 'generation', got {mode!r}")
    if batch_size <= 0:
        raise ValueError(f"batch_size must be > 0, got {batch_size}")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
    prepared = _prepare(data_cfg, processor, "eval", bad_records, for_generation=(mode == "generation"), source=source)
    if prepared is None:
        return None
    proc, bad_records, source, lengths, found, classes = prepared
    require_usable(lengths, data_cfg.max_tokens_per_pack, "data.eval", found)
    if mode == "packs":
        planner = PackPlanner(lengths, data_cfg.max_tokens_per_pack, seed=0, shuffle=False, name="data.eval",
                              classes=classes)
        plan = planner.plan(0)
        per_rank = math.ceil(len(plan) / dp_size)
        keys = []
        for k in range(per_rank):
            g = dp_rank + k * dp_size
            keys.append((g, 0, g, tuple(plan[g]) if g < len(plan) else ()))
        dataset: Dataset = _PackDataset(_Processor(source, proc, data_cfg), data_cfg.max_tokens_per_pack,
                                        proc.pad_token_id)
    else:
        valid = [int(i) for i in np.nonzero((lengths > 0) & (lengths <= data_cfg.max_tokens_per_pack))[0]]
        per_rank = math.ceil(len(valid) / dp_size)
        mine: list = [valid[j] if j < len(valid) else None for j in range(dp_rank, per_rank * dp_size, dp_size)]
        keys = [mine[s:s + batch_size] for s in range(0, len(mine), batch_size)]
        dataset = _GenerationDataset(_Processor(source, proc, data_cfg, for_generation=True), proc, padding_side)
    return EvalDataLoader(dataset, keys, num_workers=data_cfg.num_workers, prefetch_factor=data_cfg.prefetch_factor,
                          bad_records=bad_records, mode=mode,
                          timeout_s=data_cfg.loader_timeout_s)
