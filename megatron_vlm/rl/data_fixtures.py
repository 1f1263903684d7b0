"""Write small Geometry3K- and ViRL39K-schema files (tests, demos, benchmarks; nothing is downloaded).

Each row is a tiny generated picture plus a question whose reference answer is in the style of the
release: Geometry3K answers are LaTeX values ("3\\sqrt{3}", "\\frac{40}{3}", "67.5"); ViRL39K answers
are boxed ("\\boxed{12}", "\\boxed{B}") and multiple-choice questions list their options. The files
use the public column names and storage layouts:

    geometry3k: parquet, `images` = list of {bytes: PNG, path: str} structs (the Hugging Face Image
                feature), `problem` starting with "<image>", `answer`
    virl39k:    parquet, `image` = list of paths relative to the release folder ("images/xxx.png",
                the files written next to the parquet), `question`, `answer`, `qid`, `category`,
                `source`, `PassRate_32BTrained`, `PassRate_7BBase`
"""
from __future__ import annotations

import io
import os
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageDraw

__all__ = ["write_geometry3k_fixture", "write_virl39k_fixture", "GEOMETRY3K_ANSWERS"]

GEOMETRY3K_ANSWERS = ["3\\sqrt{3}", "\\frac{40}{3}", "67.5", "12", "2\\sqrt{221}", "60", "\\frac{\\sqrt{3}}{2}", "8.5"]
_GEO_PROBLEMS = [
    "<image>Find x.",
    "<image>Find the area of the triangle. Round to the nearest tenth if necessary.",
    "<image>Find m \\angle 2.",
    "<image>In \\odot P, find the length of \\widehat{RT}.",
]


def _png(seed: int, size: int = 56) -> bytes:
    rng = random.Random(seed)
    img = Image.new("RGB", (size, size), (245, 245, 245))
    d = ImageDraw.Draw(img)
    pts = [(rng.randint(2, size - 3), rng.randint(2, size - 3)) for _ in range(3)]
    d.polygon(pts, outline=(20, 20, 20))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _write_parquet(rows: list[dict], path: Path) -> None:
    pq.write_table(pa.Table.from_pylist(rows), path)


def write_geometry3k_fixture(out_dir: str | os.PathLike, n: int = 8, seed: int = 0, *, split: str = "train") -> Path:
    """Write `<out_dir>/<split>.parquet` with n Geometry3K-schema rows; returns its path."""
    if n < 1:
        raise ValueError(f"n: must be >= 1, got {n}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        rows.append({
            "images": [{"bytes": _png(seed * 7919 + i), "path": f"{split}_{i}.png"}],
            "problem": rng.choice(_GEO_PROBLEMS),
            "answer": GEOMETRY3K_ANSWERS[i % len(GEOMETRY3K_ANSWERS)],
        })
    path = out / f"{split}.parquet"
    _write_parquet(rows, path)
    return path


def write_virl39k_fixture(out_dir: str | os.PathLike, n: int = 8, seed: int = 0) -> Path:
    """Write `<out_dir>/39Krelease.parquet` and `<out_dir>/images/*.png` (n ViRL39K-schema rows, a mix of
    free-form and multiple-choice questions, one with two images); returns the parquet path."""
    if n < 1:
        raise ValueError(f"n: must be >= 1, got {n}")
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        n_img = 2 if i % 5 == 4 else 1
        rels = []
        for k in range(n_img):
            rel = f"images/Processed-{seed}-{i}-{k}.png"
            (out / rel).write_bytes(_png(seed * 104729 + i * 7 + k))
            rels.append(rel)
        if n_img == 2:
            question = "<image>\n<image>\nHow many more triangles are in the second figure than in the first?"
            answer = f"\\boxed{{{rng.randint(1, 5)}}}"
            category = "Spatial Reasoning"
        elif i % 3 == 1:
            question = "<image>Which length is AB?\nChoices:\n(A) 3\n(B) 5\n(C) 7\n(D) 9"
            answer = "\\boxed{" + "ABCD"[i % 4] + "}"
            category = "(GradeSchool) Geometric"
        else:
            question = "<image>What is the value of x in the figure? Express your answer as a fraction."
            answer = "\\boxed{\\frac{" + str(rng.randint(1, 9)) + "}{" + str(rng.randint(10, 19)) + "}}"
            category = "(GradeSchool) Non-Geo Math"
        rows.append({
            "question": question,
            "answer": answer,
            "PassRate_32BTrained": round(rng.random(), 3),
            "PassRate_7BBase": round(rng.random(), 3),
            "category": category,
            "source": "fixture",
            "qid": f"fixture-{seed}-{i}",
            "image": rels,
        })
    path = out / "39Krelease.parquet"
    _write_parquet(rows, path)
    return path
