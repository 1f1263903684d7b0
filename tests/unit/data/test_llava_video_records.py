"""LLaVA-Video-178K records: a video's place in the conversation is written as an "<image>" marker.

That dataset (and LLaVA-NeXT's loader that trains on it) writes {"id", "data_source", "video": "<path>.mp4",
"conversations": [{"from": "human", "value": "<image>\\nWhat ...?"}, {"from": "gpt", ...}, ...]}: the video has
no "<video>" marker of its own and the record has no image, so the one "<image>" marker is where the video goes.
Every such record was refused as a placeholder_mismatch ("1 <image> markers but 0 images"). Records where the
marker's meaning is not this one reading (images given as well, or markers and videos not as many) stay refused.
"""
from __future__ import annotations

import json

import pytest

from megatron_vlm.data.bad_records import BadRecordError, BadRecordLog
from megatron_vlm.data.messages import read_messages_jsonl, record_from_messages_row

VIDEO = "liwei_youtube_videos/videos/youtube_video_2024/ytb_7nRmsEw7nsE.mp4"
ROW = {"id": "ytb_7nRmsEw7nsE", "data_source": "2_3_m_youtube_v0_1", "video": VIDEO,
       "conversations": [{"from": "human", "value": "<image>\nWhat is the man doing?"},
                         {"from": "gpt", "value": "He is cooking."},
                         {"from": "human", "value": "What does he cook?"},
                         {"from": "gpt", "value": "Noodles."}]}

# What the record means, written in our messages form by hand (the video where the marker was).
EXPECTED = [{"role": "user", "content": [{"type": "video", "video": VIDEO},
                                         {"type": "text", "text": "\nWhat is the man doing?"}]},
            {"role": "assistant", "content": "He is cooking."},
            {"role": "user", "content": "What does he cook?"},
            {"role": "assistant", "content": "Noodles."}]


def _record(row):
    return record_from_messages_row(row, lambda r: r, source="t", index=1)


def test_image_marker_of_a_video_only_record_is_the_video():
    rec = _record(ROW)
    assert rec.messages == EXPECTED
    assert rec.meta == {"id": "ytb_7nRmsEw7nsE", "data_source": "2_3_m_youtube_v0_1"}


def test_llava_video_json_array_file_is_read(tmp_path):
    (tmp_path / "0_30_s_youtube_v0_1_cap_processed.json").write_text(json.dumps([ROW, ROW]))
    log = BadRecordLog()
    recs = read_messages_jsonl(tmp_path / "0_30_s_youtube_v0_1_cap_processed.json", image_root="/videos",
                               bad_records=log)
    assert len(recs) == 2 and len(log) == 0
    assert recs[0].messages[0]["content"][0] == {"type": "video", "video": f"/videos/{VIDEO}"}


@pytest.mark.parametrize("change, match", [
    ({"image": "a.png"}, "<video> markers"),                                   # an image too: whose marker?
    ({"conversations": [{"from": "human", "value": "<image><image> Compare."},
                        {"from": "gpt", "value": "Same."}]}, "markers"),        # two markers, one video
    ({"conversations": [{"from": "human", "value": "<video> and <image>"},
                        {"from": "gpt", "value": "Same."}]}, "markers"),        # its own <video> marker as well
    ({"conversations": [{"from": "human", "value": "What happens?"},
                        {"from": "gpt", "value": "Nothing."}]}, "0 <video> markers"),  # no marker at all
])
def test_ambiguous_video_records_stay_refused(change, match):
    with pytest.raises(BadRecordError, match=match) as e:
        _record({**ROW, **change})
    assert e.value.category == "placeholder_mismatch"
