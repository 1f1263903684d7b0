"""LLaVA-Video-178K rows read with `data.type = "hf"`: a "conversations" column of {"from", "value"} turns whose one
"<image>" marker is the place of the row's "video" (a file name), read as the messages_jsonl source reads them.

The same rows in LLaVA-Video's own JSON-array file went through `data.type = "messages_jsonl"`, but the dataset as a
table (parquet, or `save_to_disk`'s arrow) mapped with `columns = {messages = "conversations", video = "video"}` was
refused at config time ("'video' is not read beside 'messages'"), and without the "video" mapping every row was a
placeholder_mismatch (a marker, no image). The rows are written here in the real format with `datasets`, beside tiny
videos made in code: a video file in a small raw container (frame count, rate, size, then the RGB bytes) read by a
decoder installed for the test (no FFmpeg here), and a folder of PNG frames read by the real reader. Each row's
tokens, label mask and video pixels through the table must equal those of the JSON-array file, and the video grid
the hand-derived one: 56 x 56 frames, 4 sampled, 2-frame temporal patches of 14 x 14 pixels -> t, h, w = 2, 4, 4.
"""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from PIL import Image

import megatron_vlm.data.media as media
from megatron_vlm.config.loader import from_dict
from megatron_vlm.data.bad_records import BadRecordLog
from megatron_vlm.data.config import DataConfig
from megatron_vlm.data.processing import process_record
from megatron_vlm.data.sources import open_split

datasets = pytest.importorskip("datasets")

SIDE, FRAMES, MAX_FRAMES = 56, 8, 4
ROWS = [
    {"id": "ytb_7nRmsEw7nsE", "data_source": "2_3_m_youtube_v0_1", "video": "videos/ytb_7nRmsEw7nsE.raw",
     "conversations": [{"from": "human", "value": "<image>\nWhat is the man doing?"},
                       {"from": "gpt", "value": "He is cooking."},
                       {"from": "human", "value": "What does he cook?"},
                       {"from": "gpt", "value": "Noodles."}]},
    {"id": "frames_clip", "data_source": "0_30_s_activitynet", "video": "frames/clip_b",
     "conversations": [{"from": "human", "value": "<image>\nDescribe the clip."},
                       {"from": "gpt", "value": "A grey square brightens."}]},
]


class RawVideoDecoder:
    """Reads the test's raw container: a 16-byte header (frames, fps x 1000, height, width as uint32) then the frames'
    RGB bytes, frame after frame."""

    @staticmethod
    def _read(src):
        if hasattr(src, "read"):
            return src.read()
        with open(src, "rb") as f:
            return f.read()

    def probe(self, src):
        n, fps, h, w = struct.unpack("<4I", self._read(src)[:16])
        return media.VideoInfo(n, fps / 1000, h, w)

    def decode(self, src, indices):
        data = self._read(src)
        n, _, h, w = struct.unpack("<4I", data[:16])
        frames = np.frombuffer(data[16:], dtype=np.uint8).reshape(n, h, w, 3)
        return [frames[i].copy() for i in indices]


def _write_media(root):
    rng = np.random.default_rng(0)
    (root / "videos").mkdir(parents=True)
    frames = rng.integers(0, 256, (FRAMES, SIDE, SIDE, 3), dtype=np.uint8)
    (root / "videos" / "ytb_7nRmsEw7nsE.raw").write_bytes(struct.pack("<4I", FRAMES, 10_000, SIDE, SIDE)
                                                          + frames.tobytes())
    folder = root / "frames" / "clip_b"
    folder.mkdir(parents=True)
    for k in range(FRAMES):
        Image.fromarray(rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)).save(folder / f"{k:03d}.png")


@pytest.fixture
def raw_decoder():
    previous = media.set_video_decoder(RawVideoDecoder())
    yield
    media.set_video_decoder(previous)


def _table(tmp_path, layout: str) -> str:
    ds = datasets.Dataset.from_list(ROWS)
    if layout == "parquet":
        path = tmp_path / "table" / "0_30_s_youtube_v0_1_cap_processed.parquet"
        path.parent.mkdir()
        ds.to_parquet(str(path))
        return str(path)
    ds.save_to_disk(str(tmp_path / "saved"))
    return str(tmp_path / "saved")


def test_the_config_accepts_a_video_column_beside_a_messages_column():
    cfg = from_dict(DataConfig, {"type": "hf", "train_path": "x.parquet",
                                 "columns": {"messages": "conversations", "video": "video"}}, "data")
    assert cfg.columns == {"messages": "conversations", "video": "video"}


@pytest.mark.parametrize("layout", ["parquet", "save_to_disk"])
def test_llava_video_rows_read_from_a_table_equal_the_json_array_file(tmp_path, proc, raw_decoder, layout):
    root = tmp_path / "media"
    _write_media(root)
    array = tmp_path / "0_30_s_youtube_v0_1_cap_processed.json"
    array.write_text(json.dumps(ROWS))  # LLaVA-Video-178K's own file: one JSON array
    jsonl_cfg = DataConfig(type="messages_jsonl", train_path=str(array), image_root=str(root))
    hf_cfg = from_dict(DataConfig, {"type": "hf", "train_path": _table(tmp_path, layout), "image_root": str(root),
                                    "columns": {"messages": "conversations", "video": "video"}}, "data")
    logs = BadRecordLog(), BadRecordLog()
    want_src, got_src = open_split(jsonl_cfg, "train", logs[0]), open_split(hf_cfg, "train", logs[1])
    assert want_src is not None and got_src is not None and len(want_src) == len(got_src) == len(ROWS)
    for i in range(len(ROWS)):
        want_rec, got_rec = want_src.get(i), got_src.get(i)
        assert got_rec.messages == want_rec.messages
        assert got_rec.messages[0]["content"][0] == {"type": "video", "video": str(root / ROWS[i]["video"])}
        assert {k: got_rec.meta[k] for k in ("id", "data_source")} == {"id": ROWS[i]["id"],
                                                                      "data_source": ROWS[i]["data_source"]}
        want = process_record(want_rec, proc, max_frames=MAX_FRAMES)
        got = process_record(got_rec, proc, max_frames=MAX_FRAMES)
        assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.label_mask, want.label_mask)
        assert got.video_grid_thw is not None and want.video_grid_thw is not None
        assert got.video_grid_thw.tolist() == want.video_grid_thw.tolist() == [[MAX_FRAMES // 2, SIDE // 14, SIDE // 14]]
        assert got.pixel_values_videos is not None and want.pixel_values_videos is not None
        assert got.pixel_values_videos.shape == want.pixel_values_videos.shape
        assert torch.equal(got.pixel_values_videos, want.pixel_values_videos)
        assert got.pixel_values is None  # the marker is the video, not an image
    assert len(logs[0]) == len(logs[1]) == 0


def test_a_role_content_messages_column_takes_the_video_column_at_its_marker_or_item(tmp_path):
    """The "video" mapping beside a role / content messages column: the row's video goes to the "<video>" text marker
    (ms-swift's layout) or to the video item without data (TRL's), as the messages_jsonl source places a record's
    "videos"; a video that no place takes is a placeholder_mismatch, never trained without its video."""
    from megatron_vlm.data.bad_records import BadRecordError
    from megatron_vlm.data.hf_source import record_from_columns

    c = {"messages": "messages", "video": "video"}
    marked = {"messages": [{"role": "user", "content": "<video>What happens?"},
                           {"role": "assistant", "content": "Nothing."}], "video": "v.mp4"}
    item = {"messages": [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]},
                         {"role": "assistant", "content": "Nothing."}], "video": "v.mp4"}
    want = [{"type": "video", "video": str(tmp_path / "v.mp4")}, {"type": "text", "text": "What happens?"}]
    for row in (marked, item):
        rec = record_from_columns(row, c, root=tmp_path, source="t.parquet", index=0)
        assert rec.messages[0]["content"] == want
    unplaced = {"messages": [{"role": "user", "content": "What happens?"}, {"role": "assistant", "content": "No."}],
                "video": "v.mp4"}
    with pytest.raises(BadRecordError) as e:
        record_from_columns(unplaced, c, root=tmp_path, source="t.parquet", index=0)
    assert e.value.category == "placeholder_mismatch"
