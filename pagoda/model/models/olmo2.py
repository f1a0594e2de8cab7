"""OLMo 2: norms after each block (of its output, before the residual add) instead of
before it, and RMSNorms over the whole q and k projections before RoPE (under tensor
parallelism each rank's mean square comes from every rank's sums: Attention._sharded_norm).

OLMo 3: OLMo 2's layers with sliding-window attention on three layers of four (``layer_types``;
every fourth global when the config leaves them out), the windowed layers' RoPE unscaled
(a long-context checkpoint's YaRN applies to the global layers only). llama.cpp writes it as
an ``olmo2`` file with ``attention.sliding_window`` and ``attention.sliding_window_pattern``:
such a file is served with its windows, never without."""

from __future__ import annotations

from typing import Any

from pagoda.model.arch import ModelArchConfig, gguf_layer_types, periodic_layer_types
from pagoda.model.layers.decoder import CausalLM

_OPTIONS = {"qk_norm": "full", "norm_placement": "post"}
OLMO3_WINDOW_PERIOD = 4   # every fourth layer global (transformers' and llama.cpp's default)


class Olmo2ForCausalLM(CausalLM):

    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        fields = ModelArchConfig.hf_fields(config, architecture)
        if fields["sliding_window"] and fields["layer_types"] is None:
            fields["layer_types"] = periodic_layer_types(fields["num_hidden_layers"], OLMO3_WINDOW_PERIOD)
        if fields["sliding_window"] and fields.get("local_rope_theta") is None:
            fields["local_rope_theta"] = fields["rope_theta"]   # windowed layers: plain RoPE
        return ModelArchConfig(**{**fields, **_OPTIONS})

    @classmethod
    def arch_from_gguf(cls, md: dict[str, Any], tensor_names: set[str], architecture: str) -> ModelArchConfig:
        fields = ModelArchConfig.gguf_fields(md, tensor_names, architecture)
        if fields["sliding_window"]:   # an OLMo 3 file
            p = f"{md['general.architecture']}."
            fields["architecture"] = "Olmo3ForCausalLM"
            fields["layer_types"] = gguf_layer_types(md, fields["num_hidden_layers"], OLMO3_WINDOW_PERIOD)
            fields["local_rope_theta"] = float(md.get(p + "rope.freq_base_swa") or fields["rope_theta"])
        return ModelArchConfig(**{**fields, **_OPTIONS})


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    pass
