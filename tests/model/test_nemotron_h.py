"""Nemotron-H beyond the shared hybrid family tests (tests/model/test_hybrid.py): a
correction bias away from zero (the shared fixture leaves it at its initial zeros), the
latent experts, transformers' stacked expert tensors, the MTP tensors skipped (llama.cpp's
MTP block too), a checkpoint without experts (plain MLP layers; llama.cpp's nemotron_h
file), and the refusals."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers

from tests.model.hybrid_nemotron_h import _LAYERS, _nemotronh


def _save(config, path, stacked: bool = False, mtp: bool = False):
    """A tiny random checkpoint with the router's correction bias away from zero; ``stacked``:
    rewritten with transformers' names (model.*, each layer's experts as one [E, out, in]
    tensor); ``mtp``: with an MTP layer's tensors, which pagoda skips."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for m in hf.modules():
            if getattr(m, "e_score_correction_bias", None) is not None:
                m.e_score_correction_bias.normal_(0, 0.3)
    hf.save_pretrained(path, safe_serialization=True)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    if stacked:
        renamed = {}
        for name, t in tensors.items():
            renamed[name.replace("backbone.", "model.", 1)] = t
        for i, kind in enumerate(_LAYERS):
            if kind == "moe":
                for proj in ("up_proj", "down_proj"):
                    keys = [f"model.layers.{i}.mixer.experts.{e}.{proj}.weight" for e in range(config.n_routed_experts)]
                    renamed[f"model.layers.{i}.mixer.experts.{proj}"] = torch.stack([renamed.pop(k) for k in keys])
        tensors = renamed
    if mtp:
        tensors["mtp.layers.0.norm.weight"] = torch.ones(config.hidden_size)
        tensors["mtp.layers.0.mixer.q_proj.weight"] = torch.zeros(64, config.hidden_size)
        with open(os.path.join(path, "config.json")) as f:
            saved = json.load(f)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({**saved, "num_nextn_predict_layers": 1}, f)
    save_file(tensors, file, metadata={"format": "pt"})
    return hf


def _assert_matches_hf(llm, hf, label: str) -> None:
    """Greedy tokens of two prompts and one prompt's logprobs (within 1e-3) as transformers'."""
    from pagoda import SamplingParams
    from tests.model.helpers import assert_greedy_matches_hf

    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (9, 40)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2), use_tqdm=False)
    assert_greedy_matches_hf(hf, prompts, outputs, 8, label)
    out = llm.generate([{"prompt_token_ids": prompts[1]}], SamplingParams(max_tokens=1, prompt_logprobs=1),
                       use_tqdm=False)[0]
    with torch.inference_mode():
        want = torch.log_softmax(hf(torch.tensor([prompts[1]])).logits[0].float(), -1)
    got = [entry[tok].logprob for entry, tok in zip(out.prompt_logprobs[1:], prompts[1][1:])]
    ref = [want[i, tok].item() for i, tok in enumerate(prompts[1][1:])]
    assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-3


def _skip_without_cpu_kernels() -> None:
    from pagoda.ops import cpu_kernels

    if cpu_kernels.kernels() is None:
        pytest.skip("GGUF files are served from their blocks by pagoda's CPU kernels")


@pytest.mark.parametrize("variant", ["latent_mtp", "stacked", "latent_mtp_gguf"])
def test_nemotronh_routing_bias_latent_experts_and_checkpoint_forms(tmp_path, variant):
    """``latent_mtp_gguf``: llama.cpp's nemotron_h_moe file of the latent checkpoint, its
    MTP layers folded into a block past the last layer (``nextn_predict_layers``)."""
    from pagoda import LLM
    from tests.model.hybrid_nemotron_h import write_nemotronh_gguf

    if variant.endswith("gguf"):
        _skip_without_cpu_kernels()
    latent = variant.startswith("latent")
    config = _nemotronh(moe_latent_size=48) if latent else _nemotronh()
    hf = _save(config, str(tmp_path / "hf"), stacked=variant == "stacked", mtp=latent)
    path = str(tmp_path / "hf")
    if variant.endswith("gguf"):
        path = write_nemotronh_gguf(hf, str(tmp_path / "model.gguf"), path)
    llm = LLM(path, skip_tokenizer_init=True, show_progress=False, num_kv_blocks=16, block_size=64,
              max_num_batched_tokens=32)
    _assert_matches_hf(llm, hf, f"nemotronh {variant}")


@pytest.mark.parametrize(("change", "words"), [
    ({"mlp_hidden_act": "silu"}, "mlp_hidden_act 'silu' is not supported"),
    ({"mamba_hidden_act": "gelu"}, "mamba_hidden_act 'gelu' is not supported"),
    ({"layers_block_type": ["mamba", "cross_attention"]}, r"layer types \['cross_attention'\] are not supported"),
])
def test_nemotronh_refuses_what_it_cannot_serve(change, words):
    from pagoda.model.arch import ModelArchConfig
    from pagoda.model.models import UnsupportedModelError

    config = {**_nemotronh().to_dict(), "architectures": ["NemotronHForCausalLM"], **change}
    with pytest.raises(UnsupportedModelError, match=words):
        ModelArchConfig.from_hf_config(config)


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_nemotronh_without_experts_matches_transformers(tmp_path, source):
    """A checkpoint without experts (plain relu² MLP layers): from safetensors, and as
    llama.cpp's ``nemotron_h`` file (Q/K permuted, A as -exp(A_log), D and the gated norm
    reshaped, ``backbone.*`` names) served from its blocks: transformers' greedy tokens and
    prompt logprobs."""
    from pagoda import LLM
    from tests.model.hybrid_nemotron_h import DENSE_LAYERS, write_nemotronh_gguf

    if source == "gguf":
        _skip_without_cpu_kernels()
    hf = _save(_nemotronh(layers_block_type=DENSE_LAYERS), str(tmp_path / "hf"))
    path = str(tmp_path / "hf")
    if source == "gguf":
        path = write_nemotronh_gguf(hf, str(tmp_path / "model.gguf"), path)
    llm = LLM(path, skip_tokenizer_init=True, show_progress=False, num_kv_blocks=16, block_size=64,
              max_num_batched_tokens=32)
    _assert_matches_hf(llm, hf, f"nemotronh dense {source}")


def test_nemotronh_moe_gguf_layers_that_differ_are_refused():
    """NVIDIA's Puzzle files (``nemotron_h_moe``): experts of a different width or number per
    token layer by layer, which pagoda's layers (one geometry for all) cannot hold."""
    from pagoda.model.arch import ModelArchConfig
    from pagoda.model.models import UnsupportedModelError

    p = "nemotron_h_moe."
    md = {"general.architecture": "nemotron_h_moe", p + "block_count": 3, p + "embedding_length": 64,
          p + "attention.head_count": 4, p + "attention.head_count_kv": [0, 2, 0], p + "vocab_size": 512,
          p + "feed_forward_length": [0, 0, 32], p + "ssm.time_step_rank": 4, p + "ssm.inner_size": 128,
          p + "ssm.group_count": 2, p + "ssm.state_size": 8, p + "ssm.conv_kernel": 4, p + "expert_count": 8,
          p + "expert_used_count": 2, p + "expert_shared_feed_forward_length": 64,
          p + "expert_feed_forward_length": [0, 0, 32]}
    arch = ModelArchConfig.from_gguf_metadata(md, set())
    assert arch.block_types == ("mamba", "attention", "moe") and arch.moe_intermediate_size == 32
    md.update({p + "block_count": 4, p + "attention.head_count_kv": [0, 2, 0, 0],
               p + "feed_forward_length": [0, 0, 32, 48], p + "expert_feed_forward_length": [0, 0, 32, 48]})
    with pytest.raises(UnsupportedModelError, match=r"expert widths \[32, 48\] .* varying by layer"):
        ModelArchConfig.from_gguf_metadata(md, set())


def test_nemotronh_reads_the_older_config_keys():
    """NVIDIA's first Nemotron-H configs: the layers as a pattern of letters, the Mamba
    options under their mamba_* names, the attention head size as attention_head_dim."""
    from pagoda.model.arch import ModelArchConfig

    config = {k: v for k, v in _nemotronh().to_dict().items()
              if k not in ("layers_block_type", "n_groups", "conv_kernel", "head_dim")}
    config.update(architectures=["NemotronHForCausalLM"], hybrid_override_pattern="M*E-", mamba_n_groups=4,
                  mamba_d_conv=3, attention_head_dim=32)
    arch = ModelArchConfig.from_hf_config(config)
    assert arch.block_types == ("mamba", "attention", "moe", "mlp") and arch.num_hidden_layers == 4
    assert (arch.mamba["groups"], arch.mamba["d_conv"], arch.head_dim) == (4, 3, 32)
    assert arch.mamba_layers == (True, False, False, False) and arch.moe_layers == (False, False, True, False)
