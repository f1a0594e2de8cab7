"""Prompts with images: the images of chat messages (as the dialects send them) taken out
for the processor, the messages left as the chat template expects them, and the prompt's
token ids with each image's placeholder span.

Content parts become ``{"type": "image"}`` for the template (transformers' convention, which
the VLM templates read) and ``{"type": "text", "text": ...}`` for text; a string content
becomes one text part, as transformers' processors hand it to these templates.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from PIL import Image

from pagoda.multimodal.images import decode_base64_image, image_from_data_url, to_rgb
from pagoda.multimodal.inputs import ImageError, ImageInput, MultiModalLimits
from pagoda.multimodal.processors import ImageProcessor, expand_images


@dataclass
class ChatImages:
    """Messages ready for the template and the images they hold, in order."""

    messages: list[dict[str, Any]]
    images: list[Image.Image] = field(default_factory=list)
    details: list[str] = field(default_factory=list)   # each image's detail (auto / low / high)


def has_image_parts(messages: Sequence[dict[str, Any]]) -> bool:
    return first_image_part(messages) is not None


def first_image_part(messages: Sequence[dict[str, Any]]) -> str | None:
    """Where the first image part of the messages is (``messages.[i].content.[j]``), or None."""
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list):
            for j, p in enumerate(content):
                if isinstance(p, dict) and p.get("type") in _IMAGE_TYPES:
                    return _where(i, j)
    return None


def _where(i: int, j: int) -> str:
    return f"messages.[{i}].content.[{j}]"   # OpenAI's spelling of a parameter's place


_IMAGE_TYPES = frozenset({"image_url", "image", "image_pil", "input_image", "image_base64"})


def take_images(messages: Sequence[dict[str, Any]], limits: MultiModalLimits = MultiModalLimits(),
                fetch: Callable[[str, str], Image.Image] | None = None) -> ChatImages:  # fmt: skip
    """OpenAI's ``image_url`` parts (a data URL; another URL through ``fetch(url, where)``, or
    refused without one), ``image_base64`` parts (the other dialects' base64 images) and vLLM's
    offline ``image_pil`` parts (a PIL image) become ``{"type": "image"}`` parts;
    ``ImageError`` names the part of anything wrong."""
    out: list[dict[str, Any]] = []
    images: list[Image.Image] = []
    found = ChatImages(out, images)
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, str):
            out.append({**message, "content": [{"type": "text", "text": content}]})
            continue
        if not isinstance(content, list):
            out.append(dict(message))
            continue
        parts = []
        for j, part in enumerate(content):
            where = _where(i, j)
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": part.get("text", "")})
                continue
            if kind not in _IMAGE_TYPES:
                raise ImageError(f"{where}: content parts of type {kind!r} are not supported", where)
            if len(images) >= limits.max_images:   # before decoding one more
                raise ImageError(f"{where}: at most {limits.max_images} image(s) per prompt "
                                 "(--limit-mm-per-prompt)", where)  # fmt: skip
            detail = "auto"
            if kind == "image_url":
                spec = part.get("image_url")
                url = spec.get("url") if isinstance(spec, dict) else spec
                if not isinstance(url, str):
                    raise ImageError(f"{where}: image_url must be {{'url': <string>}}", where)
                detail = (spec.get("detail") if isinstance(spec, dict) else None) or "auto"
                if detail not in ("auto", "low", "high"):
                    raise ImageError(f"{where}: image_url.detail must be auto, low or high, got {detail!r}", where)
                images.append(_from_url(url, where, limits, fetch))
            elif kind == "image_base64":   # Ollama's images, Anthropic's base64 sources
                data = part.get("image_base64")
                if not isinstance(data, str):
                    raise ImageError(f"{where}: an image must be base64 text", where)
                images.append(decode_base64_image(data, where, limits))
            elif kind == "image_pil":
                img = part.get("image_pil")
                if not isinstance(img, Image.Image):
                    raise ImageError(f"{where}: image_pil must be a PIL image", where)
                images.append(to_rgb(img))
            elif isinstance(part, dict) and kind == "image" and isinstance(part.get("image"), Image.Image):
                images.append(to_rgb(part["image"]))
            else:   # an "image" part without a PIL image; "input_image" (the Responses API converts its own)
                raise ImageError(f"{where}: content parts of type {kind!r} are not supported", where)
            found.details.append(detail)
            parts.append({"type": "image"})
        out.append({**message, "content": parts})
    return found


def _from_url(url: str, where: str, limits: MultiModalLimits,
              fetch: Callable[[str, str], Image.Image] | None) -> Image.Image:  # fmt: skip
    if url.startswith("data:"):
        return image_from_data_url(url, where, limits)
    if fetch is None:
        raise ImageError(f"{where}: only base64 data URLs are accepted here (data:image/<type>;base64,...)", where)
    return fetch(url, where)


def image_prompt(text: str, images: Sequence[Image.Image], processor: ImageProcessor | None,
                 encode: Callable[[str], list[int]], image_token_id: int | None,
                 where: str = "messages", details: Sequence[str] | None = None) -> tuple[list[int], list[ImageInput]]:
    """The token ids and image inputs of a rendered prompt that holds one marker per image."""
    if processor is None or image_token_id is None:
        raise ImageError("this model takes text only: it cannot read images", where)
    return expand_images(text, images, processor, encode, image_token_id, where, details)
