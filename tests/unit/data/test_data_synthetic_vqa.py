"""The synthetic VQA set: deterministic bytes, answers that agree with the pixels (checked by
segmenting the PNGs, independently of the generator), balanced answers so that chance is
1/choices per question type and the blind baseline of a split is the theoretical 0.261, and shapes
that each lie inside one 28x28 quadrant (one merged vision token of the default 56 px canvas)."""
from __future__ import annotations

import json
from collections import Counter, deque

import numpy as np
import pytest
from PIL import Image

from megatron_vlm.data.synthetic_vqa import (
    ANSWERS,
    COLOURS,
    blind_baseline_accuracy,
    normalize_answer,
    write_synthetic_vqa,
)


def _components(img: np.ndarray, with_bbox: bool = False):
    """4-connected components of non-background pixels: list of (colour name, pixel count, bbox area)
    (+ the bbox (y0, x0, y1, x1) inclusive when `with_bbox`)."""
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
            bbox = (min(ys), min(xs), max(ys), max(xs))
            out.append((name, len(pix), area, bbox) if with_bbox else (name, len(pix), area))
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


def _chance() -> float:
    return sum(1 / len(c) for c in ANSWERS.values()) / len(ANSWERS)


def test_answers_are_balanced_so_the_blind_baseline_is_chance(tmp_path):
    # 180 = 3 types x lcm(4, 5, 3): every type a third, every answer of a type equally often
    paths = write_synthetic_vqa(tmp_path, n_train=181, n_eval=180, seed=0)
    records = [json.loads(line) for line in paths["eval"].read_text().splitlines()]
    types = Counter(r["question_type"] for r in records)
    assert types == {q: 60 for q in ANSWERS}
    for qtype, choices in ANSWERS.items():
        freq = Counter(r["answer"] for r in records if r["question_type"] == qtype)
        assert freq == {a: 60 // len(choices) for a in choices}
    assert blind_baseline_accuracy(records) == pytest.approx(47 / 180)  # (15 + 12 + 20) / 180
    assert pytest.approx(_chance()) == 47 / 180
    meta = json.loads(paths["meta"].read_text())
    assert meta["eval_blind_baseline_accuracy"] == pytest.approx(47 / 180)
    assert meta["chance_per_question_type"] == {q: 1 / len(c) for q, c in ANSWERS.items()}
    # a size that is not a multiple of 180: counts within one of each other, baseline close to chance
    train = [json.loads(line) for line in paths["train"].read_text().splitlines()]
    assert len(train) == 181
    for qtype in ANSWERS:
        freq = Counter(r["answer"] for r in train if r["question_type"] == qtype)
        assert max(freq.values()) - min(freq.values()) <= 1
    assert blind_baseline_accuracy(train) == pytest.approx(_chance(), abs=0.01)
    # shuffled: not the generation order (types in turn)
    assert [r["question_type"] for r in records[:6]] != list(ANSWERS)[:3] * 2


def test_the_other_shapes_are_random(tmp_path):
    """Balancing fixes only the asked-about answer: the number of shapes of colour / shape questions
    is uniform, and every colour and kind appears among the other shapes."""
    paths = write_synthetic_vqa(tmp_path, n_train=480, n_eval=0, seed=1)
    records = [json.loads(line) for line in paths["train"].read_text().splitlines()]
    n_shapes = Counter()
    colours, kinds = set(), set()
    for i, r in enumerate(records):
        if r["question_type"] == "count":
            continue
        comps = _components(np.asarray(Image.open(tmp_path / f"images/train_{i:05d}.png").convert("RGB")))
        n_shapes[len(comps)] += 1
        colours |= {c for c, _, _ in comps}
        kinds |= {_shape_from_fill(n, a) for _, n, a in comps}
    total = sum(n_shapes.values())
    assert set(n_shapes) == {1, 2, 3, 4} and all(abs(v / total - 0.25) < 0.07 for v in n_shapes.values())
    assert colours == set(COLOURS) and kinds == {"circle", "square", "triangle"}


def test_each_shape_lies_inside_one_quadrant(tmp_path):
    """On the default 56 px canvas each shape is inside one 28x28 quadrant (a merged vision token),
    roughly centred, never touching the quadrant border; on a larger canvas the quadrants scale."""
    for size in (56, 112):
        write_synthetic_vqa(tmp_path / str(size), n_train=40, n_eval=0, seed=2, image_size=size)
        cell = size // 2
        for i in range(40):
            img = np.asarray(Image.open(tmp_path / str(size) / f"images/train_{i:05d}.png").convert("RGB"))
            for _, _, _, (y0, x0, y1, x1) in _components(img, with_bbox=True):
                row, col = y0 // cell, x0 // cell
                assert y1 // cell == row and x1 // cell == col, (size, i, (y0, x0, y1, x1))
                assert min(y0 - row * cell, x0 - col * cell) >= 1
                assert max(y1 - row * cell, x1 - col * cell) <= cell - 2
                side = max(y1 - y0, x1 - x0) + 1
                assert 0.6 * cell <= side <= 0.9 * cell
                centre = ((y0 + y1) / 2 - row * cell, (x0 + x1) / 2 - col * cell)
                assert all(abs(c - (cell - 1) / 2) <= 2 for c in centre)


def test_generate_sample_rejects_bad_requests():
    import random

    from megatron_vlm.data.synthetic_vqa import generate_sample

    with pytest.raises(ValueError, match="question_type"):
        generate_sample(random.Random(0), question_type="size")
    with pytest.raises(ValueError, match="'orange'"):
        generate_sample(random.Random(0), question_type="colour_of_shape", answer="orange")
    img, ann = generate_sample(random.Random(0), question_type="count", answer="3")
    assert ann["answer"] == "3" and len(ann["shapes"]) == 3 and img.size == (56, 56)


def test_normalize_answer():
    assert normalize_answer("  Red.\n") == "red"
    assert normalize_answer("3 shapes") == "3"
    assert normalize_answer("") == ""
