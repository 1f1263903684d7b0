"""A synthetic visual question-answering set whose answers can only come from the image.

Each image is a small canvas (56x56 by default, so a tiny vision tower is fast) with 1-4 filled
shapes, one per quadrant, each of one of 5 colours and 3 kinds, centred in its quadrant: with the
default canvas a quadrant is exactly one merged vision token of Qwen2.5-VL (2x2 patches of 14 px),
so every shape is seen whole by one token. Three question types, each with a small closed answer set:

    count            "How many shapes are there?"     -> "1" | "2" | "3" | "4"                 chance 1/4
    colour_of_shape  "What colour is the <shape>?"    -> red | green | blue | yellow | purple  chance 1/5
    shape_of_colour  "What shape is <colour>?"        -> circle | square | triangle            chance 1/3

The asked-about shape kind / colour occurs exactly once in the image, so every question has one
right answer. The text alone carries no information about the answer, so a blind model cannot beat
`blind_baseline_accuracy(records)` (the best guess per question type from the answer frequencies).
Splits are balanced: each question type gets a third of the samples and, within a type, each
answer the same number (+-1), in shuffled order; so the blind baseline of a split is the
theoretical (1/4 + 1/5 + 1/3) / 3 = 0.261 (exactly so when its size is a multiple of 180), not an
optimistic estimate inflated by the sampling noise of a small split. Everything is a pure function
of (seed, sizes, image_size): the same call writes the same bytes.

`write_synthetic_vqa` writes PNGs under images/ and train.jsonl / eval.jsonl in the messages format
(see data/messages.py), plus "question_type" and "answer" fields used by evaluation. Files are written
atomically and meta.json last, so several ranks may call it on the same folder at once.
"""
from __future__ import annotations

import io
import json
import os
import random
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from PIL import Image, ImageDraw

__all__ = [
    "COLOURS", "SHAPES", "QUESTION_TYPES", "ANSWERS", "VOCABULARY_WORDS",
    "generate_sample", "write_synthetic_vqa", "blind_baseline_accuracy", "normalize_answer",
]

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 230),
    "yellow": (235, 210, 40),
    "purple": (150, 60, 190),
}
SHAPES = ("circle", "square", "triangle")
QUESTION_TYPES = ("count", "colour_of_shape", "shape_of_colour")
ANSWERS: dict[str, tuple[str, ...]] = {
    "count": ("1", "2", "3", "4"),
    "colour_of_shape": tuple(COLOURS),
    "shape_of_colour": SHAPES,
}
_BACKGROUND = (245, 245, 245)
_SPLIT_STREAM = {"train": 0, "eval": 1}

# Words of the task: the tiny tokenizer is trained on them so that questions and answers are short.
VOCABULARY_WORDS = (
    list(COLOURS) + list(SHAPES)
    + ["What", "colour", "shape", "is", "the", "How", "many", "shapes", "are", "there", "?"]
    + list(ANSWERS["count"])
)


def _question(qtype: str, subject: str = "") -> str:
    if qtype == "count":
        return "How many shapes are there?"
    if qtype == "colour_of_shape":
        return f"What colour is the {subject}?"
    return f"What shape is {subject}?"


def _draw_shape(draw: ImageDraw.ImageDraw, kind: str, box: tuple[int, int, int, int], rgb) -> None:
    x0, y0, x1, y1 = box
    if kind == "circle":
        draw.ellipse(box, fill=rgb)
    elif kind == "square":
        draw.rectangle(box, fill=rgb)
    else:
        draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=rgb)


def _shape_box(rng: random.Random, cell: int, col: int, row: int) -> tuple[int, int, int, int]:
    """Bounding box of a shape in quadrant (col, row): centred in the quadrant (+-1 px), side 64-86%
    of it, at least 1 px from the quadrant's border so that no two shapes touch. With the default
    56 px canvas a quadrant is exactly one 28x28 merged vision token (2x2 patches of 14 px), so each
    shape is seen whole by one token and split evenly over its four patches."""
    side = rng.randint(round(0.64 * cell), round(0.86 * cell))
    centred = (cell - side) // 2
    ox = col * cell + min(max(centred + rng.randint(-1, 1), 1), cell - side - 1)
    oy = row * cell + min(max(centred + rng.randint(-1, 1), 1), cell - side - 1)
    return ox, oy, ox + side - 1, oy + side - 1


def generate_sample(rng: random.Random, image_size: int = 56, *, question_type: str | None = None,
                    answer: str | None = None) -> tuple[Image.Image, dict]:
    """One (image, annotation) pair; annotation has question_type, question, answer, shapes.

    The question type and the answer are drawn uniformly unless given (the split writer passes
    them to balance the answers exactly); the number of shapes is uniform in 1-4 (it is the answer
    of a count question). The other shapes are drawn so that the asked-about kind (or colour)
    occurs exactly once.
    """
    qtype = question_type if question_type is not None else rng.choice(QUESTION_TYPES)
    if qtype not in ANSWERS:
        raise ValueError(f"question_type must be one of {QUESTION_TYPES}, got {qtype!r}")
    if answer is not None and answer not in ANSWERS[qtype]:
        raise ValueError(f"answer {answer!r} is not a possible answer of {qtype!r}: {ANSWERS[qtype]}")
    colour_names = list(COLOURS)
    if qtype == "count":
        n = int(answer) if answer is not None else rng.randint(1, 4)
        shapes = [(rng.choice(SHAPES), rng.choice(colour_names)) for _ in range(n)]
        question, answer = _question(qtype), str(n)
    elif qtype == "colour_of_shape":
        n = rng.randint(1, 4)
        kind, colour = rng.choice(SHAPES), answer if answer is not None else rng.choice(colour_names)
        others = [k for k in SHAPES if k != kind]
        shapes = [(kind, colour)] + [(rng.choice(others), rng.choice(colour_names)) for _ in range(n - 1)]
        question, answer = _question(qtype, kind), colour
    else:
        n = rng.randint(1, 4)
        kind, colour = answer if answer is not None else rng.choice(SHAPES), rng.choice(colour_names)
        others = [c for c in colour_names if c != colour]
        shapes = [(kind, colour)] + [(rng.choice(SHAPES), rng.choice(others)) for _ in range(n - 1)]
        question, answer = _question(qtype, colour), kind
    quadrants = rng.sample(range(4), n)

    img = Image.new("RGB", (image_size, image_size), _BACKGROUND)
    draw = ImageDraw.Draw(img)
    cell = image_size // 2
    for q, (kind, colour) in zip(quadrants, shapes):
        box = _shape_box(rng, cell, q % 2, q // 2)
        _draw_shape(draw, kind, box, COLOURS[colour])
    ann = {"question_type": qtype, "question": question, "answer": answer,
           "shapes": [{"kind": k, "colour": c, "quadrant": q} for (k, c), q in zip(shapes, quadrants)]}
    return img, ann


def _record(image_rel: str, ann: dict) -> dict:
    return {
        "messages": [
            {"role": "user", "content": [{"type": "image", "image": image_rel},
                                         {"type": "text", "text": ann["question"]}]},
            {"role": "assistant", "content": ann["answer"]},
        ],
        "question_type": ann["question_type"],
        "answer": ann["answer"],
    }


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _balanced_plan(rng: random.Random, n: int) -> list[tuple[str, str]]:
    """(question_type, answer) for n samples: types in turn, each type's answers in turn, then shuffled.

    Every question type gets n/3 samples (+-1) and, within a type, every answer the same count (+-1),
    so the blind baseline of even a small split is the theoretical one."""
    plan = []
    for t, qtype in enumerate(QUESTION_TYPES):
        choices = ANSWERS[qtype]
        per_type = n // len(QUESTION_TYPES) + (1 if t < n % len(QUESTION_TYPES) else 0)
        plan += [(qtype, choices[i % len(choices)]) for i in range(per_type)]
    rng.shuffle(plan)
    return plan


def _split_records(out: Path, split: str, n: int, seed: int, image_size: int) -> list[dict]:
    rng = random.Random(seed * 1_000_003 + _SPLIT_STREAM[split])
    records = []
    for i, (qtype, answer) in enumerate(_balanced_plan(rng, n)):
        img, ann = generate_sample(rng, image_size, question_type=qtype, answer=answer)
        rel = f"images/{split}_{i:05d}.png"
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        _atomic_write_bytes(out / rel, buf.getvalue())
        records.append(_record(rel, ann))
    return records


def write_synthetic_vqa(out_dir: str | os.PathLike, n_train: int, n_eval: int, seed: int = 0,
                        image_size: int = 56) -> dict[str, Path]:
    """Write the set into `out_dir`; returns {"train": path, "eval": path, "meta": path}.

    Skips the work when `out_dir/meta.json` already records the same parameters.
    """
    if n_train <= 0 or n_eval < 0:
        raise ValueError(f"n_train must be > 0 and n_eval >= 0, got {n_train}, {n_eval}")
    if image_size < 28:
        raise ValueError(f"image_size must be >= 28, got {image_size}")
    out = Path(out_dir)
    paths = {"train": out / "train.jsonl", "eval": out / "eval.jsonl", "meta": out / "meta.json"}
    params = {"n_train": n_train, "n_eval": n_eval, "seed": seed, "image_size": image_size, "version": 2}
    if paths["meta"].is_file():
        try:
            if json.loads(paths["meta"].read_text()).get("params") == params:
                return paths
        except (json.JSONDecodeError, OSError):
            pass
    (out / "images").mkdir(parents=True, exist_ok=True)
    meta = {"params": params}
    for split, n in (("train", n_train), ("eval", n_eval)):
        records = _split_records(out, split, n, seed, image_size)
        text = "".join(json.dumps(r) + "\n" for r in records)
        _atomic_write_bytes(paths[split], text.encode())
        meta[f"{split}_blind_baseline_accuracy"] = blind_baseline_accuracy(records) if records else None
    meta["chance_per_question_type"] = {q: 1.0 / len(a) for q, a in ANSWERS.items()}
    _atomic_write_bytes(paths["meta"], (json.dumps(meta, indent=2) + "\n").encode())
    return paths


def blind_baseline_accuracy(records: Iterable[dict]) -> float:
    """Accuracy of the best image-blind strategy: per question type, always answer its most frequent
    answer. This is "chance" for this set (≈ 1/num_choices per type, since answers are ~uniform)."""
    by_type: dict[str, Counter] = {}
    n = 0
    for r in records:
        by_type.setdefault(r["question_type"], Counter())[r["answer"]] += 1
        n += 1
    if n == 0:
        raise ValueError("blind_baseline_accuracy: no records")
    return sum(c.most_common(1)[0][1] for c in by_type.values()) / n


_SENTENCE_PUNCT = re.compile(r"!|(?<!\d)[.,]|[.,](?!\d)")
"""`!`, and `.` / `,` unless between two digits: "Red." -> "Red", "3.5" stays "3.5" (not "3", which would
make 3.5 and 3.7 the same answer), "1,000" stays."""


def normalize_answer(text: str) -> str:
    """Lower-case first word without sentence punctuation (`. , !`, but not the decimal point or digit
    group separator of a number): how a generated answer is compared to the truth."""
    words = _SENTENCE_PUNCT.sub(" ", text.strip().lower()).split()
    return words[0] if words else ""
