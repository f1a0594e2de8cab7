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
from typing import Any, Iterator

import torch

from pagoda.model.arch import UnsupportedModelError

# Projector type -> the HF architecture of the vision-language family that serves it.
PROJECTORS = {"idefics3": "Idefics3ForConditionalGeneration"}

_LAYER = re.compile(r"^v\.blk\.(\d+)\.(\w+)\.(weight|bias)$")
_IDEFICS3_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                   "attn_out": "self_attn.out_proj", "ln1": "layer_norm1", "ln2": "layer_norm2",
                   "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"}
_IDEFICS3_OTHER = {"v.patch_embd.weight": "vision_model.embeddings.patch_embedding.weight",
                   "v.patch_embd.bias": "vision_model.embeddings.patch_embedding.bias",
                   "v.position_embd.weight": "vision_model.embeddings.position_embedding.weight",
                   "v.post_ln.weight": "vision_model.post_layernorm.weight",
                   "v.post_ln.bias": "vision_model.post_layernorm.bias",
                   "mm.model.fc.weight": "connector.modality_projection.proj.weight"}


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
    kind = projector_type(md, path)
    p = "clip.vision."
    if "<image>" not in tokens:
        raise UnsupportedModelError(f"{path}: the language model's vocabulary has no '<image>' token")
    vision = dict(hidden_size=md[p + "embedding_length"], intermediate_size=md[p + "feed_forward_length"],
                  num_hidden_layers=md[p + "block_count"], num_attention_heads=md[p + "attention.head_count"],
                  num_channels=3, image_size=md[p + "image_size"], patch_size=md[p + "patch_size"],
                  layer_norm_eps=float(md.get(p + "attention.layer_norm_epsilon", 1e-6)),
                  hidden_act="gelu_pytorch_tanh", scale_factor=int(md.get(p + "projector.scale_factor", 2)),
                  image_token_id=tokens.index("<image>"))
    return PROJECTORS[kind], vision


def mmproj_names(md: dict[str, Any], tensor_names: list[str], path: str) -> dict[str, str]:
    """The projector file's tensor names -> the family's HF names."""
    projector_type(md, path)
    names = {}
    for name in tensor_names:
        m = _LAYER.match(name)
        if m is not None and m.group(2) in _IDEFICS3_LAYER:
            names[name] = f"vision_model.encoder.layers.{m.group(1)}.{_IDEFICS3_LAYER[m.group(2)]}.{m.group(3)}"
        elif name in _IDEFICS3_OTHER:
            names[name] = _IDEFICS3_OTHER[name]
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
