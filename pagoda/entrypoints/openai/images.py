"""Images at the HTTP edge: a request's images taken out of its messages, decoded and
processed for the served model, every problem a 400 naming the part (pagoda/multimodal)."""

from __future__ import annotations

import functools
from typing import Any

from pagoda.engine.client import EngineClient
from pagoda.entrypoints.openai.errors import bad_request
from pagoda.hub.stores import resolve_model
from pagoda.multimodal.fetch import MediaFetcher
from pagoda.multimodal.inputs import ImageError, ImageInput, MultiModalLimits
from pagoda.multimodal.processors import ImageProcessor, load_image_processor
from pagoda.multimodal.prompts import ChatImages, first_image_part, image_prompt, take_images


@functools.lru_cache(maxsize=16)
def _processor(path: str, mmproj: str | None) -> ImageProcessor | None:
    return load_image_processor(path, mmproj=mmproj)


class ImagePrompts:
    """The served model's image processor (None: it takes text only) and the request limits."""

    def __init__(self, engine: EngineClient) -> None:
        config = engine.config
        self.tokenizer = engine.tokenizer
        self.processor = _processor(resolve_model(config.model).path, config.mmproj)
        self.image_token_id = (self.tokenizer.token_to_id(self.processor.image_token)
                               if self.processor is not None else None)
        self.limits = MultiModalLimits(max_images=config.max_images)
        self.fetch = MediaFetcher(tuple(config.allowed_media_domains or ()), config.allowed_local_media_path,
                                  self.limits, config.media_fetch_timeout)

    def take(self, messages: list[dict[str, Any]]) -> ChatImages:
        """The messages as the template reads them, and their images decoded."""
        if self.processor is None:
            where = first_image_part(messages)
            if where is not None:
                raise bad_request(f"{where}: this model takes text only; it cannot read images.", param=where)
        try:
            found = take_images(messages, self.limits, self.fetch)
        except ImageError as e:
            raise bad_request(str(e), param=e.param) from None
        return found

    def expand(self, text: str, images: ChatImages) -> tuple[list[int], list[ImageInput]]:
        """The prompt's token ids with each image's placeholders, and the images' inputs."""
        try:
            return image_prompt(text, images.images, self.processor,
                                lambda t: self.tokenizer.encode(t, add_special_tokens=False), self.image_token_id,
                                "messages", images.details)
        except ImageError as e:
            raise bad_request(str(e), param=e.param) from None
