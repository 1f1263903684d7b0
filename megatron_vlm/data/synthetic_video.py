"""A synthetic multi-frame video question-answering set for the tiny video curriculum demo
(`launch/configs/demo_internvl_video.toml`), laid out like the RoboVQA recipe's preprocessed data.

Why: the RoboVQA curriculum (16-frame clips, stage 1 = one question per sample, stage 2 = all
questions of a clip as one multi-turn conversation, frames stored once and shared by both stages)
needs a task a tiny model learns on a CPU in minutes and that can only be answered from the frames —
one question needs a single frame, the other needs their order:

    colour     "What colour is the moving square?"   -> red | green | blue | yellow     (any frame)
    direction  "Which way does the square move?"     -> left | right | up | down        (frame order)

Each clip is `num_frames` (16) frames of a `size` x `size` canvas with one square that moves in a
straight line across it. Layout (paths relative to the folder, which is the configs' `image_root`):

    images/<clip>/<frame>.png       16 frames per clip, written once
    stage1/train.jsonl, val.jsonl   one question per record: [{"type": "video", "video": [frames]},
                                    {"type": "text", question}] -> answer (clips x 2 records)
    stage2/train.jsonl, val.jsonl   one conversation per clip: the frames in the first user turn,
                                    both questions, text-only second turn
    meta.json                       the parameters (written last; a folder with the same is kept)

Records carry "question_type" and "answer" (used by the per-type answer accuracy). Everything is a
pure function of the parameters; several ranks may call `write_synthetic_video` at once (atomic writes).

    python -m megatron_vlm.data.synthetic_video runs/demo_assets/synthetic_video
"""
from __future__ import annotations

import argparse
import io
import json
import os
import random
from pathlib import Path

from PIL import Image, ImageDraw

__all__ = ["COLOURS", "DIRECTIONS", "clip_frames", "write_synthetic_video"]

COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (50, 80, 230), "yellow": (230, 210, 40)}
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
QUESTIONS = {"colour": "What colour is the moving square?", "direction": "Which way does the square move?"}
_VERSION = 1


def clip_frames(colour: str, direction: str, *, num_frames: int = 16, size: int = 56, offset: int = 0) -> list[Image.Image]:
    """The frames of one clip: a square of `colour` crossing the canvas in `direction`; `offset`
    shifts its lane (perpendicular to the motion) so clips of one class differ."""
    side = max(4, size // 5)
    dx, dy = DIRECTIONS[direction]
    span = size - side
    lane = (size - side) // 2 + offset
    frames = []
    for t in range(num_frames):
        pos = round(span * t / max(1, num_frames - 1))
        along = pos if (dx + dy) > 0 else span - pos
        x, y = (along, lane) if dx else (lane, along)
        im = Image.new("RGB", (size, size), (245, 245, 245))
        ImageDraw.Draw(im).rectangle([x, y, x + side - 1, y + side - 1], fill=COLOURS[colour])
        frames.append(im)
    return frames


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    if path.is_file() and path.read_bytes() == data:
        return
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _png(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def _clips(n: int, rng: random.Random, size: int) -> list[tuple[str, str, int]]:
    """Balanced (colour, direction) classes in shuffled order, each with a random lane offset."""
    classes = [(c, d) for c in COLOURS for d in DIRECTIONS]
    out = [classes[i % len(classes)] for i in range(n)]
    rng.shuffle(out)
    reach = max(0, size // 4)
    return [(c, d, rng.randint(-reach, reach)) for c, d in out]


def write_synthetic_video(out_dir: str | os.PathLike, *, train_clips: int = 256, val_clips: int = 32,
                          num_frames: int = 16, size: int = 56, seed: int = 0) -> dict[str, Path]:
    """Write the set (module docstring); returns {"stage1_train", "stage1_val", "stage2_train",
    "stage2_val", "meta"} paths. Does nothing when meta.json records the same parameters."""
    if train_clips <= 0 or val_clips < 0 or num_frames < 2 or size < 28:
        raise ValueError(f"need train_clips > 0, val_clips >= 0, num_frames >= 2, size >= 28; got {train_clips}, "
                         f"{val_clips}, {num_frames}, {size}")
    out = Path(out_dir)
    params = {"train_clips": train_clips, "val_clips": val_clips, "num_frames": num_frames, "size": size, "seed": seed,
              "version": _VERSION}
    paths = {f"stage{s}_{split}": out / f"stage{s}" / f"{split}.jsonl" for s in (1, 2) for split in ("train", "val")}
    paths["meta"] = out / "meta.json"
    try:
        if json.loads(paths["meta"].read_text()).get("params") == params:
            return paths
    except (OSError, json.JSONDecodeError):
        pass
    rng = random.Random(seed)
    for s in (1, 2):
        (out / f"stage{s}").mkdir(parents=True, exist_ok=True)
    for split, n in (("train", train_clips), ("val", val_clips)):
        stage1, stage2 = [], []
        for k, (colour, direction, offset) in enumerate(_clips(n, rng, size)):
            clip = f"{split}_{k:05d}"
            folder = out / "images" / clip
            folder.mkdir(parents=True, exist_ok=True)
            frames = []
            for t, im in enumerate(clip_frames(colour, direction, num_frames=num_frames, size=size, offset=offset)):
                _atomic_write_bytes(folder / f"{t:02d}.png", _png(im))
                frames.append(f"images/{clip}/{t:02d}.png")
            answers = {"colour": colour, "direction": direction}
            order = list(QUESTIONS)
            rng.shuffle(order)
            for q in order:  # stage 1: one question per record, every record with all frames
                stage1.append({"messages": [
                    {"role": "user", "content": [{"type": "video", "video": frames}, {"type": "text", "text": QUESTIONS[q]}]},
                    {"role": "assistant", "content": answers[q]}], "question_type": q, "answer": answers[q], "clip": clip})
            first, second = order  # stage 2: one conversation per clip, frames in the first turn only
            stage2.append({"messages": [
                {"role": "user", "content": [{"type": "video", "video": frames}, {"type": "text", "text": QUESTIONS[first]}]},
                {"role": "assistant", "content": answers[first]},
                {"role": "user", "content": QUESTIONS[second]},
                {"role": "assistant", "content": answers[second]}], "question_type": second, "answer": answers[second],
                "clip": clip})
        _atomic_write_bytes(paths[f"stage1_{split}"], "".join(json.dumps(r) + "\n" for r in stage1).encode())
        _atomic_write_bytes(paths[f"stage2_{split}"], "".join(json.dumps(r) + "\n" for r in stage2).encode())
    _atomic_write_bytes(paths["meta"], (json.dumps({"params": params}, indent=2) + "\n").encode())
    return paths


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Write the synthetic video QA set of the video curriculum demo.")
    p.add_argument("out_dir")
    p.add_argument("--train-clips", type=int, default=256)
    p.add_argument("--val-clips", type=int, default=32)
    p.add_argument("--frames", type=int, default=16)
    p.add_argument("--size", type=int, default=56)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    paths = write_synthetic_video(a.out_dir, train_clips=a.train_clips, val_clips=a.val_clips, num_frames=a.frames,
                                  size=a.size, seed=a.seed)
    print("\n".join(f"{k}: {v}" for k, v in paths.items()))


if __name__ == "__main__":
    main()
