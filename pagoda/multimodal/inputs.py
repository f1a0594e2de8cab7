"""What a request carries for each of its images, from the API process to the model runner."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import msgspec
import numpy as np


class ImageError(ValueError):
    """An image a request sent cannot be used (not an image, truncated, too large, animated,
    refused URL...): a 400 at the HTTP edge, naming the part."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ImageInput(msgspec.Struct, frozen=True):
    """One image of a prompt, processed.

    ``offset`` / ``length``: the prompt positions its placeholder span covers (from its first
    placeholder token to its last, with the family's markers between tiles inside); the
    encoder's embeddings replace the span's image tokens (the model's ``image_token_id``)
    in order. ``hash``: the processed pixels' SHA-256 with the processor's identity; it keys
    the encoder cache and joins the prefix cache's block hashes (the same text with another
    image never hits). ``pixels``: C order, of ``shape`` (tiles, channels, height, width):
    float32 as the encoder reads them, or, with ``normalize`` = (rescale, mean, std), the
    8-bit pixels the processor resized and cut, a quarter of the bytes, made float where
    the encoder runs (``float_pixels``: the same numbers)."""

    hash: str
    offset: int
    length: int
    pixels: bytes
    shape: tuple[int, ...]
    normalize: tuple[float | None, tuple[float, ...] | None, tuple[float, ...] | None] | None = None

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def itemsize(self) -> int:
        return 4 if self.normalize is None else 1

    def float_pixels(self) -> np.ndarray:
        """float32 [tiles, channels, height, width], as the encoder reads them."""
        if self.normalize is None:
            return np.frombuffer(self.pixels, dtype=np.float32).reshape(self.shape).copy()
        return rescale_normalize(np.frombuffer(self.pixels, dtype=np.uint8).reshape(self.shape), *self.normalize)


def rescale_normalize(img: np.ndarray, scale: float | None, mean: Sequence[float] | None,
                      std: Sequence[float] | None) -> np.ndarray:
    """transformers' ``rescale`` (float64, then float32) and ``normalize`` (float32), on
    [..., channels, height, width]."""
    out = img.astype(np.float64) * scale if scale is not None else img
    out = out.astype(np.float32)
    if mean is not None and std is not None:
        m = np.asarray(mean, dtype=np.float32)[:, None, None]
        s = np.asarray(std, dtype=np.float32)[:, None, None]
        out = (out - m) / s
    return out.astype(np.float32, copy=False)


@dataclass(frozen=True)
class MultiModalLimits:
    """What one request may send: images per prompt (vLLM's ``--limit-mm-per-prompt``
    ``{"image": N}``), the bytes of one encoded image, and its decoded pixels (width x
    height; also the guard against decompression bombs)."""

    max_images: int = 8
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 40_000_000
