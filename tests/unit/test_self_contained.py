"""The repository explains itself: nothing in code, configs or docs points at documents that live
outside it (the design notes and source documents the project was started from), so a reader of a
clone is never sent to a file they do not have. A reason belongs in place, or in a file of the repo."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# "DESIGN.md", "shared/seeds", "seed 004", "seed 002's", "the seeds'", "phase 1" ...
OUTSIDE = re.compile(r"DESIGN\.md|\bseeds?/|\bseed[ _-]?0\d\d\b|\bthe seeds?'|\bphase[ -]?[12]\b", re.IGNORECASE)


def _tracked_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    if out.returncode == 0 and out.stdout.strip():
        return [REPO / p for p in out.stdout.splitlines()]
    return [p for p in REPO.rglob("*") if p.is_file() and ".git" not in p.parts]


def test_no_reference_to_documents_outside_the_repository():
    hits = []
    this = Path(__file__).resolve()
    for path in _tracked_files():
        if path.resolve() == this or path.suffix not in {".py", ".md", ".toml", ".sh", ".sbatch", ".txt", ".cfg", ".json", ".yaml", ".yml", ".cpp", ".cu", ".h"}:
            continue
        if not path.is_file():
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{path.relative_to(REPO)}:{n}: {line.strip()[:120]}")
    assert not hits, "references to documents outside the repository:\n" + "\n".join(hits[:50])


def test_the_pattern_catches_what_it_should():
    for bad in ("see DESIGN.md §8", "from ../shared/seeds/", "seed 004's metrics", "the seeds' configs", "phase 1 only"):
        assert OUTSIDE.search(bad), bad
    for ok in ("train.seed = 0", "seed_everything(seed)", "a seed of 42", "sampling seeds per rank", "phase timer"):
        assert not OUTSIDE.search(ok), ok
