"""What a request carries for each of its images, from the API process to the model runner."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec


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
    image never hits). ``pixels``: float32, C order, of ``shape`` (tiles, channels, height,
    width)."""

    hash: str
    offset: int
    length: int
    pixels: bytes
    shape: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class MultiModalLimits:
    """What one request may send: images per prompt (vLLM's ``--limit-mm-per-prompt``
    ``{"image": N}``), the bytes of one encoded image, and its decoded pixels (width x
    height; also the guard against decompression bombs)."""

    max_images: int = 8
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 40_000_000
