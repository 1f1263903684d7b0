"""The zoom demo's data: "What colour is the dot?" about a dot too small to read at the resolution the model sees.

Why this task: each image is `image_size` px square (448 by default); the tiny Qwen2.5-VL processor shrinks it to
at most 112 x 112 (`TINY_IMAGE_MAX_PIXELS`, 16 merged vision tokens), a factor of 4, so the `dot` px dot (4 by
default) becomes one pixel blended into its 14 px patch, among `specks` specks of the same size in
every colour scattered over the image (so the image's colours say nothing about the answer). The `zoom` tool of
`[rl.env] name = "zoom"` (rl/env/builtin.py) crops a box and shows it enlarged: the box `ZOOM_BOX` around the
centre (1 % of each side, 5 px) comes back 4 times enlarged (the tool's scale) and the processor brings it to
its 56 px minimum, so the dot fills most of the crop's 4 merged vision tokens.
The dot is always at the centre (inside a thin ring that stays visible at the small size): the demo measures
reading a detail through the tool, not finding where to look.

Files in the folder (written atomically; skipped when meta.json records the same parameters):
- `images/`: the PNGs; `zoom/`: the tool's reply images of the SFT traces (what `ZoomEnv` returns for `ZOOM_BOX`).
- `train.jsonl` / `eval.jsonl` / `test.jsonl`: prompts in the messages format (a user turn with the image and the
  question, the assistant's answer) plus `answer`; eval = the GRPO prompts, test = the held-out test
  (`rl/env/demo_eval.py`), train = the SFT's images. Answers are balanced over the 3 colours, red / green /
  blue (chance 0.33): few and far apart, because the tiny model reads them through a frozen random vision tower.
- `sft_tool.jsonl`: per training image, the conversation the `zoom` environment holds with a model that uses
  the tool: the system turn with the tool specs (the rollout's text), the question, a `<tool_call>` of `zoom`
  with `ZOOM_BOX`, the tool's reply (the enlarged crop and its text) and the bare colour. Only every
  `spec_every`-th trace carries the system turn, the others are the same turns without it (as the calculator
  demo's traces, rl/env/calculator_data.py): the specs are ~480 of a trace's ~660 tokens and the same in every
  trace, so a step of the same token budget holds ~16 conversations instead of ~6, and the held-out evaluation,
  which runs with the specs, still gets the call.
- `sft_direct.jsonl`: the training images answered directly (the no-tool arm; its GRPO prompts have no system turn).

    python -m megatron_vlm.rl.env.zoom_data runs/demo_assets/synthetic_zoom
"""
from __future__ import annotations

import argparse
import io
import json
import os
import random
from pathlib import Path

from PIL import Image, ImageDraw

__all__ = ["QUESTION", "ZOOM_BOX", "ZOOM_COLOURS", "zoom_image", "zoom_call_text", "write_synthetic_zoom"]

ZOOM_COLOURS: dict[str, tuple[int, int, int]] = {"red": (230, 30, 30), "green": (30, 190, 30), "blue": (30, 30, 230)}
QUESTION = "What colour is the dot in the centre?"
ZOOM_BOX = {"left": 0.495, "top": 0.495, "right": 0.505, "bottom": 0.505}
_BACKGROUND = (245, 245, 245)
_SPLITS = {"train": 0, "eval": 1, "test": 2}


def zoom_image(rng: random.Random, colour: str, *, image_size: int = 448, dot: int = 4, specks: int = 60) -> Image.Image:
    """One image: background, `specks` dots of random colours away from the centre, a thin ring and the
    `colour` dot at the centre."""
    img = Image.new("RGB", (image_size, image_size), _BACKGROUND)
    draw = ImageDraw.Draw(img)
    c = image_size // 2
    ring = max(8, image_size // 16)
    names = list(ZOOM_COLOURS)
    placed = 0
    while placed < specks:
        x, y = rng.randrange(image_size - dot), rng.randrange(image_size - dot)
        if abs(x + dot / 2 - c) < ring + dot and abs(y + dot / 2 - c) < ring + dot:
            continue
        draw.rectangle((x, y, x + dot - 1, y + dot - 1), fill=ZOOM_COLOURS[rng.choice(names)])
        placed += 1
    width = max(1, image_size // 112)
    draw.ellipse((c - ring, c - ring, c + ring, c + ring), outline=(30, 30, 30), width=width)
    h = dot // 2
    draw.rectangle((c - h, c - h, c - h + dot - 1, c - h + dot - 1), fill=ZOOM_COLOURS[colour])
    return img


def zoom_call_text() -> str:
    """The model turn of the SFT traces: one `<tool_call>` of `zoom` with `ZOOM_BOX`."""
    return "<tool_call>\n" + json.dumps({"name": "zoom", "arguments": ZOOM_BOX}) + "\n</tool_call>"


def _png(path: Path, img: Image.Image) -> None:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, path)


def _text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_synthetic_zoom(folder: str | Path, *, n_train: int = 1000, n_eval: int = 200, n_test: int = 200,
                         seed: int = 0, image_size: int = 448, dot: int = 4, specks: int = 60,
                         spec_every: int = 8) -> dict[str, Path]:
    """Write the files (module docstring) into `folder`; returns {"train", "eval", "test", "sft_tool",
    "sft_direct", "meta"}."""
    from megatron_vlm.rl.env.base import EnvSample
    from megatron_vlm.rl.env.builtin import ZoomEnv
    from megatron_vlm.rl.env.turns import with_tools

    if spec_every < 0:
        raise ValueError(f"spec_every: must be >= 0 (0: no trace carries the tool specs), got {spec_every}")
    if n_train <= 0 or n_eval < 0 or n_test < 0:
        raise ValueError(f"n_train must be > 0, n_eval and n_test >= 0; got {n_train}, {n_eval}, {n_test}")
    out = Path(folder)
    names = ("train", "eval", "test", "sft_tool", "sft_direct")
    paths = {k: out / f"{k}.jsonl" for k in names} | {"meta": out / "meta.json"}
    params = {"n_train": n_train, "n_eval": n_eval, "n_test": n_test, "seed": seed, "image_size": image_size,
              "dot": dot, "specks": specks, "box": ZOOM_BOX, "colours": {k: list(v) for k, v in ZOOM_COLOURS.items()},
              "spec_every": spec_every, "version": 2}
    if paths["meta"].is_file():
        try:
            if json.loads(paths["meta"].read_text()) == params:
                return paths
        except (json.JSONDecodeError, OSError):
            pass
    (out / "images").mkdir(parents=True, exist_ok=True)
    (out / "zoom").mkdir(parents=True, exist_ok=True)
    env = ZoomEnv()
    tools = env.tools()
    colours = list(ZOOM_COLOURS)
    texts: dict[str, list[str]] = {k: [] for k in names}
    for split, n in (("train", n_train), ("eval", n_eval), ("test", n_test)):
        rng = random.Random(seed * 1_000_003 + _SPLITS[split])
        plan = [colours[i % len(colours)] for i in range(n)]
        rng.shuffle(plan)
        for i, colour in enumerate(plan):
            img = zoom_image(rng, colour, image_size=image_size, dot=dot, specks=specks)
            rel = f"images/{split}_{i:05d}.png"
            _png(out / rel, img)
            user = {"role": "user", "content": [{"type": "image", "image": rel}, {"type": "text", "text": QUESTION}]}
            direct = [user, {"role": "assistant", "content": colour}]
            texts[split].append(json.dumps({"messages": direct, "answer": colour}))
            if split != "train":
                continue
            texts["sft_direct"].append(json.dumps({"messages": direct, "answer": colour}))
            env.reset(EnvSample(problem=QUESTION, answer=colour, images=[img]))
            reply, crops = env._zoom(**ZOOM_BOX)
            zrel = f"zoom/{split}_{i:05d}.png"
            _png(out / zrel, crops[0])
            turns: list[dict] = [user, {"role": "assistant", "content": zoom_call_text()},
                                 {"role": "tool", "content": [{"type": "image", "image": zrel},
                                                              {"type": "text", "text": reply}]},
                                 {"role": "assistant", "content": colour}]
            tool = with_tools(turns, tools) if spec_every > 0 and i % spec_every == 0 else turns
            texts["sft_tool"].append(json.dumps({"messages": tool, "answer": colour}))
    for k in names:
        _text(paths[k], "".join(t + "\n" for t in texts[k]))
    _text(paths["meta"], json.dumps(params, indent=1) + "\n")
    return paths


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder")
    p.add_argument("--train", type=int, default=1000)
    p.add_argument("--eval", type=int, default=200)
    p.add_argument("--test", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--spec-every", type=int, default=8, help="every k-th tool trace carries the tool specs (0: none)")
    a = p.parse_args(argv)
    for name, path in write_synthetic_zoom(a.folder, n_train=a.train, n_eval=a.eval, n_test=a.test, seed=a.seed,
                                           spec_every=a.spec_every).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
