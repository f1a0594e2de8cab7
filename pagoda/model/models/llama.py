"""Llama 2/3.x (and SmolLM2, which is a Llama) and Mistral: the shared decoder as it is."""

from __future__ import annotations

from pagoda.model.layers.decoder import CausalLM, GatedMLP as LlamaMLP  # noqa: F401 (LlamaMLP re-exported)
from pagoda.model.layers.norm import RMSNorm  # noqa: F401 (re-exported)
from pagoda.model.layers.rotary import apply_rope  # noqa: F401 (re-exported)


class LlamaForCausalLM(CausalLM):
    # llama.cpp's Llama converter interleaves each head's Q/K rows for its rotary layout.
    gguf_qk_permuted = True


class MistralForCausalLM(LlamaForCausalLM):
    pass
