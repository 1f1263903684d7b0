"""Images that are not 8-bit RGB reach the model as transformers would show them, not as PIL's bare
`convert("RGB")` leaves them.

- transparency (RGBA, LA, PA, palette or grayscale PNGs with a transparent colour) is composited onto
  white: the reference is transformers' own `image_transforms.convert_to_rgb`, which the family's
  image processors apply; a bare convert drops the alpha channel, turning a transparent logo's
  invisible pixels (here black) into its background;
- 16-bit grayscale (a 16-bit PNG opens as "I;16") is scaled to 8 bits (v / 257, checked against
  numpy), where a bare convert clips every value above 255 to white;
- the SFT reader (`load_image`, the processor call) uses the same conversion.
"""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from megatron_vlm.data.media import load_image, to_rgb


def _pixels(seed: int, shape) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def _transparent_palette() -> Image.Image:
    img = Image.fromarray(_pixels(3, (8, 9))).convert("P")
    img.info["transparency"] = int(np.asarray(img)[0, 0])
    return img


def _transparent_gray() -> Image.Image:
    img = Image.fromarray(_pixels(4, (8, 9)), mode="L")
    img.info["transparency"] = int(np.asarray(img)[0, 0])
    return img


CASES = {
    "RGB": lambda: Image.fromarray(_pixels(0, (8, 9, 3))),
    "RGBA": lambda: Image.fromarray(_pixels(1, (8, 9, 4)), mode="RGBA"),
    "LA": lambda: Image.fromarray(_pixels(2, (8, 9, 2)), mode="LA"),
    "L": lambda: Image.fromarray(_pixels(5, (8, 9))),
    "P": lambda: Image.fromarray(_pixels(6, (8, 9, 3))).convert("P"),
    "P+transparency": _transparent_palette,
    "L+transparency": _transparent_gray,
    "CMYK": lambda: Image.fromarray(_pixels(7, (8, 9, 4)), mode="CMYK"),
    "1": lambda: Image.fromarray(_pixels(8, (8, 9)) > 127),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_modes_match_transformers_convert_to_rgb(name, tmp_path):
    from transformers.image_transforms import convert_to_rgb

    img = CASES[name]()
    expected = convert_to_rgb(img, return_numpy=True)
    got = to_rgb(img)
    assert got.mode == "RGB"
    np.testing.assert_array_equal(np.asarray(got), expected)
    if name in ("RGBA", "LA", "P+transparency"):  # through a PNG file too
        img.save(tmp_path / "x.png")
        np.testing.assert_array_equal(np.asarray(load_image(str(tmp_path / "x.png"))), expected)


def test_transparent_pixels_are_white_not_their_hidden_colour(tmp_path):
    a = np.zeros((4, 4, 4), dtype=np.uint8)  # black everywhere, fully transparent but one opaque red pixel
    a[1, 2] = (255, 0, 0, 255)
    Image.fromarray(a, mode="RGBA").save(tmp_path / "logo.png")
    rgb = np.asarray(load_image(str(tmp_path / "logo.png")))
    assert rgb[1, 2].tolist() == [255, 0, 0]
    assert (rgb.reshape(-1, 3).sum(1) == 765).sum() == 15  # PIL's convert("RGB") leaves them black


@pytest.mark.parametrize("seed", [0, 1])
def test_16_bit_grayscale_is_scaled_not_clipped(tmp_path, seed):
    a = np.random.default_rng(seed).integers(0, 65536, (6, 7), dtype=np.uint16)
    a[0, 0], a[0, 1] = 0, 65535
    Image.fromarray(a).save(tmp_path / "g16.png")
    assert Image.open(tmp_path / "g16.png").mode.startswith("I")
    rgb = np.asarray(load_image(str(tmp_path / "g16.png")))
    ref = np.round(a.astype(np.float64) / 257.0).astype(np.uint8)
    for c in range(3):
        np.testing.assert_array_equal(rgb[..., c], ref)
    assert rgb[0, 0, 0] == 0 and rgb[0, 1, 0] == 255


def test_32_bit_int_image_with_8_bit_values_is_kept():
    a = np.arange(56, dtype=np.int32).reshape(7, 8) * 4  # 0..220: already 8-bit values
    got = np.asarray(to_rgb(Image.fromarray(a, mode="I")))
    np.testing.assert_array_equal(got[..., 0], a.astype(np.uint8))


def test_processor_call_uses_the_same_conversion(proc):
    a = np.zeros((28, 28, 4), dtype=np.uint8)  # all transparent black: must be seen as white
    rgba = Image.fromarray(a, mode="RGBA")
    white = Image.new("RGB", (28, 28), (255, 255, 255))
    text = proc.render([{"role": "user", "content": [{"type": "image", "image": "x"}, {"type": "text", "text": "q"}]}],
                       add_generation_prompt=True)
    got = proc(text=text, images=[rgba])["pixel_values"]
    ref = proc(text=text, images=[white])["pixel_values"]
    assert ref.abs().sum() > 0
    assert float((got - ref).abs().max()) == 0.0
