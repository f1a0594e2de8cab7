"""The model registry: one module per family, one line per architecture.

Adding a family is one file in this package (a ``CausalLM`` subclass from
``pagoda.model.layers.decoder``: its config parsing, weight names and any layer of its own)
plus its lines here. Classes are imported on first use.
"""

from __future__ import annotations

import importlib


class UnsupportedModelError(ValueError):
    """A model this registry has no family for (or a family option pagoda lacks)."""


# HF `architectures` name -> (module in this package, class).
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "SmolLM3ForCausalLM": ("smollm3", "SmolLM3ForCausalLM"),
    "GraniteForCausalLM": ("granite", "GraniteForCausalLM"),
    "Olmo2ForCausalLM": ("olmo2", "Olmo2ForCausalLM"),
    "Olmo3ForCausalLM": ("olmo2", "Olmo3ForCausalLM"),
    "SeedOssForCausalLM": ("seed_oss", "SeedOssForCausalLM"),
    "Exaone4ForCausalLM": ("exaone4", "Exaone4ForCausalLM"),
    "Glm4MoeForCausalLM": ("glm4_moe", "Glm4MoeForCausalLM"),
    "Cohere2ForCausalLM": ("cohere2", "Cohere2ForCausalLM"),
    "HunYuanDenseV1ForCausalLM": ("hunyuan_dense", "HunYuanDenseV1ForCausalLM"),
    "Ernie4_5_MoeForCausalLM": ("ernie4_5_moe", "Ernie4_5_MoeForCausalLM"),
    "MiniMaxM2ForCausalLM": ("minimax_m2", "MiniMaxM2ForCausalLM"),
    "Llama4ForCausalLM": ("llama4", "Llama4ForCausalLM"),
    "Llama4ForConditionalGeneration": ("llama4", "Llama4ForConditionalGeneration"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Gemma3ForConditionalGeneration": ("gemma3_vision", "Gemma3ForConditionalGeneration"),
    "Gemma4ForCausalLM": ("gemma4", "Gemma4ForCausalLM"),
    "Gemma4ForConditionalGeneration": ("gemma4_vision", "Gemma4ForConditionalGeneration"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM"),
    "DeepseekV2ForCausalLM": ("deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek_v2", "DeepseekV3ForCausalLM"),
    "DeepseekV32ForCausalLM": ("deepseek_v2", "DeepseekV32ForCausalLM"),
    "Lfm2ForCausalLM": ("lfm2", "Lfm2ForCausalLM"),
    "Lfm2MoeForCausalLM": ("lfm2", "Lfm2MoeForCausalLM"),
    "GraniteMoeHybridForCausalLM": ("granite_hybrid", "GraniteMoeHybridForCausalLM"),
    "NemotronHForCausalLM": ("nemotron_h", "NemotronHForCausalLM"),
    "FalconH1ForCausalLM": ("falcon_h1", "FalconH1ForCausalLM"),
    "Qwen3_5ForCausalLM": ("qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("qwen3_5", "Qwen3_5MoeForCausalLM"),
    "Qwen3VLForConditionalGeneration": ("qwen3_vl", "Qwen3VLForConditionalGeneration"),
    "Qwen3VLMoeForConditionalGeneration": ("qwen3_vl", "Qwen3VLMoeForConditionalGeneration"),
    "Qwen3_5ForConditionalGeneration": ("qwen3_vl", "Qwen3_5ForConditionalGeneration"),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_vl", "Qwen3_5MoeForConditionalGeneration"),
    "Qwen3NextForCausalLM": ("qwen3_5", "Qwen3NextForCausalLM"),
    "Idefics3ForConditionalGeneration": ("idefics3", "Idefics3ForConditionalGeneration"),
    "Qwen2VLForConditionalGeneration": ("qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_vl", "Qwen2_5_VLForConditionalGeneration"),
    "LlavaForConditionalGeneration": ("llava", "LlavaForConditionalGeneration"),
    "Mistral3ForConditionalGeneration": ("mistral3", "Mistral3ForConditionalGeneration"),
    # An encoder served as a classifier only (cross-encoders: task classify).
    "BertForSequenceClassification": ("bert", "BertForSequenceClassification"),
}

# GGUF `general.architecture` -> HF architecture name.
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen2vl": "Qwen2ForCausalLM",   # Qwen2-VL / Qwen2.5-VL's language model (M-RoPE: with --mmproj)
    "qwen3": "Qwen3ForCausalLM",
    "qwen3vl": "Qwen3ForCausalLM",   # Qwen3-VL's language model (M-RoPE and deepstack: with --mmproj)
    "qwen3vlmoe": "Qwen3MoeForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "llama4": "Llama4ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gemma4": "Gemma4ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",   # Mixtral files are "llama" files with experts
    "gpt-oss": "GptOssForCausalLM",
    "lfm2": "Lfm2ForCausalLM",
    "lfm2moe": "Lfm2MoeForCausalLM",
    "qwen35": "Qwen3_5ForCausalLM",
    "qwen35moe": "Qwen3_5MoeForCausalLM",
    "qwen3next": "Qwen3NextForCausalLM",
    "seed_oss": "SeedOssForCausalLM",
    "exaone4": "Exaone4ForCausalLM",
    "glm4moe": "Glm4MoeForCausalLM",
    "cohere2": "Cohere2ForCausalLM",
    "hunyuan-dense": "HunYuanDenseV1ForCausalLM",
    "ernie4_5-moe": "Ernie4_5_MoeForCausalLM",
    "minimax-m2": "MiniMaxM2ForCausalLM",
    "granitehybrid": "GraniteMoeHybridForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
    "nemotron_h_moe": "NemotronHForCausalLM",
    "falcon-h1": "FalconH1ForCausalLM",
}


def hf_architectures() -> list[str]:
    return sorted(ARCHITECTURES)


def model_class(architecture: str):
    """The ``CausalLM`` subclass serving an HF architecture name."""
    if architecture not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(hf_architectures())}")
    module, name = ARCHITECTURES[architecture]
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
