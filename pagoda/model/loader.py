"""Find, read and instantiate a model: HF safetensors folders and GGUF files."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from pagoda.config.engine import PIPELINE_MODES
from pagoda.hub.paths import ModelLoadError
from pagoda.hub.stores import resolve_model_path
from pagoda.model.arch import ModelArchConfig, UnsupportedModelError
from pagoda.model.auto_mode import auto_quantization
from pagoda.model.gguf_tensors import copy_rows, load_tensor, tensor_rows
from pagoda.model.hf_quant import QuantMethod, method_for
from pagoda.model.layers.decoder import CausalLM
from pagoda.model.layers.parallel import EXPERT_NAME, Collectives, ShardPlan, checkpoint_name
from pagoda.model.layers.pipeline import StageLink, StagePlan
from pagoda.model.models import model_class
from pagoda.ops import cpu_kernels

logger = logging.getLogger(__name__)

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
    model: CausalLM
    arch: ModelArchConfig
    path: str
    gguf_metadata: dict | None = None   # for building the tokenizer from a GGUF file
    shard: ShardPlan | None = None       # this rank's part of a tensor-parallel model
    stage: StagePlan | None = None       # this rank's stage of a pipeline-parallel model


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
    expert_parallel: bool = False,
    pipe: StageLink | None = None,
    mmproj: str | None = None,
) -> LoadedModel:
    """Read the weights, then swap in quantized layers if asked (the model
    code itself never branches on quantization). On the CPU in float32, a GGUF
    file's weights stay in its blocks, memory-mapped, and a bfloat16/float16 HF
    checkpoint's in its dtype (``BlocksLinear``, ``BlocksEmbedding``). With ``tp_group`` (a
    tensor-parallel group of ``tp_group.world_size`` ranks), build this rank's
    shard only: parallel layers in place of the model's, and only this rank's
    part of each tensor kept as it is read (blocks cut along block boundaries); the
    quantized modes then convert the shard, every rank in step (``quantize_model``). With
    ``pipe`` (a pipeline stage's links), build only that stage's layers
    (pagoda/model/layers/pipeline.py): other stages' tensors are never read. ``mmproj``:
    llama.cpp's projector file beside a GGUF language model (pagoda/model/mmproj.py),
    served as the vision-language family it names."""
    from pagoda.model.layers.quantization import QUANTIZATION_MODES, calibration_token_ids, quantize_model

    path = resolve_model_path(model)
    device = torch.device(device)
    if quantization == "auto":
        quantization, _ = auto_quantization(path, str(device), str(dtype).removeprefix("torch."))
    if quantization not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_MODES)}; got {quantization!r}")
    tp = None if tp_group is None else _TP(tp_group, tp_rank, expert_parallel, quantization)
    if pipe is not None and quantization not in PIPELINE_MODES:
        raise ValueError(f"--quantization {quantization} is not supported with pipeline parallelism "
                         f"(supported: {', '.join(PIPELINE_MODES)})")
    # Weights stay as stored (GGUF blocks, float16/bfloat16) where pagoda's CPU kernels
    # multiply them: the exact mode in float32 (and the gguf mode's int8 activations), a
    # pipeline stage its own layers'. Otherwise (CUDA, another dtype, no kernels) they are
    # dequantized to ``dtype`` at load.
    keep_blocks = device.type == "cpu" and dtype == torch.float32 and cpu_kernels.kernels() is not None
    if mmproj is not None and not (os.path.isfile(path) and _has_gguf_magic(path)):
        raise ModelLoadError(f"--mmproj goes with a GGUF language model; {path!r} is not one")
    if os.path.isdir(path):
        method = _quant_method(path)
        if method is not None:
            method.check_quantization(quantization)
        # Under tensor parallelism a pre-quantized checkpoint is dequantized at load (its
        # groups are not cut along the ranks' shares).
        kept = keep_blocks and (tp is None or method is None)
        if keep_blocks and not kept:
            logger.info("tensor parallelism: the %s checkpoint's weights are dequantized to %s at load",
                        method.name, dtype)
        loaded = (_load_hf_kept(path, device, show_progress, method, tp, pipe) if kept else None) or \
            _load_hf_folder(path, dtype, device, show_progress, tp, method, pipe)
    elif (path.endswith(".gguf") or _has_gguf_magic(path)) and keep_blocks:
        loaded = _load_gguf_blocks(path, device, show_progress, tp, pipe, mmproj)
    elif path.endswith(".gguf") or _has_gguf_magic(path):
        loaded = _load_gguf(path, dtype, device, show_progress, tp, pipe, mmproj)
    else:
        raise ModelLoadError(f"{path!r} is neither a model folder nor a GGUF file")
    quantize_model(loaded.model, quantization, device,
                   calibration_token_ids(loaded.path, loaded.gguf_metadata) if quantization == "int8" else None,
                   show_progress=show_progress)
    return loaded


@dataclass(frozen=True)
class _TP:
    """A tensor-parallel load: the group, this rank, experts split by expert, and the
    quantized mode (q4 splits inputs in its groups of 32)."""

    group: Collectives
    rank: int
    expert_parallel: bool
    quantization: str


# Weights per block along the input dimension of the layers the quantized modes build
# from a float shard: q4's groups.
_MODE_INPUT_UNITS = {"q4": 32}


def _shard_model(model: CausalLM, arch: ModelArchConfig, tp: _TP,
                 units: dict[str, int] | None = None) -> ShardPlan:
    """Build this rank's plan and swap its layers into ``model`` (on the meta device).
    ``units``: the blocks the row-parallel layers' weights are kept in (``ShardPlan.build``)."""
    cls = type(model)
    if not cls.tensor_parallel:
        raise UnsupportedModelError(f"{arch.architecture} cannot be served with tensor parallelism")
    mode = _MODE_INPUT_UNITS.get(tp.quantization, 1)
    merged = {k: max((units or {}).get(k, 1), mode) for k in ("o_proj", "down_proj", "out_proj")}
    plan = ShardPlan.build(arch, tp.rank, tp.group.world_size, tp.expert_parallel, merged)
    with torch.device("meta"):
        plan.apply(model, tp.group)
    return plan


def _has_gguf_magic(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _instantiate(arch: ModelArchConfig, dtype: torch.dtype, device: torch.device,
                 tp: _TP | None = None,
                 pipe: StageLink | None = None) -> tuple[CausalLM, ShardPlan | None, StagePlan | None]:
    cls = model_class(arch.architecture)
    # Build on the meta device: no time spent on random init of weights we overwrite,
    # and a tensor-parallel rank allocates only its shard.
    with torch.device("meta"):
        model = cls(arch)
    plan = None if tp is None else _shard_model(model, arch, tp)
    stage = None
    if pipe is not None and arch.vision is not None:
        raise UnsupportedModelError(f"{arch.architecture} (a vision-language model) cannot be served with "
                                    "pipeline parallelism yet")
    if pipe is not None:
        stage = StagePlan.build(arch.num_hidden_layers, pipe.stage, pipe.num_stages, arch.tie_word_embeddings)
        with torch.device("meta"):
            stage.apply(model, pipe)
    model = model.to_empty(device=device).to(dtype)
    model.init_rope(device)  # buffers are not loaded from checkpoints
    model.eval().requires_grad_(False)
    return model, plan, stage


def packed_projections(cls: type[CausalLM] | CausalLM) -> dict[str, tuple[str, int]]:
    """Checkpoint projection -> (the stacked module holding it, its shard index). (The
    loader asks the model: a family may stack other parts in some of its files, Qwen3-Next
    in llama.cpp's.)"""
    return {proj: (stacked, i) for stacked, projs in cls.packed_modules_mapping.items() for i, proj in enumerate(projs)}


def _target(model: CausalLM, name: str) -> tuple[str, slice | None]:
    """Map a checkpoint tensor name to (parameter name, row slice or None).

    E.g. model.layers.3.self_attn.k_proj.weight -> (model.layers.3.self_attn.qkv_proj.weight, rows of k).
    """
    packed = packed_projections(model)
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in packed:
            stacked, shard = packed[part]
            parent = ".".join(parts[:i])
            try:
                alone = not hasattr(model.get_submodule(parent) if parent else model, stacked)
            except AttributeError:
                alone = False
            if alone:   # a layer holding the projection alone (Gemma 4's KV-sharing q_proj)
                return name, None
            start, end = model.shard_rows(".".join(parts[:i] + [stacked]), shard)
            return ".".join(parts[:i] + [stacked] + parts[i + 1:]), slice(start, end)
    return name, None


def checkpoint_names(model: CausalLM) -> list[str]:
    """The tensor names of the family's HF checkpoints (stacked projections as their
    parts; the LM head even when tied), from the model's own parameters."""
    mapping = model.packed_modules_mapping
    names = []
    for name, _ in model.named_parameters(remove_duplicate=False):
        module, _, leaf = name.rpartition(".")
        prefix, _, last = module.rpartition(".")
        names += [f"{prefix}.{p}.{leaf}" for p in mapping[last]] if last in mapping else [name]
    return names + ([] if "lm_head.weight" in names else ["lm_head.weight"])


_KEY_PROJ = re.compile(r"^model\.layers\.(\d+)\.self_attn\.k_proj\.(weight|bias)$")


def _values_from_keys(arch: ModelArchConfig, tensors: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """The tensors, with a layer's key projection also as its value projection where the
    architecture says its values are its keys (``value_from_key``: Gemma 4's global layers,
    whose checkpoints hold no v_proj)."""
    for name, t in tensors:
        yield name, t
        m = _KEY_PROJ.match(name) if arch.value_from_key is not None else None
        if m is not None and arch.value_from_key[int(m.group(1))]:
            yield name.replace(".k_proj.", ".v_proj."), t


def _fill(
    model: CausalLM,
    tensors: Iterator[tuple[str, torch.Tensor]],
    total: int,
    path: str,
    show_progress: bool,
    plan: ShardPlan | None = None,
    stage: StagePlan | None = None,
) -> None:
    """``plan``: keep only this rank's part of each tensor (tensor parallelism); ``stage``:
    only this pipeline stage's tensors (the readers skip the others unread)."""
    tensors = _values_from_keys(model.config, tensors)
    params = {checkpoint_name(n): p for n, p in model.named_parameters()}
    # A tied LM head is the embedding here, unless a pipeline stage holds only one of them.
    tied = model.config.tie_word_embeddings and "model.embed_tokens.weight" in params
    if tied:
        params.pop("lm_head.weight", None)
    # Every parameter (or row range of a stacked one) must be written exactly once.
    mapping = model.packed_modules_mapping
    expected = set()
    for n in params:
        stacked = n.split(".")[-2]
        if stacked in mapping:
            module = n.rpartition(".")[0]
            expected.update((n, model.shard_rows(module, shard)) for shard in range(len(mapping[stacked])))
        else:
            expected.add((n, None))
    loaded: set = set()
    unexpected: list[str] = []
    bar = tqdm(total=total, desc="Loading weights", unit="tensor", disable=not show_progress, leave=False)
    with torch.no_grad():
        for name, tensor in tensors:
            bar.update(1)
            if name == "lm_head.weight" and tied:
                continue
            if plan is not None and not plan.holds(name):
                continue   # another rank's expert
            if stage is not None:
                if not stage.holds(name):
                    continue   # another stage's
                name = stage.rename(name)
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
    if tied:
        model.tie_weights()


# ---- HF folders --------------------------------------------------------------


def _checkpoint_reader(handles: list) -> Callable[[str], torch.Tensor]:
    """name -> that tensor, from whichever of a checkpoint's files holds it."""
    where = {name: handle for handle in handles for name in handle.keys()}

    def read(name: str) -> torch.Tensor:
        if name not in where:
            raise ModelLoadError(f"the checkpoint has no tensor {name}")
        return where[name].get_tensor(name)

    return read


class _BaseModelFile:
    """A safetensors file of a transformers base model (an embedding checkpoint) read under the
    causal LM's names: ``layers.0.mlp.up_proj.weight`` as ``model.layers.0.mlp.up_proj.weight``."""

    def __init__(self, handle) -> None:
        self.handle = handle
        self._theirs = {n if n.startswith("model.") else f"model.{n}": n for n in handle.keys()}  # noqa: SIM118

    def keys(self) -> list[str]:
        return list(self._theirs)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.handle.get_tensor(self._theirs[name])

    def get_slice(self, name: str):
        return self.handle.get_slice(self._theirs[name])


def _base_model_layout(arch: ModelArchConfig, handles: list, path: str) -> tuple[ModelArchConfig, list]:
    """An embedding checkpoint as the causal LM's loader reads it: tensors saved from the base
    model (no ``model.`` prefix) renamed, and a sentence-transformers model saved without its
    (untied) LM head marked as having none."""
    names = {n for h in handles for n in h.keys()}  # noqa: SIM118 (safetensors handles)
    if not any(n.startswith("model.") for n in names) and any(n.startswith("layers.") for n in names):
        handles = [_BaseModelFile(h) for h in handles]
    st_layout = os.path.isfile(os.path.join(path, "modules.json"))
    if st_layout and arch.has_lm_head and not arch.tie_word_embeddings and "lm_head.weight" not in names:
        arch = arch.without_lm_head()
    return arch, handles


def _quant_method(path: str) -> QuantMethod | None:
    """The pre-quantized format of an HF folder (``quantization_config``), if any."""
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        return None
    with open(config_file) as f:
        return method_for(json.load(f))


# A decoder layer's tensors in an HF checkpoint (a multimodal one's language model too).
_HF_LAYER = re.compile(r"^(?:model\.)?(?:language_model\.)?layers\.(\d+)\.")


def _checkpoint_tensors(model_cls: type[CausalLM], method: QuantMethod | None,
                        checkpoint: Callable[[str], torch.Tensor], arch: ModelArchConfig):
    """(name, tensor) -> the model tensors it holds: a pre-quantized checkpoint's
    method first (a quantized layer's weight as a ``BlockWeight``), then the family's
    ``hf_tensors`` for everything else. Layers from ``arch.num_hidden_layers`` on hold
    none: the multi-token-prediction layers some checkpoints keep after the last one
    (GLM-4.5's, DeepSeek-V3's), not served (as ``_read_gguf`` drops a GGUF file's). A
    family whose checkpoints rotate interleaved pairs (``hf_qk_permuted``: Cohere, ERNIE
    4.5) has its Q/K rows put in rotate-half order here, before any tensor-parallel split."""
    from pagoda.model.layers.blocks import BlockWeight, release_checkpoint_pages

    num_layers = arch.num_hidden_layers
    heads = _qk_heads(arch, model_cls, hf=True)

    def rotate_half_order(ours: str, t: Any) -> Any:
        proj = ours.split(".")[-2] if "." in ours else ""
        if proj not in heads:
            return t
        if isinstance(t, BlockWeight):   # whole rows of blocks: the same permutation of rows
            return BlockWeight(unpermute_rope(t.data, heads[proj]), t.ggml_type, t.in_features, False, t.input_order)
        return unpermute_rope(t, heads[proj])

    def convert(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, Any]]:
        layer = _HF_LAYER.match(name)
        if layer is not None and int(layer.group(1)) >= num_layers:
            return
        out = method.tensors(name, tensor, checkpoint) if method is not None else None
        if out is None:
            for ours, t in model_cls.hf_tensors(name, tensor, checkpoint):
                yield ours, rotate_half_order(ours, t)
            return
        repacked = False
        for n, t in out:
            if isinstance(t, BlockWeight):
                repacked = repacked or not _shares_memory(t.data, tensor)
                ours = model_cls.hf_name(n)
                if ours is not None:
                    yield ours, rotate_half_order(ours, t)
            else:
                for ours, u in model_cls.hf_tensors(n, t, checkpoint):
                    yield ours, rotate_half_order(ours, u)
        if repacked:   # its bytes now live in the blocks: the checkpoint's pages can go
            release_checkpoint_pages(tensor)

    return convert


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _load_hf_folder(path: str, dtype: torch.dtype, device: torch.device, show_progress: bool,
                    tp: _TP | None = None,
                    method: QuantMethod | None = None, pipe: StageLink | None = None) -> LoadedModel:
    from safetensors import safe_open

    from pagoda.model.layers.blocks import BlockWeight

    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise ModelLoadError(f"{path}: no config.json (expected an HF model folder)")
    with open(config_file) as f:
        config = json.load(f)
    arch = ModelArchConfig.from_hf_config(config)
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights (pickled .bin checkpoints are not loaded)")
    arch, handles = _base_model_layout(arch, [safe_open(str(f), framework="pt") for f in files], path)
    model, plan, stage = _instantiate(arch, dtype, device, tp, pipe)
    model_cls = type(model)

    total = sum(len(list(h.keys())) for h in handles)
    convert = _checkpoint_tensors(model_cls, method, _checkpoint_reader(handles), arch)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for handle in handles:
            for name in handle.keys():
                ours = model_cls.hf_name(name)
                if ours is not None and (stage is None or stage.holds(ours)):
                    for target, t in convert(name, handle.get_tensor(name)):
                        yield target, (t.dequantize() if isinstance(t, BlockWeight) else t)

    _fill(model, tensors(), total, path, show_progress, plan, stage)
    return LoadedModel(model, arch, path, shard=plan, stage=stage)


# ---- GGUF --------------------------------------------------------------------


def gguf_names(gguf_arch: str, model: CausalLM) -> dict[str, str | list[str]]:
    """GGUF tensor name -> HF checkpoint name, for every tensor of the family's checkpoints:
    the ``gguf`` library's own table of llama.cpp's names (``TensorNameMap``) asked for each
    HF name the model has (so one HF name maps as llama.cpp maps it for this architecture:
    Llama's post_attention_layernorm is ``ffn_norm``, OLMo 2's ``post_attention_norm``).
    llama.cpp stacks a layer's experts into one 3-D tensor (``ffn_gate_exps``: [experts,
    rows, columns]): its entry is the list of the experts' HF names, in expert order."""
    from gguf.constants import MODEL_ARCH, MODEL_ARCH_NAMES
    from gguf.tensor_mapping import get_tensor_name_map

    arch = next(a for a, n in MODEL_ARCH_NAMES.items() if n == gguf_arch) if gguf_arch in MODEL_ARCH_NAMES.values() \
        else None
    if arch is None or arch not in MODEL_ARCH:
        raise UnsupportedModelError(f"the gguf library does not know the architecture {gguf_arch!r}")
    table = get_tensor_name_map(arch, model.config.num_hidden_layers)
    names: dict[str, str | list] = {}
    merged: dict[str, dict[str, list[str]]] = {}   # merged gate/up experts: their two lists
    tower = tuple(getattr(model, "tower_prefixes", ()))   # a vision tower's: in the mmproj file
    for hf_name in checkpoint_names(model):
        if tower and hf_name.startswith(tower):
            continue
        lookup = type(model).gguf_lookup_name(hf_name)
        module, _, leaf = lookup.rpartition(".")
        expert = EXPERT_NAME.search(module)
        gguf = table.get_name(EXPERT_NAME.sub(".experts.", module) if expert else module)
        part = module.rpartition(".")[2]
        if gguf is None and expert and part in ("gate_proj", "up_proj"):
            # An architecture whose files hold only merged experts (Gemma 4: ffn_gate_up_exps).
            merged_name = table.get_name(EXPERT_NAME.sub(".experts.", module)[: -len(part)] + "gate_up_proj")
            if merged_name is not None:
                merged.setdefault(f"{merged_name}.{leaf}", {}).setdefault(part, []).append(hf_name)
                continue
        if gguf is None and module == "lm_head" and model.config.tie_word_embeddings:
            continue   # an architecture whose files always tie it (Gemma 2)
        if gguf is None and table.get_name(lookup) is not None:
            # A name the table knows whole: "<name>.weight" (GPT-OSS's sinks) or the name alone
            # (the SSM's A and D; Falcon-H1's pre_ff_layernorm.weight, stored as ffn_pre_norm).
            gguf, leaf = table.get_name(lookup), leaf if leaf in ("weight", "bias") else "weight"
            names[gguf] = hf_name
        if gguf is None:
            raise UnsupportedModelError(f"llama.cpp has no name for {module} in {gguf_arch} files")
        if expert:
            names.setdefault(f"{gguf}.{leaf}", []).append(hf_name)   # experts come in order
        else:
            names[f"{gguf}.{leaf}"] = hf_name
    for name, parts in merged.items():   # each expert's (gate, up) pair, in expert order
        names[name] = list(zip(parts["gate_proj"], parts["up_proj"]))
    return names



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


CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def _read_gguf(path: str, mmproj: str | None = None):
    """(the open file, its architecture, its GGUF -> HF names, the family's model built on
    the meta device) for a GGUF model file (with ``mmproj``, the vision-language family of
    the projector file)."""
    from pagoda.hub.gguf_file import GGUFFile

    gf = GGUFFile(path)
    # Tensors that are configuration (LongRoPE's factors): read into the metadata the
    # family's parser sees, not loaded as weights.
    md = dict(gf.metadata)
    for name in CONFIG_TENSORS:
        if name in gf.tensors:
            md[name] = load_tensor(gf, name, dtype=torch.float32).flatten().tolist()
    arch = ModelArchConfig.from_gguf_metadata(md, set(gf.tensors))
    if mmproj is not None:
        arch = _with_projector(arch, md, mmproj)
    if md.get(f"{md['general.architecture']}.nextn_predict_layers"):
        # The multi-token-prediction blocks past the last layer (Qwen3.5's, Nemotron 3's):
        # not served (the family reads the layers before them), their tensors not read.
        for name in [n for n in gf.tensors if n.startswith("blk.") and n.split(".")[1].isdigit()
                     and int(n.split(".")[1]) >= arch.num_hidden_layers]:  # fmt: skip
            del gf.tensors[name]
    with torch.device("meta"):
        model = model_class(arch.architecture)(arch)
    names = gguf_names(gf.metadata["general.architecture"], model)
    for merged in [n for n in gf.tensors if n.endswith(".ffn_gate_up_exps.weight") and n not in names]:
        # llama.cpp's merged experts ([experts, gate rows then up rows, columns]): each entry
        # a pair of the expert's gate and up names.
        gate, up = (names.pop(merged.replace("gate_up", part), None) for part in ("gate", "up"))
        if not isinstance(gate, list) or not isinstance(up, list) or len(gate) != len(up):
            raise ModelLoadError(f"{path}: {merged}: the model has no experts' gate and up projections there")
        names[merged] = list(zip(gate, up))
    return gf, arch, names, model


def _with_projector(arch: ModelArchConfig, md: dict[str, Any], mmproj: str) -> ModelArchConfig:
    """The language model's architecture as the vision-language family of ``mmproj``."""
    from pagoda.hub.gguf_file import GGUFFile
    from pagoda.model.mmproj import mmproj_vision

    proj = GGUFFile(mmproj)
    try:
        family, vision = mmproj_vision(proj.metadata, md.get("tokenizer.ggml.tokens") or [], mmproj,
                                       arch.architecture, {n: t.shape for n, t in proj.tensors.items()})
    finally:
        proj.close()
    return model_class(family).with_projector(dataclasses.replace(arch, architecture=family, vision=vision), md)


def _qk_heads(arch: ModelArchConfig, cls: type[CausalLM], hf: bool = False) -> dict[str, int]:
    """Projection -> heads, for the rows to un-permute: a GGUF file's where llama.cpp holds
    them interleaved (``gguf_qk_permuted``), an HF checkpoint's where the family's own RoPE
    rotates interleaved pairs (``hf_qk_permuted``); none otherwise."""
    permuted = cls.hf_qk_permuted if hf else cls.gguf_qk_permuted
    return {"q_proj": arch.num_attention_heads, "k_proj": arch.num_key_value_heads} if permuted else {}


def _load_gguf(path: str, dtype: torch.dtype, device: torch.device, show_progress: bool,
               tp: _TP | None = None, pipe: StageLink | None = None, mmproj: str | None = None) -> LoadedModel:
    gf, arch, names, meta_model = _read_gguf(path, mmproj)
    heads = _qk_heads(arch, type(meta_model))
    model, plan, stage = _instantiate(arch, dtype, device, tp, pipe)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for gguf_name in gf.tensors:
            if gguf_name in CONFIG_TENSORS:
                continue
            hf_name = names.get(gguf_name)
            if hf_name is None:
                yield gguf_name, torch.empty(0)
                continue
            if stage is not None and not stage.holds(_first_name(hf_name)):
                continue   # another pipeline stage's: not read
            t = load_tensor(gf, gguf_name, dtype=torch.float32)
            if isinstance(hf_name, list):   # a layer's experts, stacked
                _check_experts(path, gguf_name, tuple(t.shape), len(hf_name))
                for e, n in enumerate(hf_name):
                    if isinstance(n, tuple):   # merged: gate rows, then up rows
                        yield from zip(n, (u.to(dtype) for u in t[e].chunk(2, dim=0)))
                    else:
                        yield n, type(model).gguf_tensor(n, t[e]).to(dtype)
                continue
            proj = hf_name.split(".")[-2]
            if proj in heads:
                t = unpermute_rope(t, heads[proj])
            yield hf_name, type(model).gguf_tensor(hf_name, t).to(dtype)
        if mmproj is not None:
            from pagoda.model.mmproj import mmproj_tensors

            yield from ((n, t.to(dtype)) for n, t in mmproj_tensors(mmproj))

    _fill(model, tensors(), len(gf.tensors), path, show_progress, plan, stage)
    return LoadedModel(model, arch, path, gguf_metadata=gf.metadata, shard=plan, stage=stage)


# ---- weights kept in their blocks (GGUF) or dtype (HF bfloat16 / float16) ---------


def kept_weight_slots(model: CausalLM) -> dict[str, tuple[str, int]]:
    """Where checkpoint matrices go when weights are kept as stored: HF weight name ->
    (module path, shard of a stacked projection), for every projection, the LM head and
    the embedding (a tensor-parallel layer's local layer under its layer's name). Other
    tensors (norms, biases) become float32 parameters."""
    mapping = model.packed_modules_mapping
    slots = {}
    for path, module in model.named_modules():
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            continue
        prefix, _, last = checkpoint_name(path).rpartition(".")
        for i, proj in enumerate(mapping.get(last, (last,))):
            slots[f"{prefix}.{proj}.weight" if prefix else f"{proj}.weight"] = (path, i)
    return slots


def _load_gguf_blocks(path: str, device: torch.device, show_progress: bool, tp: _TP | None = None,
                      pipe: StageLink | None = None, mmproj: str | None = None) -> LoadedModel:
    """A GGUF model whose projections, LM head and embedding stay in the file's blocks:
    views into a copy-on-write memory map (nothing read until a kernel reads it), except
    Q and K of Llama-converted files, whose rows are put back in HF order (a copy). With
    ``tp``, this rank's part of each: its rows (still views of the map), its columns of
    the row-parallel layers in whole blocks (a copy). With ``pipe``, this stage's tensors
    only (``_stage_of``)."""
    from pagoda.model.layers.blocks import BLOCK_TYPES, BlockWeight, block_format

    gf, arch, names, model = _read_gguf(path, mmproj)
    md = gf.metadata
    heads = _qk_heads(arch, type(model))
    plan = None
    if tp is not None:
        units: dict[str, int] = {}
        for gguf_name, info in gf.tensors.items():
            hf = names.get(gguf_name)
            kind = (_first_name(hf) if hf else "").rpartition(".")[0].rpartition(".")[2]
            if kind in ("o_proj", "down_proj", "out_proj") and len(info.shape) >= 2 and info.ggml_type in BLOCK_TYPES:
                units[kind] = max(units.get(kind, 1), block_format(info.ggml_type)[0])
        plan = _shard_model(model, arch, tp, units)
    stage = _stage_of(model, arch, pipe)
    slots = kept_weight_slots(model)

    def narrow(name: str, w):
        if plan is None:
            return w
        return plan.narrow_blocks(name, w) if isinstance(w, BlockWeight) else plan.narrow(name, w)

    blocks: dict[str, dict[int, BlockWeight]] = {}   # module path -> shard -> weight
    floats: dict[str, torch.Tensor] = {}              # parameter / bias name -> tensor
    unexpected: list[str] = []
    bar = tqdm(total=len(gf.tensors), desc="Mapping weights", unit="tensor", disable=not show_progress, leave=False)
    for gguf_name, info in gf.tensors.items():
        bar.update(1)
        if gguf_name in CONFIG_TENSORS:
            continue
        hf_name = names.get(gguf_name)
        if hf_name is None:
            unexpected.append(gguf_name)
            continue
        if stage is not None:
            if not stage.holds(_first_name(hf_name)):
                continue   # another pipeline stage's: not read
            hf_name = hf_name if isinstance(hf_name, list) else stage.rename(hf_name)
        if isinstance(hf_name, list) and isinstance(hf_name[0], tuple):   # merged gate and up experts
            _check_experts(path, gguf_name, info.shape, len(hf_name))
            _check_block_type(path, gguf_name, info.ggml_type, BLOCK_TYPES)
            rows, data = info.shape[1], tensor_rows(gf, gguf_name)
            for e, pair in enumerate(hf_name):
                for half, n in enumerate(pair):
                    if plan is None or plan.holds(n):
                        start = e * rows + half * rows // 2
                        module, shard = slots[n]
                        blocks.setdefault(module, {})[shard] = narrow(n, BlockWeight(
                            data[start:start + rows // 2], info.ggml_type, info.shape[2], True))
            continue
        if isinstance(hf_name, list):   # a layer's experts, stacked: one view of rows each
            _check_experts(path, gguf_name, info.shape, len(hf_name))
            held = [(e, n) for e, n in enumerate(hf_name) if plan is None or plan.holds(n)]
            if len(info.shape) == 2:   # their biases (GPT-OSS): [experts, rows]
                t = load_tensor(gf, gguf_name, dtype=torch.float32)
                floats.update((n, narrow(n, t[e])) for e, n in held)
                continue
            _check_block_type(path, gguf_name, info.ggml_type, BLOCK_TYPES)
            rows, data = info.shape[1], tensor_rows(gf, gguf_name)
            for e, n in held:
                module, shard = slots[n]
                blocks.setdefault(module, {})[shard] = narrow(n, BlockWeight(data[e * rows:(e + 1) * rows],
                                                                             info.ggml_type, info.shape[2], True))
            continue
        proj = hf_name.split(".")[-2] if "." in hf_name else ""
        slot = slots.get(hf_name) if len(info.shape) == 2 else None
        if slot is not None:
            _check_block_type(path, gguf_name, info.ggml_type, BLOCK_TYPES)
            mapped = proj not in heads
            data = tensor_rows(gf, gguf_name) if mapped else unpermute_rope(copy_rows(gf, gguf_name), heads[proj])
            w = BlockWeight(data, info.ggml_type, info.shape[1], mapped)
            blocks.setdefault(slot[0], {})[slot[1]] = narrow(hf_name, w)
            continue
        t = load_tensor(gf, gguf_name, dtype=torch.float32)
        if proj in heads and hf_name.endswith(".bias"):
            t = unpermute_rope(t, heads[proj])
        floats[hf_name] = narrow(hf_name, type(model).gguf_tensor(hf_name, t))
    bar.close()
    gf.close()  # the header's map; the weights keep the copy-on-write map alive
    if unexpected:
        raise ModelLoadError(f"{path}: tensors pagoda does not know: {unexpected[:8]}")
    if mmproj is not None:   # the tower in float32, as a float checkpoint's would be
        from pagoda.model.mmproj import mmproj_tensors

        floats.update(mmproj_tensors(mmproj))
    _kept_weights_model(model, blocks, floats, path, device)
    return LoadedModel(model, arch, path, gguf_metadata=md, shard=plan, stage=stage)


def _stage_of(model: CausalLM, arch: ModelArchConfig, pipe: StageLink | None) -> StagePlan | None:
    """A pipeline stage's plan, its placeholders swapped into ``model`` (on the meta device)."""
    if pipe is None:
        return None
    stage = StagePlan.build(arch.num_hidden_layers, pipe.stage, pipe.num_stages, arch.tie_word_embeddings)
    with torch.device("meta"):
        stage.apply(model, pipe)
    return stage


def _first_name(hf_name: str | list) -> str:
    """The (first) checkpoint name a GGUF tensor holds: itself, its first expert's, or the
    first of a merged pair's."""
    if isinstance(hf_name, str):
        return hf_name
    return hf_name[0][0] if isinstance(hf_name[0], tuple) else hf_name[0]


def _check_experts(path: str, name: str, shape: tuple[int, ...], experts: int) -> None:
    """A layer's experts' tensors stacked: [experts, rows, columns] (weights) or
    [experts, rows] (biases)."""
    if len(shape) != (2 if name.endswith(".bias") else 3) or shape[0] != experts:
        raise ModelLoadError(f"{path}: tensor {name} has shape {shape}, expected [{experts} experts, rows"
                             f"{'' if name.endswith('.bias') else ', columns'}]")


def _check_block_type(path: str, name: str, ggml_type, supported) -> None:
    if ggml_type not in supported:
        raise ModelLoadError(f"{path}: tensor {name} has type {ggml_type.name}, which pagoda cannot read "
                             f"(supported: {', '.join(sorted(t.name for t in supported))})")


def _load_hf_kept(path: str, device: torch.device, show_progress: bool,
                  method: QuantMethod | None = None, tp: _TP | None = None,
                  pipe: StageLink | None = None) -> LoadedModel | None:
    """An HF folder whose weights are bfloat16 or float16 (how most checkpoints ship),
    served in that dtype: projections, LM head and embedding as ``BlocksLinear`` /
    ``BlocksEmbedding`` over the checkpoint's own bytes (half of a float32 copy; products
    in float32); a pre-quantized one (``method``) in its format's blocks. None when the
    folder is float32 and not pre-quantized (loaded as ``nn.Linear`` layers). With ``tp``
    (a checkpoint that is not pre-quantized), this rank's rows and columns of each."""
    from safetensors import safe_open

    from pagoda.model.layers.blocks import TORCH_DTYPE_TYPES, BlockWeight

    config_file = os.path.join(path, "config.json")
    files = sorted(Path(path).glob("*.safetensors"))
    if not os.path.isfile(config_file) or not files:
        return None  # _load_hf_folder says what is missing
    with open(config_file) as f:
        arch = ModelArchConfig.from_hf_config(json.load(f))
    arch, handles = _base_model_layout(arch, [safe_open(str(f), framework="pt") for f in files], path)
    with torch.device("meta"):
        model = model_class(arch.architecture)(arch)
    slots = kept_weight_slots(model)   # (of the whole model: the checkpoint's dtypes)
    cls = type(model)
    convert = _checkpoint_tensors(cls, method, _checkpoint_reader(handles), arch)
    dtypes = {h.get_slice(n).get_dtype() for h in handles for n in h.keys()
              if cls.hf_name(n) in slots and len(h.get_slice(n).get_shape()) == 2}
    if method is None and (not dtypes or not dtypes <= {"BF16", "F16"}):
        return None
    # (A bfloat16/float16 weight is a block of one weight: any share of its columns is whole.)
    plan = None if tp is None else _shard_model(model, arch, tp)
    stage = _stage_of(model, arch, pipe)
    slots = kept_weight_slots(model)
    blocks: dict[str, dict[int, BlockWeight]] = {}
    floats: dict[str, torch.Tensor] = {}
    for handle in handles:
        for name in tqdm(list(handle.keys()), desc="Loading weights", unit="tensor", disable=not show_progress,
                         leave=False):
            if cls.hf_name(name) is None:
                continue
            if stage is not None and not stage.holds(cls.hf_name(name)):
                continue   # another pipeline stage's: not read
            for ours, t in convert(name, handle.get_tensor(name)):
                if plan is not None and not plan.holds(ours):
                    continue   # another rank's expert
                if stage is not None:
                    ours = stage.rename(ours)
                if isinstance(t, BlockWeight):   # kept in its blocks (MXFP4 experts, pre-quantized layers)
                    blocks.setdefault(slots[ours][0], {})[slots[ours][1]] = (
                        t if plan is None else plan.narrow_blocks(ours, t))
                    continue
                slot = slots.get(ours) if t.dim() == 2 else None
                if plan is not None:
                    t = plan.narrow(ours, t)
                if slot is not None and t.dtype in TORCH_DTYPE_TYPES:
                    blocks.setdefault(slot[0], {})[slot[1]] = BlockWeight.from_tensor(t)
                elif "rotary_emb" not in ours:
                    floats[ours] = t.float()
    _kept_weights_model(model, blocks, floats, path, device)
    return LoadedModel(model, arch, path, shard=plan, stage=stage)


def _kept_weights_model(model: CausalLM, blocks: dict, floats: dict[str, torch.Tensor], path: str,
                        device: torch.device) -> None:
    """Fill ``model`` (built on the meta device) with the kept weights, in place."""
    from pagoda.model.layers.blocks import BlocksEmbedding, BlocksLinear

    arch = model.config
    slots = kept_weight_slots(model)
    head, embedding = (slots.get(n, (None,))[0] for n in ("lm_head.weight", "model.embed_tokens.weight"))
    if head is not None and head not in blocks and arch.tie_word_embeddings and embedding in blocks:
        blocks[head] = blocks[embedding]
    _assemble_blocks(model, blocks, floats, path, BlocksLinear, BlocksEmbedding)
    model.init_rope(device)
    model.eval().requires_grad_(False)


def _assemble_blocks(model: CausalLM, blocks: dict, floats: dict[str, torch.Tensor], path: str,
                     linear_cls: type, embedding_cls: type) -> None:
    """Put the kept weights into ``model`` (built on the meta device): a ``linear_cls``
    per projection (stacked parts in shard order), an ``embedding_cls``, and the
    float tensors (norms, biases) into the parameters left; everything must fit."""
    mapping = model.packed_modules_mapping
    problems: list[str] = []
    if model.config.value_from_key is not None:
        # Layers whose values are their keys: the value rows are the key's blocks (shared).
        for i, same in enumerate(model.config.value_from_key):
            attn = f"model.layers.{i}.self_attn"
            if same and 1 in blocks.get(f"{attn}.qkv_proj", {}):
                blocks[f"{attn}.qkv_proj"].setdefault(2, blocks[f"{attn}.qkv_proj"][1])
                if f"{attn}.k_proj.bias" in floats:
                    floats.setdefault(f"{attn}.v_proj.bias", floats[f"{attn}.k_proj.bias"])
    tower = tuple(getattr(model, "tower_prefixes", ()))   # a vision tower: float parameters
    for name, module in list(model.named_modules()):
        if not isinstance(module, (nn.Linear, nn.Embedding)) or (tower and checkpoint_name(name).startswith(tower)):
            continue
        shards = blocks.pop(name, None)
        parent_name, _, attr = name.rpartition(".")
        projections = mapping.get(attr, (attr,))
        if shards is None or sorted(shards) != list(range(len(projections))):
            problems.append(f"missing {name}")
            continue
        parts = [shards[i] for i in range(len(projections))]
        if isinstance(module, nn.Embedding):
            w = parts[0]
            if (w.out_features, w.in_features) != (module.num_embeddings, module.embedding_dim):
                problems.append(f"{name} is {w.out_features}x{w.in_features}")
                continue
            new: nn.Module = embedding_cls(w)
        else:
            bias = None
            if module.bias is not None:
                names = [f"{parent_name}.{p}.bias" for p in projections]
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
