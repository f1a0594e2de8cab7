"""Read a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors).

An adapter adds ``scaling * B @ A`` to some of the model's projections, per
layer: A is [rank, in], B is [out, rank], ``scaling = lora_alpha / rank``
(``lora_alpha / sqrt(rank)`` with rsLoRA). Checkpoint tensors are named like
``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``.

Only what pagoda can apply exactly is accepted; anything else (DoRA, LoRA
biases, embeddings or the LM head as targets, modules_to_save...) is an error
that names the setting or the module, never silently skipped.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

from pagoda.lora.errors import LoRAAdapterError
from pagoda.lora.request import LoRARequest
from pagoda.model.arch import ModelArchConfig

# Checkpoint projection -> (pagoda module, output slice index within it).
# q/k/v live in one stacked qkv_proj, gate/up in gate_up_proj.
TARGET_MODULES: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}

# Targets a checkpoint stores stacked (Phi-3): one adapter on the stacked output, split
# into its projections' row ranges (the same A for each, B's rows).
STACKED_TARGETS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
_MLP_TARGETS = {"gate_proj", "up_proj", "down_proj", "gate_up_proj"}

_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)\.weight$")


@dataclass
class LoRAModuleWeights:
    a: torch.Tensor          # [rank, in]
    b: torch.Tensor          # [out, rank], already multiplied by the scaling
    rank: int


@dataclass
class LoRAAdapter:
    request: LoRARequest
    rank: int                # the largest rank among its modules
    # (layer index, checkpoint projection name e.g. "k_proj") -> weights
    modules: dict[tuple[int, str], LoRAModuleWeights]

    @property
    def lora_int_id(self) -> int:
        return self.request.lora_int_id


def projection_shapes(arch: ModelArchConfig) -> dict[str, tuple[int, int]]:
    """Checkpoint projection -> (in features, out features)."""
    h, i = arch.hidden_size, arch.intermediate_size
    q = arch.num_attention_heads * arch.head_dim
    kv = arch.num_key_value_heads * arch.head_dim
    return {
        "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
        "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
    }


def _permuted_qk_heads(arch: ModelArchConfig) -> dict[str, int]:
    """q_proj / k_proj -> heads where the family's HF Q/K rows are un-permuted at load
    (``hf_qk_permuted``: interleaved RoPE), so an adapter's B rows are too; else empty."""
    from pagoda.model.loader import _qk_heads
    from pagoda.model.models import model_class

    return _qk_heads(arch, model_class(arch.architecture), hf=True)


def _check_config(config: dict, path: str) -> None:
    def fail(what: str) -> LoRAAdapterError:
        return LoRAAdapterError(f"LoRA adapter {path}: {what} is not supported")

    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise fail(f"peft_type {peft_type!r} (only LORA)")
    if config.get("bias", "none") != "none":
        raise fail(f"bias={config['bias']!r} (only 'none')")
    if config.get("lora_bias"):
        raise fail("lora_bias=True")
    if config.get("use_dora"):
        raise fail("use_dora=True (DoRA)")
    if config.get("fan_in_fan_out"):
        raise fail("fan_in_fan_out=True")
    if config.get("modules_to_save"):
        raise fail(f"modules_to_save={config['modules_to_save']!r}")
    if config.get("alpha_pattern"):
        raise fail(f"alpha_pattern={config['alpha_pattern']!r}")
    if config.get("trainable_token_indices"):
        raise fail("trainable_token_indices")
    if config.get("target_parameters"):
        raise fail(f"target_parameters={config['target_parameters']!r}")
    # Variants that change the forward beyond scaling * B @ A.
    for key in ("alora_invocation_tokens", "use_qalora", "layer_replication", "arrow_config",
                "use_bdlora", "kasa_config", "monteclora_config"):
        if config.get(key):
            raise fail(f"{key}={config[key]!r}")
    targets = config.get("target_modules")
    if isinstance(targets, (list, tuple)):
        for target in targets:
            module = str(target).rsplit(".", 1)[-1]
            if module not in TARGET_MODULES and module not in STACKED_TARGETS:
                raise LoRAAdapterError(
                    f"LoRA adapter {path}: unsupported target module {module!r}; "
                    f"supported: {', '.join([*TARGET_MODULES, *STACKED_TARGETS])}"
                )
    for key in ("lora_alpha", "r"):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise LoRAAdapterError(f"LoRA adapter {path}: adapter_config.json {key} must be a positive number, got {value!r}")


def load_adapter(
    request: LoRARequest, arch: ModelArchConfig, max_rank: int, dtype: torch.dtype = torch.float32
) -> LoRAAdapter:
    """Read and check an adapter against the base model; the tensors stay on the CPU."""
    from safetensors import SafetensorError, safe_open

    path = request.lora_path
    config_file = os.path.join(path, "adapter_config.json")
    weights_file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isdir(path):
        raise LoRAAdapterError(f"LoRA adapter path {path!r} is not a directory")
    if not os.path.isfile(config_file):
        raise LoRAAdapterError(f"LoRA adapter {path}: no adapter_config.json")
    if not os.path.isfile(weights_file):
        extra = " (pickled adapter_model.bin is not loaded)" if os.path.isfile(os.path.join(path, "adapter_model.bin")) else ""
        raise LoRAAdapterError(f"LoRA adapter {path}: no adapter_model.safetensors{extra}")
    try:
        with open(config_file) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise LoRAAdapterError(f"LoRA adapter {path}: unreadable adapter_config.json: {e}") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"LoRA adapter {path}: adapter_config.json is not an object")
    _check_config(config, path)
    alpha = float(config["lora_alpha"])
    rslora = bool(config.get("use_rslora", False))
    shapes = projection_shapes(arch)
    qk_heads = _permuted_qk_heads(arch)

    raw: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(weights_file, framework="pt") as handle:
            for name in handle.keys():
                m = _TENSOR.search(name)
                if m is None:
                    parts = name.split(".")
                    lora = next((k for k, p in enumerate(parts) if p.startswith("lora_")), None)
                    module = parts[lora - 1] if lora else name
                    raise LoRAAdapterError(
                        f"LoRA adapter {path}: unsupported target module {module!r} (tensor {name}); "
                        f"supported: {', '.join(TARGET_MODULES)}"
                    )
                layer, _, module, which = int(m.group(1)), m.group(2), m.group(3), m.group(4)
                if module not in TARGET_MODULES and module not in STACKED_TARGETS:
                    raise LoRAAdapterError(
                        f"LoRA adapter {path}: unsupported target module {module!r} (tensor {name}); "
                        f"supported: {', '.join([*TARGET_MODULES, *STACKED_TARGETS])}"
                    )
                if module in _MLP_TARGETS and arch.is_moe_layer(layer):
                    raise LoRAAdapterError(
                        f"LoRA adapter {path}: layers.{layer}.{module}: adapters on a mixture of experts' "
                        "projections are not supported (attention projections are)")
                if layer >= arch.num_hidden_layers:
                    raise LoRAAdapterError(
                        f"LoRA adapter {path}: module layers.{layer}.{module} does not exist "
                        f"(the base model has {arch.num_hidden_layers} layers)"
                    )
                raw.setdefault((layer, module), {})[which] = handle.get_tensor(name)
    except SafetensorError as e:
        raise LoRAAdapterError(f"LoRA adapter {path}: unreadable adapter_model.safetensors: {e}") from None
    if not raw:
        raise LoRAAdapterError(f"LoRA adapter {path}: adapter_model.safetensors holds no LoRA weights")

    for (layer, module) in [key for key in raw if key[1] in STACKED_TARGETS]:
        pair = raw.pop((layer, module))
        parts = STACKED_TARGETS[module]
        if any((layer, p) in raw for p in parts):
            raise LoRAAdapterError(f"LoRA adapter {path}: layers.{layer} has both {module} and its parts")
        if set(pair) == {"A", "B"} and pair["B"].dim() == 2 and pair["B"].shape[0] == sum(shapes[p][1] for p in parts):
            rows = pair["B"].split([shapes[p][1] for p in parts])
            for p, b in zip(parts, rows):
                raw[(layer, p)] = {"A": pair["A"], "B": b}
        else:   # the checks below name what is wrong, on the first part
            raw[(layer, parts[0])] = pair
    modules: dict[tuple[int, str], LoRAModuleWeights] = {}
    for (layer, module), pair in sorted(raw.items()):
        label = f"layers.{layer}.{module}"
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise LoRAAdapterError(f"LoRA adapter {path}: module {label} has no {missing} weight")
        a, b = pair["A"], pair["B"]
        in_f, out_f = shapes[module]
        rank = a.shape[0] if a.dim() == 2 else -1
        if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (rank, in_f) or tuple(b.shape) != (out_f, rank):
            raise LoRAAdapterError(
                f"LoRA adapter {path}: module {label} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
                f"the base model needs lora_A (rank, {in_f}) and lora_B ({out_f}, rank)"
            )
        if rank > max_rank:
            raise LoRAAdapterError(
                f"LoRA adapter {path}: module {label} has rank {rank}, above --max-lora-rank {max_rank}"
            )
        scaling = alpha / (math.sqrt(rank) if rslora else rank)
        if module in qk_heads:   # the base model's Q/K rows were put in rotate-half order at load
            from pagoda.model.loader import unpermute_rope

            b = unpermute_rope(b, qk_heads[module])
        modules[(layer, module)] = LoRAModuleWeights(
            a.to(torch.float32).to(dtype), (b.to(torch.float32) * scaling).to(dtype), rank
        )
    return LoRAAdapter(request, max(w.rank for w in modules.values()), modules)
