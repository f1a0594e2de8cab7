"""Find, read and instantiate a model: HF safetensors folders and GGUF files."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from torch import nn
from tqdm import tqdm

from pagoda.model.layers.parallel import Collectives, ShardPlan
from pagoda.model.arch import SUPPORTED_ARCHITECTURES, ModelArchConfig, UnsupportedModelError
from pagoda.model.models.llama import STACKED_PARAMS, LlamaForCausalLM
from pagoda.model.paths import ModelLoadError, default_model_path, resolve_model_path  # noqa: F401 (re-exported)
from pagoda.ops import cpu_kernels

# HF architecture name -> model class. One class serves the whole Llama family.
MODEL_REGISTRY: dict[str, type[torch.nn.Module]] = {
    name: LlamaForCausalLM for name in SUPPORTED_ARCHITECTURES
}

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}")
    return _DTYPES[dtype]


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    arch: ModelArchConfig
    path: str
    gguf_metadata: dict | None = None   # for building the tokenizer from a GGUF file
    shard: ShardPlan | None = None       # this rank's part of a tensor-parallel model


def parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters and buffers this process holds (tied weights counted once)."""
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def load_model(
    model: str | os.PathLike | None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    show_progress: bool = True,
    quantization: str = "none",
    tp_group: Collectives | None = None,
    tp_rank: int = 0,
) -> LoadedModel:
    """Read the weights, then swap in quantized layers if asked (the model
    code itself never branches on quantization). On the CPU in float32, a GGUF
    file's weights stay in its blocks, memory-mapped, and a bfloat16/float16 HF
    checkpoint's in its dtype (``BlocksLinear``, ``BlocksEmbedding``). With ``tp_group`` (a
    tensor-parallel group of ``tp_group.world_size`` ranks), build this rank's
    shard only: parallel layers in place of the model's, and only this rank's
    part of each tensor kept as it is read."""
    from pagoda.model.layers.quantization import calibration_token_ids, quantize_model

    path = resolve_model_path(model)
    device = torch.device(device)
    tp = None if tp_group is None else (tp_group, tp_rank)
    if tp is not None and quantization != "none":
        raise ValueError("quantization is not supported with tensor parallelism")
    # Weights stay as stored (GGUF blocks, float16/bfloat16) where pagoda's CPU kernels
    # multiply them: the exact mode in float32 on one process. Otherwise (CUDA, another
    # dtype, tensor parallelism, no kernels) they are dequantized to ``dtype`` at load.
    keep_blocks = (device.type == "cpu" and dtype == torch.float32 and tp is None
                   and cpu_kernels.kernels() is not None)
    if os.path.isdir(path):
        loaded = (_load_hf_kept(path, device, show_progress) if keep_blocks else None) or \
            _load_hf_folder(path, dtype, device, show_progress, tp)
    elif (path.endswith(".gguf") or _has_gguf_magic(path)) and keep_blocks:
        loaded = _load_gguf_blocks(path, device, show_progress)
    elif path.endswith(".gguf") or _has_gguf_magic(path):
        loaded = _load_gguf(path, dtype, device, show_progress, tp)
    else:
        raise ModelLoadError(f"{path!r} is neither a model folder nor a GGUF file")
    quantize_model(loaded.model, quantization, device,
                   calibration_token_ids(loaded.path, loaded.gguf_metadata) if quantization == "int8" else None,
                   show_progress=show_progress)
    return loaded


def _has_gguf_magic(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _instantiate(arch: ModelArchConfig, dtype: torch.dtype, device: torch.device,
                 tp: tuple[Collectives, int] | None = None) -> tuple[LlamaForCausalLM, ShardPlan | None]:
    cls = MODEL_REGISTRY[arch.architecture]
    # Build on the meta device: no time spent on random init of weights we overwrite,
    # and a tensor-parallel rank allocates only its shard.
    with torch.device("meta"):
        model = cls(arch)
    plan = None
    if tp is not None:
        group, rank = tp
        plan = ShardPlan.build(arch, rank, group.world_size)
        with torch.device("meta"):
            plan.apply(model, group)
    model = model.to_empty(device=device).to(dtype)
    model.inv_freq = _inv_freq(arch, device)  # buffers are not loaded from checkpoints
    model.eval().requires_grad_(False)
    return model, plan


def _inv_freq(arch: ModelArchConfig, device: torch.device) -> torch.Tensor:
    from pagoda.model.models.llama import rope_inv_freq

    return rope_inv_freq(arch).to(device)


def _target(model: LlamaForCausalLM, name: str) -> tuple[str, slice | None]:
    """Map a checkpoint tensor name to (parameter name, row slice or None).

    E.g. model.layers.3.self_attn.k_proj.weight -> (model.layers.3.self_attn.qkv_proj.weight, rows of k).
    """
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in STACKED_PARAMS:
            stacked, shard = STACKED_PARAMS[part]
            start, end = model.shard_rows(stacked, shard)
            return ".".join(parts[:i] + [stacked] + parts[i + 1:]), slice(start, end)
    return name, None


def _fill(
    model: LlamaForCausalLM,
    tensors: Iterator[tuple[str, torch.Tensor]],
    total: int,
    path: str,
    show_progress: bool,
    plan: ShardPlan | None = None,
) -> None:
    """``plan``: keep only this rank's part of each tensor (tensor parallelism)."""
    params = dict(model.named_parameters())
    if model.config.tie_word_embeddings:
        params.pop("lm_head.weight", None)
    # Every parameter (or row range of a stacked one) must be written exactly once.
    expected = {(n, None) for n in params if not n.endswith(("qkv_proj.weight", "qkv_proj.bias", "gate_up_proj.weight"))}
    for n in params:
        stacked = n.split(".")[-2]
        if stacked in ("qkv_proj", "gate_up_proj"):
            for shard in range(3 if stacked == "qkv_proj" else 2):
                expected.add((n, model.shard_rows(stacked, shard)))
    loaded: set = set()
    unexpected: list[str] = []
    bar = tqdm(total=total, desc="Loading weights", unit="tensor", disable=not show_progress, leave=False)
    with torch.no_grad():
        for name, tensor in tensors:
            bar.update(1)
            if name == "lm_head.weight" and model.config.tie_word_embeddings:
                continue
            target, rows = _target(model, name)
            param = params.get(target)
            if param is None:
                if "rotary_emb" not in name:
                    unexpected.append(name)
                continue
            if plan is not None:
                tensor = plan.narrow(name, tensor)
            dest = param if rows is None else param[rows]
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ModelLoadError(
                    f"{path}: tensor {name} has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            loaded.add((target, None if rows is None else (rows.start, rows.stop)))
    bar.close()
    missing = sorted(f"{n}{'' if r is None else f'[{r[0]}:{r[1]}]'}" for n, r in expected - loaded)
    if missing or unexpected:
        raise ModelLoadError(
            f"{path}: weights do not match the architecture; missing {missing[:8]}"
            f"{'...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
        )
    model.tie_weights()


# ---- HF folders --------------------------------------------------------------


def _load_hf_folder(path: str, dtype: torch.dtype, device: torch.device, show_progress: bool,
                    tp: tuple[Collectives, int] | None = None) -> LoadedModel:
    from safetensors import safe_open

    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise ModelLoadError(f"{path}: no config.json (expected an HF model folder)")
    with open(config_file) as f:
        config = json.load(f)
    arch = ModelArchConfig.from_hf_config(config)
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights (pickled .bin checkpoints are not loaded)")
    model, plan = _instantiate(arch, dtype, device, tp)

    handles = [safe_open(str(f), framework="pt") for f in files]
    total = sum(len(list(h.keys())) for h in handles)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for handle in handles:
            for name in handle.keys():
                yield name, handle.get_tensor(name)

    _fill(model, tensors(), total, path, show_progress, plan)
    return LoadedModel(model, arch, path, shard=plan)


# ---- GGUF --------------------------------------------------------------------

_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def gguf_to_hf_name(name: str) -> str | None:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def unpermute_rope(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's conversion-time permutation of Q/K rows.

    llama.cpp rotates interleaved pairs (x0, x1), (x2, x3)...; HF rotates
    halves (x0, x_{D/2}), ... The converter reorders each head's rows from
    [first half | second half] to interleaved; this reverses that:
    per head, rows (0, 2, 4, ..., 1, 3, 5, ...) of the stored tensor.
    """
    rows = w.shape[0]
    head_dim = rows // num_heads
    rest = w.shape[1:]
    return (
        w.reshape(num_heads, head_dim // 2, 2, *rest)
        .transpose(1, 2)
        .reshape(rows, *rest)
    )


def _load_gguf(path: str, dtype: torch.dtype, device: torch.device, show_progress: bool,
               tp: tuple[Collectives, int] | None = None) -> LoadedModel:
    from pagoda.model.gguf_file import GGUFFile

    gf = GGUFFile(path)
    md = gf.metadata
    arch = ModelArchConfig.from_gguf_metadata(md, set(gf.tensors))
    # llama.cpp permutes Q/K only for models it converts with the Llama converter.
    permuted = md.get("general.architecture") in ("llama", "mistral")
    model, plan = _instantiate(arch, dtype, device, tp)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for gguf_name in gf.tensors:
            hf_name = gguf_to_hf_name(gguf_name)
            if hf_name is None:
                if gguf_name == "rope_freqs.weight":
                    raise UnsupportedModelError(f"{path}: GGUF rope_freqs tensors are not supported")
                yield gguf_name, torch.empty(0)
                continue
            t = gf.load_tensor(gguf_name, dtype=torch.float32)
            if permuted and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
                t = unpermute_rope(t, arch.num_attention_heads)
            elif permuted and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
                t = unpermute_rope(t, arch.num_key_value_heads)
            yield hf_name, t.to(dtype)

    _fill(model, tensors(), len(gf.tensors), path, show_progress, plan)
    return LoadedModel(model, arch, path, gguf_metadata=md, shard=plan)


# ---- GGUF, weights kept in their blocks ------------------------------------------

# Checkpoint projection -> (module path inside a decoder layer, shard of it).
_LAYER_PROJECTIONS = {
    "q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1), "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1), "down_proj": ("mlp.down_proj", 0),
}


def _kept_weight_slot(hf_name: str, ndim: int) -> tuple[str, int] | None:
    """Where a checkpoint tensor goes when weights are kept as stored: (module path,
    shard of a stacked projection) for projection, LM head and embedding matrices;
    None for the rest (norms, biases: float32 parameters)."""
    parts = hf_name.split(".")
    if not hf_name.endswith(".weight") or ndim != 2:
        return None
    if len(parts) == 6 and parts[4] in _LAYER_PROJECTIONS:   # model.layers.{i}.{block}.{proj}.weight
        module, shard = _LAYER_PROJECTIONS[parts[4]]
        return ".".join(parts[:3] + [module]), shard
    if hf_name in ("lm_head.weight", "model.embed_tokens.weight"):
        return hf_name.rsplit(".", 1)[0], 0
    return None


def _load_gguf_blocks(path: str, device: torch.device, show_progress: bool) -> LoadedModel:
    """A GGUF model whose projections, LM head and embedding stay in the file's blocks:
    views into a copy-on-write memory map (nothing read until a kernel reads it), except
    Q and K of Llama-converted files, whose rows are put back in HF order (a copy)."""
    from pagoda.model.gguf_file import GGUFFile
    from pagoda.model.layers.blocks import BLOCK_TYPES, BlockWeight

    gf = GGUFFile(path)
    md = gf.metadata
    arch = ModelArchConfig.from_gguf_metadata(md, set(gf.tensors))
    permuted = md.get("general.architecture") in ("llama", "mistral")
    heads = {"q_proj": arch.num_attention_heads, "k_proj": arch.num_key_value_heads}

    blocks: dict[str, dict[int, BlockWeight]] = {}   # module path -> shard -> weight
    floats: dict[str, torch.Tensor] = {}              # parameter / bias name -> tensor
    unexpected: list[str] = []
    bar = tqdm(total=len(gf.tensors), desc="Mapping weights", unit="tensor", disable=not show_progress, leave=False)
    for gguf_name, info in gf.tensors.items():
        bar.update(1)
        hf_name = gguf_to_hf_name(gguf_name)
        if hf_name is None:
            if gguf_name == "rope_freqs.weight":
                raise UnsupportedModelError(f"{path}: GGUF rope_freqs tensors are not supported")
            unexpected.append(gguf_name)
            continue
        proj = hf_name.split(".")[-2] if "." in hf_name else ""
        slot = _kept_weight_slot(hf_name, len(info.shape))
        if slot is not None:
            if info.ggml_type not in BLOCK_TYPES:
                raise ModelLoadError(
                    f"{path}: tensor {gguf_name} has type {info.ggml_type.name}, which pagoda cannot read "
                    f"(supported: {', '.join(sorted(t.name for t in BLOCK_TYPES))})"
                )
            mapped = not (permuted and proj in heads)
            data = gf.tensor_rows(gguf_name) if mapped else unpermute_rope(gf.copy_rows(gguf_name), heads[proj])
            blocks.setdefault(slot[0], {})[slot[1]] = BlockWeight(data, info.ggml_type, info.shape[1], mapped)
            continue
        t = gf.load_tensor(gguf_name, dtype=torch.float32)
        if permuted and proj in heads and hf_name.endswith(".bias"):
            t = unpermute_rope(t, heads[proj])
        floats[hf_name] = t
    bar.close()
    gf.close()  # the header's map; the weights keep the copy-on-write map alive
    if unexpected:
        raise ModelLoadError(f"{path}: tensors pagoda does not know: {unexpected[:8]}")
    model = _kept_weights_model(arch, blocks, floats, path, device)
    return LoadedModel(model, arch, path, gguf_metadata=md)


def _load_hf_kept(path: str, device: torch.device, show_progress: bool) -> LoadedModel | None:
    """An HF folder whose weights are bfloat16 or float16 (how most checkpoints ship),
    served in that dtype: projections, LM head and embedding as ``BlocksLinear`` /
    ``BlocksEmbedding`` over the checkpoint's own bytes (half of a float32 copy; products
    in float32). None when the folder is float32 (loaded as ``nn.Linear`` layers)."""
    from safetensors import safe_open

    from pagoda.model.layers.blocks import TORCH_DTYPE_TYPES, BlockWeight

    config_file = os.path.join(path, "config.json")
    files = sorted(Path(path).glob("*.safetensors"))
    if not os.path.isfile(config_file) or not files:
        return None  # _load_hf_folder says what is missing
    handles = [safe_open(str(f), framework="pt") for f in files]
    dtypes = {h.get_slice(n).get_dtype() for h in handles for n in h.keys()
              if _kept_weight_slot(n, len(h.get_slice(n).get_shape())) is not None}
    if not dtypes or not dtypes <= {"BF16", "F16"}:
        return None
    with open(config_file) as f:
        arch = ModelArchConfig.from_hf_config(json.load(f))
    blocks: dict[str, dict[int, BlockWeight]] = {}
    floats: dict[str, torch.Tensor] = {}
    for handle in handles:
        for name in tqdm(list(handle.keys()), desc="Loading weights", unit="tensor", disable=not show_progress,
                         leave=False):
            t = handle.get_tensor(name)
            slot = _kept_weight_slot(name, t.dim())
            if slot is not None and t.dtype in TORCH_DTYPE_TYPES:
                blocks.setdefault(slot[0], {})[slot[1]] = BlockWeight.from_tensor(t)
            elif "rotary_emb" not in name:
                floats[name] = t.float()
    model = _kept_weights_model(arch, blocks, floats, path, device)
    return LoadedModel(model, arch, path)


def _kept_weights_model(arch: ModelArchConfig, blocks: dict, floats: dict[str, torch.Tensor], path: str,
                        device: torch.device) -> LlamaForCausalLM:
    from pagoda.model.layers.blocks import BlocksEmbedding, BlocksLinear

    if "lm_head" not in blocks and arch.tie_word_embeddings and "model.embed_tokens" in blocks:
        blocks["lm_head"] = blocks["model.embed_tokens"]
    with torch.device("meta"):
        model = MODEL_REGISTRY[arch.architecture](arch)
    _assemble_blocks(model, blocks, floats, path, BlocksLinear, BlocksEmbedding)
    model.inv_freq = _inv_freq(arch, device)
    model.eval().requires_grad_(False)
    return model


def _assemble_blocks(model: LlamaForCausalLM, blocks: dict, floats: dict[str, torch.Tensor], path: str,
                     linear_cls: type, embedding_cls: type) -> None:
    """Put the kept weights into ``model`` (built on the meta device): a ``linear_cls``
    per projection (stacked parts in shard order), an ``embedding_cls``, and the
    float tensors (norms, biases) into the parameters left; everything must fit."""
    problems: list[str] = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            continue
        shards = blocks.pop(name, None)
        n_shards = 3 if name.endswith("qkv_proj") else 2 if name.endswith("gate_up_proj") else 1
        if shards is None or sorted(shards) != list(range(n_shards)):
            problems.append(f"missing {name}")
            continue
        parts = [shards[i] for i in range(n_shards)]
        if isinstance(module, nn.Embedding):
            w = parts[0]
            if (w.out_features, w.in_features) != (module.num_embeddings, module.embedding_dim):
                problems.append(f"{name} is {w.out_features}x{w.in_features}")
                continue
            new: nn.Module = embedding_cls(w)
        else:
            bias = None
            if module.bias is not None:
                names = [f"{name.rsplit('.', 1)[0]}.{p}.bias" for p in ("q_proj", "k_proj", "v_proj")]
                if not all(n in floats for n in names):
                    problems.append(f"missing bias of {name}")
                    continue
                bias = torch.cat([floats.pop(n) for n in names])
            lin = linear_cls(parts, bias)
            if (lin.out_features, lin.in_features) != (module.out_features, module.in_features):
                problems.append(f"{name} is {lin.out_features}x{lin.in_features}, "
                                f"expected {module.out_features}x{module.in_features}")
                continue
            new = lin
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)
    for name, param in list(model.named_parameters()):
        t = floats.pop(name, None)
        if t is None or tuple(t.shape) != tuple(param.shape):
            problems.append(f"missing {name}" if t is None else f"{name} has shape {tuple(t.shape)}")
            continue
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, nn.Parameter(t.contiguous(), requires_grad=False))
    problems += [f"unexpected {n}" for n in list(blocks) + list(floats)]
    if problems:
        raise ModelLoadError(f"{path}: weights do not match the architecture: {problems[:8]}"
                             f"{'...' if len(problems) > 8 else ''}")
