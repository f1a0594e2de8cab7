"""Each family's image processor: an image's pixels as its encoder reads them, and the
placeholder text it becomes in the prompt.

Built from the checkpoint's own processor config (``preprocessor_config.json``, or the
``image_processor`` inside ``processor_config.json`` as transformers 5 writes it), with the
very operations of transformers' PIL image processors (``image_processing_pil_*``): PIL's
resampling on 8-bit pixels, then rescaling in float64 and normalising in float32, so the
same image gives the same pixel values (tests compare them). The 8-bit tiles travel to the
engine (``ImageInput.normalize``); the floats are made where the encoder runs.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np
from PIL import Image

from pagoda.multimodal.inputs import ImageError, ImageInput, rescale_normalize

__all__ = ["ImageProcessor", "ProcessedImage", "Idefics3ImageProcessor", "LlavaImageProcessor", "Gemma3ImageProcessor",
           "Gemma4ImageProcessor", "Qwen2VLImageProcessor", "load_image_processor", "expand_images"]


@dataclass(frozen=True)
class ProcessedImage:
    frames: np.ndarray          # uint8 [tiles, channels, height, width]: resized and cut
    normalize: tuple            # (rescale, mean, std): what makes them the encoder's floats
    text: str                   # the placeholder text the image's marker becomes
    num_embeds: int             # image tokens (embeddings) in ``text``

    @property
    def pixels(self) -> np.ndarray:
        """float32 [tiles, channels, height, width], as the encoder reads them."""
        return rescale_normalize(self.frames, *self.normalize)


class ImageProcessor(Protocol):
    image_marker: str           # what the chat template writes for an image ("<image>")
    image_token: str            # the placeholder token the encoder's embeddings replace
    identity: str               # the processor and its settings (joins each image's hash)

    def process(self, image: Image.Image, detail: str = "auto") -> ProcessedImage:
        """``detail``: OpenAI's image_url detail; "low" reads the image at the encoder's
        base resolution only (one tile where the family tiles), "auto" / "high" as the
        checkpoint's processor config says."""
        ...


def _config(path: str) -> dict[str, Any] | None:
    """The image processor's settings of an HF folder, None when it has none."""
    pre = os.path.join(path, "preprocessor_config.json")
    proc = os.path.join(path, "processor_config.json")
    settings = None
    if os.path.isfile(pre):
        with open(pre) as f:
            settings = json.load(f)
    outer: dict[str, Any] = {}
    if os.path.isfile(proc):
        with open(proc) as f:
            outer = json.load(f)
        if settings is None:
            settings = outer.get("image_processor")
    if settings is None:
        return None
    return {**{k: v for k, v in outer.items() if k != "image_processor"}, **settings}


def load_image_processor(path: str, model_config: dict[str, Any] | None = None,
                         mmproj: str | None = None) -> ImageProcessor | None:  # fmt: skip
    """The image processor of the model at ``path`` (an HF folder; a GGUF file with llama.cpp's
    projector file ``mmproj``), None for a model that takes text only."""
    if mmproj is not None:
        return _mmproj_processor(mmproj)
    if not os.path.isdir(path):
        return None
    if model_config is None:
        config_file = os.path.join(path, "config.json")
        if not os.path.isfile(config_file):
            return None
        with open(config_file) as f:
            model_config = json.load(f)
    archs = model_config.get("architectures") or []
    family = next((cls for arch, cls in _FAMILIES.items() if arch in archs), None)
    if family is None:
        return None
    settings = _config(path)
    if settings is None:
        raise ImageError(f"{path}: a {archs[0]} model without its processor config "
                         "(preprocessor_config.json or processor_config.json)")
    return family(settings, model_config)


def _mmproj_processor(mmproj: str) -> ImageProcessor:
    """The processor of a projector file, with the settings its HF processor config would
    give (llama.cpp's converter writes them into the file's ``clip.vision.*`` keys)."""
    from pagoda.hub.gguf_file import GGUFFile

    gf = GGUFFile(mmproj)
    try:
        md = dict(gf.metadata)
    finally:
        gf.close()
    kind = md.get("clip.projector_type") or md.get("clip.vision.projector_type")
    supported = ("idefics3", "gemma3", "gemma4v", *_MMPROJ_QWEN)
    if kind not in supported:
        raise ImageError(f"{mmproj}: projector type {kind!r} is not supported (supported: {', '.join(supported)})")
    p = "clip.vision."
    size, patch = md[p + "image_size"], md[p + "patch_size"]
    if kind == "gemma4v":
        # The file's pixel budget (llama.cpp's key) as the largest soft-token budget within it,
        # else the HF processor's default, 280 soft tokens (llama-server reads up to 1,120).
        kernel = int(md.get(p + "projector.scale_factor", 3))
        most = md.get(p + "image_max_pixels")
        tokens = 280 if not most else max([b for b in Gemma4ImageProcessor.BUDGETS
                                           if b * (patch * kernel) ** 2 <= most] or [70])
        return Gemma4ImageProcessor({"patch_size": patch, "pooling_kernel_size": kernel, "max_soft_tokens": tokens}, {})
    if kind in _MMPROJ_QWEN:
        # The pixel budget the file writes, else llama.cpp's for these models: 8 to 4096 tokens.
        merge = int(md.get(p + "spatial_merge_size", 2))
        cell = (patch * merge) ** 2
        settings = {"patch_size": patch, "merge_size": merge, "min_pixels": md.get(p + "image_min_pixels") or 8 * cell,
                    "max_pixels": md.get(p + "image_max_pixels") or 4096 * cell,
                    "image_mean": list(md.get(p + "image_mean", [0.5] * 3)),
                    "image_std": list(md.get(p + "image_std", [0.5] * 3))}
        return Qwen2VLImageProcessor(settings, {})
    scale = int(md.get(p + "projector.scale_factor", 2 if kind == "idefics3" else 4))
    tokens = (size // patch) ** 2 // (scale * scale)
    norm = {"image_mean": list(md.get(p + "image_mean", [0.5, 0.5, 0.5])),
            "image_std": list(md.get(p + "image_std", [0.5, 0.5, 0.5]))}
    if kind == "gemma3":
        return Gemma3ImageProcessor({"size": {"height": size, "width": size}, "image_seq_length": tokens, **norm}, {})
    settings = {"size": {"longest_edge": int(md.get(p + "preproc_image_size", size))},
                "max_image_size": {"longest_edge": size}, "do_image_splitting": True, "image_seq_len": tokens, **norm}
    return Idefics3ImageProcessor(settings, {"vision_config": {"image_size": size, "patch_size": patch},
                                             "scale_factor": scale})


_MMPROJ_QWEN = ("qwen2vl_merger", "qwen2.5vl_merger", "qwen3vl_merger")


def _require_rgb(settings: dict[str, Any], family: str) -> None:
    """Every family's processor reads RGB: a config turning the conversion off is refused."""
    if settings.get("do_convert_rgb") is False:
        raise ImageError(f"{family} image processors with do_convert_rgb false are not supported")


def _normalization(settings: dict[str, Any], mean: list[float], std: list[float]) -> tuple:
    """(rescale factor, mean, std) from a processor config (None where it turns one off);
    ``mean`` / ``std``: the family's defaults."""
    rescale = float(settings.get("rescale_factor", 1 / 255)) if settings.get("do_rescale", True) else None
    if not settings.get("do_normalize", True):
        return rescale, None, None
    return rescale, settings.get("image_mean", mean), settings.get("image_std", std)


def _norm(processor) -> tuple:
    """A processor's (rescale, mean, std) as ``ImageInput.normalize`` carries them."""
    return (processor.rescale, None if processor.mean is None else tuple(map(float, processor.mean)),
            None if processor.std is None else tuple(map(float, processor.std)))


# ---- Idefics3 (SmolVLM) ----------------------------------------------------------------

_MAX_IMAGE_SIZE = 4096   # transformers' MAX_IMAGE_SIZE for Idefics3


def _rescale_to_max_len(height: int, width: int, max_len: int) -> tuple[int, int]:
    aspect = width / height
    if width >= height:
        width = max_len
        height = int(width / aspect)
        if height % 2 != 0:
            height += 1
    else:
        height = max_len
        width = int(height * aspect)
        if width % 2 != 0:
            width += 1
    return max(height, 1), max(width, 1)


def _scale_below(height: int, width: int, max_len: int) -> tuple[int, int]:
    aspect = width / height
    if width >= height and width > max_len:
        width = max_len
        height = int(width / aspect)
    elif height > width and height > max_len:
        height = max_len
        width = int(height * aspect)
    return max(height, 1), max(width, 1)


class Idefics3ImageProcessor:
    """SmolVLM / Idefics3: the image resized so its longest edge is ``size``, then (with
    ``do_image_splitting``) resized up to whole tiles of ``max_image_size`` and cut into
    them, row by row, with the whole image resized to one tile after them; each tile is
    ``image_seq_len`` image tokens (after the connector's pixel shuffle), marked
    ``<row_r_col_c>`` and the whole image ``<global-img>``, between
    ``<fake_token_around_image>`` tokens."""

    image_marker = "<image>"
    image_token = "<image>"
    fake_token = "<fake_token_around_image>"
    global_tag = "<global-img>"

    def __init__(self, settings: dict[str, Any], model_config: dict[str, Any]) -> None:
        vision = model_config.get("vision_config") or {}
        scale = int(model_config.get("scale_factor", 2))
        image_size = int(vision.get("image_size", 224))
        patch = int(vision.get("patch_size", 32))
        self.image_seq_len = int(settings.get("image_seq_len") or ((image_size // patch) ** 2) // (scale * scale))
        self.do_resize = bool(settings.get("do_resize", True))
        self.size = int((settings.get("size") or {}).get("longest_edge", 4 * 364))
        self.tile = int((settings.get("max_image_size") or {}).get("longest_edge", 364))
        self.do_split = bool(settings.get("do_image_splitting", True))
        self.resample = Image.Resampling(int(settings.get("resample", Image.Resampling.LANCZOS)))
        self.rescale, self.mean, self.std = _normalization(settings, [0.5, 0.5, 0.5], [0.5, 0.5, 0.5])
        _require_rgb(settings, "Idefics3")
        keys = dict(seq=self.image_seq_len, resize=self.do_resize, size=self.size, tile=self.tile,
                    split=self.do_split, resample=int(self.resample), rescale=self.rescale, mean=self.mean,
                    std=self.std)
        self.identity = "idefics3:" + json.dumps(keys, sort_keys=True)

    def _resize(self, img: Image.Image, height: int, width: int) -> Image.Image:
        return img if img.size == (width, height) else img.resize((width, height), self.resample)

    def process(self, image: Image.Image, detail: str = "auto") -> ProcessedImage:
        """``detail`` "low": the whole image as one tile (no splitting)."""
        img = image
        if self.do_resize:
            h, w = _rescale_to_max_len(img.height, img.width, self.size)
            img = self._resize(img, *_scale_below(h, w, _MAX_IMAGE_SIZE))
        tile = self.tile
        rows = cols = 0
        if self.do_split and detail != "low":
            # Up to whole tiles, keeping the aspect ratio's rounding as transformers does.
            height, width = img.height, img.width
            aspect = width / height
            if width >= height:
                width = math.ceil(width / tile) * tile
                height = math.ceil(int(width / aspect) / tile) * tile
            else:
                height = math.ceil(height / tile) * tile
                width = math.ceil(int(height * aspect) / tile) * tile
            img = self._resize(img, height, width)
            if height > tile or width > tile:
                rows = (height - tile) // tile + 1
                cols = (width - tile) // tile + 1
                arr = np.asarray(img).transpose(2, 0, 1)
                frames = [arr[:, r * tile:(r + 1) * tile, c * tile:(c + 1) * tile]
                          for r in range(rows) for c in range(cols)]
                frames.append(np.asarray(self._resize(img, tile, tile)).transpose(2, 0, 1))
            else:
                frames = [np.asarray(img).transpose(2, 0, 1)]
        else:
            frames = [np.asarray(self._resize(img, tile, tile)).transpose(2, 0, 1)]
        pixels = np.stack(frames)
        tokens = self.image_token * self.image_seq_len
        if rows == 0 and cols == 0:
            text = f"{self.fake_token}{self.global_tag}{tokens}{self.fake_token}"
        else:
            text = ""
            for r in range(rows):
                for c in range(cols):
                    text += f"{self.fake_token}<row_{r + 1}_col_{c + 1}>{tokens}"
                text += "\n"
            text += f"\n{self.fake_token}{self.global_tag}{tokens}{self.fake_token}"
        return ProcessedImage(np.ascontiguousarray(pixels), _norm(self), text, self.image_seq_len * len(frames))


# ---- LLaVA ---------------------------------------------------------------------------------


class LlavaImageProcessor:
    """LLaVA (CLIP's processing): optionally padded to a square of the mean colour, the
    shortest edge resized to ``size``, the centre cropped to ``crop_size``; one tile, one
    ``<image>`` token per patch (plus the class token's unless the "default" strategy drops
    it). ``detail`` changes nothing: the tower reads one resolution."""

    image_marker = "<image>"

    def __init__(self, settings: dict[str, Any], model_config: dict[str, Any]) -> None:
        vision = model_config.get("vision_config") or {}
        self.image_token = settings.get("image_token", "<image>")
        self.image_marker = self.image_token
        patch = int(settings.get("patch_size") or vision.get("patch_size", 32))
        strategy = settings.get("vision_feature_select_strategy") or model_config.get(
            "vision_feature_select_strategy", "default")
        size = settings.get("size") or {"shortest_edge": 224}
        self.shortest = size.get("shortest_edge")
        self.fixed = (size["height"], size["width"]) if self.shortest is None else None
        self.do_resize = bool(settings.get("do_resize", True))
        crop = settings.get("crop_size") or {"height": 224, "width": 224}
        self.crop = (int(crop["height"]), int(crop["width"])) if settings.get("do_center_crop", True) else None
        self.resample = Image.Resampling(int(settings.get("resample", Image.Resampling.BICUBIC)))
        self.rescale, self.mean, self.std = _normalization(settings, [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711])
        self.pad = bool(settings.get("do_pad", False))
        _require_rgb(settings, "LLaVA")
        out_h, out_w = self.crop or self.fixed or (self.shortest, self.shortest)
        extra = int(settings.get("num_additional_image_tokens", 0))
        self.num_tokens = (out_h // patch) * (out_w // patch) + extra - (1 if strategy == "default" else 0)
        keys = dict(shortest=self.shortest, fixed=self.fixed, crop=self.crop, resample=int(self.resample),
                    rescale=self.rescale, mean=self.mean, std=self.std, pad=self.pad, tokens=self.num_tokens)
        self.identity = "llava:" + json.dumps(keys, sort_keys=True)

    def process(self, image: Image.Image, detail: str = "auto") -> ProcessedImage:
        arr = np.asarray(image).transpose(2, 0, 1)
        if self.pad and arr.shape[1] != arr.shape[2]:
            side = max(arr.shape[1:])
            color = [int(x * 255) for x in self.mean] if self.mean else [0, 0, 0]
            square = np.empty((3, side, side), dtype=arr.dtype)
            square[:] = np.asarray(color, dtype=arr.dtype)[:, None, None]
            h, w = arr.shape[1:]
            if w > h:
                square[:, (side - h) // 2:(side - h) // 2 + h, :] = arr
            else:
                square[:, :, (side - w) // 2:(side - w) // 2 + w] = arr
            arr = square
        if self.do_resize:
            h, w = arr.shape[1:]
            if self.shortest is not None:
                short, long = (w, h) if w <= h else (h, w)
                new_short, new_long = self.shortest, int(self.shortest * long / short)
                h, w = (new_long, new_short) if w <= h else (new_short, new_long)
            else:
                h, w = self.fixed
            img = Image.fromarray(arr.transpose(1, 2, 0))
            if img.size != (w, h):
                img = img.resize((w, h), self.resample)
            arr = np.asarray(img).transpose(2, 0, 1)
        if self.crop is not None:
            arr = _center_crop(arr, *self.crop)
        return ProcessedImage(np.ascontiguousarray(arr[None]), _norm(self), self.image_token * self.num_tokens,
                              self.num_tokens)


# ---- Gemma 3 ---------------------------------------------------------------------------------


class Gemma3ImageProcessor:
    """Gemma 3 (SigLIP's processing): the image resized to the tower's square (bilinear; no
    crop, no padding), one tile of ``image_seq_length`` image tokens between
    ``<start_of_image>`` and ``<end_of_image>``, a blank line on each side; the chat template
    writes ``<start_of_image>`` where the image goes. Pan and scan (extra crops of a wide
    image) is refused. ``detail`` changes nothing: the tower reads one resolution."""

    image_marker = "<start_of_image>"
    image_token = "<image_soft_token>"
    end_token = "<end_of_image>"

    def __init__(self, settings: dict[str, Any], model_config: dict[str, Any]) -> None:
        if settings.get("do_pan_and_scan"):
            raise ImageError("a Gemma 3 processor with do_pan_and_scan is not supported")
        _require_rgb(settings, "Gemma 3")
        size = settings.get("size") or {"height": 224, "width": 224}
        self.size = (int(size["height"]), int(size["width"]))
        self.do_resize = bool(settings.get("do_resize", True))
        self.resample = Image.Resampling(int(settings.get("resample", Image.Resampling.BILINEAR)))
        self.rescale, self.mean, self.std = _normalization(settings, [0.5, 0.5, 0.5], [0.5, 0.5, 0.5])
        self.num_tokens = int(settings.get("image_seq_length") or model_config.get("mm_tokens_per_image", 256))
        keys = dict(size=self.size, resize=self.do_resize, resample=int(self.resample), rescale=self.rescale,
                    mean=self.mean, std=self.std, tokens=self.num_tokens)
        self.identity = "gemma3:" + json.dumps(keys, sort_keys=True)

    def process(self, image: Image.Image, detail: str = "auto") -> ProcessedImage:
        h, w = self.size
        img = image if not self.do_resize or image.size == (w, h) else image.resize((w, h), self.resample)
        frames = np.asarray(img).transpose(2, 0, 1)[None]
        text = f"\n\n{self.image_marker}{self.image_token * self.num_tokens}{self.end_token}\n\n"
        return ProcessedImage(np.ascontiguousarray(frames), _norm(self), text, self.num_tokens)


# ---- Qwen2-VL / Qwen2.5-VL ---------------------------------------------------------------


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's target size: each side a multiple of ``factor`` (patch x merge), the area
    within [min_pixels, max_pixels], the aspect ratio kept as near as that allows."""
    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"an image of {width}x{height} pixels: its aspect ratio must be below 200")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


class Qwen2VLImageProcessor:
    """Qwen2-VL / Qwen2.5-VL (dynamic resolution): the image resized (bicubic) to whole
    cells of ``patch_size x merge_size`` pixels with its area between ``min_pixels`` and
    ``max_pixels`` (``size``'s shortest_edge / longest_edge in transformers 5's configs), one
    ``<|image_pad|>`` token per cell; the chat template writes one ``<|image_pad|>`` between
    ``<|vision_start|>`` and ``<|vision_end|>`` per image. The model cuts the patches
    (``pagoda/model/models/qwen2_vl.py``). ``detail`` "low": at most ``LOW_DETAIL_CELLS``
    cells (tokens), as OpenAI's low detail reads a small copy of the image."""

    image_marker = "<|image_pad|>"
    image_token = "<|image_pad|>"
    LOW_DETAIL_CELLS = 256

    def __init__(self, settings: dict[str, Any], model_config: dict[str, Any]) -> None:
        _require_rgb(settings, "Qwen2-VL")
        size = settings.get("size") or {}
        self.min_pixels = int(settings.get("min_pixels") or size.get("shortest_edge") or 56 * 56)
        self.max_pixels = int(settings.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280)
        self.patch = int(settings.get("patch_size", 14))
        self.merge = int(settings.get("merge_size", 2))
        if int(settings.get("temporal_patch_size", 2)) != int((model_config.get("vision_config") or {}).get(
                "temporal_patch_size", 2)):
            raise ImageError("the processor's temporal_patch_size differs from the vision tower's")
        self.do_resize = bool(settings.get("do_resize", True))
        self.resample = Image.Resampling(int(settings.get("resample", Image.Resampling.BICUBIC)))
        self.rescale, self.mean, self.std = _normalization(settings, [0.48145466, 0.4578275, 0.40821073],
                                                           [0.26862954, 0.26130258, 0.27577711])
        keys = dict(min=self.min_pixels, max=self.max_pixels, patch=self.patch, merge=self.merge,
                    resize=self.do_resize, resample=int(self.resample), rescale=self.rescale, mean=self.mean,
                    std=self.std)
        self.identity = "qwen2_vl:" + json.dumps(keys, sort_keys=True)

    def process(self, image: Image.Image, detail: str = "auto") -> ProcessedImage:
        factor = self.patch * self.merge
        h, w = image.height, image.width
        if self.do_resize:
            most = self.max_pixels if detail != "low" else min(self.max_pixels, self.LOW_DETAIL_CELLS * factor * factor)
            h, w = smart_resize(h, w, factor, min(self.min_pixels, most), most)
            if image.size != (w, h):
                image = image.resize((w, h), self.resample)
        elif h % factor or w % factor:
            raise ImageError(f"an image of {w}x{h} pixels: without resizing, its sides must be multiples of {factor}")
        frames = np.asarray(image).transpose(2, 0, 1)[None]
        cells = (h // factor) * (w // factor)
        return ProcessedImage(np.ascontiguousarray(frames), _norm(self), self.image_token * cells, cells)


# ---- Mistral 3 (Pixtral) -------------------------------------------------------------------


class PixtralImageProcessor:
    """Mistral 3's (Pixtral's processing): an image whose longer side passes ``longest_edge``
    shrunk to fit it, then both sides rounded up to whole cells of ``patch_size x
    spatial_merge_size`` pixels (bicubic), normalised; a row of ``[IMG]`` per row of cells,
    each row ended by ``[IMG_BREAK]`` and the last by ``[IMG_END]``; the chat template writes
    ``[IMG]`` once per image. ``detail`` "low": the longer side at most 512 pixels."""

    image_marker = "[IMG]"
    image_token = "[IMG]"
    LOW_DETAIL_EDGE = 512

    def __init__(self, settings: dict[str, Any], model_config: dict[str, Any]) -> None:
        _require_rgb(settings, "Pixtral")
        vision = model_config.get("vision_config") or {}
        patch = settings.get("patch_size") or vision.get("patch_size", 16)
        patch = int(patch["height"] if isinstance(patch, dict) else patch)
        self.cell = patch * int(settings.get("spatial_merge_size") or model_config.get("spatial_merge_size", 2))
        self.longest = int((settings.get("size") or {}).get("longest_edge", 1024))
        self.do_resize = bool(settings.get("do_resize", True))
        self.resample = Image.Resampling(int(settings.get("resample", Image.Resampling.BICUBIC)))
        self.rescale, self.mean, self.std = _normalization(settings, [0.48145466, 0.4578275, 0.40821073],
                                                           [0.26862954, 0.26130258, 0.27577711])
        self.image_break = settings.get("image_break_token", "[IMG_BREAK]")
        self.image_end = settings.get("image_end_token", "[IMG_END]")
        keys = dict(cell=self.cell, longest=self.longest, resize=self.do_resize, resample=int(self.resample),
                    rescale=self.rescale, mean=self.mean, std=self.std)
        self.identity = "pixtral:" + json.dumps(keys, sort_keys=True)

    def process(self, image: Image.Image, detail: str = "auto") -> ProcessedImage:
        h, w = image.height, image.width
        if self.do_resize:
            longest = self.longest if detail != "low" else min(self.longest, self.LOW_DETAIL_EDGE)
            ratio = max(h / longest, w / longest)
            if ratio > 1:
                h, w = int(math.floor(h / ratio)), int(math.floor(w / ratio))
            h, w = ((h - 1) // self.cell + 1) * self.cell, ((w - 1) // self.cell + 1) * self.cell
            if image.size != (w, h):
                image = image.resize((w, h), self.resample)
        elif h % self.cell or w % self.cell:
            raise ImageError(f"an image of {w}x{h} pixels: without resizing, its sides must be multiples of {self.cell}")
        rows, cols = h // self.cell, w // self.cell
        text = ((self.image_token * cols + self.image_break) * rows)[:-len(self.image_break)] + self.image_end
        frames = np.asarray(image).transpose(2, 0, 1)[None]
        return ProcessedImage(np.ascontiguousarray(frames), _norm(self), text, rows * cols)


# ---- Gemma 4 ---------------------------------------------------------------------------------


class Gemma4ImageProcessor:
    """Gemma 4 (variable resolution): the image resized (bicubic), its aspect ratio kept, to
    the most ``patch_size`` patches ``max_soft_tokens`` x ``pooling_kernel_size``^2 allows with
    both sides whole pooling cells; rescaled to [0, 1], not normalised. One ``<|image|>`` per
    pooling cell, between ``<|image>`` and ``<image|>``; the chat template writes
    ``<|image|>`` once per image. ``detail`` "low": at most 70 soft tokens (the smallest
    budget the processor offers)."""

    image_marker = "<|image|>"
    image_token = "<|image|>"
    begin, end = "<|image>", "<image|>"
    BUDGETS = (70, 140, 280, 560, 1120)

    def __init__(self, settings: dict[str, Any], model_config: dict[str, Any]) -> None:
        _require_rgb(settings, "Gemma 4")
        self.patch = int(settings.get("patch_size", 16))
        self.kernel = int(settings.get("pooling_kernel_size", 3))
        self.max_tokens = int(settings.get("max_soft_tokens") or settings.get("image_seq_length") or 280)
        if self.max_tokens not in self.BUDGETS:
            raise ImageError(f"a Gemma 4 processor with max_soft_tokens {self.max_tokens} (supported: {self.BUDGETS})")
        self.do_resize = bool(settings.get("do_resize", True))
        self.resample = Image.Resampling(int(settings.get("resample", Image.Resampling.BICUBIC)))
        self.rescale, self.mean, self.std = _normalization({"do_normalize": False, **settings}, [0.0] * 3, [1.0] * 3)
        keys = dict(patch=self.patch, kernel=self.kernel, tokens=self.max_tokens, resize=self.do_resize,
                    resample=int(self.resample), rescale=self.rescale, mean=self.mean, std=self.std)
        self.identity = "gemma4:" + json.dumps(keys, sort_keys=True)

    def _size(self, height: int, width: int, tokens: int) -> tuple[int, int]:
        """transformers' aspect-ratio-preserving size for a budget of ``tokens`` soft tokens."""
        target = tokens * self.kernel ** 2 * self.patch ** 2
        factor = math.sqrt(target / (height * width))
        side = self.kernel * self.patch
        h = int(math.floor(factor * height / side)) * side
        w = int(math.floor(factor * width / side)) * side
        if h == 0 and w == 0:
            raise ImageError(f"an image of {width}x{height} pixels is too small or too thin to read")
        longest = tokens * side
        if h == 0:
            h, w = side, min(int(math.floor(width / height)) * side, longest)
        elif w == 0:
            w, h = side, min(int(math.floor(height / width)) * side, longest)
        if h * w > target:
            raise ImageError(f"an image of {width}x{height} pixels does not fit {tokens} soft tokens")
        return h, w

    def process(self, image: Image.Image, detail: str = "auto") -> ProcessedImage:
        tokens = self.BUDGETS[0] if detail == "low" else self.max_tokens
        h, w = image.height, image.width
        if self.do_resize:
            h, w = self._size(h, w, tokens)
            if image.size != (w, h):
                image = image.resize((w, h), self.resample)
        side = self.kernel * self.patch
        if h % side or w % side:
            raise ImageError(f"an image of {w}x{h} pixels: without resizing, its sides must be multiples of {side}")
        frames = np.asarray(image).transpose(2, 0, 1)[None]
        cells = (h // side) * (w // side)
        return ProcessedImage(np.ascontiguousarray(frames), _norm(self), f"{self.begin}{self.image_token * cells}{self.end}",
                              cells)


def _center_crop(arr: np.ndarray, height: int, width: int) -> np.ndarray:
    """transformers' ``center_crop``: the centre, zero-padded first where the image is smaller."""
    h, w = arr.shape[1:]
    top, left = (h - height) // 2, (w - width) // 2
    if top >= 0 and left >= 0 and top + height <= h and left + width <= w:
        return arr[:, top:top + height, left:left + width]
    new_h, new_w = max(height, h), max(width, w)
    padded = np.zeros((arr.shape[0], new_h, new_w), dtype=arr.dtype)
    top_pad, left_pad = math.ceil((new_h - h) / 2), math.ceil((new_w - w) / 2)
    padded[:, top_pad:top_pad + h, left_pad:left_pad + w] = arr
    top, left = top + top_pad, left + left_pad
    return padded[:, max(top, 0):max(top, 0) + height, max(left, 0):max(left, 0) + width]


def image_hash(processor: ImageProcessor, frames: np.ndarray) -> str:
    """The processed image's key: the processor's identity (its settings, normalisation
    included) and its 8-bit pixels."""
    h = hashlib.sha256(processor.identity.encode())
    h.update(repr(frames.shape).encode())
    h.update(frames.tobytes())
    return h.hexdigest()


def expand_images(text: str, images: Sequence[Image.Image], processor: ImageProcessor,
                  encode, image_token_id: int, where: str = "messages",
                  details: Sequence[str] | None = None) -> tuple[list[int], list[ImageInput]]:  # fmt: skip
    """The token ids of a prompt whose text holds one ``image_marker`` per image, each
    marker replaced by the image's placeholder text, and the images' inputs (their spans
    located in the token ids). ``encode``: text -> token ids (the model's tokenizer);
    ``details``: each image's detail (``ImageProcessor.process``), "auto" when None."""
    marker = processor.image_marker
    parts = text.split(marker)
    if len(parts) - 1 != len(images):
        raise ImageError(f"the prompt holds {len(parts) - 1} image placeholder(s) {marker!r} for "
                         f"{len(images)} image(s)", where)  # fmt: skip
    details = details or ["auto"] * len(images)
    processed = [processor.process(img, detail) for img, detail in zip(images, details)]
    out = parts[0]
    for p, rest in zip(processed, parts[1:]):
        out += p.text + rest
    ids = encode(out)
    positions = [i for i, t in enumerate(ids) if t == image_token_id]
    if len(positions) != sum(p.num_embeds for p in processed):
        raise ImageError(f"the prompt's image tokens ({len(positions)}) do not match its images' "
                         f"({sum(p.num_embeds for p in processed)}): does the text hold {marker!r} itself?", where)
    inputs = []
    at = 0
    for p in processed:
        first, last = positions[at], positions[at + p.num_embeds - 1]
        at += p.num_embeds
        inputs.append(ImageInput(image_hash(processor, p.frames), first, last - first + 1, p.frames.tobytes(),
                                 tuple(p.frames.shape), p.normalize))
    return ids, inputs


# HF architecture -> its image processor.
_FAMILIES: dict[str, type] = {"Idefics3ForConditionalGeneration": Idefics3ImageProcessor,
                              "LlavaForConditionalGeneration": LlavaImageProcessor,
                              "Gemma3ForConditionalGeneration": Gemma3ImageProcessor,
                              "Gemma4ForConditionalGeneration": Gemma4ImageProcessor,
                              "Mistral3ForConditionalGeneration": PixtralImageProcessor,
                              "Qwen2VLForConditionalGeneration": Qwen2VLImageProcessor,
                              "Qwen2_5_VLForConditionalGeneration": Qwen2VLImageProcessor,
                              "Qwen3VLForConditionalGeneration": Qwen2VLImageProcessor,
                              "Qwen3VLMoeForConditionalGeneration": Qwen2VLImageProcessor,
                              "Qwen3_5ForConditionalGeneration": Qwen2VLImageProcessor,
                              "Qwen3_5MoeForConditionalGeneration": Qwen2VLImageProcessor}
