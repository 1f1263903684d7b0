"""A prompt / answer table with a "video" column: a "<video>" marker in the prompt is where the clip goes, so it
is removed (the video is placed before the text), as "<image>" markers are; left in, Qwen-VL trained the marker as
literal text and InternVL's template (whose own placeholder is "<video>") refused every row as a
placeholder_mismatch. A marker count other than the videos given is a placeholder_mismatch."""
from __future__ import annotations

import json

import pytest

from megatron_vlm.data.bad_records import BadRecordError
from megatron_vlm.data.hf_source import HFRecords


def _table(tmp_path, prompts, videos):
    path = tmp_path / "v.jsonl"
    path.write_text("".join(json.dumps({"q": q, "a": "a cat", "v": v}) + "\n" for q, v in zip(prompts, videos)))
    return HFRecords(path, {"prompt": "q", "answer": "a", "video": "v"})


def test_video_marker_is_where_the_clip_goes(tmp_path):
    src = _table(tmp_path, ["<video>\nWhat happens?", "What happens here?"], [["f0.png", "f1.png"]] * 2)
    for i, text in ((0, "What happens?"), (1, "What happens here?")):
        user = src.get(i).messages[0]["content"]
        assert [it["type"] for it in user] == ["video", "text"]
        assert user[1]["text"] == text


@pytest.mark.parametrize("prompt, video", [("<video><video> Compare.", ["f0.png"]), ("<video>What happens?", None)])
def test_video_markers_other_than_the_videos_given(tmp_path, prompt, video):
    src = _table(tmp_path, [prompt], [video])
    with pytest.raises(BadRecordError) as e:
        src.get(0)
    assert e.value.category == "placeholder_mismatch" and "<video>" in str(e.value)
