"""Decoding the images requests send, with every check a public endpoint needs.

An image arrives as bytes (base64 in a data URL, an Ollama ``images`` entry, an Anthropic
``image`` block) and leaves as an RGB ``PIL.Image`` or an ``ImageError`` naming the part:
empty, over the byte limit, not an image PIL reads, over the pixel limit (checked from the
header, before any pixel is decoded: the decompression-bomb guard), animated (several
frames), or truncated. Transparency is composited onto white, as transformers' processors do.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import warnings

from PIL import Image, UnidentifiedImageError

from pagoda.multimodal.inputs import ImageError, MultiModalLimits

__all__ = ["decode_image", "decode_base64_image", "image_from_data_url", "to_rgb"]

_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,", re.I)


def decode_image(data: bytes, where: str, limits: MultiModalLimits = MultiModalLimits()) -> Image.Image:
    """The RGB image of encoded bytes (PNG, JPEG, WebP, GIF, BMP...), or ImageError(where)."""
    if not data:
        raise ImageError(f"{where}: the image is empty (0 bytes)", where)
    if len(data) > limits.max_image_bytes:
        raise ImageError(f"{where}: the image is {len(data)} bytes; the limit is {limits.max_image_bytes}", where)
    try:
        with warnings.catch_warnings():
            # PIL warns (and past twice its limit, raises) about large images; the pixel
            # limit below is pagoda's own check, made before decoding.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        raise ImageError(f"{where}: the image has more pixels than PIL will decode; the limit is "
                         f"{limits.max_image_pixels} pixels", where) from None
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise ImageError(f"{where}: not an image this server can read ({type(e).__name__})", where) from None
    width, height = img.size
    if width < 1 or height < 1:
        raise ImageError(f"{where}: the image has no pixels ({width}x{height})", where)
    if width * height > limits.max_image_pixels:
        raise ImageError(f"{where}: the image is {width}x{height} pixels; the limit is "
                         f"{limits.max_image_pixels} pixels", where)  # fmt: skip
    if getattr(img, "n_frames", 1) > 1:
        raise ImageError(f"{where}: animated images (several frames) are not supported", where)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img.load()
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise ImageError(f"{where}: the image could not be decoded ({e})", where) from None
    return to_rgb(img)


def to_rgb(img: Image.Image) -> Image.Image:
    """RGB, transparency composited onto white (transformers' ``convert_to_rgb``)."""
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img if img.mode == "RGB" else img.convert("RGB")


def decode_base64_image(text: str, where: str, limits: MultiModalLimits = MultiModalLimits()) -> Image.Image:
    """An image sent as base64 text (Ollama's ``images``, Anthropic's base64 source)."""
    if len(text) > limits.max_image_bytes * 4 // 3 + 4:
        raise ImageError(f"{where}: the image is over the limit of {limits.max_image_bytes} bytes", where)
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{where}: not valid base64", where) from None
    return decode_image(data, where, limits)


def image_from_data_url(url: str, where: str, limits: MultiModalLimits = MultiModalLimits()) -> Image.Image:
    """The image of a ``data:image/...;base64,...`` URL."""
    m = _DATA_URL.match(url)
    if m is None or not m.group("b64"):
        raise ImageError(f"{where}: expected a base64 data URL (data:image/<type>;base64,...)", where)
    mime = (m.group("mime") or "").lower()
    if mime and not mime.startswith("image/"):
        raise ImageError(f"{where}: a data URL of type {mime!r} is not an image", where)
    return decode_base64_image(url[m.end():], where, limits)
