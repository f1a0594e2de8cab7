"""LLaVA (``LlavaForConditionalGeneration``): a CLIP vision tower, a two-layer MLP projector,
and a Llama / Mistral language model.

Each image is one square tile at the tower's resolution (the processor resizes its shortest
edge and crops the centre); the tower's output after ``vision_feature_layer`` layers (HF's
hidden_states index: -2 is the next-to-last layer's output), without the class token with
the "default" strategy, goes through the projector: one embedding per patch, which replace
the prompt's ``<image>`` tokens in order. The tower stays in float in every mode but int8 (``quantize_tower``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagoda.model.arch import ModelArchConfig, UnsupportedModelError, renamed, text_config
from pagoda.model.layers.vision import VisionEncoder, VisionLanguage, activation, one_tile, vision_config
from pagoda.model.models.llama import LlamaForCausalLM

# transformers' CLIPVisionConfig defaults.
_CLIP_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                      num_channels=3, image_size=224, patch_size=32, layer_norm_eps=1e-5, hidden_act="quick_gelu")


class ClipEmbeddings(nn.Module):
    def __init__(self, v: dict[str, Any]) -> None:
        super().__init__()
        d, self.patch_size, self.image_size = v["hidden_size"], v["patch_size"], v["image_size"]
        self.class_embedding = nn.Parameter(torch.empty(d))
        self.patch_embedding = nn.Conv2d(v["num_channels"], d, self.patch_size, self.patch_size, bias=False)
        self.position_embedding = nn.Embedding((self.image_size // self.patch_size) ** 2 + 1, d)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:   # [n, C, S, S] -> [n, 1 + patches, d]
        patches = self.patch_embedding(pixels).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(pixels.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight[None]


class ClipVisionTransformer(nn.Module):
    def __init__(self, v: dict[str, Any]) -> None:
        super().__init__()
        self.embeddings = ClipEmbeddings(v)
        self.pre_layrnorm = nn.LayerNorm(v["hidden_size"], eps=v["layer_norm_eps"])   # CLIP's spelling
        self.encoder = VisionEncoder(v)
        self.post_layernorm = nn.LayerNorm(v["hidden_size"], eps=v["layer_norm_eps"])   # loaded, not read

    def forward(self, pixels: torch.Tensor, layers: int) -> torch.Tensor:
        """The hidden states after the first ``layers`` encoder layers."""
        x = self.pre_layrnorm(self.embeddings(pixels))
        for layer in self.encoder.layers[:layers]:
            x = layer(x)
        return x


class Projector(nn.Module):
    def __init__(self, v: dict[str, Any], text_hidden: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(v["hidden_size"], text_hidden, bias=v["projector_bias"])
        self.act = activation(v["projector_act"])
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=v["projector_bias"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


_TEXT_FAMILIES = ("llama", "mistral")
# transformers 5 writes language_model.model.*, vision_tower.* (the CLIP transformer's own
# names); other files model.language_model.*, vision_tower.vision_model.*.
_HF_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                ("language_model.lm_head.", "lm_head."), ("model.vision_tower.vision_model.", "vision_tower."),
                ("vision_tower.vision_model.", "vision_tower."), ("model.vision_tower.", "vision_tower."),
                ("model.multi_modal_projector.", "multi_modal_projector."))


class LlavaForConditionalGeneration(VisionLanguage, LlamaForCausalLM):
    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__(config)
        self.vision_tower = ClipVisionTransformer(config.vision)
        self.multi_modal_projector = Projector(config.vision, config.hidden_size)

    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        text = text_config(config)
        kind = text.get("model_type", "llama")
        if kind not in _TEXT_FAMILIES:
            raise UnsupportedModelError(f"LLaVA with a {kind!r} language model is not supported "
                                        f"(supported: {', '.join(_TEXT_FAMILIES)})")
        vc = config.get("vision_config") or {}
        if vc.get("model_type", "clip_vision_model") != "clip_vision_model":
            raise UnsupportedModelError(f"LLaVA with a {vc.get('model_type')!r} vision tower is not supported "
                                        "(supported: clip_vision_model)")
        v = vision_config(vc, _CLIP_DEFAULTS)
        layer = config.get("vision_feature_layer", -2)
        if not isinstance(layer, int):
            raise UnsupportedModelError("LLaVA with several vision_feature_layer values is not supported")
        total = v["num_hidden_layers"]
        layers = total + 1 + layer if layer < 0 else layer
        if not 0 <= layers <= total:
            raise UnsupportedModelError(f"vision_feature_layer {layer} is outside the tower's {total} layers")
        strategy = config.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise UnsupportedModelError(f"vision_feature_select_strategy {strategy!r} is not supported")
        token = config.get("image_token_id", config.get("image_token_index", 32000))
        v.update(feature_layers=layers, drop_cls=strategy == "default", image_token_id=int(token),
                 projector_act=config.get("projector_hidden_act", "gelu"),
                 projector_bias=bool(config.get("multimodal_projector_bias", True)))
        activation(v["projector_act"])
        return ModelArchConfig(**ModelArchConfig.hf_fields(text, architecture), vision=v)

    @classmethod
    def hf_name(cls, name: str) -> str | None:
        return renamed(name, _HF_PREFIXES)

    @classmethod
    def num_image_embeds(cls, vision: dict[str, Any], shape: tuple[int, ...]) -> int:
        size = one_tile(vision, shape)
        return (size // vision["patch_size"]) ** 2 + (0 if vision["drop_cls"] else 1)

    def embed_images(self, pixels: torch.Tensor) -> torch.Tensor:
        v = self.config.vision
        dtype = self.vision_tower.pre_layrnorm.weight.dtype   # (a norm: float in every mode)
        x = self.vision_tower(pixels.to(dtype), v["feature_layers"])
        if v["drop_cls"]:
            x = x[:, 1:]
        out = self.multi_modal_projector(x)
        return out.reshape(-1, out.shape[-1])
