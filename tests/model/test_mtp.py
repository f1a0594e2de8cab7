"""MTP speculative decoding (``{"method": "mtp"}``): the head a GLM-4.5 / DeepSeek-V3
checkpoint keeps after its last layer drafts, the target verifies. transformers drops the
head when it loads these checkpoints, so there is no reference for the head itself: the
tests write head tensors into tiny checkpoints and check the output equals decoding without
speculation, greedy, under preemption and prefix caching; and, for acceptance, a pair built
so that the head knows the target: a target whose layers add nothing (a bigram model: each
token's logits are its own embedding's) and a head that reads the embedding of the token it
is given through the same norm, so it predicts the target's token after next exactly."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pagoda.model.loader import load_model
from pagoda.model.models import UnsupportedModelError
from pagoda.sampling_params import SamplingParams
from tests.model.test_spec_decode import engine, run, spec_stats

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

MTP = {"method": "mtp", "num_speculative_tokens": 2}
PROMPTS = [list(range(3, 3 + n)) for n in (5, 17, 40)]


def _glm(path, bigram: bool) -> str:
    """A tiny GLM-4.5 checkpoint (3 layers, experts from the second) with an MTP layer (3):
    random, or for ``bigram`` the pair the module docstring describes."""
    config = transformers.Glm4MoeConfig(   # (the bundled tokenizer's vocabulary: the int8 mode calibrates on text)
        vocab_size=49152, hidden_size=64, intermediate_size=128, head_dim=32, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=3, max_position_embeddings=1024, initializer_range=0.3,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, use_qk_norm=True, attention_bias=True,
        tie_word_embeddings=False, architectures=["Glm4MoeForCausalLM"], num_nextn_predict_layers=1)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).float().save_pretrained(path, safe_serialization=True)
    file = f"{path}/model.safetensors"
    state = safetensors.load_file(file)
    head = {k.replace("model.layers.2.", "model.layers.3."): v.clone() for k, v in state.items()
            if k.startswith("model.layers.2.")}
    gen = torch.Generator().manual_seed(1)
    head.update({"model.layers.3.enorm.weight": torch.ones(64), "model.layers.3.hnorm.weight": torch.ones(64),
                 "model.layers.3.eh_proj.weight": torch.randn(64, 128, generator=gen) * 0.2,
                 "model.layers.3.shared_head.norm.weight": torch.ones(64)})
    if bigram:
        for part in (state, head):
            for k in part:   # every layer's output projections: the layers add nothing
                if "o_proj" in k or "down_proj" in k:
                    part[k] = torch.zeros_like(part[k])
        head["model.layers.3.eh_proj.weight"] = torch.cat((torch.eye(64), torch.zeros(64, 64)), dim=1)
        head["model.layers.3.shared_head.norm.weight"] = state["model.norm.weight"].clone()
        safetensors.save_file(state, file, metadata={"format": "pt"})
    safetensors.save_file(head, f"{path}/mtp.safetensors", metadata={"format": "pt"})
    from pagoda.bench.hf_quant_files import write_tokenizer

    write_tokenizer(str(path))
    return str(path)


@pytest.fixture(scope="module")
def glm_mtp(tmp_path_factory):
    return load_model(_glm(tmp_path_factory.mktemp("glm-mtp"), bigram=False), torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def glm_bigram(tmp_path_factory):
    return load_model(_glm(tmp_path_factory.mktemp("glm-bigram"), bigram=True), torch.float32, torch.device("cpu"))


def test_mtp_head_keeps_greedy_tokens(glm_mtp):
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * len(PROMPTS)
    want, _ = run(engine(glm_mtp), PROMPTS, params)
    core = engine(glm_mtp, MTP)
    got, _ = run(core, PROMPTS, params)
    assert got == want
    assert spec_stats(core)[1] > 0   # it drafted
    # The head: one layer of the family with its own cache over the target's block ids.
    assert len(core.runner.proposer.kv_caches) == 1
    assert core.runner.proposer.kv_caches[0].shape[1] == core.num_blocks


def test_mtp_head_in_the_int8_mode(glm_bigram):
    """The head's projections follow the target's quantized mode (int8 here): the same tokens
    as the int8 target alone, and the head still knows it."""
    from pagoda.model.layers.quantization import Int8Linear

    loaded = load_model(glm_bigram.path, torch.float32, torch.device("cpu"), quantization="int8")
    params = [SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)] * len(PROMPTS)
    want, _ = run(engine(loaded, quantization="int8"), PROMPTS, params)
    core = engine(loaded, {"method": "mtp", "num_speculative_tokens": 3}, quantization="int8")
    got, _ = run(core, PROMPTS, params)
    assert got == want
    assert isinstance(core.runner.proposer.head.eh_proj, Int8Linear)
    _, draft_tokens, accepted = spec_stats(core)
    assert accepted / draft_tokens > 0.8


def test_mtp_under_preemption_and_prefix_caching(glm_mtp):
    shared = [5, 17, 42, 99, 7, 300, 12, 64] * 3
    prompts = [shared + [i, i + 1, i + 2] for i in range(1, 6)]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * len(prompts)
    want, _ = run(engine(glm_mtp, enable_prefix_caching=False), prompts, params)
    core = engine(glm_mtp, MTP, num_kv_blocks=14, block_size=4, max_model_len=56)
    got, _ = run(core, prompts, params)
    assert got == want
    stats = core.scheduler.make_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0 and stats.spec_num_draft_tokens > 0


def test_mtp_head_that_knows_the_target_is_accepted(glm_bigram):
    params = [SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)] * len(PROMPTS)
    want, _ = run(engine(glm_bigram), PROMPTS, params)
    core = engine(glm_bigram, {"method": "mtp", "num_speculative_tokens": 3})
    got, _ = run(core, PROMPTS, params)
    assert got == want
    drafts, draft_tokens, accepted = spec_stats(core)
    assert draft_tokens > 0 and accepted / draft_tokens > 0.9, (drafts, draft_tokens, accepted)


def test_mtp_sampled_requests_finish(glm_mtp):
    params = [SamplingParams(temperature=0.8, top_k=50, max_tokens=16, ignore_eos=True, seed=i) for i in range(3)]
    core = engine(glm_mtp, MTP)
    got, _ = run(core, PROMPTS, params)
    assert [len(t) for t in got] == [16] * 3
    assert spec_stats(core)[1] > 0


def test_deepseek_v3_mtp_head_keeps_greedy_tokens(tmp_path):
    """DeepSeek-V3's head: its layer's latent attention and experts, its own cache shape."""
    config = transformers.DeepseekV3Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=1024, initializer_range=0.3, num_hidden_layers=2, kv_lora_rank=32, q_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, num_nextn_predict_layers=1)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).float().save_pretrained(tmp_path, safe_serialization=True)
    state = safetensors.load_file(f"{tmp_path}/model.safetensors")
    head = {k.replace("model.layers.1.", "model.layers.2."): v.clone() for k, v in state.items()
            if k.startswith("model.layers.1.")}
    head.update({"model.layers.2.enorm.weight": torch.ones(64), "model.layers.2.hnorm.weight": torch.ones(64),
                 "model.layers.2.eh_proj.weight": torch.randn(64, 128) * 0.2,
                 "model.layers.2.shared_head.norm.weight": torch.ones(64),
                 "model.layers.2.shared_head.head.weight": state["lm_head.weight"].clone(),
                 "model.layers.2.embed_tokens.weight": state["model.embed_tokens.weight"].clone()})
    safetensors.save_file(head, f"{tmp_path}/mtp.safetensors", metadata={"format": "pt"})
    loaded = load_model(str(tmp_path), torch.float32, torch.device("cpu"))
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * len(PROMPTS)
    want, _ = run(engine(loaded), PROMPTS, params)
    core = engine(loaded, MTP)
    got, _ = run(core, PROMPTS, params)
    assert got == want and spec_stats(core)[1] > 0
    assert core.runner.proposer.kv_caches[0].shape[-1] == 32 + 8   # the latent and the rotary key


def test_qwen35_mtp_head_beside_state_layers(tmp_path):
    """Qwen3.5's head (``mtp.*``: fc, pre-fc norms, its zero-centred norms, one gated
    attention layer) drafting for a hybrid target, whose verifying steps roll its state layers
    back: the same greedy tokens."""
    from tests.model.hybrid_qwen3_5 import FAMILIES as QWEN

    config = QWEN["qwen35"].config()
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).float().save_pretrained(tmp_path, safe_serialization=True)
    state = safetensors.load_file(f"{tmp_path}/model.safetensors")
    full = max(i for i, t in enumerate(config.layer_types) if t == "full_attention")
    h = config.hidden_size
    head = {k.replace(f"model.layers.{full}.", "mtp.layers.0."): v.clone() for k, v in state.items()
            if k.startswith(f"model.layers.{full}.")}
    head.update({"mtp.fc.weight": torch.randn(h, 2 * h) * 0.2, "mtp.pre_fc_norm_embedding.weight": torch.zeros(h),
                 "mtp.pre_fc_norm_hidden.weight": torch.zeros(h), "mtp.norm.weight": torch.zeros(h)})
    safetensors.save_file(head, f"{tmp_path}/mtp.safetensors", metadata={"format": "pt"})
    loaded = load_model(str(tmp_path), torch.float32, torch.device("cpu"))
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * len(PROMPTS)
    want, _ = run(engine(loaded), PROMPTS, params)
    core = engine(loaded, MTP)
    got, _ = run(core, PROMPTS, params)
    assert got == want and spec_stats(core)[1] > 0
    assert torch.equal(core.runner.proposer.head.enorm.weight, torch.ones(h))   # (1 + w)


def test_mtp_needs_a_head(tiny_glm4moe_dir, tmp_path):
    """A checkpoint whose config has no MTP layers, or whose tensors lack them, is refused by name."""
    path = tmp_path / "no-mtp"
    shutil.copytree(tiny_glm4moe_dir, path)
    config = json.loads((path / "config.json").read_text())
    for layers, error in ((0, "no multi-token-prediction layers"), (1, "MTP layer lacks")):
        config["num_nextn_predict_layers"] = layers
        (path / "config.json").write_text(json.dumps(config))
        loaded = load_model(str(path), torch.float32, torch.device("cpu"))
        with pytest.raises(UnsupportedModelError, match=error):
            engine(loaded, MTP)
