"""Every architecture family of the registry against transformers: a tiny random
checkpoint of each (built here from the family's own config class, float32), loaded by
pagoda from safetensors and from a GGUF file written from the same tensors
(tests/model/hf_to_gguf.py): prompt logits within 1e-3 of transformers' and greedy
tokens equal, through a batch of mixed lengths, chunked prefill, prefix-cache hits and
preemption; every KV block comes back."""

from __future__ import annotations

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.core.kv_layout import KVLayout
from pagoda.engine.messages import EngineCoreRequest
from pagoda.model.arch import ModelArchConfig, UnsupportedModelError
from pagoda.model.models import ARCHITECTURES, GGUF_ARCHITECTURES, model_class
from pagoda.ops import cpu_kernels
from pagoda.worker.model_runner import kv_cache_bytes_per_block
from tests.model.helpers import assert_greedy_matches_hf, compare_greedy, hf_greedy, top2_gap
from tests.model.hf_to_gguf import write_gguf
from tests.model.test_reference import pagoda_prompt_logits

transformers = pytest.importorskip("transformers")

_COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.3,
               pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _configs():
    t = transformers
    return {
        # head_dim 32 with hidden 64 / 4 heads (Qwen3's head size is its own).
        "qwen3": (t.Qwen3Config(**_COMMON, num_hidden_layers=2, head_dim=32, rope_theta=1e6,
                                tie_word_embeddings=True), "qwen3"),
        # 4 layers: the fourth applies no RoPE.
        "smollm3": (t.SmolLM3Config(**_COMMON, num_hidden_layers=4, no_rope_layer_interval=4,
                                    tie_word_embeddings=True), "smollm3"),
        "granite": (t.GraniteConfig(**_COMMON, num_hidden_layers=2, embedding_multiplier=6.0,
                                    residual_multiplier=0.3, attention_multiplier=0.09, logits_scaling=4.0,
                                    tie_word_embeddings=False), "granite"),
        "olmo2": (t.Olmo2Config(**_COMMON, num_hidden_layers=2, tie_word_embeddings=False), "olmo2"),
        # OLMo 3: three windowed layers (16) to one global, the prompts past the window;
        # llama.cpp writes it as an olmo2 file with its windows.
        "olmo3": (t.Olmo3Config(**_COMMON, num_hidden_layers=4, sliding_window=16, tie_word_embeddings=False),
                  "olmo2"),
        # GLM-4.5: q/k/v biases and per-head norms, RoPE on half of each head, a dense first
        # layer, then DeepSeek-V3's router (sigmoid, choice bias set random below; one group:
        # llama.cpp's files carry none) over 8 experts x 2.5 plus a shared expert.
        "glm4moe": (t.Glm4MoeConfig(**_COMMON, num_hidden_layers=3, head_dim=32, n_routed_experts=8,
                                    num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                                    first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=2.5,
                                    use_qk_norm=True, attention_bias=True, tie_word_embeddings=False), "glm4moe"),
        # EXAONE 4: post-norms, per-head q/k norms, three windowed layers (16) to one global
        # whose attention applies no RoPE.
        "exaone4": (t.Exaone4Config(**_COMMON, num_hidden_layers=4, sliding_window=16, tie_word_embeddings=False),
                    "exaone4"),
        # Command R7B: parallel blocks, Cohere's LayerNorm, RoPE on interleaved pairs (Q/K rows
        # un-permuted at load), three windowed layers (16) to one global without RoPE, the
        # logits x 0.25 (a tied head: llama.cpp's cohere2 files hold no other).
        "cohere2": (t.Cohere2Config(**_COMMON, num_hidden_layers=4, sliding_window=16, logit_scale=0.25,
                                    tie_word_embeddings=True), "cohere2"),
        # Hunyuan dense: per-head q/k norms after RoPE, q/k/v/o biases, "dynamic" RoPE with a
        # fixed alpha (NTK-alpha: a stretched base; llama.cpp's files hold it stretched).
        "hunyuan": (t.HunYuanDenseV1Config(**_COMMON, num_hidden_layers=2, head_dim=32, attention_bias=True,
                                           tie_word_embeddings=False,
                                           rope_parameters={"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0,
                                                            "rope_theta": 10000.0}), "hunyuan-dense"),
        # ERNIE 4.5 MoE: interleaved RoPE (Q/K rows un-permuted at load), a dense first layer,
        # then a softmax router whose choice bias (set random below) does not weigh, top-3 of
        # 8 experts renormalised, plus a shared expert; a tied head.
        "ernie45moe": (t.Ernie4_5_MoeConfig(**_COMMON, num_hidden_layers=3, moe_num_experts=8, moe_k=3,
                                            moe_intermediate_size=32, moe_num_shared_experts=1,
                                            moe_layer_start_index=1, tie_word_embeddings=True), "ernie4_5-moe"),
        # MiniMax-M2: q/k RMSNorms over the whole projections, RoPE on 16 of 32 dimensions,
        # experts in every layer: a sigmoid router whose choice bias (set random below) does
        # not weigh, top-2 of 8, renormalised.
        "minimaxm2": (t.MiniMaxM2Config(**{**_COMMON, "intermediate_size": 32}, num_hidden_layers=2, head_dim=32,
                                        num_local_experts=8, num_experts_per_tok=2, rotary_dim=16,
                                        tie_word_embeddings=False), "minimax-m2"),
        # Seed-OSS: biases on q, k, v and o (attention_out_bias) and the MLP.
        # Chunked attention (chunks of 16: the prompts cross several, as do the step's chunks)
        # with RoPE on 3 of 4 layers; the fourth global, no RoPE, queries scaled by position
        # (floor 8); dense and MoE layers alternating, top-1 of 4 experts weighing their
        # inputs, a shared expert (HF only: llama.cpp's files fix chunks and floors at 8192).
        "llama4": (t.Llama4TextConfig(**{**_COMMON, "intermediate_size": 64}, intermediate_size_mlp=128, head_dim=16,
                                      num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=1,
                                      interleave_moe_layer_step=2, attention_chunk_size=16, floor_scale=8,
                                      attn_scale=0.5, tie_word_embeddings=False,
                                      architectures=["Llama4ForCausalLM"]), None),
        # llama.cpp's llama4 files: their fixed chunks and temperature floor (8192), top-2
        # experts (transformers' sum of the experts' weighted inputs' outputs).
        "llama4-gguf": (t.Llama4TextConfig(**{**_COMMON, "intermediate_size": 64}, intermediate_size_mlp=128,
                                           head_dim=16, num_hidden_layers=4, num_local_experts=4,
                                           num_experts_per_tok=2, interleave_moe_layer_step=2,
                                           attention_chunk_size=8192, floor_scale=8192, attn_scale=0.1,
                                           tie_word_embeddings=False, architectures=["Llama4ForCausalLM"]),
                        "llama4"),
        # Five windowed layers (16) to one global with wider, fewer heads (64 wide, one KV head)
        # whose values are its keys (attention_k_eq_v), values normed, proportional RoPE on
        # the global layer, logits capped at 30.
        "gemma4": (t.Gemma4TextConfig(**_COMMON, num_hidden_layers=6, head_dim=32, global_head_dim=64,
                                      num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=16,
                                      hidden_size_per_layer_input=0, final_logit_softcapping=30.0,
                                      architectures=["Gemma4ForCausalLM"]), "gemma4"),
        # Gemma 4's MoE layers: top-2 of 4 experts beside each dense MLP. Larger weights: with
        # 0.3 its near-flat logits flip under bfloat16 weights in transformers too (unit-RMS
        # queries and keys at attention scale 1 amplify rounding).
        # Gemma 4 E2B / E4B: per-layer inputs (32 a layer), the last two layers reading the KV
        # cache of the last earlier layer of their type, double-wide MLPs there.
        "gemma4e": (t.Gemma4TextConfig(**_COMMON, num_hidden_layers=6, head_dim=32, global_head_dim=64,
                                       layer_types=["sliding_attention", "full_attention"] * 3, sliding_window=16,
                                       hidden_size_per_layer_input=32, vocab_size_per_layer_input=512,
                                       num_kv_shared_layers=2, use_double_wide_mlp=True,
                                       final_logit_softcapping=30.0, architectures=["Gemma4ForCausalLM"]), "gemma4"),
        "gemma4moe": (t.Gemma4TextConfig(**{**_COMMON, "initializer_range": 1.0}, num_hidden_layers=6, head_dim=32, global_head_dim=64,
                                         num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=16,
                                         hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=4,
                                         top_k_experts=2, moe_intermediate_size=32,
                                         architectures=["Gemma4ForCausalLM"]), "gemma4"),
        "seedoss": (t.SeedOssConfig(**_COMMON, num_hidden_layers=2, attention_bias=True, attention_out_bias=True,
                                    mlp_bias=True, tie_word_embeddings=False), "seed_oss"),
        # q/k/v and gate/up stacked in the checkpoint itself.
        "phi3": (t.Phi3Config(**_COMMON, num_hidden_layers=2, tie_word_embeddings=False), "phi3"),
        # Phi-4-mini's rotary: 12 of 16 dimensions, LongRoPE factors (the sequences here
        # stay within the original 128 positions: the short factors, x attention factor).
        "phi4mini": (t.Phi3Config(**_COMMON, num_hidden_layers=2, tie_word_embeddings=True, partial_rotary_factor=0.75,
                                  original_max_position_embeddings=128,
                                  rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                                "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]}), "phi3"),
        # Five windowed layers (window 16, RoPE base 10^4) to one global (10^6); the
        # prompts run past the window. llama.cpp's files keep no query_pre_attn_scalar:
        # it is the head size here, as in every Gemma 3 but the 27B.
        "gemma3": (t.Gemma3TextConfig(**_COMMON, num_hidden_layers=6, head_dim=32, query_pre_attn_scalar=32,
                                      sliding_window=16, tie_word_embeddings=True,
                                      architectures=["Gemma3ForCausalLM"]), "gemma3"),
        # YaRN past an original context of 32 (Qwen2.5/3's long-context setting; llama.cpp's
        # files: its factor and original context as keys).
        "qwen3-yarn": (t.Qwen3Config(**_COMMON, num_hidden_layers=2, head_dim=32, tie_word_embeddings=True,
                                     rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 32}), "qwen3"),
        # Llama 3.1's rope scaling (llama.cpp's files: a rope_freqs tensor of divisors).
        "llama31": (t.LlamaConfig(**_COMMON, num_hidden_layers=2, tie_word_embeddings=True,
                                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
                    "llama"),
        # Top-2 of 4 experts; llama.cpp writes Mixtral as a llama file with experts.
        "mixtral": (t.MixtralConfig(**_COMMON, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
                                    tie_word_embeddings=False), "llama"),
        # Top-2 of 6 small experts, renormalised.
        "qwen3moe": (t.Qwen3MoeConfig(**_COMMON, num_hidden_layers=2, head_dim=32, num_experts=6,
                                      num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
                                      tie_word_embeddings=False), "qwen3moe"),
        # Layer 1 a dense MLP, weights not renormalised (llama.cpp's qwen3moe files have
        # no dense layers: HF only).
        "qwen3moe-mixed": (t.Qwen3MoeConfig(**_COMMON, num_hidden_layers=2, head_dim=32, num_experts=6,
                                            num_experts_per_tok=3, moe_intermediate_size=64, norm_topk_prob=False,
                                            mlp_only_layers=[1], tie_word_embeddings=False), None),
        # Alternating windowed / global layers, attention logits capped at 50, final at 30.
        "gemma2": (t.Gemma2Config(**_COMMON, num_hidden_layers=4, head_dim=32, query_pre_attn_scalar=32,
                                  sliding_window=16, tie_word_embeddings=True), "gemma2"),
        # Windowed (16) and global layers alternating, attention sinks, q/k/v/o biases, YaRN
        # (factor 4 past 64 positions), top-2 of 4 experts behind a biased router, clamped
        # SwiGLU with biases (HF only: llama.cpp's files hold MXFP4 experts).
        "gptoss": (t.GptOssConfig(**{**_COMMON, "intermediate_size": 64}, num_hidden_layers=2, head_dim=16,
                                  num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
                                  tie_word_embeddings=False,
                                  rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                   "beta_slow": 1.0, "truncate": False, "rope_theta": 10000.0,
                                                   "original_max_position_embeddings": 64}), None),
        # Multi-head latent attention (a latent of 32 + a rotary key of 8 cached per token),
        # a dense first layer, then top-2 of 4 experts (x 2.0) plus a shared expert (HF only).
        "deepseekv2": (t.DeepseekV2Config(**{**_COMMON, "num_key_value_heads": 4}, num_hidden_layers=3,
                                          kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16,
                                          qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4,
                                          num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                                          first_k_dense_replace=1, routed_scaling_factor=2.0), None),
        # DeepSeek-V2's full form: queries through their own low rank, experts limited to the
        # best of 2 groups, YaRN with its mscale on the softmax scale.
        "deepseekv2-full": (t.DeepseekV2Config(**{**_COMMON, "num_key_value_heads": 4}, num_hidden_layers=2,
                                               kv_lora_rank=32, q_lora_rank=32, qk_nope_head_dim=16,
                                               qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                                               num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=2,
                                               first_k_dense_replace=0, topk_method="group_limited_greedy",
                                               n_group=2, topk_group=1,
                                               rope_parameters={"rope_type": "yarn", "factor": 4.0, "mscale": 0.707,
                                                                "mscale_all_dim": 0.707, "rope_theta": 10000.0,
                                                                "original_max_position_embeddings": 64,
                                                                "beta_fast": 32, "beta_slow": 1}), None),
        # DeepSeek-V3: sigmoid router with a choice bias (set random below), experts of the
        # best of 2 groups by their best two, renormalised x 2.5.
        "deepseekv3": (t.DeepseekV3Config(**{**_COMMON, "num_key_value_heads": 4}, num_hidden_layers=2,
                                          kv_lora_rank=32, q_lora_rank=32, qk_nope_head_dim=16,
                                          qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                                          num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                                          first_k_dense_replace=1, n_group=2, topk_group=1,
                                          routed_scaling_factor=2.5, norm_topk_prob=True), None),
        # DeepSeek-V3.2: V3 with an indexer (top-128 keys here) that chooses every key of
        # contexts up to its top-k: served up to there, the indexer not read (HF only).
        "deepseekv32": (t.DeepseekV32Config(**{**_COMMON, "num_key_value_heads": 4}, num_hidden_layers=2,
                                            kv_lora_rank=32, q_lora_rank=32, qk_nope_head_dim=16,
                                            qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                                            num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                                            first_k_dense_replace=1, n_group=2, topk_group=1,
                                            routed_scaling_factor=2.5, norm_topk_prob=True, index_topk=128,
                                            index_n_heads=4, index_head_dim=32), None),
        # Every layer windowed (llama.cpp's files carry no Mistral window: HF only).
        "mistral": (t.MistralConfig(**_COMMON, num_hidden_layers=2, sliding_window=16,
                                    tie_word_embeddings=False), None),
    }


@pytest.fixture(scope="module", params=["llama31", "qwen3", "qwen3-yarn", "smollm3", "granite", "olmo2", "olmo3", "llama4", "llama4-gguf", "gemma4", "gemma4e", "gemma4moe", "seedoss", "exaone4", "glm4moe", "cohere2", "hunyuan", "ernie45moe", "minimaxm2", "phi3", "phi4mini", "gemma2", "gemma3", "mistral", "mixtral", "qwen3moe", "gptoss", "deepseekv2",
                                                 "deepseekv2-full", "deepseekv3", "deepseekv32",
                                                 "qwen3moe-mixed"])
def family(request, tmp_path_factory):
    config, gguf_arch = _configs()[request.param]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for m in hf.modules():
            if hasattr(m, "e_score_correction_bias"):   # DeepSeek-V3's choice bias: zeros at init
                m.e_score_correction_bias.normal_(0, 0.3)
        for n, p in [*hf.named_parameters(), *hf.named_buffers()]:   # Gemma 4's scalars and scales: ones at init
            if n.endswith(("layer_scalar", "per_expert_scale", "router.scale")):
                p.uniform_(0.5, 1.5)
        for name, m in hf.named_modules():
            if name.endswith(("query_layernorm", "key_layernorm")):
                # HunYuan's q/k norms after RoPE: unit weights would commute with the rotation.
                m.weight.normal_(1.0, 0.5)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path / "hf", safe_serialization=True)
    gguf_path = write_gguf(hf, str(path / "model.gguf"), gguf_arch, str(path / "hf")) if gguf_arch else None
    return request.param, hf, str(path / "hf"), gguf_path


def _kv_layout(config) -> KVLayout:
    """The KV groups pagoda forms for a transformers config's layer types."""
    config = getattr(config, "text_config", config)
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
    chunk = getattr(config, "attention_chunk_size", None)
    return KVLayout.plan([window if t == "sliding_attention" else None for t in types],
                         [chunk if t == "chunked_attention" else None for t in types])


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (5, 17, 33, 70)]


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_family_matches_transformers(family, source):
    name, hf, hf_dir, gguf_path = family
    path = hf_dir if source == "hf" else gguf_path
    if source == "gguf" and path is None:
        pytest.skip(f"no GGUF {name} file to compare")
    if source == "gguf" and cpu_kernels.kernels() is None:
        pytest.skip("GGUF files are served from their blocks by pagoda's CPU kernels")
    prompts = _prompts()
    # Small blocks and a small step budget: chunked prefill over several blocks.
    llm = LLM(path, skip_tokenizer_init=True, show_progress=False, num_kv_blocks=64, block_size=16,
              max_num_batched_tokens=32)
    model = llm.engine.runner.model
    assert type(model) is model_class(hf.config.architectures[0])
    for ids in prompts:
        with torch.inference_mode():
            want = hf(torch.tensor([ids])).logits[0].float()
        for chunks in ([len(ids)], [3, len(ids) - 3]):
            got = pagoda_prompt_logits(model, ids, chunks)
            assert (got - want).abs().max().item() < 1e-3, (name, source, chunks)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    # The same prompts twice: the second pass hits the prefix cache.
    for _ in range(2):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert_greedy_matches_hf(hf, prompts, outputs, 24, f"{name} {source}")
    llm.engine.check_integrity()
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks


# The families whose attention the Triton test covers in the default run (windows and sinks,
# MLA's latent heads); the others repeat one of these through the kernels, or add soft-caps
# (gemma2), and run under `make test-all` (the interpreter is slow).
TRITON_DEFAULT_FAMILIES = ("gptoss", "deepseekv2")


def test_family_through_the_triton_backend(family, request):
    """The Triton attention kernels (in Triton's interpreter on the CPU, on the GPU where
    there is one) give transformers' greedy tokens for every family: windows, soft-caps,
    sinks, MLA's latent heads, chunked prefill and prefix-cache hits."""
    from pagoda.ops import triton_attention

    name, hf, hf_dir, _ = family
    if name not in TRITON_DEFAULT_FAMILIES and "not slow" in (request.config.option.markexpr or ""):
        pytest.skip(f"{name} through Triton runs under make test-all (slow)")
    if not triton_attention.available() or not (triton_attention.interpreted() or torch.cuda.is_available()):
        pytest.skip("triton is not installed, or its kernels were imported without TRITON_INTERPRET=1")
    prompts = _prompts()[1:3]   # 17 and 33 tokens: chunked (32 a step), whole blocks to hit
    llm = LLM(hf_dir, skip_tokenizer_init=True, show_progress=False, num_kv_blocks=64, block_size=16,
              max_num_batched_tokens=32, attention_backend="triton")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    for _ in range(2):   # the second pass hits the prefix cache
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert_greedy_matches_hf(hf, prompts, outputs, 6, f"{name} triton")
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks


def test_family_under_preemption(family):
    """A pool too small for the batch: requests are preempted and recomputed, and still
    produce transformers' tokens."""
    name, hf, hf_dir, _ = family
    prompts = _prompts()
    # One block more than the longest request (70 + 24 tokens) holds at once: a windowed
    # model gives back the blocks behind its window, so it gets chunked prompts (its
    # windowed KV groups then hold a window and a chunk) and still runs out.
    layout = _kv_layout(hf.config)
    chunk = 512 if set(layout.group_windows) == {None} else 32
    llm = LLM(hf_dir, skip_tokenizer_init=True, show_progress=False, block_size=16, max_num_batched_tokens=chunk,
              num_kv_blocks=layout.blocks_for(94, 16, chunk) + 1)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for ids, out in zip(prompts, outputs):
        want, want_logits = hf_greedy(hf, ids, 24)
        result = compare_greedy(out.outputs[0].token_ids, want, lambda pos: top2_gap(want_logits[pos]), name)
        assert result.equal, result.excused
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks


def test_registry_covers_gguf_names_and_refuses_unknown():
    assert set(GGUF_ARCHITECTURES.values()) <= set(ARCHITECTURES)
    with pytest.raises(UnsupportedModelError, match="supported: .*Qwen3ForCausalLM"):
        ModelArchConfig.from_hf_config({"architectures": ["NopeForCausalLM"], "model_type": "nope"})
    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'nope'"):
        ModelArchConfig.from_gguf_metadata({"general.architecture": "nope"}, set())


def _bf16_weights_error(hf, ids: list[int], want: torch.Tensor) -> float:
    """transformers' relative logit error with its projections rounded to bfloat16 (the
    routers and DeepSeek's kv_b_proj, which pagoda keeps in float, left alone; experts held
    as stacked parameters rounded too)."""
    import copy

    rounded = copy.deepcopy(hf)
    with torch.inference_mode():
        for name, m in rounded.named_modules():
            if isinstance(m, torch.nn.Linear) and not name.endswith(("mlp.gate", "router", "router.proj", "kv_b_proj")):
                m.weight.copy_(m.weight.bfloat16().float())
        for name, p in rounded.named_parameters():
            if p.dim() == 3 and ".experts." in name:
                p.copy_(p.bfloat16().float())
        got = rounded(torch.tensor([ids])).logits[0].float()
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("mode", ["bf16", "q4"])
def test_quantized_modes_apply_to_every_family(family, mode):
    """The quantized linear layers replace every family's projections through the shared
    layers. bf16 stays near the float32 reference (tiny random models with large weights:
    the real model's perplexity bounds are in test_quantization.py); q4 only has to run."""
    from pagoda.model.layers.quantization import Bf16Linear, Q4Linear

    name, hf, hf_dir, _ = family
    if cpu_kernels.kernels() is None:
        pytest.skip("the quantized modes need pagoda's CPU kernels")
    llm = LLM(hf_dir, skip_tokenizer_init=True, show_progress=False, num_kv_blocks=16, block_size=16,
              quantization=mode)
    model = llm.engine.runner.model
    kind = Bf16Linear if mode == "bf16" else Q4Linear
    layers = model.config.num_hidden_layers
    assert sum(isinstance(m, kind) for m in model.modules()) >= 4 * layers
    ids = _prompts()[2]
    with torch.inference_mode():
        want = hf(torch.tensor([ids])).logits[0].float()
    got = pagoda_prompt_logits(model, ids, [len(ids)])
    assert torch.isfinite(got).all()
    if mode == "bf16":
        # Within 0.1, or within a small multiple of what transformers gives with the same
        # weights rounded to bfloat16 (the mode also rounds activations): tiny random
        # models with large weights can be that sensitive (DeepSeek's routing flips: 0.19
        # there, 0.21 here; GPT-OSS: 0.05 there, 0.11 here).
        error = ((got - want).abs().max() / want.abs().max()).item()
        assert error < max(0.1, 2.5 * _bf16_weights_error(hf, ids, want) + 0.02)
        assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.85


def _saved(name: str, path) -> transformers.PreTrainedModel:
    config, _ = _configs()[name]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    hf.save_pretrained(path, safe_serialization=True)
    return hf


def _generate_stepping(core, hf, prompt: list[int], max_tokens: int, after_step, label: str) -> None:
    """One greedy request run step by step (``after_step()`` after each, then the integrity
    check); its tokens must be transformers' and every block must come back."""
    core.add_request(EngineCoreRequest(request_id="w", prompt_token_ids=prompt, sampling_params=SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True)))
    tokens = []
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            tokens += out.new_token_ids
        after_step()
        core.check_integrity()
    want, want_logits = hf_greedy(hf, prompt, max_tokens)
    result = compare_greedy(tokens, want, lambda pos: top2_gap(want_logits[pos]), label)
    assert result.equal, result.excused
    assert core.kv_manager.num_free_blocks == core.num_blocks


def test_windowed_model_releases_blocks_behind_the_window(tmp_path):
    """Every layer windowed (16 positions, blocks of 16): a request holds only the blocks
    its window and current chunk need, the rest go back to the pool as it advances,
    and its tokens are still transformers'."""
    hf = _saved("mistral", tmp_path)
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, show_progress=False, num_kv_blocks=64, block_size=16,
              max_num_batched_tokens=32)
    core = llm.engine
    assert core.kv_manager.sliding_window == 16
    seen = {"held": 0, "released": 0}

    def after_step() -> None:
        blocks = core.kv_manager.req_to_blocks.get("w", [[]])[0]
        seen["held"] = max(seen["held"], sum(b is not None for b in blocks))
        seen["released"] = max(seen["released"], core.kv_manager.num_released.get("w", [0])[0])

    # 70 tokens: chunks of 32, 32, 6.
    _generate_stepping(core, hf, _prompts()[3], 40, after_step, "mistral window")
    # A window of 16 plus a 32-token chunk spans at most 4 blocks of 16 (6 without release).
    assert seen["held"] <= 4 and seen["released"] >= 5


def test_mixed_windows_keep_a_block_table_per_kv_group(tmp_path):
    """Gemma 3 (five windowed layers to one global): the global KV group keeps every block
    of a request, the five windowed groups give back what leaves their window, a block is
    one layer's K/V (the groups share one buffer), and the tokens stay transformers'."""
    hf = _saved("gemma3", tmp_path)
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, show_progress=False, num_kv_blocks=64, block_size=16,
              max_num_batched_tokens=32)
    core = llm.engine
    kv = core.kv_manager
    assert kv.group_windows == (None, 16, 16, 16, 16, 16)
    assert core.runner.layout.num_buffers == 1 and len({id(c) for c in core.runner.kv_caches}) == 1
    c = hf.config
    assert kv_cache_bytes_per_block(core.runner.model, 16, torch.float32) == 2 * 16 * c.num_key_value_heads * 32 * 4
    seen = {"global": 0, "windowed": 0}

    def after_step() -> None:
        tables = kv.req_to_blocks.get("w")
        if tables:
            assert None not in tables[0]
            seen["global"] = max(seen["global"], len(tables[0]))
            seen["windowed"] = max(seen["windowed"], *(sum(b is not None for b in t) for t in tables[1:]))

    _generate_stepping(core, hf, _prompts()[3], 40, after_step, "gemma3 kv groups")
    # 109 computed positions: 7 global blocks; a window of 16 plus a 32-token chunk spans
    # at most 4 blocks in each windowed group.
    assert seen["global"] == 7 and seen["windowed"] <= 4


@pytest.mark.parametrize("caching", [False, True])
def test_mixed_windows_under_swap_preemption(tmp_path, caching):
    """Gemma 2 (alternating windowed / global layers) in a pool too small for the batch:
    victims' held blocks go to the host pool and back (caches poisoned with NaN, so a block
    restored to the wrong place would show), with and without prefix caching."""
    from pagoda.config import EngineConfig
    from pagoda.engine.engine_core import EngineCore
    from tests.model.test_swap import _run, poison

    hf = _saved("gemma2", tmp_path)
    prompts = _prompts()
    prompts.append(prompts[3][:40] + prompts[1])       # shares 32 tokens with the longest
    layout = _kv_layout(hf.config)
    base = dict(model=str(tmp_path), show_progress=False, block_size=16, max_num_batched_tokens=32,
                enable_prefix_caching=caching)  # fmt: skip
    tight = poison(EngineCore(EngineConfig(**base, num_kv_blocks=layout.blocks_for(94, 16, 32) + 2,
                                           preemption_mode="swap", swap_space=1 << 22), collect_stats=False))
    got, gaps = _run(tight, prompts, 24)
    stats = tight.scheduler.make_stats()
    assert stats.num_swap_preemptions > 0 and 0 < stats.num_swapped_in_blocks <= stats.num_swapped_out_blocks
    for i, ids in enumerate(prompts):
        want, want_logits = hf_greedy(hf, ids, 24)
        result = compare_greedy(got[f"r{i}"], want, lambda pos: top2_gap(want_logits[pos]), f"gemma2 r{i}")
        assert result.equal, result.excused


def test_mla_caches_one_latent_per_token_and_refuses_what_it_cannot(tmp_path):
    """DeepSeek's latent attention caches [latent | rotary key] as one KV head (32 + 8 here,
    576 for the real models); LoRA and tensor parallelism, not built for it, are refused."""
    _saved("deepseekv2", tmp_path)
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, show_progress=False, num_kv_blocks=16, block_size=16)
    assert all(tuple(c.shape) == (2, 16, 16, 1, 40) for c in llm.engine.runner.kv_caches)
    with pytest.raises(ValueError, match="LoRA adapters are not supported for DeepseekV2ForCausalLM"):
        LLM(str(tmp_path), enable_lora=True, skip_tokenizer_init=True, show_progress=False, num_kv_blocks=16)
    with pytest.raises(ValueError, match="DeepseekV2ForCausalLM cannot be served with tensor parallelism"):
        LLM(str(tmp_path), tensor_parallel_size=2, enable_expert_parallel=True, skip_tokenizer_init=True,
            show_progress=False)


def _mxfp4_round_trip(t: torch.Tensor) -> torch.Tensor:
    """Rows (last axis, blocks of 32) through MXFP4 and back: values MXFP4 holds exactly."""
    from gguf import GGMLQuantizationType, quants

    arr = t.detach().float().contiguous().numpy()
    q = quants.quantize(arr, GGMLQuantizationType.MXFP4)
    return torch.from_numpy(quants.dequantize(q, GGMLQuantizationType.MXFP4).reshape(arr.shape))


def test_gpt_oss_gguf_serves_mxfp4_experts_from_their_blocks(tmp_path):
    """llama.cpp's GPT-OSS files: experts in MXFP4 (read in place by the block kernels),
    gate and up split, biases stacked per expert, sinks, even layers windowed, YaRN
    truncated as llama.cpp's is: transformers' logits and tokens on the same weights (its
    experts rounded through MXFP4 first)."""
    from gguf import GGMLQuantizationType

    from pagoda.model.layers.blocks import BlocksLinear

    config, _ = _configs()["gptoss"]
    config.rope_parameters = {**config.rope_parameters, "truncate": True}
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            e = layer.mlp.experts   # [E, in, out]: MXFP4 blocks run along the inputs
            e.gate_up_proj.copy_(_mxfp4_round_trip(e.gate_up_proj.transpose(1, 2)).transpose(1, 2))
            e.down_proj.copy_(_mxfp4_round_trip(e.down_proj.transpose(1, 2)).transpose(1, 2))
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    path = write_gguf(hf, str(tmp_path / "model.gguf"), "gpt-oss", str(tmp_path / "hf"),
                      expert_type=GGMLQuantizationType.MXFP4)
    llm = LLM(path, skip_tokenizer_init=True, show_progress=False, num_kv_blocks=64, block_size=16,
              max_num_batched_tokens=32)
    model = llm.engine.runner.model
    expert = model.model.layers[0].mlp.experts[0]
    assert isinstance(expert.gate_up_proj, BlocksLinear)
    assert {p.ggml_type for p in expert.gate_up_proj.parts} == {GGMLQuantizationType.MXFP4}
    prompts = _prompts()
    for ids in prompts:
        with torch.inference_mode():
            want = hf(torch.tensor([ids])).logits[0].float()
        got = pagoda_prompt_logits(model, ids, [3, len(ids) - 3])
        assert (got - want).abs().max().item() < 1e-3
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_greedy_matches_hf(hf, prompts, outputs, 24, "gpt-oss gguf")


def test_gpt_oss_mxfp4_checkpoint_is_served_from_its_blocks(tmp_path):
    """The published GPT-OSS checkpoints: bfloat16 attention, experts in MXFP4 (``*_blocks``,
    ``*_scales``, quantization_config mxfp4). pagoda repacks the experts into ggml's MXFP4
    blocks and serves them in place: transformers' logits and tokens on the weights its own
    MXFP4 reader (``convert_moe_packed_tensors``) gives."""
    import json

    from gguf import GGMLQuantizationType
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from pagoda.model.layers.blocks import BlocksLinear

    config, _ = _configs()["gptoss"]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    gen = torch.Generator().manual_seed(5)
    packed = {}
    with torch.no_grad():
        for name, p in hf.named_parameters():   # what a bfloat16 checkpoint holds
            p.copy_(p.bfloat16().float())
        for i, layer in enumerate(hf.model.layers):
            e = layer.mlp.experts
            for proj in ("gate_up_proj", "down_proj"):
                w = getattr(e, proj)                       # [E, in, out]
                experts, width, rows = w.shape
                blocks = torch.randint(0, 256, (experts, rows, width // 32, 16), dtype=torch.uint8, generator=gen)
                scales = torch.randint(122, 126, (experts, rows, width // 32), dtype=torch.uint8, generator=gen)
                w.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                packed[f"model.layers.{i}.mlp.experts.{proj}_blocks"] = blocks
                packed[f"model.layers.{i}.mlp.experts.{proj}_scales"] = scales
    hf.save_pretrained(tmp_path, safe_serialization=True)
    state = {k: v for k, v in load_file(str(tmp_path / "model.safetensors")).items()
             if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    state = {k: (v if v.dtype != torch.float32 else v.bfloat16()) for k, v in state.items()}
    state.update(packed)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["self_attn", "router"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))

    llm = LLM(str(tmp_path), skip_tokenizer_init=True, show_progress=False, num_kv_blocks=64, block_size=16,
              max_num_batched_tokens=32)
    model = llm.engine.runner.model
    expert = model.model.layers[1].mlp.experts[3]
    assert isinstance(expert.gate_up_proj, BlocksLinear) and isinstance(expert.down_proj, BlocksLinear)
    assert {p.ggml_type for p in expert.gate_up_proj.parts} == {GGMLQuantizationType.MXFP4}
    prompts = _prompts()
    for ids in prompts:
        with torch.inference_mode():
            want = hf(torch.tensor([ids])).logits[0].float()
        got = pagoda_prompt_logits(model, ids, [len(ids)])
        assert (got - want).abs().max().item() < 1e-3
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_greedy_matches_hf(hf, prompts, outputs, 24, "gpt-oss mxfp4")
    with pytest.raises(ValueError, match="quantized with 'awq' are not supported"):
        cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                                      "version": "gemm"}
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        LLM(str(tmp_path), skip_tokenizer_init=True, show_progress=False)


def test_gemma3_multimodal_checkpoint_computes_text_as_transformers(tmp_path):
    """Gemma 3 4B-27B ship as Gemma3ForConditionalGeneration (language_model.* beside a
    vision tower, a text_config that leaves out its defaults): a text prompt's logits are
    transformers' (images: tests/multimodal/test_gemma3.py)."""
    tc = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, head_dim=32,
              num_attention_heads=4, num_key_value_heads=2, sliding_window=16, query_pre_attn_scalar=32,
              initializer_range=0.3)
    vc = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14)
    config = transformers.Gemma3Config(text_config=tc, vision_config=vc, mm_tokens_per_image=4)
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(config).float().eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, show_progress=False, num_kv_blocks=32, block_size=16)
    model = llm.engine.runner.model
    assert type(model).__name__ == "Gemma3ForConditionalGeneration" and model.config.num_hidden_layers == 6
    assert any(n.startswith("vision_tower.") for n, _ in model.named_parameters())
    for ids in _prompts()[1:]:
        with torch.inference_mode():
            want = hf(input_ids=torch.tensor([ids])).logits[0].float()
        got = pagoda_prompt_logits(model, ids, [len(ids)])
        assert (got - want).abs().max().item() < 1e-3


def test_longrope_takes_the_long_factors_past_the_original_context():
    """Positions from original_max_position_embeddings on rotate with the long factors
    (and the same attention factor); below it, with the short ones."""
    config, _ = _configs()["phi4mini"]
    arch = ModelArchConfig.from_hf_config(config.to_dict() | {"architectures": ["Phi3ForCausalLM"]})
    assert arch.rotary_dim == 12 and arch.rope_scaling["original_max_position_embeddings"] == 128
    model = model_class("Phi3ForCausalLM")(arch)
    cos, sin = model._rope_tables(torch.tensor([5, 127, 128, 500]), torch.float32)
    attention = (1 + torch.log(torch.tensor(1024 / 128.0)) / torch.log(torch.tensor(128.0))).sqrt()
    base = 1.0 / (10000.0 ** (torch.arange(0, 12, 2, dtype=torch.float64) / 12))
    for row, pos, factors in ((0, 5, "short_factor"), (1, 127, "short_factor"), (2, 128, "long_factor"),
                              (3, 500, "long_factor")):
        freqs = (pos * (base / torch.tensor(arch.rope_scaling[factors], dtype=torch.float64))).float()
        want = torch.cat((freqs, freqs)).cos() * attention
        torch.testing.assert_close(cos[row, 0], want, rtol=1e-5, atol=1e-5)


def test_moe_expert_load_counts_every_routed_token(tiny_mixtral_dir):
    """Each MoE layer counts top-k picks per expert: tokens computed x experts per token,
    sent to the API process at most once a second."""
    llm = LLM(tiny_mixtral_dir, skip_tokenizer_init=True, show_progress=False, num_kv_blocks=32, block_size=16)
    core = llm.engine
    assert core.runner.model.expert_load() == [[0] * 4, [0] * 4]
    llm.generate([{"prompt_token_ids": list(range(3, 8))}, {"prompt_token_ids": list(range(10, 19))}],
                 SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    load = core.runner.model.expert_load()
    computed = 5 + 9 + 2 * 2          # prompts, then each request's two decode steps
    assert [sum(layer) for layer in load] == [2 * computed] * 2 and all(len(layer) == 4 for layer in load)
    core._last_expert_load = float("-inf")
    assert core._maybe_expert_load(100.0) == load and core._maybe_expert_load(100.5) is None


def test_speculative_decoding_keeps_each_familys_tokens(family):
    """Drafts (the model's first layer: a layer-skip draft proposes at every step) verified
    several tokens at a time, through windows, soft-capping, experts, released blocks and
    rejected drafts' trimmed slots, leave the greedy tokens unchanged."""
    name, hf, hf_dir, _ = family
    method = "layer_skip"
    prompts = [p * 3 for p in (_prompts()[0], _prompts()[1][:9])]
    llm = LLM(hf_dir, skip_tokenizer_init=True, show_progress=False, num_kv_blocks=32, block_size=16,
              speculative_config={"method": method, "num_speculative_tokens": 3, "num_layers": 1})
    # No logprobs: a request that asks for them is not drafted for.
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.scheduler.make_stats().spec_num_draft_tokens > 0
    for ids, out in zip(prompts, outputs):
        want, want_logits = hf_greedy(hf, ids, 20)
        result = compare_greedy(out.outputs[0].token_ids, want, lambda pos: top2_gap(want_logits[pos]),
                                f"{name} {method}")
        assert result.equal, result.excused
    llm.engine.check_integrity()
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks


def test_deepseek_v32_is_served_up_to_its_indexers_top_k(tmp_path):
    """Past index_topk keys DeepSeek-V3.2's indexer would choose among them: a longer
    max_model_len is refused by name, the default is capped there."""
    config, _ = _configs()["deepseekv32"]
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path, safe_serialization=True)
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, show_progress=False, num_kv_blocks=16)
    assert llm.engine.max_model_len == 128
    with pytest.raises(ValueError, match="longest context DeepseekV32ForCausalLM is served at"):
        LLM(str(tmp_path), skip_tokenizer_init=True, show_progress=False, num_kv_blocks=16, max_model_len=256)


def test_mtp_layers_past_the_last_are_not_read(tiny_glm4moe_dir, tmp_path):
    """GLM-4.5's (and DeepSeek-V3's) checkpoints keep their multi-token-prediction layer
    after the last one (``model.layers.{num_hidden_layers}.*``): not served, not read, and
    the model is the one without it."""
    import shutil

    from safetensors.torch import save_file

    path = tmp_path / "with-mtp"
    shutil.copytree(tiny_glm4moe_dir, path)
    save_file({"model.layers.3.eh_proj.weight": torch.randn(64, 128),
               "model.layers.3.self_attn.q_proj.weight": torch.randn(128, 64)}, str(path / "mtp.safetensors"))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = []
    for p in (tiny_glm4moe_dir, str(path)):
        llm = LLM(p, skip_tokenizer_init=True, show_progress=False, num_kv_blocks=16)
        tokens.append(llm.generate([{"prompt_token_ids": list(range(3, 20))}], params, use_tqdm=False)[0]
                      .outputs[0].token_ids)
    assert tokens[0] == tokens[1] and len(tokens[0]) == 8
