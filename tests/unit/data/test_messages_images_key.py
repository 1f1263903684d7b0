"""A messages JSONL line's top-level "images" / "videos" lists are the record's media, never silently dropped.

Two common exports put the media next to the messages: TRL's vision datasets (image items without a path,
{"type": "image"}, taking the row's "images" in order, as the `hf` source already reads them) and
LLaMA-Factory's sharegpt files ("<image>" markers in string content plus "images"). The messages_jsonl reader
kept such keys as metadata: the TRL form was refused as "an image item has no path", and the LLaMA-Factory
form trained on the literal "<image>" text without any image. Now the items take the row's media in order, the
markers of text-only messages take them at their places (ms-swift's and LLaMA-Factory's layout: the same tokens
as the items written out), and media that no item or marker takes is a counted "placeholder_mismatch"."""
from __future__ import annotations

import json

import torch

from megatron_vlm.data.bad_records import BadRecordLog
from megatron_vlm.data.messages import read_messages_jsonl
from megatron_vlm.data.processing import process_record


def _line(user_content, **top) -> str:
    return json.dumps({"messages": [{"role": "user", "content": user_content},
                                    {"role": "assistant", "content": "red"}], **top}) + "\n"


def test_top_level_images_fill_image_items_or_are_refused(tmp_path, proc, write_image):
    write_image(tmp_path / "img" / "a.png", size=(56, 84), seed=1)
    write_image(tmp_path / "img" / "b.png", size=(84, 56), seed=2)
    item = [{"type": "image"}, {"type": "text", "text": "Colour?"}]
    lines = [
        _line([{"type": "image", "image": "img/a.png"}, {"type": "image", "image": "img/b.png"},
               {"type": "text", "text": "Colour?"}]),                                           # 1 the reference
        _line([item[0], item[0], item[1]], images=["img/a.png", "img/b.png"]),                 # 2 TRL form
        _line("<image><image>Colour?", images=["img/a.png", "img/b.png"]),                     # 3 ms-swift form
        _line(item, images=["img/a.png", "img/b.png"]),                                        # 4 one image too many
        _line([item[0], item[0], item[1]], images="img/a.png"),                                # 5 one too few
        _line([{"type": "video"}, item[1]], videos=[["img/a.png", "img/a.png"]]),              # 6 a frame-list video
    ]
    (tmp_path / "d.jsonl").write_text("".join(lines))
    log = BadRecordLog()
    recs = read_messages_jsonl(tmp_path / "d.jsonl", bad_records=log)
    assert [r.index for r in recs] == [1, 2, 3, 6]
    assert [(b.index, b.category) for b in log.entries] == [(4, "placeholder_mismatch"), (5, "placeholder_mismatch")]
    assert "images" in log.entries[0].detail
    paths = [str(tmp_path / "img" / "a.png"), str(tmp_path / "img" / "b.png")]
    assert recs[1].images() == recs[0].images() == recs[2].images() == paths
    assert "images" not in recs[1].meta and "images" not in recs[2].meta
    ref = process_record(recs[0], proc, max_frames=4)
    for got in (process_record(recs[1], proc, max_frames=4), process_record(recs[2], proc, max_frames=4)):
        assert torch.equal(got.input_ids, ref.input_ids) and torch.equal(got.pixel_values, ref.pixel_values)
        assert torch.equal(got.label_mask, ref.label_mask)
    assert recs[3].videos()[0]["video"] == [str(tmp_path / "img" / "a.png")] * 2


def test_the_singular_image_key_is_read_as_images_is(tmp_path):
    """LLaVA's singular top-level "image" beside image items is the row's image, as "images" is (and as the markers
    layout and the `hf` columns read it): it filled no item (a refused row naming "images"), and beside items with
    paths it was kept as metadata, an image of the row silently left out."""
    from megatron_vlm.data.bad_records import BadRecordError
    from megatron_vlm.data.messages import record_from_messages_row

    def record(row):
        return record_from_messages_row(row, lambda r: str(tmp_path / r), source="t", index=1)

    turns = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]},
             {"role": "assistant", "content": "red"}]
    assert record({"messages": turns, "image": "a.png"}).images() == record({"messages": turns, "images": ["a.png"]}).images()
    assert record({"messages": turns, "image": "a.png"}).images() == [str(tmp_path / "a.png")]
    with_path = [{"role": "user", "content": [{"type": "image", "image": "b.png"}, {"type": "text", "text": "What?"}]},
                 {"role": "assistant", "content": "red"}]
    text_only = [{"role": "user", "content": [{"type": "text", "text": "What?"}]}, {"role": "assistant", "content": "red"}]
    for key, value, turns in (("images", ["a.png"], with_path), ("image", "a.png", with_path),
                              ("image", "a.png", text_only)):
        try:
            record({"messages": turns, key: value})
            raise AssertionError(f"{key}: an image no item takes was accepted")
        except BadRecordError as e:
            assert e.category == "placeholder_mismatch", key
