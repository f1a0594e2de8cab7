"""Image decoding at the edge: limits, formats, transparency, and every broken payload an
ImageError naming its part (never another exception)."""

from __future__ import annotations

import base64
import io
import random

import numpy as np
import pytest
from PIL import Image

from pagoda.multimodal.images import decode_base64_image, decode_image, image_from_data_url
from pagoda.multimodal.inputs import ImageError, MultiModalLimits
from tests.multimodal.checkpoints import random_image


def _encoded(img: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def test_limits_on_bytes_and_pixels():
    data = _encoded(random_image(20, 20), "PNG")
    with pytest.raises(ImageError, match="bytes; the limit is 100") as e:
        decode_image(data, "p", MultiModalLimits(max_image_bytes=100))
    assert e.value.param == "p"
    with pytest.raises(ImageError, match="20x20 pixels; the limit is 399 pixels"):
        decode_image(data, "p", MultiModalLimits(max_image_pixels=399))
    assert decode_image(data, "p", MultiModalLimits(max_image_pixels=400)).size == (20, 20)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "BMP", "GIF"])
def test_formats_decode_to_rgb(fmt):
    img = decode_image(_encoded(random_image(16, 12, mode="RGB" if fmt != "GIF" else "P"), fmt), "p")
    assert img.mode == "RGB" and img.size == (16, 12)


def test_transparency_is_composited_on_white_and_grey_becomes_rgb():
    rgba = Image.new("RGBA", (4, 4), (10, 20, 30, 0))
    assert np.asarray(decode_image(_encoded(rgba, "PNG"), "p")).tolist() == [[[255, 255, 255]] * 4] * 4
    grey = Image.new("L", (3, 3), 77)
    assert np.asarray(decode_image(_encoded(grey, "PNG"), "p"))[0, 0].tolist() == [77, 77, 77]


def test_fuzzed_payloads_are_image_errors():
    """Random bytes, every truncation of a PNG and a JPEG, flipped bytes: ImageError or an
    image, never another exception."""
    rng = random.Random(0)
    png, jpeg = _encoded(random_image(24, 24), "PNG"), _encoded(random_image(24, 24), "JPEG")
    payloads = [bytes(rng.getrandbits(8) for _ in range(n)) for n in (1, 7, 64, 500)]
    payloads += [png[:n] for n in range(0, len(png), max(1, len(png) // 40))]
    payloads += [jpeg[:n] for n in range(0, len(jpeg), max(1, len(jpeg) // 40))]
    for _ in range(40):
        flipped = bytearray(png)
        flipped[rng.randrange(len(flipped))] ^= 0xFF
        payloads.append(bytes(flipped))
    for data in payloads:
        try:
            decode_image(data, "p")
        except ImageError as e:
            assert e.param == "p"


def test_base64_and_data_urls():
    data = _encoded(random_image(5, 5), "PNG")
    b64 = base64.b64encode(data).decode()
    assert decode_base64_image(b64, "p").size == (5, 5)
    assert image_from_data_url(f"data:image/png;base64,{b64}", "p").size == (5, 5)
    for bad in (f"data:image/png,{b64}", "http://x/y.png", f"data:text/html;base64,{b64}"):
        with pytest.raises(ImageError):
            image_from_data_url(bad, "p")
    with pytest.raises(ImageError, match="not valid base64"):
        decode_base64_image("abc$", "p")
