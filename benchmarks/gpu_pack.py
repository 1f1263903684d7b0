"""One tarball of everything a GPU-suite run wrote, rewritten after every step.

Why: a lease returns results only as a few files, and its time limit can end the run at any moment.
Packing the run folder (logs, benchmark JSON, statuses) and the summary (`<tag>.md` / `.json`) into
`<out>/<tag>.tgz` after each step means a run killed by the limit still hands back all that finished.
The archive is written to a temporary name and renamed, so a kill during packing leaves the previous
complete archive, never a truncated one; `copy_to` (the suite's --tar, e.g. $OUT/res.tgz) gets the
same treatment.
"""
from __future__ import annotations

import os
import shutil
import tarfile
from pathlib import Path
from typing import Optional


def pack(out_dir: Path, tag: str, copy_to: Optional[Path] = None) -> Path:
    """<out_dir>/<tag>.tgz holding <tag>/ (the run folder) and <tag>.md / <tag>.json when written."""
    out_dir = Path(out_dir)
    target = out_dir / f"{tag}.tgz"
    tmp = out_dir / f".{tag}.tgz.partial"
    with tarfile.open(tmp, "w:gz") as tar:
        run_dir = out_dir / tag
        if run_dir.is_dir():
            tar.add(run_dir, arcname=tag)
        for suffix in (".md", ".json"):
            f = out_dir / f"{tag}{suffix}"
            if f.is_file():
                tar.add(f, arcname=f.name)
    os.replace(tmp, target)
    if copy_to is not None:
        copy_to = Path(copy_to)
        copy_to.parent.mkdir(parents=True, exist_ok=True)
        part = copy_to.with_name(f".{copy_to.name}.partial")
        shutil.copyfile(target, part)
        os.replace(part, copy_to)
    return target
