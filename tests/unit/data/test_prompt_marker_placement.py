"""A prompt / answer table row whose prompt has "<image>" / "<video>" markers between its text: SFT placed every
image before the text (the markers removed) while GRPO's reader of the same row places them at the markers, so one
file gave two prompts and an SFT-then-GRPO run trained another question layout than it rolled out. Now both take
the media where the markers are (hand-derived layouts below); a prompt without markers keeps them before the text."""
from __future__ import annotations

import json

from megatron_vlm.data.hf_source import HFRecords
from megatron_vlm.rl.prompts.dataset import _user_content


def _row(tmp_path, q, images=None, video=None):
    path = tmp_path / "t.jsonl"
    row = {"q": q, "a": "4"}
    cols = {"prompt": "q", "answer": "a"}
    if images is not None:
        row["imgs"], cols["images"] = images, "imgs"
    if video is not None:
        row["v"], cols["video"] = video, "v"
    path.write_text(json.dumps(row) + "\n")
    return HFRecords(path, cols).get(0).messages[0]["content"]


def _name(value):
    return [_name(v) for v in value] if isinstance(value, list) else str(value).rsplit("/", 1)[-1]


def _layout(items):
    """Text pieces, and (kind, file name(s)) of the media (paths resolved against the file's folder)."""
    return [it["text"] if it["type"] == "text" else (it["type"], _name(it.get(it["type"]))) for it in items]


def test_images_go_where_the_markers_are(tmp_path):
    user = _row(tmp_path, "Compare <image> with\n<image>. Which is larger?", ["a.png", "b.png"])
    assert _layout(user) == ["Compare", ("image", "a.png"), "with", ("image", "b.png"), ". Which is larger?"]
    # the same as GRPO's reader of such a row (an identity template)
    grpo = _user_content("Compare <image> with\n<image>. Which is larger?", ["a.png", "b.png"])
    assert _layout(user) == _layout(grpo)


def test_a_video_marker_and_unmarked_images(tmp_path):
    user = _row(tmp_path, "What changes in <video> after this?", ["a.png"], ["f0.png", "f1.png"])
    assert _layout(user) == [("image", "a.png"), "What changes in", ("video", ["f0.png", "f1.png"]), "after this?"]


def test_no_markers_media_first(tmp_path):
    user = _row(tmp_path, "  How many?  ", ["a.png", "b.png"])
    assert _layout(user) == [("image", "a.png"), ("image", "b.png"), "How many?"]
