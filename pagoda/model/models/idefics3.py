"""Idefics3 (SmolVLM): a SigLIP-style vision tower of variable resolution, a pixel-shuffle
connector, and a Llama language model.

Each image tile (``pagoda/multimodal/processors.py`` cuts them) goes through the tower
(patch convolution, learned positions, pre-norm encoder layers of bidirectional attention,
a final LayerNorm); the connector folds each ``scale_factor`` x ``scale_factor`` square of
patches into one vector (the pixel shuffle) and projects it to the language model's width:
``image_seq_len`` embeddings per tile, which replace the prompt's ``<image>`` tokens in order.
The tower stays in float in every mode but int8 (``quantize_tower``; the other quantized modes
convert the language model only).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagoda.model.arch import ModelArchConfig, renamed, text_config
from pagoda.model.layers.vision import SiglipVisionTransformer, VisionLanguage, vision_config
from pagoda.model.models.llama import LlamaForCausalLM


class ModalityProjection(nn.Module):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, out_features, bias=False)


class Connector(nn.Module):
    def __init__(self, v: dict[str, Any], text_hidden: int) -> None:
        super().__init__()
        self.scale = v["scale_factor"]
        self.modality_projection = ModalityProjection(v["hidden_size"] * self.scale ** 2, text_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # [n, patches, d] -> [n, patches / s^2, text hidden]
        n, seq, d = x.shape
        side, s = int(round(seq ** 0.5)), self.scale
        # The pixel shuffle: each s x s square of patches becomes one vector of s^2 x d.
        x = x.view(n, side, side // s, d * s).permute(0, 2, 1, 3)
        x = x.reshape(n, side // s, side // s, d * s * s).permute(0, 2, 1, 3)
        return self.modality_projection.proj(x.reshape(n, seq // (s * s), d * s * s))


# transformers' Idefics3VisionConfig defaults (a config.json may leave any of them out).
_VISION_DEFAULTS = dict(hidden_size=1152, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=16,
                        num_channels=3, image_size=224, patch_size=32, layer_norm_eps=1e-6,
                        hidden_act="gelu_pytorch_tanh")


class Idefics3ForConditionalGeneration(VisionLanguage, LlamaForCausalLM):
    gguf_qk_permuted = True
    tower_prefixes = ("vision_model.", "connector.")

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__(config)
        v = config.vision
        self.vision_model = SiglipVisionTransformer(v)
        self.connector = Connector(v, config.hidden_size)

    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        text = text_config(config)
        fields = ModelArchConfig.hf_fields(text, architecture)
        vision = vision_config(config.get("vision_config") or {}, _VISION_DEFAULTS)
        vision.update(scale_factor=int(config.get("scale_factor", 2)),
                      image_token_id=int(config.get("image_token_id", 128257)))
        return ModelArchConfig(**fields, vision=vision)

    @classmethod
    def hf_name(cls, name: str) -> str | None:
        return renamed(name, (("model.text_model.", "model."), ("model.vision_model.", "vision_model."),
                              ("model.connector.", "connector.")))

    @classmethod
    def num_image_embeds(cls, vision: dict[str, Any], shape: tuple[int, ...]) -> int:
        """The embeddings an image of pixel ``shape`` (tiles, C, H, W) becomes; ValueError for
        a shape the tower cannot read."""
        if len(shape) != 4 or shape[1] != vision["num_channels"]:
            raise ValueError(f"image pixels of shape {tuple(shape)}; expected (tiles, {vision['num_channels']}, H, W)")
        step = vision["patch_size"] * vision["scale_factor"]
        if shape[0] < 1 or shape[2] % step or shape[3] % step or shape[2] != shape[3]:
            raise ValueError(f"image tiles of {shape[2]}x{shape[3]} pixels; expected squares of a multiple of {step}")
        return shape[0] * (shape[2] // step) * (shape[3] // step)

    def embed_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """[tiles, C, H, W] float -> [tiles x image_seq_len, hidden]: the embeddings that
        replace the image's tokens, in order."""
        dtype = self.vision_model.post_layernorm.weight.dtype   # (a norm: float in every mode)
        out = self.connector(self.vision_model(pixels.to(dtype)))
        return out.reshape(-1, out.shape[-1])
