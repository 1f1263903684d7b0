"""The finished benchmarks of a stopped evaluation job, kept for the job that runs again in its folder.

Why: an evaluation job has no step to save at; a stop (SLURM preemption: exit 143, no results written) or a crash
in its fifth benchmark lost the four it had scored, and the requeued job scored them all again, for hours on a
large model. Now rank 0 writes each benchmark's result to `eval_partial/<name>.json` as soon as it is done, with the
benchmark's fingerprint: every setting that decides it (`eval_settings`: the `[eval]` keys, this benchmark's table
and its place in the list, which seeds its sampling, the `[data]` / `[model]` / `[parallel]` / `[kernels]` keys and the
world size) and the signatures (path, size, modification time) of the files it reads: the model folder's, the
adapter's, the benchmark's data files and the image / video files its rows name by path (`media_signatures`: an image
edited in place, the data file untouched, must not pass for the old one; a stat per file, the rows read once at
start-up by rank 0 only; images stored in the data file itself are covered by its signature). A job in that folder whose benchmark has the same fingerprint takes the
kept result instead of scoring it again; any difference (another model export, an edited file, another key) and the
benchmark is scored anew. The results of a finished job are written as before (report.py), which then removes the
folder: a complete evaluation is never reused, and running one again scores everything.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional

from megatron_vlm.data.data_files import file_signature
from megatron_vlm.durable import write_text_durably
from megatron_vlm.parallel.collectives import all_gather_objects

__all__ = ["PARTIAL_DIR", "folder_signature", "media_signatures", "benchmark_fingerprint", "evaluate_benchmarks_kept"]

PARTIAL_DIR = "eval_partial"


def folder_signature(folder: str) -> list[dict]:
    """The signatures of the files directly in `folder` (a model or adapter folder), sorted; [] for "" or none."""
    if not folder or not Path(folder).is_dir():
        return []
    return [file_signature(p) for p in sorted(Path(folder).iterdir()) if p.is_file()]


def _media_paths(ref: Any) -> list[str]:
    """The local paths an image / video item's value names: a path (a file, or a folder of frames), a list of frame
    paths, or a table Image struct's {"path"} without bytes; none for embedded bytes or a remote URL."""
    if isinstance(ref, dict):
        ref = ref.get("path") if ref.get("bytes") is None else None
    refs = ref if isinstance(ref, (list, tuple)) else [ref]
    return [r for r in refs if isinstance(r, str) and "://" not in r and not r.startswith("data:")]


def _path_signature(path: str) -> Any:
    """A referenced file's signature, a folder's (of frames) files' signatures, or the path marked missing (a row the
    evaluation will count as bad, until the file appears)."""
    p = Path(path)
    if p.is_dir():
        return {"folder": str(p.resolve()), "files": folder_signature(path)}
    try:
        return file_signature(p)
    except OSError:
        return {"file": path, "missing": True}


def media_signatures(source: Any) -> list:
    """The signatures of the image / video files that the records of benchmark `source` (`len`, `get`) name by path,
    sorted by path, each once. A row that does not make a record is passed over: the evaluation counts it."""
    paths: set[str] = set()
    for i in range(len(source)):
        try:
            record = source.get(i)
        except Exception:  # a bad row: counted where the benchmark is scored, not here
            continue
        for m in record.messages:
            for it in m["content"] if isinstance(m["content"], (list, tuple)) else ():
                if it.get("type") in ("image", "video"):
                    paths.update(_media_paths(it.get(it["type"])))
    return [_path_signature(p) for p in sorted(paths)]


def benchmark_fingerprint(settings: dict, index: int, name: str, data_identity: Any, model_path: str,
                          adapter: str = "", media_files: Sequence[Any] = ()) -> str:
    """What benchmark `index` (`name`) of a job with `settings` (eval/settings.py `eval_settings`) depends on, as one
    JSON text (module docstring); `media_files`: its `media_signatures`."""
    common = {k: v for k, v in settings.items() if k != "benchmarks"}
    fp = {"settings": common, "benchmark": settings["benchmarks"][name], "index": index, "data": data_identity,
          "model_files": folder_signature(model_path), "adapter_files": folder_signature(adapter),
          "media_files": list(media_files)}
    return json.dumps(fp, sort_keys=True, default=str)


def _path(run_dir: str | os.PathLike, name: str) -> Path:
    return Path(run_dir) / PARTIAL_DIR / f"{name}.json"


def _load(run_dir: str | os.PathLike, name: str, fingerprint: str) -> Optional[dict]:
    """The kept result of benchmark `name` when its fingerprint is `fingerprint`, else None (none, another one, a
    file that does not read)."""
    try:
        kept = json.loads(_path(run_dir, name).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(kept, dict) or kept.get("fingerprint") != fingerprint or not isinstance(kept.get("result"), dict):
        return None
    return kept["result"]


def _save(run_dir: str | os.PathLike, name: str, fingerprint: str, result: dict) -> None:
    path = _path(run_dir, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_durably(path, json.dumps({"fingerprint": fingerprint, "result": result}, default=str))


def evaluate_benchmarks_kept(run_dir: str | os.PathLike, names: Sequence[str], fingerprints: Sequence[str],
                             evaluate: Callable[[int], dict], *, is_main: bool,
                             on_kept: Optional[Callable[[int, dict], None]] = None) -> list[dict]:
    """The results of benchmarks 0 ... len(names) - 1: each one kept from an earlier job with the same fingerprint
    (rank 0 reads it, every rank gets it: the evaluation is collective, so every rank skips alike), else
    `evaluate(i)`, whose result rank 0 keeps at once (module docstring). `on_kept(i, result)`: told of a kept one."""
    results = []
    for i, (name, fp) in enumerate(zip(names, fingerprints)):
        kept = all_gather_objects(_load(run_dir, name, fp) if is_main else None)[0]
        if kept is not None:
            if on_kept is not None:
                on_kept(i, kept)
            results.append(kept)
            continue
        result = evaluate(i)
        if is_main:
            _save(run_dir, name, fp, result)
        results.append(result)
    return results
