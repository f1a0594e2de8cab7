"""llama.cpp's multimodal projector files (``--mmproj``): a vision tower and its projector in
a GGUF file of their own (``general.architecture`` "clip"), served beside a GGUF language
model as the vision-language family the projector type names.

``mmproj_vision(md, tokens)`` reads the tower's geometry from the file's ``clip.vision.*``
keys into the family's ``ModelArchConfig.vision``; ``mmproj_tensors`` yields its tensors under
the family's HF names (float32). The image processor's settings come from the same keys
(``pagoda.multimodal.processors.load_image_processor``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from pagoda.model.arch import UnsupportedModelError

@dataclass(frozen=True)
class Projector:
    family: str                  # the HF architecture of the vision-language family that serves it
    text: str                    # the language model's architecture it goes with
    tower: str                   # the family's name prefix of its tower
    image_token: str             # the placeholder token its embeddings replace
    scale_factor: int            # llama.cpp's default where the file writes none
    other: dict[str, str]        # its projector's tensors -> the family's names
    pooled: bool = False         # patches pooled to a fixed count of image tokens that attend
                                 # to each other both ways (Gemma 3), not pixel-shuffled (Idefics3)


PROJECTORS = {
    "idefics3": Projector("Idefics3ForConditionalGeneration", "LlamaForCausalLM", "vision_model.", "<image>", 2,
                          {"mm.model.fc.weight": "connector.modality_projection.proj.weight"}),
    "gemma3": Projector("Gemma3ForConditionalGeneration", "Gemma3ForCausalLM", "vision_tower.", "<image_soft_token>",
                        4, {"mm.input_projection.weight": "multi_modal_projector.mm_input_projection_weight",
                            "mm.soft_emb_norm.weight": "multi_modal_projector.mm_soft_emb_norm.weight"},
                        pooled=True),
}

_LAYER = re.compile(r"^v\.blk\.(\d+)\.(\w+)\.(weight|bias)$")
_LAYER_PARTS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_out": "self_attn.out_proj", "ln1": "layer_norm1", "ln2": "layer_norm2",
                "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"}
# The SigLIP tower's other tensors, under the tower's prefix.
_TOWER_OTHER = {"v.patch_embd.weight": "embeddings.patch_embedding.weight",
                "v.patch_embd.bias": "embeddings.patch_embedding.bias",
                "v.position_embd.weight": "embeddings.position_embedding.weight",
                "v.post_ln.weight": "post_layernorm.weight", "v.post_ln.bias": "post_layernorm.bias"}


def projector_type(md: dict[str, Any], path: str) -> str:
    if md.get("general.architecture") != "clip" or not md.get("clip.has_vision_encoder"):
        raise UnsupportedModelError(f"{path} is not a multimodal projector file with a vision encoder "
                                    "(llama.cpp's convert_hf_to_gguf.py --mmproj writes them)")
    kind = md.get("clip.projector_type")
    if kind not in PROJECTORS:
        raise UnsupportedModelError(f"{path}: projector type {kind!r} is not supported "
                                    f"(supported: {', '.join(PROJECTORS)})")
    return kind


def mmproj_vision(md: dict[str, Any], tokens: list[str], path: str) -> tuple[str, dict[str, Any]]:
    """(the family's HF architecture, its vision dict) from a projector file's metadata and the
    language model's vocabulary (the image token's id)."""
    proj = PROJECTORS[projector_type(md, path)]
    p = "clip.vision."
    if proj.image_token not in tokens:
        raise UnsupportedModelError(f"{path}: the language model's vocabulary has no {proj.image_token!r} token")
    scale = int(md.get(p + "projector.scale_factor", proj.scale_factor))
    vision = dict(hidden_size=md[p + "embedding_length"], intermediate_size=md[p + "feed_forward_length"],
                  num_hidden_layers=md[p + "block_count"], num_attention_heads=md[p + "attention.head_count"],
                  num_channels=3, image_size=md[p + "image_size"], patch_size=md[p + "patch_size"],
                  layer_norm_eps=float(md.get(p + "attention.layer_norm_epsilon", 1e-6)),
                  hidden_act="gelu_pytorch_tanh", image_token_id=tokens.index(proj.image_token))
    if proj.pooled:
        vision.update(mm_tokens_per_image=(vision["image_size"] // vision["patch_size"] // scale) ** 2,
                      bidirectional=True)
    else:
        vision.update(scale_factor=scale)
    return proj.family, vision


def mmproj_names(md: dict[str, Any], tensor_names: list[str], path: str) -> dict[str, str]:
    """The projector file's tensor names -> the family's HF names."""
    proj = PROJECTORS[projector_type(md, path)]
    names = {}
    for name in tensor_names:
        m = _LAYER.match(name)
        if m is not None and m.group(2) in _LAYER_PARTS:
            names[name] = f"{proj.tower}encoder.layers.{m.group(1)}.{_LAYER_PARTS[m.group(2)]}.{m.group(3)}"
        elif name in _TOWER_OTHER:
            names[name] = proj.tower + _TOWER_OTHER[name]
        elif name in proj.other:
            names[name] = proj.other[name]
        else:
            raise UnsupportedModelError(f"{path}: tensor {name} of the projector is not known")
    return names


def mmproj_tensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The projector file's tensors under the family's HF names, as float32."""
    from pagoda.hub.gguf_file import GGUFFile
    from pagoda.model.gguf_tensors import load_tensor

    gf = GGUFFile(path)
    try:
        names = mmproj_names(gf.metadata, list(gf.tensors), path)
        for gguf_name, hf_name in names.items():
            yield hf_name, load_tensor(gf, gguf_name, dtype=torch.float32)
    finally:
        gf.close()
