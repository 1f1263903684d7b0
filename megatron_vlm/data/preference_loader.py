"""Loaders of preference pairs: each pair's chosen and rejected responses packed into the same pack.

    loader = build_preference_dataloader(cfg.data, processor, seed=seed, dp_rank=r, dp_size=dp)
    for pack in loader: ...   # endless, resumable (state_dict / load_state_dict), like the SFT loader

A pack holds whole pairs, chosen then rejected for each: sequences 2k and 2k + 1 of its `cu_seqlens`
are pair k's chosen and rejected response with the same prompt and images, so one varlen forward
scores both (attention confined to each sequence). Only the response turn is labelled: a
multi-turn prompt's earlier assistant turns are context, not part of the preference. Besides the
SFT pack keys a pack carries `pair_index` [pairs] (the pair's row in the split: the key of the
precomputed reference log-probs) and `num_pairs`, and a pack with images `vision_rows` [sequences, vision keys]: how
many rows of each `VISION_KEYS` tensor each sequence holds (the training step reads it to keep one copy of a
pair's prompt images when it computes the prompt once: training/pair_prompts.py).

Packs are planned over pair lengths (chosen + rejected tokens, from `estimate_length` on both
halves, cached like the SFT lengths: `ResponseHalves`, with their pack classes: a Nemotron-VL video's pairs
go to packs of its tile size) by the SFT planner (plan.py), so the
stream of packs, its sharding over data-parallel ranks and its resume position behave as SFT's. A
pair either half of which is bad (a missing image, an empty response, a too-long pair) is skipped
and counted once in the bad-record log.

`build_preference_pass_loader` iterates a split once in file order (held-out evaluation, and the
one pass that precomputes the reference log-probs of the train split), the same number of packs on
every rank (padding with empty packs).
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from megatron_vlm.data.bad_records import BadRecordError, BadRecordLog, keep_planning_records, unexpected
from megatron_vlm.data.batch import VISION_KEYS
from megatron_vlm.data.config import DataConfig
from megatron_vlm.data.data_files import data_path_errors
from megatron_vlm.data.lengths import compute_lengths_and_classes
from megatron_vlm.data.loader import (
    EvalDataLoader,
    SFTDataLoader,
    build_processor,
    data_files_of,
    plan_settings_of,
    require_usable,
)
from megatron_vlm.data.media import MediaLimits
from megatron_vlm.data.packing import collate_pack, empty_pack, vision_shape_conflict
from megatron_vlm.data.plan import PackPlanner
from megatron_vlm.data.preference_records import PreferenceRows, ResponseHalves, SyntheticPreferencePairs
from megatron_vlm.data.processing import ProcessedSample, process_record
from megatron_vlm.data.processor import VLProcessor
from megatron_vlm.data.sources import open_split

__all__ = ["open_preference_split", "build_preference_dataloader", "build_preference_pass_loader", "response_only"]


def open_preference_split(cfg: DataConfig, split: str, bad_records: Optional[BadRecordLog] = None):
    """The split's preference pairs (`preference_records`), or None when the config has no such split."""
    if cfg.type == "synthetic_vqa":
        records = open_split(cfg, split, bad_records)
        return None if records is None else SyntheticPreferencePairs(records, seed=cfg.synthetic_seed)
    path = cfg.train_path if split == "train" else cfg.eval_path
    if not path:
        if split == "train":
            raise ValueError("data.train_path: required")
        return None
    with data_path_errors(f"data.{split}_path"):
        return PreferenceRows(path, cfg.columns if cfg.type == "hf" else None, jsonl=cfg.type == "messages_jsonl",
                              image_root=cfg.image_root or None, bad_records=bad_records)


def response_only(sample: ProcessedSample) -> ProcessedSample:
    """Keep the labels of the last assistant turn only (the response; earlier turns are prompt)."""
    idx = torch.nonzero(sample.label_mask).flatten()
    if idx.numel():
        end = int(idx[-1])
        start = end
        while start > 0 and bool(sample.label_mask[start - 1]):
            start -= 1
        mask = torch.zeros_like(sample.label_mask)
        mask[start:end + 1] = True
        sample.label_mask = mask
    return sample


class _PairProcessor:
    """Pair index -> (chosen, rejected) ProcessedSamples inside a worker, collecting bad records."""

    def __init__(self, halves: ResponseHalves, proc: VLProcessor, cfg: DataConfig):
        self.halves, self.proc = halves, proc
        self.max_frames, self.fps = cfg.max_frames, cfg.fps
        self.limits = MediaLimits.from_config(cfg)

    def __call__(self, i: int, bad: list) -> Optional[tuple[ProcessedSample, ProcessedSample]]:
        where = self.halves.locate(2 * i)
        try:
            out = tuple(response_only(process_record(self.halves.get(2 * i + k), self.proc, max_frames=self.max_frames,
                                                     fps=self.fps, limits=self.limits)) for k in (0, 1))
        except BadRecordError as e:
            bad.append((*where, e.category, e.detail))
            return None
        except Exception as e:  # keep the run going; the summary names the record and the exception
            err = unexpected(e, f"{where[0]}:{where[1]}")
            bad.append((*where, err.category, err.detail))
            return None
        if not all(bool(s.label_mask.any()) for s in out):
            bad.append((*where, "invalid_record", "a response has no trained token"))
            return None
        return out  # type: ignore[return-value]


class _PairPackDataset(Dataset):
    """key = (global index, epoch, index in epoch, pair indices) -> pack dict (+ "_meta")."""

    def __init__(self, processor: _PairProcessor, capacity: int, pad_token_id: int):
        self.processor, self.capacity, self.pad_token_id = processor, capacity, pad_token_id
        self.left_out: dict[int, tuple[str, str]] = {}
        """Pair index -> (category, detail) of the pairs no pack takes although planned: those the one precomputed
        reference pass could not score (`leave_out`)."""

    def leave_out(self, rows: dict[int, tuple[str, str]]) -> None:
        """Skip (and count as bad records) these pair indices whenever a pack plans them. Set before the loader is
        iterated: its worker processes take a copy of the dataset when an iteration starts."""
        self.left_out = {int(i): why for i, why in rows.items()}

    def __len__(self) -> int:
        raise TypeError("a pack stream has no length")

    def __getitem__(self, key) -> dict:
        g, epoch, j, pair_ids = key
        bad: list = []
        samples, pairs, total = [], [], 0
        for i in pair_ids:
            if int(i) in self.left_out:
                category, detail = self.left_out[int(i)]
                bad.append((*self.processor.halves.locate(2 * int(i)), category, detail))
                continue
            pair = self.processor(i, bad)
            if pair is None:
                continue
            n = len(pair[0]) + len(pair[1])
            if total + n > self.capacity:
                bad.append((pair[0].source, pair[0].index, "length_mismatch",
                            f"{n} tokens do not fit the {self.capacity - total} left in pack {g} "
                            "(planned lengths disagree with processing)"))
                continue
            conflict = vision_shape_conflict(samples, pair[0]) or vision_shape_conflict([*samples, pair[0]], pair[1])
            if conflict:
                bad.append((pair[0].source, pair[0].index, "video", f"{conflict} in pack {g}"))
                continue
            samples += list(pair)
            pairs.append(int(i))
            total += n
        pack = collate_pack(samples) if samples else empty_pack(self.pad_token_id)
        pack["pair_index"] = torch.tensor(pairs, dtype=torch.long)
        pack["num_pairs"] = torch.tensor(len(pairs))
        if samples and any(k in pack for k in VISION_KEYS):  # which rows of each vision tensor are each sequence's
            pack["vision_rows"] = torch.tensor([[0 if getattr(s, k) is None else int(getattr(s, k).shape[0])
                                                 for k in VISION_KEYS] for s in samples], dtype=torch.long)
        pack["_meta"] = {"global_index": g, "epoch": epoch, "index_in_epoch": j, "bad_records": bad,
                         "num_tokens": total}
        return pack


def _prepare(data_cfg: DataConfig, processor: Any, split: str, bad_records: Optional[BadRecordLog],
             split_over_ranks: bool = False):
    data_cfg.validate()
    proc = build_processor(data_cfg, processor)
    bad_records = bad_records if bad_records is not None else BadRecordLog()
    planned = BadRecordLog()  # what every rank finds alike: counted once (keep_planning_records)
    pairs = open_preference_split(data_cfg, split, planned)
    if pairs is None:
        return None
    halves = ResponseHalves(pairs)
    found = BadRecordLog()  # a bad prompt fails both halves: counted once per pair
    lengths, half_classes = compute_lengths_and_classes(
        halves, proc, max_frames=data_cfg.max_frames, limits=MediaLimits.from_config(data_cfg), fps=data_cfg.fps,
        cache_dir=data_cfg.length_cache_dir or None, bad_records=found, num_workers=data_cfg.num_workers,
        split_over_ranks=split_over_ranks)
    planned.extend(found.entries)
    halves_len = lengths.reshape(-1, 2)
    pair_lengths = np.where((halves_len > 0).all(axis=1), halves_len.sum(axis=1), -1).astype(np.int64)
    # both halves hold the prompt's videos (the responses are text): the pair's class is theirs
    hc = half_classes.reshape(-1, 2)
    pair_classes = np.where(hc[:, 0] != 0, hc[:, 0], hc[:, 1])
    cap = data_cfg.max_tokens_per_pack
    for i in np.nonzero(pair_lengths > cap)[0]:
        file, idx = pairs.locate(int(i))
        planned.add(file, idx, "too_long", f"chosen + rejected: {int(pair_lengths[i])} tokens > "
                                           f"max_tokens_per_pack={cap}")
    keep_planning_records(planned, bad_records)
    require_usable(pair_lengths, cap, f"data.{split}", planned)
    dataset = _PairPackDataset(_PairProcessor(halves, proc, data_cfg), cap, proc.pad_token_id)
    return proc, bad_records, pairs, pair_lengths, dataset, pair_classes


def build_preference_dataloader(data_cfg: DataConfig, processor: Any, *, seed: int, dp_rank: int, dp_size: int,
                                split: str = "train", bad_records: Optional[BadRecordLog] = None,
                                split_over_ranks: bool = False) -> SFTDataLoader:
    """Endless packed loader of `split`'s pairs on this rank (module docstring). `split_over_ranks`: every
    rank builds it together, each estimating 1 / world of the lengths (`data.lengths.compute_lengths`)."""
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
    prepared = _prepare(data_cfg, processor, split, bad_records, split_over_ranks=split_over_ranks)
    if prepared is None:
        raise ValueError(f"data: no {split} split configured")
    proc, bad_records, pairs, lengths, dataset, classes = prepared
    planner = PackPlanner(lengths, data_cfg.max_tokens_per_pack, seed=seed,
                          shuffle=data_cfg.shuffle and split == "train", name=f"data.{split}", classes=classes)
    loader = SFTDataLoader(dataset, planner, dp_rank=dp_rank, dp_size=dp_size, num_workers=data_cfg.num_workers,
                           prefetch_factor=data_cfg.prefetch_factor, bad_records=bad_records, split=split,
                           timeout_s=data_cfg.loader_timeout_s, data_files=data_files_of(pairs),
                           plan_settings=plan_settings_of(proc, data_cfg))
    loader.prepared = prepared  # the pairs, their lengths and dataset: a pass over the same split reuses them
    return loader


def build_preference_pass_loader(data_cfg: DataConfig, processor: Any, *, split: str, dp_rank: int, dp_size: int,
                                 bad_records: Optional[BadRecordLog] = None, like=None) -> Optional[EvalDataLoader]:
    """One pass over `split`'s pairs in file order, rank r taking packs r, r + dp, ... (padded with empty
    packs to the same count on every rank); None when the split is not configured. `.num_pairs`: the
    split's rows (the size of a table indexed by `pair_index`); `.planned_lengths`: each row's pair length, -1
    for a row no pack holds (bad or over `max_tokens_per_pack`); `.data_identity`: the files (path, size,
    modification time) or synthetic seed the pairs come from and the processor's token-count settings. `like`: a loader of the same split
    (`build_preference_dataloader`) whose pairs and lengths are reused instead of computed again."""
    prepared = like.prepared if like is not None else _prepare(data_cfg, processor, split, bad_records)
    if prepared is None:
        return None
    proc, bad_records, pairs, lengths, dataset, classes = prepared
    plan = PackPlanner(lengths, data_cfg.max_tokens_per_pack, seed=0, shuffle=False, name=f"data.{split}",
                       classes=classes).plan(0)
    keys = []
    for k in range(math.ceil(len(plan) / dp_size)):
        g = dp_rank + k * dp_size
        keys.append((g, 0, g, tuple(plan[g]) if g < len(plan) else ()))
    loader = EvalDataLoader(dataset, keys, num_workers=data_cfg.num_workers, prefetch_factor=data_cfg.prefetch_factor,
                            bad_records=bad_records, mode="packs", timeout_s=data_cfg.loader_timeout_s)
    loader.num_pairs = len(pairs)
    cap = data_cfg.max_tokens_per_pack
    loader.planned_lengths = np.where((lengths > 0) & (lengths <= cap), lengths, -1)  # -1: not in any pack
    loader.data_identity = {"pairs": pairs.identity(), "processor": proc.identity()}
    return loader
