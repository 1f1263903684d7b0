"""Bad data records: skipped, counted and summarised, never fatal.

A long run must not die on record 812,345 because one image is truncated. Every stage that finds a
problem with one record (malformed JSON, a missing or corrupt image, placeholder / feature count
mismatch, a sample longer than the pack budget, ...) raises `BadRecordError`; the caller catches
it, adds it to a `BadRecordLog` with the record's file and line (JSONL, 1-based) or row index (HF
datasets, 0-based) and goes on. `write_summary` writes the log as JSON (or text for a `.txt` path)
at the end of the run.

Records that fail at processing time fail again in every epoch; the log keeps one entry per
(source, index, category) and counts how often it was skipped.

An exception that is not a `BadRecordError` (a bug in a processor, a library raising something
unexpected for one odd file) must not stop the run either, but must not vanish: `unexpected(e)`
turns it into a BadRecordError("unexpected_error", "<type>: <message>") and logs the first one per
process as a warning with its traceback.
"""
from __future__ import annotations

import json
import logging
import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_vlm.durable import write_text_durably

__all__ = ["BadRecord", "BadRecordError", "BadRecordLog", "CATEGORIES", "unexpected", "keep_planning_records",
           "merge_by_shard"]

log = logging.getLogger("megatron_vlm")

CATEGORIES = (
    "malformed_json",        # the line is not a JSON object
    "invalid_record",        # JSON is fine but the messages structure is not (roles, content items, ...)
    "missing_image",         # an image / frame file does not exist
    "corrupt_image",         # the file exists but cannot be decoded
    "video",                 # a video cannot be decoded or its frames disagree in size
    "placeholder_mismatch",  # placeholder tokens in the text vs images / videos / features disagree
    "too_long",              # the sample alone exceeds max_tokens_per_pack
    "length_mismatch",       # planned (estimated) and processed lengths disagree; the pack would overflow
    "invalid_encoding",      # the line is not valid UTF-8
    "image_too_large",       # an image / frame header declares more pixels than data.max_image_pixels
    "video_too_large",       # a video's sampled frames x pixels exceed data.max_video_pixels
    "timeout",               # decoding took longer than data.video_decode_timeout_s
    "unsupported_shape",     # an image shape the model's processor refuses (Qwen-VL: aspect ratio over 200;
                             # Nemotron-VL: a side that scales to 0 patches)
    "unexpected_error",      # any other exception while reading one record (type and message in the detail)
    "reference_unscored",    # DPO: the precomputed reference pass could not score the pair (it failed there)
)


class BadRecordError(Exception):
    """Raised for a record that must be skipped; `category` is one of CATEGORIES."""

    def __init__(self, category: str, detail: str):
        if category not in CATEGORIES:
            raise ValueError(f"unknown bad-record category {category!r}; expected one of {CATEGORIES}")
        super().__init__(f"{category}: {detail}")
        self.category = category
        self.detail = detail

    def __reduce__(self):
        # pickled into (and out of) DataLoader workers: rebuilt from its two fields, not from the message
        return (BadRecordError, (self.category, self.detail))


_warned_unexpected = False


def unexpected(err: BaseException, where: str = "") -> BadRecordError:
    """`err` (not a BadRecordError) as a BadRecordError("unexpected_error", ...) naming its type and
    message; the first one in this process is logged as a warning with its traceback, since it may
    be a bug rather than bad data. `where` (e.g. "file:line") goes into that warning."""
    global _warned_unexpected
    if isinstance(err, BadRecordError):
        return err
    detail = f"{type(err).__name__}: {err}"[:500]
    if not _warned_unexpected:
        _warned_unexpected = True
        log.warning("record %s failed with an unexpected %s (counted as a bad record 'unexpected_error'; further "
                    "ones are only counted): %s", where or "?", type(err).__name__, err,
                    exc_info=(type(err), err, err.__traceback__))
    return BadRecordError("unexpected_error", detail)


@dataclass(frozen=True)
class BadRecord:
    source: str
    """The data file (or dataset path) the record came from."""
    index: int
    """1-based line number for JSONL files, 0-based row index for HF datasets."""
    category: str
    detail: str

    def __str__(self) -> str:
        return f"{self.source}:{self.index}: {self.category}: {self.detail}"


class BadRecordLog:
    """Collects skipped records; one entry per (source, index, category), with a skip count."""

    def __init__(self) -> None:
        self._entries: dict[tuple[str, int, str], BadRecord] = {}
        self._skips: Counter = Counter()

    def add(self, source: str, index: int, category: str, detail: str, skips: int = 1) -> BadRecord:
        rec = BadRecord(str(source), int(index), category, detail)
        key = (rec.source, rec.index, rec.category)
        self._entries.setdefault(key, rec)
        self._skips[key] += int(skips)
        return rec

    def add_error(self, source: str, index: int, err: BadRecordError) -> BadRecord:
        return self.add(source, index, err.category, err.detail)

    def extend(self, records: Iterable[BadRecord | tuple | dict]) -> None:
        """Merge records from another log (e.g. gathered from other ranks or worker processes). A dict
        may carry "skips" (as `to_dict()["records"]` does): the merged log then counts that many."""
        for r in records:
            skips = 1
            if isinstance(r, dict):
                r = dict(r)
                skips = int(r.pop("skips", 1))
                r = BadRecord(**r)
            elif isinstance(r, tuple):
                r = BadRecord(*r)
            self.add(r.source, r.index, r.category, r.detail, skips=skips)

    @property
    def entries(self) -> list[BadRecord]:
        return sorted(self._entries.values(), key=lambda r: (r.source, r.index, r.category))

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: tuple[str, int]) -> bool:
        return any(k[:2] == tuple(key) for k in self._entries)

    @property
    def total_skips(self) -> int:
        return sum(self._skips.values())

    def counts_by_category(self) -> dict[str, int]:
        return dict(sorted(Counter(k[2] for k in self._entries).items()))

    def to_dict(self) -> dict:
        return {
            "num_bad_records": len(self),
            "num_skips": self.total_skips,
            "by_category": self.counts_by_category(),
            "records": [
                {**asdict(r), "skips": self._skips[(r.source, r.index, r.category)]} for r in self.entries
            ],
        }

    def remove(self, records: Iterable[BadRecord | tuple]) -> None:
        """Take back skips `extend` counted (one each): the records of packs a loader put back unused
        (`SFTDataLoader.rewind`), which a resumed run reads and counts again. An entry left with no skip goes."""
        for r in records:
            r = r if isinstance(r, BadRecord) else BadRecord(*r)
            key = (str(r.source), int(r.index), r.category)
            if self._skips[key] <= 1:
                self._entries.pop(key, None)
                self._skips.pop(key, None)
            else:
                self._skips[key] -= 1

    def take(self) -> list[dict]:
        """The records (as `to_dict()["records"]`, with their skip counts), leaving the log empty: what was found
        since the last `take`, handed to another process's log (an asynchronous GRPO rollout rank's prompt skips
        go to the trainer with each step's samples, so they are counted in the checkpoint of the step they
        belong to)."""
        records = self.to_dict()["records"]
        self._entries.clear()
        self._skips.clear()
        return records

    def write_summary(self, path: str | os.PathLike) -> Path:
        """Write the log (JSON, or plain text when `path` ends in .txt); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".txt":
            d = self.to_dict()
            lines = [f"{d['num_bad_records']} bad records skipped ({d['num_skips']} skips)"]
            lines += [f"  {k}: {v}" for k, v in d["by_category"].items()]
            lines += [str(r) for r in self.entries]
            text = "\n".join(lines) + "\n"
        else:
            text = json.dumps(self.to_dict(), indent=2) + "\n"
        write_text_durably(path, text)  # a full disk leaves no half-written temporary file in the run folder
        return path


def keep_planning_records(found: BadRecordLog, into: BadRecordLog) -> None:
    """Add the bad records found while opening and planning a split (`found`) to the run's log `into` on
    global rank 0 only. Every rank opens and plans the whole split, so every rank finds the same ones;
    the run's summary gathers all ranks' logs and adds their skip counts, which counted a missing image
    once per rank (skips 8 on 8 GPUs). Records that fail while a pack is processed are found by the rank
    that processed it and stay in its own log."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        into.extend(found.to_dict()["records"])


def merge_by_shard(gathered: Iterable[tuple[int | None, list]]) -> BadRecordLog:
    """One log from every rank's (data-parallel rank, `to_dict()["records"]`), gathered in rank order. Ranks
    that share a data-parallel rank (tp / cp ranks, pp stages) process the same samples and log the same
    skips: the first of them counts; a None shard always counts."""
    merged = BadRecordLog()
    seen: set[int] = set()
    for shard, records in gathered:
        if shard is not None:
            if shard in seen:
                continue
            seen.add(shard)
        merged.extend(records)
    return merged
