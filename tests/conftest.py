"""Shared fixtures: the bundled default model, a transformers reference, tiny random models."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
# Without a GPU, pagoda's Triton kernels run in Triton's interpreter on CPU tensors: the
# variable is read when a kernel module is imported, so it is set before any test imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """A test that changes torch's thread count (an in-process engine sets its own) gives it
    back: kernels whose blocking follows the thread count see the same count in every test,
    whatever ran before it on the same pytest worker."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from pagoda.hub.paths import default_model_path as find

    return find()


@pytest.fixture(scope="session")
def hf_default_model(default_model_path):
    """transformers' fp32 load of the same GGUF: the reference implementation."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(default_model_path),
        gguf_file=os.path.basename(default_model_path),
        dtype=torch.float32,
    )
    return model.eval()


def _save_tiny(tmp_path_factory, name: str, config, dtype: torch.dtype = torch.float32) -> str:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()
    path = tmp_path_factory.mktemp(name)
    # Small shards, so the loader's sharded path is exercised.
    model.save_pretrained(path, safe_serialization=True, max_shard_size="200KB")
    return str(path)


def _tiny_llama_config(tie_word_embeddings: bool):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        rope_theta=10000.0, tie_word_embeddings=tie_word_embeddings, initializer_range=0.3,
        architectures=["LlamaForCausalLM"],
    )


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    return _save_tiny(tmp_path_factory, "tiny-llama", _tiny_llama_config(True))


@pytest.fixture(scope="session")
def tiny_llama_bf16_dir(tmp_path_factory) -> str:
    """A bfloat16 checkpoint (how most HF models ship): pagoda keeps it in bfloat16."""
    return _save_tiny(tmp_path_factory, "tiny-llama-bf16", _tiny_llama_config(False), torch.bfloat16)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> str:
    from transformers import Qwen2Config

    config = Qwen2Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=1024,
        rope_theta=1000000.0, tie_word_embeddings=False, initializer_range=0.3,
        architectures=["Qwen2ForCausalLM"],
    )
    return _save_tiny(tmp_path_factory, "tiny-qwen2", config)


def _tiny_family(tmp_path_factory, name: str, config_class: str, **fields) -> str:
    """A tiny float32 checkpoint of a family: 4 heads of 32, 2 KV heads, vocabulary 512."""
    import transformers

    config = getattr(transformers, config_class)(
        vocab_size=512, hidden_size=64, intermediate_size=128, head_dim=32, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.3, tie_word_embeddings=True,
        **fields)
    return _save_tiny(tmp_path_factory, name, config)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> str:
    """Qwen3: q/k RMSNorms per head, a head size (32) not hidden / heads (16)."""
    return _tiny_family(tmp_path_factory, "tiny-qwen3", "Qwen3Config", num_hidden_layers=2, rope_theta=1e6,
                        architectures=["Qwen3ForCausalLM"])


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory) -> str:
    """Gemma 3: windowed (16) and global layers, sandwich norms, q/k norms per head."""
    return _tiny_family(tmp_path_factory, "tiny-gemma3", "Gemma3TextConfig", num_hidden_layers=6,
                        sliding_window=16, query_pre_attn_scalar=32, pad_token_id=0,
                        architectures=["Gemma3ForCausalLM"])


@pytest.fixture(scope="session")
def tiny_mixtral_dir(tmp_path_factory) -> str:
    """Mixtral: top-2 of 4 experts in every layer."""
    return _tiny_family(tmp_path_factory, "tiny-mixtral", "MixtralConfig", num_hidden_layers=2, num_local_experts=4,
                        num_experts_per_tok=2, architectures=["MixtralForCausalLM"])


@pytest.fixture(scope="session")
def tiny_qwen3moe_dir(tmp_path_factory) -> str:
    """Qwen3-MoE: top-2 of 6 small experts, renormalised, q/k norms."""
    return _tiny_family(tmp_path_factory, "tiny-qwen3moe", "Qwen3MoeConfig", num_hidden_layers=2, num_experts=6,
                        num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True, rope_theta=1e6,
                        architectures=["Qwen3MoeForCausalLM"])


@pytest.fixture(scope="session")
def tiny_gptoss_dir(tmp_path_factory) -> str:
    """GPT-OSS: windowed (16) and global layers, sinks, biases, top-2 of 4 clamped-SwiGLU experts."""
    return _tiny_family(tmp_path_factory, "tiny-gptoss", "GptOssConfig", num_hidden_layers=2, num_local_experts=4,
                        num_experts_per_tok=2, sliding_window=16,
                        architectures=["GptOssForCausalLM"])


@pytest.fixture(scope="session")
def tiny_phi3_dir(tmp_path_factory) -> str:
    """Phi-3: q/k/v and gate/up stacked in the checkpoint itself."""
    return _tiny_family(tmp_path_factory, "tiny-phi3", "Phi3Config", num_hidden_layers=2, pad_token_id=0,
                        architectures=["Phi3ForCausalLM"])


@pytest.fixture(scope="session")
def tiny_seedoss_dir(tmp_path_factory) -> str:
    """Seed-OSS: biases on q, k, v, o and the MLP."""
    return _tiny_family(tmp_path_factory, "tiny-seedoss", "SeedOssConfig", num_hidden_layers=2, attention_bias=True,
                        attention_out_bias=True, mlp_bias=True, architectures=["SeedOssForCausalLM"])


@pytest.fixture(scope="session")
def tiny_olmo3_dir(tmp_path_factory) -> str:
    """OLMo 3: OLMo 2's layers, three windowed (16) to one global."""
    return _tiny_family(tmp_path_factory, "tiny-olmo3", "Olmo3Config", num_hidden_layers=4, sliding_window=16,
                        architectures=["Olmo3ForCausalLM"])


@pytest.fixture(scope="session")
def tiny_exaone4_dir(tmp_path_factory) -> str:
    """EXAONE 4: post-norms, per-head q/k norms, windowed layers (16) and NoPE global ones."""
    return _tiny_family(tmp_path_factory, "tiny-exaone4", "Exaone4Config", num_hidden_layers=4, sliding_window=16,
                        architectures=["Exaone4ForCausalLM"])


@pytest.fixture(scope="session")
def tiny_cohere2_dir(tmp_path_factory) -> str:
    """Command R7B: parallel blocks, LayerNorms, interleaved RoPE (Q/K rows and their biases
    un-permuted at load, before the heads are split), windowed (16) and NoPE global layers."""
    return _tiny_family(tmp_path_factory, "tiny-cohere2", "Cohere2Config", num_hidden_layers=4, sliding_window=16,
                        attention_bias=True, logit_scale=0.25, architectures=["Cohere2ForCausalLM"])


@pytest.fixture(scope="session")
def tiny_llama4_dir(tmp_path_factory) -> str:
    """Llama 4: chunked attention (chunks of 16) with RoPE and weightless q/k norms on 3 of 4
    layers, the fourth global without RoPE, queries scaled by position; dense and MoE layers
    alternating (top-1 of 4 experts weighing their inputs, a shared expert)."""
    return _tiny_family(tmp_path_factory, "tiny-llama4", "Llama4TextConfig", num_hidden_layers=4,
                        intermediate_size_mlp=128, num_local_experts=4, num_experts_per_tok=1,
                        interleave_moe_layer_step=2, attention_chunk_size=16, floor_scale=8, attn_scale=0.5,
                        architectures=["Llama4ForCausalLM"])


def _tiny_biased_moe(tmp_path_factory, name: str, config, random_norms: tuple[str, ...] = ()) -> str:
    """A tiny MoE checkpoint whose routers' choice bias (zeros at init) is random, and the
    weights of the norms named ``random_norms`` (ones at init)."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for module_name, m in model.named_modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.normal_(0, 0.3)
            if random_norms and module_name.endswith(random_norms):
                m.weight.normal_(1.0, 0.3)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="session")
def tiny_ernie45moe_dir(tmp_path_factory) -> str:
    """ERNIE 4.5 MoE: interleaved RoPE, a dense first layer, then 8 experts (3 a token, softmax
    router with a random choice bias) plus a shared expert."""
    import transformers

    config = transformers.Ernie4_5_MoeConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=3, max_position_embeddings=1024, initializer_range=0.3, moe_num_experts=8, moe_k=3,
        moe_intermediate_size=32, moe_num_shared_experts=1, moe_layer_start_index=1, tie_word_embeddings=True,
        architectures=["Ernie4_5_MoeForCausalLM"])
    return _tiny_biased_moe(tmp_path_factory, "tiny-ernie45moe", config)


@pytest.fixture(scope="session")
def tiny_minimaxm2_dir(tmp_path_factory) -> str:
    """MiniMax-M2: q/k RMSNorms over the whole projections (random weights: each rank holds its
    heads' part), RoPE on half of each head, 8 experts in every layer (2 a token, sigmoid
    router with a random choice bias)."""
    import transformers

    config = transformers.MiniMaxM2Config(
        vocab_size=512, hidden_size=64, intermediate_size=32, head_dim=32, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=1024, initializer_range=0.3,
        num_local_experts=8, num_experts_per_tok=2, rotary_dim=16, tie_word_embeddings=False,
        architectures=["MiniMaxM2ForCausalLM"])
    return _tiny_biased_moe(tmp_path_factory, "tiny-minimaxm2", config, random_norms=("q_norm", "k_norm"))


@pytest.fixture(scope="session")
def tiny_glm4moe_dir(tmp_path_factory) -> str:
    """GLM-4.5: a dense first layer, then 8 experts (2 a token, sigmoid router with a random
    choice bias) plus a shared expert; q/k/v biases, per-head q/k norms, half-head RoPE."""
    import torch
    import transformers

    config = transformers.Glm4MoeConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, head_dim=32, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=3, max_position_embeddings=1024, initializer_range=0.3,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, use_qk_norm=True, attention_bias=True,
        tie_word_embeddings=False, architectures=["Glm4MoeForCausalLM"])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.normal_(0, 0.3)
    path = tmp_path_factory.mktemp("tiny-glm4moe")
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="session")
def tiny_olmo2_dir(tmp_path_factory) -> str:
    """OLMo 2: whole-width q/k norms, post-norms; one KV head (replicated under TP=2)."""
    from transformers import Olmo2Config

    config = Olmo2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=1024,
                         initializer_range=0.3, pad_token_id=0, architectures=["Olmo2ForCausalLM"])
    return _save_tiny(tmp_path_factory, "tiny-olmo2", config)
