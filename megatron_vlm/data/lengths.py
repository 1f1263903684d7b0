"""Per-sample token lengths for planning packs, computed cheaply and cached.

Every rank plans the same global sequence of packs, so every rank needs every sample's length —
but not its pixels: `estimate_length` renders the chat template, tokenises the text and adds the
image / video token counts from file headers and the processor's resize rule. Records that fail
here (malformed structure, missing image, unreadable header, ...) get length -1 and are logged.

With a cache folder the result is stored under a key made of the source's identity (each file's
path, size and mtime, the column mapping and the image root), the processor (tokenizer, chat template,
the family's size settings: `VLProcessor.identity()`) and the options (max_frames, fps, generation
prompts, pixel caps); a later run (or another rank) loads it instead of recomputing. The key does not
cover the image files themselves, so on a cache hit the records cached as bad (length -1) are estimated
again: an image that was missing (an unfinished copy, a wrong `data.image_root`) and is there now makes
its record usable, instead of the cache skipping it for good. The rest comes from the cache; the cache
is rewritten when a record changed.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Optional

import numpy as np

from megatron_vlm.data.bad_records import BadRecordError, BadRecordLog, unexpected
from megatron_vlm.data.media import DEFAULT_LIMITS, MediaLimits
from megatron_vlm.data.processing import estimate_length
from megatron_vlm.data.processor import VLProcessor

__all__ = ["compute_lengths", "lengths_cache_key"]

log = logging.getLogger("megatron_vlm")


def _source_identity(source) -> dict:
    """The source's files (resolved path, size, mtime) and column mapping: `source.identity()`."""
    return {"name": source.name, "n": len(source), **source.identity()}


def _processor_identity(proc: VLProcessor) -> dict:
    backend = getattr(proc.tokenizer, "backend_tokenizer", None)
    tok = backend.to_str() if backend is not None else repr(sorted(proc.tokenizer.get_vocab().items()))
    return {
        "tokenizer": hashlib.sha256(tok.encode()).hexdigest(),
        "chat_template": hashlib.sha256(proc.chat_template.encode()).hexdigest(),
        "vision": proc.identity(),
    }


def lengths_cache_key(source, proc: VLProcessor, *, max_frames: int, for_generation: bool, fps: float = 2.0,
                      limits: MediaLimits = DEFAULT_LIMITS) -> str:
    blob = json.dumps({"source": _source_identity(source), "processor": _processor_identity(proc),
                       "max_frames": max_frames, "for_generation": for_generation, "fps": float(fps),
                       "limits": limits.identity(), "version": 7},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def compute_lengths(source, proc: VLProcessor, *, max_frames: int, for_generation: bool = False, fps: float = 2.0,
                    cache_dir: str | os.PathLike | None = None,
                    bad_records: Optional[BadRecordLog] = None, limits: MediaLimits = DEFAULT_LIMITS) -> np.ndarray:
    """int64 [len(source)]: token length of each record, -1 for records that cannot be used."""
    cache_file = None
    cached: Optional[np.ndarray] = None
    if cache_dir:
        key = lengths_cache_key(source, proc, max_frames=max_frames, for_generation=for_generation, fps=fps,
                                limits=limits)
        cache_file = Path(cache_dir) / f"lengths-{key}.json"
        if cache_file.is_file():
            try:
                lengths = np.asarray(json.loads(cache_file.read_text())["lengths"], dtype=np.int64)
                if lengths.shape == (len(source),):
                    cached = lengths
            except (json.JSONDecodeError, KeyError, OSError, TypeError, ValueError):
                log.warning("ignoring unreadable length cache %s", cache_file)
    if cached is not None:
        lengths, todo = cached.copy(), np.nonzero(cached < 0)[0].tolist()  # the bad ones only (module docstring)
    else:
        lengths, todo = np.full(len(source), -1, dtype=np.int64), range(len(source))
    bad = []
    for i in todo:
        where = source.locate(i)  # (file, line / row): where a bad record is counted
        try:
            rec = source.get(i)
            lengths[i] = estimate_length(rec, proc, max_frames=max_frames, for_generation=for_generation, fps=fps,
                                         limits=limits)
        except BadRecordError as e:
            bad.append((*where, e.category, e.detail))
        except Exception as e:  # a bug or an unexpected file problem must not stop planning the run
            err = unexpected(e, f"{where[0]}:{where[1]}")
            bad.append((*where, err.category, err.detail))
    if bad_records is not None:
        bad_records.extend(bad)
    if cache_file is not None and (cached is None or not np.array_equal(cached, lengths)):
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_name(f".{cache_file.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"lengths": lengths.tolist(), "bad": bad}))
        os.replace(tmp, cache_file)
    return lengths
