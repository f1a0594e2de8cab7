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
    families: dict[str, str]     # the language model's architecture -> the family serving the pair
    tower: str                   # the family's name prefix of its tower
    image_token: str             # the placeholder token its embeddings replace
    scale_factor: int            # llama.cpp's default where the file writes none
    other: dict[str, str]        # its projector's tensors -> the family's names
    pooled: bool = False         # patches pooled to a fixed count of image tokens that attend
                                 # to each other both ways (Gemma 3), not pixel-shuffled (Idefics3)
    layers: str = "encoder.layers."            # the family's prefix of its tower's layers
    layer_parts: dict[str, str] | None = None  # a layer's tensors -> the family's names (None: SigLIP's)
    tower_other: dict[str, str] | None = None  # the tower's other tensors, under its prefix (None: SigLIP's)
    weight_leaf: dict[str, str] | None = None  # a layer part's weight -> its leaf (Gemma 4's linear.weight)


# SigLIP's layers and other tensors (Idefics3, Gemma 3), under the tower's prefix.
_SIGLIP_PARTS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_out": "self_attn.out_proj", "ln1": "layer_norm1", "ln2": "layer_norm2",
                 "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"}
_SIGLIP_OTHER = {"v.patch_embd.weight": "embeddings.patch_embedding.weight",
                 "v.patch_embd.bias": "embeddings.patch_embedding.bias",
                 "v.position_embd.weight": "embeddings.position_embedding.weight",
                 "v.post_ln.weight": "post_layernorm.weight", "v.post_ln.bias": "post_layernorm.bias"}
# The Qwen towers' (pagoda/model/models/qwen2_vl.py, qwen3_vl.py): q, k and v (Qwen2-VL,
# Qwen2.5-VL: split by the converter) stacked back into qkv, the patch embedding's two
# temporal kernels (the converter's two Conv2D halves) stacked back into the Conv3D.
_QWEN_ATTN = {"attn_q": "attn.qkv#0/3", "attn_k": "attn.qkv#1/3", "attn_v": "attn.qkv#2/3", "attn_qkv": "attn.qkv",
              "attn_out": "attn.proj", "ln1": "norm1", "ln2": "norm2"}
_QWEN_OTHER = {"v.patch_embd.weight": "patch_embed.proj.weight#0/2t", "v.patch_embd.weight.1": "patch_embed.proj.weight#1/2t",
               "v.patch_embd.bias": "patch_embed.proj.bias"}
_QWEN2_MERGER = {"v.post_ln.weight": "merger.ln_q.weight", "v.post_ln.bias": "merger.ln_q.bias",
                 **{f"mm.{i}.{leaf}": f"merger.mlp.{i}.{leaf}" for i in (0, 2) for leaf in ("weight", "bias")}}


def _qwen(families: dict[str, str], mlp: dict[str, str], merger: dict[str, str]) -> Projector:
    return Projector(families, "visual.", "<|image_pad|>", 2, {}, layers="blocks.", layer_parts={**_QWEN_ATTN, **mlp},
                     tower_other={**_QWEN_OTHER, **merger})


# Gemma 4's tower: its clippable linears hold the weight under ``linear`` and their bounds
# (``input_min``...) beside it; the norms around attention and MLP under Gemma's names.
_GEMMA4_LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                   "attn_out": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                   "ffn_down": "mlp.down_proj"}
_GEMMA4_PARTS = {**_GEMMA4_LINEARS, "ln1": "input_layernorm", "attn_post_norm": "post_attention_layernorm",
                 "ln2": "pre_feedforward_layernorm", "ffn_post_norm": "post_feedforward_layernorm",
                 "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}

PROJECTORS = {
    "idefics3": Projector({"LlamaForCausalLM": "Idefics3ForConditionalGeneration"}, "vision_model.", "<image>", 2,
                          {"mm.model.fc.weight": "connector.modality_projection.proj.weight"}),
    "gemma3": Projector({"Gemma3ForCausalLM": "Gemma3ForConditionalGeneration"}, "vision_tower.",
                        "<image_soft_token>", 4,
                        {"mm.input_projection.weight": "multi_modal_projector.mm_input_projection_weight",
                         "mm.soft_emb_norm.weight": "multi_modal_projector.mm_soft_emb_norm.weight"},
                        pooled=True),
    "qwen2vl_merger": _qwen({"Qwen2ForCausalLM": "Qwen2VLForConditionalGeneration"},
                            {"ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"}, _QWEN2_MERGER),
    "qwen2.5vl_merger": _qwen({"Qwen2ForCausalLM": "Qwen2_5_VLForConditionalGeneration"},
                              {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"},
                              _QWEN2_MERGER),
    "qwen3vl_merger": _qwen({"Qwen3ForCausalLM": "Qwen3VLForConditionalGeneration",
                             "Qwen3MoeForCausalLM": "Qwen3VLMoeForConditionalGeneration",
                             "Qwen3_5ForCausalLM": "Qwen3_5ForConditionalGeneration",
                             "Qwen3_5MoeForCausalLM": "Qwen3_5MoeForConditionalGeneration"},
                            {"ffn_up": "mlp.linear_fc1", "ffn_down": "mlp.linear_fc2"},
                            {"v.post_ln.weight": "merger.norm.weight", "v.post_ln.bias": "merger.norm.bias",
                             "v.position_embd.weight": "pos_embed.weight",
                             **{f"mm.{i}.{leaf}": f"merger.linear_fc{1 + i // 2}.{leaf}" for i in (0, 2)
                                for leaf in ("weight", "bias")}}),
    "gemma4v": Projector({"Gemma4ForCausalLM": "Gemma4ForConditionalGeneration"}, "vision_tower.", "<|image|>", 3,
                         {"mm.input_projection.weight": "embed_vision.embedding_projection.weight"},
                         layers="encoder.layers.", layer_parts=_GEMMA4_PARTS,
                         tower_other={"v.patch_embd.weight": "patch_embedder.input_proj.weight",
                                      "v.position_embd.weight": "patch_embedder.position_embedding_table",
                                      "v.std_bias": "std_bias", "v.std_scale": "std_scale"},
                         weight_leaf={part: "linear.weight" for part in _GEMMA4_LINEARS}),
}

_LAYER = re.compile(r"^v\.blk\.(\d+)\.(\w+)\.(weight|bias|input_min|input_max|output_min|output_max)$")
# Qwen3-VL's deepstack mergers, named by the tower layer they read.
_DEEPSTACK = re.compile(r"^v\.deepstack\.(\d+)\.(norm|fc1|fc2)\.(weight|bias)$")
_DEEPSTACK_PARTS = {"norm": "norm", "fc1": "linear_fc1", "fc2": "linear_fc2"}


def projector_type(md: dict[str, Any], path: str) -> str:
    if md.get("general.architecture") != "clip" or not md.get("clip.has_vision_encoder"):
        raise UnsupportedModelError(f"{path} is not a multimodal projector file with a vision encoder "
                                    "(llama.cpp's convert_hf_to_gguf.py --mmproj writes them)")
    # (files with an audio encoder beside name the vision one's under clip.vision.)
    kind = md.get("clip.projector_type") or md.get("clip.vision.projector_type")
    if kind not in PROJECTORS:
        raise UnsupportedModelError(f"{path}: projector type {kind!r} is not supported "
                                    f"(supported: {', '.join(PROJECTORS)})")
    return kind


def mmproj_vision(md: dict[str, Any], tokens: list[str], path: str, text: str,
                  shapes: dict[str, tuple[int, ...]]) -> tuple[str, dict[str, Any]]:  # fmt: skip
    """(the family's HF architecture, its vision dict) from a projector file's metadata and
    tensor shapes, the language model's vocabulary (the image token's id) and architecture
    ``text``."""
    kind = projector_type(md, path)
    proj = PROJECTORS[kind]
    if text not in proj.families:
        raise UnsupportedModelError(f"{path}: a {kind} projector goes with a language model of "
                                    f"{' or '.join(proj.families)}, not {text}")
    p = "clip.vision."
    if proj.image_token not in tokens:
        raise UnsupportedModelError(f"{path}: the language model's vocabulary has no {proj.image_token!r} token")
    image_token_id = tokens.index(proj.image_token)
    if kind == "gemma4v":
        return proj.families[text], _gemma4_vision(md, shapes, image_token_id, proj.scale_factor)
    if kind.startswith("qwen"):
        family = proj.families[text]
        v = _qwen_vision(md, shapes, kind, image_token_id)
        if v.get("deepstack_visual_indexes") and not family.startswith("Qwen3VL"):
            raise UnsupportedModelError(f"{path}: deepstack features go with a Qwen3-VL language model, not {text}")
        return family, v
    scale = int(md.get(p + "projector.scale_factor", proj.scale_factor))
    vision = dict(hidden_size=md[p + "embedding_length"], intermediate_size=md[p + "feed_forward_length"],
                  num_hidden_layers=md[p + "block_count"], num_attention_heads=md[p + "attention.head_count"],
                  num_channels=3, image_size=md[p + "image_size"], patch_size=md[p + "patch_size"],
                  layer_norm_eps=float(md.get(p + "attention.layer_norm_epsilon", 1e-6)),
                  hidden_act="gelu_pytorch_tanh", image_token_id=image_token_id)
    if proj.pooled:
        vision.update(mm_tokens_per_image=(vision["image_size"] // vision["patch_size"] // scale) ** 2,
                      bidirectional=True)
    else:
        vision.update(scale_factor=scale)
    return proj.families[text], vision


def _gemma4_vision(md: dict[str, Any], shapes: dict[str, tuple[int, ...]], image_token_id: int,
                   kernel: int) -> dict[str, Any]:  # fmt: skip
    """Gemma 4's tower from its projector file: what the converter leaves out read from the
    tensors (head size, KV heads, the learned positions, clipping and standardising where
    their tensors are), llama.cpp's constants where it holds some (RoPE base 100, 3x3 pooling)."""
    p = "clip.vision."
    head_dim = shapes["v.blk.0.attn_q_norm.weight"][0]
    v = dict(hidden_size=md[p + "embedding_length"], intermediate_size=shapes["v.blk.0.ffn_up.weight"][0],
             num_hidden_layers=md[p + "block_count"], num_attention_heads=md[p + "attention.head_count"],
             num_key_value_heads=shapes["v.blk.0.attn_k.weight"][0] // head_dim, head_dim=head_dim,
             hidden_activation="gelu_pytorch_tanh", rms_norm_eps=float(md.get(p + "attention.layer_norm_epsilon", 1e-6)),
             pooling_kernel_size=int(md.get(p + "projector.scale_factor", kernel)), patch_size=md[p + "patch_size"],
             position_embedding_size=shapes["v.position_embd.weight"][1],
             use_clipped_linears="v.blk.0.attn_q.input_max" in shapes, standardize="v.std_bias" in shapes,
             rope_theta=100.0, image_token_id=image_token_id, num_channels=3)
    v["image_size"] = v["patch_size"] * v["pooling_kernel_size"] * 8
    return v


def _qwen_vision(md: dict[str, Any], shapes: dict[str, tuple[int, ...]], kind: str,
                 image_token_id: int) -> dict[str, Any]:  # fmt: skip
    """A Qwen tower's geometry from its projector file (the keys llama.cpp's converter writes;
    its defaults where it writes none: merge size 2, Qwen2.5-VL's windows of 112 pixels; the
    MLP's width from its tensors: the converter writes Qwen2-VL's output width there)."""
    p = "clip.vision."
    patch, merge = int(md[p + "patch_size"]), int(md.get(p + "spatial_merge_size", 2))
    layers = int(md[p + "block_count"])
    up = shapes.get("v.blk.0.ffn_up.weight")
    v = dict(hidden_size=md[p + "embedding_length"], intermediate_size=up[0] if up else md[p + "feed_forward_length"],
             num_hidden_layers=layers, num_attention_heads=md[p + "attention.head_count"], num_channels=3,
             patch_size=patch, spatial_merge_size=merge, temporal_patch_size=2,
             out_hidden_size=md[p + "projection_dim"], rope_theta=10000.0, image_size=patch * merge * 8,
             image_token_id=image_token_id)
    if kind == "qwen3vl_merger":
        v["deepstack_visual_indexes"] = _deepstack(md)
        positions = shapes.get("v.position_embd.weight")
        v.update(hidden_act="gelu_pytorch_tanh",
                 num_position_embeddings=positions[0] if positions else (int(md[p + "image_size"]) // patch) ** 2)
    elif kind == "qwen2.5vl_merger":
        every = int(md[p + "n_wa_pattern"])
        v.update(hidden_act="silu", rms_norm=True, gated_mlp=True, window_size=int(md.get(p + "window_size", 112)),
                 fullatt_block_indexes=tuple(range(every - 1, layers, every)))
    else:
        v.update(hidden_act="quick_gelu", rms_norm=False, gated_mlp=False, window_size=0, fullatt_block_indexes=())
    return v


def _deepstack(md: dict[str, Any]) -> tuple[int, ...]:
    """The tower layers whose outputs feed Qwen3-VL's deepstack mergers."""
    return tuple(i for i, on in enumerate(md.get("clip.vision.is_deepstack_layers") or ()) if on)


def mmproj_names(md: dict[str, Any], tensor_names: list[str], path: str) -> dict[str, str]:
    """The projector file's tensor names -> the family's HF names; a name ending in
    ``#i/n`` is the i-th of n parts stacked into that tensor (``t``: along a new dimension 2,
    the Conv3D's time; else concatenated along the rows)."""
    proj = PROJECTORS[projector_type(md, path)]
    parts, tower = proj.layer_parts or _SIGLIP_PARTS, proj.tower_other or _SIGLIP_OTHER
    names = {}
    deepstack = _deepstack(md)
    for name in tensor_names:
        d = _DEEPSTACK.match(name)
        if d is not None and int(d.group(1)) in deepstack:
            names[name] = (f"{proj.tower}deepstack_merger_list.{deepstack.index(int(d.group(1)))}."
                           f"{_DEEPSTACK_PARTS[d.group(2)]}.{d.group(3)}")
            continue
        m = _LAYER.match(name)
        if m is not None and m.group(2) in parts:
            part, _, stack = parts[m.group(2)].partition("#")
            leaf = (proj.weight_leaf or {}).get(m.group(2), "weight") if m.group(3) == "weight" else m.group(3)
            names[name] = f"{proj.tower}{proj.layers}{m.group(1)}.{part}.{leaf}" + (f"#{stack}" if stack else "")
        elif name in tower:
            names[name] = proj.tower + tower[name]
        elif name in proj.other:
            names[name] = proj.other[name]
        else:
            raise UnsupportedModelError(f"{path}: tensor {name} of the projector is not known")
    return names


def mmproj_tensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The projector file's tensors under the family's HF names, as float32 (parts stacked)."""
    from pagoda.hub.gguf_file import GGUFFile
    from pagoda.model.gguf_tensors import load_tensor

    gf = GGUFFile(path)
    try:
        names = mmproj_names(gf.metadata, list(gf.tensors), path)
        pending: dict[str, dict[int, torch.Tensor]] = {}
        for gguf_name, hf_name in names.items():
            t = load_tensor(gf, gguf_name, dtype=torch.float32)
            if hf_name.endswith(("_min", "_max")):   # a clipping bound: a scalar, stored as [1]
                t = t.reshape(())
            elif hf_name.endswith("patch_embedder.input_proj.weight"):   # the converter's Conv2D layout
                t = t.permute(0, 2, 3, 1).reshape(t.shape[0], -1)   # [d, 3, p, p] -> [d, p * p * 3]
            if "#" not in hf_name:
                yield hf_name, t
                continue
            hf_name, _, stack = hf_name.partition("#")
            i, _, n = stack.partition("/")
            got = pending.setdefault(hf_name, {})
            got[int(i)] = t
            if len(got) == int(n.rstrip("t")):
                ordered = [got[k] for k in range(len(got))]
                yield hf_name, torch.stack(ordered, dim=2) if n.endswith("t") else torch.cat(ordered, dim=0)
                del pending[hf_name]
        if pending:
            raise UnsupportedModelError(f"{path}: parts of {sorted(pending)} are missing")
    finally:
        gf.close()
