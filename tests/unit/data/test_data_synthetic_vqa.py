"""The synthetic VQA set: deterministic bytes, answers that agree with the pixels (checked by
segmenting the PNGs, independently of the generator), near-uniform answers so chance is 1/choices."""
from __future__ import annotations

import json
from collections import Counter, deque

import numpy as np
import pytest
from PIL import Image

from megatron_vlm.data.synthetic_vqa import (
    ANSWERS, COLOURS, blind_baseline_accuracy, normalize_answer, write_synthetic_vqa,
)


def _components(img: np.ndarray):
    """4-connected components of non-background pixels: list of (colour name, pixel count, bbox area)."""
    h, w, _ = img.shape
    bg = img[0, 0]
    seen = np.zeros((h, w), dtype=bool)
    out = []
    for y in range(h):
        for x in range(w):
            if seen[y, x] or (img[y, x] == bg).all():
                continue
            q, pix = deque([(y, x)]), []
            seen[y, x] = True
            while q:
                cy, cx = q.popleft()
                pix.append((cy, cx))
                for ny, nx in ((cy + 1, cx), (cy - 1, cx), (cy, cx + 1), (cy, cx - 1)):
                    if 0 <= ny < h and 0 <= nx < w and not seen[ny, nx] and not (img[ny, nx] == bg).all():
                        seen[ny, nx] = True
                        q.append((ny, nx))
            ys, xs = zip(*pix)
            rgb = img[ys[len(ys) // 2], xs[len(xs) // 2]]
            name = min(COLOURS, key=lambda c: int(np.abs(np.array(COLOURS[c]) - rgb).sum()))
            area = (max(ys) - min(ys) + 1) * (max(xs) - min(xs) + 1)
            out.append((name, len(pix), area))
    return out


def _shape_from_fill(pixels: int, bbox_area: int) -> str:
    fill = pixels / bbox_area  # square ~1.0, circle ~pi/4, triangle ~1/2
    return "square" if fill > 0.9 else "circle" if fill > 0.66 else "triangle"


def test_answers_agree_with_the_pixels(tmp_path):
    paths = write_synthetic_vqa(tmp_path, n_train=60, n_eval=12, seed=3)
    for split in ("train", "eval"):
        records = [json.loads(line) for line in paths[split].read_text().splitlines()]
        assert len(records) == (60 if split == "train" else 12)
        for r in records:
            user, assistant = r["messages"]
            img_rel = user["content"][0]["image"]
            question = user["content"][1]["text"]
            assert assistant["content"] == r["answer"] and r["answer"] in ANSWERS[r["question_type"]]
            comps = _components(np.asarray(Image.open(tmp_path / img_rel).convert("RGB")))
            if r["question_type"] == "count":
                assert question == "How many shapes are there?"
                assert len(comps) == int(r["answer"])
            elif r["question_type"] == "colour_of_shape":
                kind = question.removeprefix("What colour is the ").removesuffix("?")
                matches = [c for c, n, a in comps if _shape_from_fill(n, a) == kind]
                assert matches == [r["answer"]]
            else:
                colour = question.removeprefix("What shape is ").removesuffix("?")
                matches = [_shape_from_fill(n, a) for c, n, a in comps if c == colour]
                assert matches == [r["answer"]]


def test_deterministic_bytes_and_skip_when_present(tmp_path):
    a = write_synthetic_vqa(tmp_path / "a", 20, 5, seed=7)
    b = write_synthetic_vqa(tmp_path / "b", 20, 5, seed=7)
    assert a["train"].read_bytes() == b["train"].read_bytes()
    for i in range(20):
        assert (tmp_path / "a/images" / f"train_{i:05d}.png").read_bytes() == \
               (tmp_path / "b/images" / f"train_{i:05d}.png").read_bytes()
    c = write_synthetic_vqa(tmp_path / "c", 20, 5, seed=8)
    assert c["train"].read_bytes() != a["train"].read_bytes()
    mtime = a["train"].stat().st_mtime_ns
    write_synthetic_vqa(tmp_path / "a", 20, 5, seed=7)  # same parameters: nothing rewritten
    assert a["train"].stat().st_mtime_ns == mtime


def test_answers_are_near_uniform_so_chance_is_well_defined(tmp_path):
    paths = write_synthetic_vqa(tmp_path, n_train=1500, n_eval=0, seed=0)
    records = [json.loads(line) for line in paths["train"].read_text().splitlines()]
    types = Counter(r["question_type"] for r in records)
    assert set(types) == set(ANSWERS) and min(types.values()) > 400
    for qtype, choices in ANSWERS.items():
        freq = Counter(r["answer"] for r in records if r["question_type"] == qtype)
        n = sum(freq.values())
        assert set(freq) == set(choices)
        assert max(freq.values()) / n < 1.0 / len(choices) + 0.06
    chance = sum(1 / len(c) for c in ANSWERS.values()) / 3
    assert blind_baseline_accuracy(records) == pytest.approx(chance, abs=0.04)
    meta = json.loads(paths["meta"].read_text())
    assert meta["chance_per_question_type"]["count"] == 0.25


def test_normalize_answer():
    assert normalize_answer("  Red.\n") == "red"
    assert normalize_answer("3 shapes") == "3"
    assert normalize_answer("") == ""
