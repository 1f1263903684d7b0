"""A photo with an EXIF orientation tag reaches the model upright, as transformers and vLLM load it.

Phone cameras store the sensor's pixels and an Orientation tag (6: rotate 90 degrees clockwise to
display). transformers' `image_utils.load_image` and vLLM's image loader apply the tag
(`ImageOps.exif_transpose`); a bare `Image.open` does not, so the model would train on the photo
sideways (and a 4:3 portrait photo would get the landscape grid). The reference is transformers'
`load_image`; the exact length planned from the header (`image_hw`) must be the upright size too.
"""
from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from megatron_vlm.data.media import image_hw, load_image
from megatron_vlm.data.messages import Record
from megatron_vlm.data.processing import estimate_length, process_record


def _tagged_jpeg(orientation: int, size=(84, 28)) -> bytes:
    a = np.zeros((size[1], size[0], 3), dtype=np.uint8)
    a[:, : size[0] // 3] = (250, 10, 10)  # a red band on the left: rotations move it
    img = Image.fromarray(a)
    exif = img.getexif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    img.save(buf, "JPEG", exif=exif.tobytes(), quality=95)
    return buf.getvalue()


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_orientation_applied_like_transformers_load_image(tmp_path, orientation):
    from transformers.image_utils import load_image as hf_load_image

    path = tmp_path / f"o{orientation}.jpg"
    path.write_bytes(_tagged_jpeg(orientation))
    expected = np.asarray(hf_load_image(str(path)))
    for ref in (str(path), path.read_bytes(), Image.open(path)):
        got = load_image(ref)
        np.testing.assert_array_equal(np.asarray(got), expected)
        assert image_hw(ref) == expected.shape[:2]


def _tagged_png(orientation: int, size=(84, 28)) -> bytes:
    a = np.zeros((size[1], size[0], 3), dtype=np.uint8)
    a[:, : size[0] // 3] = (250, 10, 10)
    img = Image.fromarray(a)
    exif = img.getexif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    img.save(buf, "PNG", exif=exif.tobytes())  # Pillow writes the eXIf chunk before the pixels
    return buf.getvalue()


def test_png_orientation_from_its_header_without_decoding_pixels(tmp_path, monkeypatch):
    """Length planning reads every image's size: a PNG without EXIF must not be decoded for it (Pillow's `getexif`
    decodes a PNG to look for an eXIf chunk behind the pixels: 85 ms per 1920x1080 image instead of 0.07 ms), and a
    PNG's eXIf chunk before the pixels is applied as transformers' `load_image` applies it."""
    from PIL import PngImagePlugin
    from transformers.image_utils import load_image as hf_load_image

    tagged, plain = tmp_path / "t.png", tmp_path / "p.png"
    tagged.write_bytes(_tagged_png(6))
    Image.new("RGB", (84, 28)).save(plain)
    expected = np.asarray(hf_load_image(str(tagged)))
    np.testing.assert_array_equal(np.asarray(load_image(str(tagged))), expected)

    decoded = []  # recorded, not raised: the orientation read swallows errors of a malformed EXIF block
    monkeypatch.setattr(PngImagePlugin.PngImageFile, "load", lambda self: decoded.append(self.filename))
    assert image_hw(str(tagged)) == expected.shape[:2] == (84, 28)
    assert image_hw(str(plain)) == (28, 84)
    assert decoded == []


def test_planned_length_and_grid_follow_the_upright_photo(tmp_path, proc):
    path = tmp_path / "portrait.jpg"
    path.write_bytes(_tagged_jpeg(6))  # stored 84 x 28 (landscape), displayed 28 x 84 (portrait)
    record = Record([{"role": "user", "content": [{"type": "image", "image": str(path)},
                                                  {"type": "text", "text": "what"}]},
                     {"role": "assistant", "content": "a"}], "mem", 0)
    sample = process_record(record, proc, max_frames=4)
    t, h, w = sample.image_grid_thw[0].tolist()
    assert h > w  # portrait grid
    assert estimate_length(record, proc, max_frames=4) == sample.input_ids.numel()


@pytest.mark.parametrize("ref", ["https://example.com/a.png", "http://host/v.mp4"])
def test_a_remote_url_is_named_as_such_not_as_a_missing_file(ref):
    """URLs are not downloaded (no network while training): the bad record says so instead of "file not found"."""
    from megatron_vlm.data.bad_records import BadRecordError
    from megatron_vlm.data.media import read_video

    with pytest.raises(BadRecordError, match="not downloaded") as e:
        read_video({"video": ref}, 4, 2.0) if ref.endswith(".mp4") else load_image(ref)
    assert e.value.category == "missing_image" and ref in str(e.value)
