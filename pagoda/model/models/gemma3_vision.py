"""Gemma 3 with its vision tower (``Gemma3ForConditionalGeneration``: 4B, 12B and 27B as
published): a SigLIP tower at one fixed resolution, a projector that average-pools its
patches to ``mm_tokens_per_image`` (256) vectors, normalises them with Gemma's RMSNorm and
projects them to the language model's width, and Gemma 3's language model.

What the language model adds for images: an image's tokens attend to each other in both
directions (transformers' token-type mask: OR(causal, same image), and within the window on
the local layers), so an image's placeholder span is ``vision["bidirectional"]``: the model
runner opens the attention mask over it (``PrefillChunk.open_spans``) and the scheduler never
ends a prompt chunk inside it (``SchedulerConfig.whole_images``). The image's embeddings are
spliced in unscaled (the text's are scaled by sqrt(hidden), as transformers does). Pan and
scan (several crops of a wide image) is off in the published processors and refused when on.
The tower stays in float in every mode but int8 (``quantize_tower``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.model.arch import ModelArchConfig, UnsupportedModelError, renamed, text_config
from pagoda.model.layers.vision import SiglipVisionTransformer, VisionLanguage, one_tile, vision_config
from pagoda.model.models.gemma3 import Gemma3ForCausalLM

# transformers' SiglipVisionConfig defaults (a config.json may leave any of them out).
_SIGLIP_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                        num_channels=3, image_size=224, patch_size=16, layer_norm_eps=1e-6,
                        hidden_act="gelu_pytorch_tanh")

_HF_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                ("language_model.lm_head.", "lm_head."), ("model.vision_tower.vision_model.", "vision_tower."),
                ("vision_tower.vision_model.", "vision_tower."), ("model.multi_modal_projector.", "multi_modal_projector."))


class SoftEmbeddingNorm(nn.Module):
    """Gemma's RMSNorm in float32, its weight held as 1 + w (the checkpoint's w plus one at load)."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).type_as(x)


class MultiModalProjector(nn.Module):
    def __init__(self, v: dict[str, Any], text_hidden: int) -> None:
        super().__init__()
        self.per_side = v["image_size"] // v["patch_size"]
        self.kernel = self.per_side // int(round(v["mm_tokens_per_image"] ** 0.5))
        self.mm_input_projection_weight = nn.Parameter(torch.empty(v["hidden_size"], text_hidden))
        self.mm_soft_emb_norm = SoftEmbeddingNorm(v["hidden_size"], v["layer_norm_eps"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # [n, patches, d] -> [n, tokens, text hidden]
        n, _, d = x.shape
        grid = x.transpose(1, 2).reshape(n, d, self.per_side, self.per_side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight)


class Gemma3ForConditionalGeneration(VisionLanguage, Gemma3ForCausalLM):
    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__(config)
        self.vision_tower = SiglipVisionTransformer(config.vision, exact_grid=True)
        self.multi_modal_projector = MultiModalProjector(config.vision, config.hidden_size)

    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        arch = super().arch_from_hf(text_config(config), architecture)
        v = vision_config(config.get("vision_config") or {}, _SIGLIP_DEFAULTS)
        tokens = int(config.get("mm_tokens_per_image", 256))
        side, per_side = int(round(tokens ** 0.5)), v["image_size"] // v["patch_size"]
        if side * side != tokens or per_side % side:
            raise UnsupportedModelError(f"mm_tokens_per_image {tokens} does not pool a {per_side}x{per_side} patch grid")
        v.update(mm_tokens_per_image=tokens, bidirectional=True,
                 image_token_id=int(config.get("image_token_id", config.get("image_token_index", 262144))))
        return dataclasses.replace(arch, vision=v)

    @classmethod
    def hf_name(cls, name: str) -> str | None:
        ours = renamed(name, _HF_PREFIXES)
        # SigLIP's pooling head (vision_use_head): not read by Gemma 3, not loaded.
        return None if ours.startswith("vision_tower.head.") else ours

    @classmethod
    def hf_tensor(cls, name: str, tensor: torch.Tensor) -> torch.Tensor:
        # SigLIP's LayerNorms are plain (the projector's RMSNorm is Gemma's: 1 + w).
        return tensor if "vision_tower." in name else super().hf_tensor(name, tensor)

    @classmethod
    def num_image_embeds(cls, vision: dict[str, Any], shape: tuple[int, ...]) -> int:
        one_tile(vision, shape)
        return vision["mm_tokens_per_image"]

    def embed_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """[1, C, S, S] float -> [mm_tokens_per_image, hidden]."""
        dtype = self.multi_modal_projector.mm_input_projection_weight.dtype
        out = self.multi_modal_projector(self.vision_tower(pixels.to(dtype)))
        return out.reshape(-1, out.shape[-1])
