"""A folder of video frames is read in frame-number order, whatever the names' zero padding.

Frames dumped as 1.png ... 12.png (ffmpeg's `%d.png`, most frame extractors) were sorted as strings: 1, 10, 11,
12, 2, ..., so the model saw a scrambled clip and Qwen3-VL / Nemotron-VL timestamps labelled the wrong frames.
The truth is built in: frame k is painted with grey level 20 * k.
"""
from __future__ import annotations

import numpy as np
from PIL import Image

from megatron_vlm.data.media import read_video


def test_unpadded_frame_numbers_are_read_in_numeric_order(tmp_path):
    folder = tmp_path / "clip"
    folder.mkdir()
    for k in range(1, 13):
        Image.new("RGB", (8, 8), (20 * k,) * 3).save(folder / f"frame_{k}.png")
    (folder / "notes.txt").write_text("not a frame")
    clip = read_video({"video": str(folder)}, max_frames=32, default_fps=2.0)
    assert [int(np.asarray(f)[0, 0, 0]) for f in clip.frames] == [20 * k for k in range(1, 13)]
    clip = read_video({"video": str(folder)}, max_frames=4, default_fps=2.0)  # uniform subsample of the ordered clip
    assert [int(np.asarray(f)[0, 0, 0]) // 20 for f in clip.frames] == [1, 5, 8, 12]
