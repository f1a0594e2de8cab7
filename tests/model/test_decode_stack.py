"""Decode-only steps run their layers in one C++ call (DecodeStack) where the model allows
it: the same tokens and the same logprobs, bit for bit, as the Python layers, in every
mode and cache type the stack takes; the models it does not take run the Python layers."""

from __future__ import annotations

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.bench.gguf_files import ModelShape, write_model
from pagoda.ops import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.kernels() is None, reason="the stack is one of pagoda's CPU kernels")

LLAMA = ModelShape("llama", 256, 2, 4, 2, 512, True, 10000.0)
QWEN2 = ModelShape("qwen2", 320, 2, 5, 1, 768, False, 1000000.0, qkv_bias=True)
# GPT-OSS's layers in llama.cpp's MXFP4 file: sinks, biases everywhere (the experts' too), a
# window on even layers, YaRN, the clamped SwiGLU.
GPT_OSS = ModelShape("gpt-oss", 256, 2, 4, 2, 256, False, 150000.0, qkv_bias=True, head_dim=64, experts=4,
                     experts_used=2, expert_ffn=256, gpt_oss=True, sliding_window=4, yarn=(4.0, 64))
PROMPTS = [[1, 504, 231, 17, 9, 400, 123], [5, 6, 7], list(range(100, 141)), [77] * 12, [300, 1, 2, 3, 4]]   # vocab 512
# A fixed KV pool: sized from the memory budget, these small models' pools hold millions of blocks of 4,
# whose bookkeeping alone takes seconds to build. The prompts need 32 of them; 256 blocks also
# give the Qwen3.5-shaped file 8 state slots, so every prompt is still admitted at once.
NUM_KV_BLOCKS = 256


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory) -> dict[str, str]:
    out = {}
    for shape in (LLAMA, QWEN2):
        path = tmp_path_factory.mktemp("gguf") / f"{shape.arch}.gguf"
        out[shape.arch] = str(write_model(str(path), shape, "Q4_K_M", show_progress=False))
    return out


def _llm(monkeypatch, model: str, **kwargs) -> LLM:
    monkeypatch.setenv("PAGODA_DECODE_STACK", "1")
    # No prefix caching: a second run of the same prompts computes them again. A fixed thread
    # count: the thread governor would move it with the machine's load between the two runs,
    # and bit-for-bit equality holds for one count.
    return LLM(model, show_progress=False, skip_tokenizer_init=True, block_size=4, enable_prefix_caching=False,
               num_threads=1, num_kv_blocks=NUM_KV_BLOCKS, **kwargs)


def _generate(llm: LLM, stack) -> tuple[list, int]:
    """(outputs, decode steps the stack ran) of a greedy batch with logprobs, the model's
    layers run by ``stack`` (None: the Python layers); every prompt admitted at once, so
    most steps decode several sequences."""
    model = llm.engine.runner.model
    ran = []
    if stack is not None:
        run = stack.run

        def counted(*args):
            out = run(*args)
            ran.append(out is not None)
            return out

        stack.run = counted
    model.decode_stack = stack
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks
    if stack is not None:
        stack.run = run
    return [o.outputs[0] for o in outs], sum(ran)


def _assert_same(monkeypatch, model: str, perturb: bool = False, **kwargs) -> None:
    llm = _llm(monkeypatch, model, **kwargs)
    stack = llm.engine.runner.model.decode_stack
    assert stack is not None
    if perturb:
        # The random files' norms and scales are ones: scaled in place (the stack holds the same
        # tensors), so a stack that skipped one would differ.
        gen = torch.Generator().manual_seed(0)
        for name, p in llm.engine.runner.model.named_parameters():
            if p.dim() <= 1 and p.dtype == torch.float32 and name.endswith(("weight", "scale", "scalar")):
                p.data.mul_(torch.rand(p.shape, generator=gen) + 0.5)
    model = llm.engine.runner.model
    counts = [model.expert_counts()]
    got, steps = _generate(llm, stack)
    counts.append(model.expert_counts())
    want, _ = _generate(llm, None)
    counts.append(model.expert_counts())
    assert steps >= 9   # every decode-only step
    if counts[0] is not None:   # the experts' token counts (/metrics) add up the same either way
        assert torch.equal(counts[1] - counts[0], counts[2] - counts[1]) and counts[1].sum() > counts[0].sum()
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        for a, b in zip(g.logprobs, w.logprobs, strict=True):   # bit for bit: float equality
            assert {t: lp.logprob for t, lp in a.items()} == {t: lp.logprob for t, lp in b.items()}


@pytest.mark.parametrize(("arch", "quantization"), [
    ("llama", "none"), ("llama", "gguf"), pytest.param("llama", "int8", marks=pytest.mark.slow),
    ("llama", "q4"),   # Q4_K / Q6_K blocks
    pytest.param("qwen2", "none", marks=pytest.mark.slow), ("qwen2", "gguf"),   # q/k/v biases, Q5_0 / Q8_0 blocks
])
def test_gguf_file_stack_equals_python_layers(monkeypatch, gguf_files, arch, quantization):
    _assert_same(monkeypatch, gguf_files[arch], quantization=quantization)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "float16"])
def test_stack_reads_and_writes_every_kernel_cache(monkeypatch, gguf_files, kv_cache_dtype):
    _assert_same(monkeypatch, gguf_files["llama"], quantization="gguf", kv_cache_dtype=kv_cache_dtype)


def test_hf_checkpoint_stack_equals_python_layers(monkeypatch, tiny_llama_dir):
    _assert_same(monkeypatch, tiny_llama_dir)   # nn.Linear projections


def test_per_head_qk_norms(monkeypatch, tiny_qwen3_dir):
    _assert_same(monkeypatch, tiny_qwen3_dir)


@pytest.mark.parametrize("family", ["qwen3moe", "glm4moe", "llama4", pytest.param("gemma3", marks=pytest.mark.slow)])
def test_hf_families_stack_equals_python_layers(monkeypatch, request, family):
    """Experts of one MLP each (an HF checkpoint's float32, as _experts_sum runs them):
    softmax top-k (Qwen3-MoE), sigmoid with a selection bias, groups and shared experts
    (GLM-4.5); Llama 4's chunked attention over 16 positions and dense layers between;
    Gemma 3's sandwich norms."""
    _assert_same(monkeypatch, request.getfixturevalue(f"tiny_{family}_dir"))


@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_gpt_oss_file_stack_equals_python_layers(monkeypatch, tmp_path, quantization):
    """GPT-OSS's MXFP4 experts with their biases and clamped SwiGLU in the one-call MoE
    kernel, sinks and windows in the attention: the Python layers' bits."""
    path = write_model(str(tmp_path / "gpt-oss.gguf"), GPT_OSS, "MXFP4", show_progress=False)
    _assert_same(monkeypatch, str(path), perturb=True, quantization=quantization)


def test_hf_gpt_oss_stack_equals_python_layers(monkeypatch, tiny_gptoss_dir):
    _assert_same(monkeypatch, tiny_gptoss_dir)   # float32 experts, one MLP each, with biases


def test_layers_the_stack_does_not_take_run_from_python(monkeypatch, tiny_gptoss_dir, tiny_olmo2_dir):
    from pagoda.model.layers import decode_stack

    llm = _llm(monkeypatch, tiny_olmo2_dir)
    model = llm.engine.runner.model
    assert model.decode_stack is None
    outs, _ = _generate(llm, None)
    assert all(len(o.token_ids) == 10 for o in outs)
    built, reason = decode_stack.build(model)
    assert built is None and reason.startswith("layer 0:") and "not a pre-norm or sandwich layer" in reason
    monkeypatch.setenv("PAGODA_DECODE_STACK", "0")
    assert decode_stack.build(model) == (None, "PAGODA_DECODE_STACK=0")
    monkeypatch.delenv("PAGODA_DECODE_STACK")
    # GPT-OSS's clamped SwiGLU at another limit than the kernels' own: its Python layers.
    model = _llm(monkeypatch, tiny_gptoss_dir).engine.runner.model
    assert model.decode_stack is not None
    for layer in model.model.layers:
        for expert in layer.mlp.experts:
            expert.limit = 6.0
    built, reason = decode_stack.build(model)
    assert built is None and "gated MLPs of one activation" in reason


def test_stack_checks_its_arguments():
    ops = cpu_kernels.kernels()
    with pytest.raises(RuntimeError, match="unknown projection kind"):
        ops.decode_linear(9, [torch.zeros(1)], [])
    with pytest.raises(RuntimeError, match="wrong number of weight tensors"):
        ops.decode_linear(2, [torch.zeros(1)], [])
    stack = ops.DecodeStack([None, None])
    x = torch.zeros(1, 8)
    slots, tables, lens = [torch.zeros(1, dtype=torch.long)], [torch.zeros(1, 1, dtype=torch.int32)], [
        torch.ones(1, dtype=torch.int32)]
    with pytest.raises(RuntimeError, match="outside the stack"):
        stack.run(x, None, [], [], [x, x], [None, None], slots, tables, lens, 0, 3)
    with pytest.raises(RuntimeError, match="not held here"):
        stack.run(x, None, [], [], [x, x], [None, None], slots, tables, lens, 0, 1)
    with pytest.raises(RuntimeError, match="for every layer, or one for all"):
        stack.run(x, None, [], [], [x, x], [None, None], slots * 3, tables * 3, lens * 3, 0, 1)


def _qwen35_file(tmp_path) -> str:
    """A scaled-down Qwen3.5-shaped file: Gated DeltaNet layers (2 key heads, 4 value heads:
    tiled) and gated attention on a quarter of each head's dimensions."""
    import dataclasses

    from pagoda.bench.gguf_files import SHAPES

    shape = dataclasses.replace(SHAPES["qwen3.5-2b"], hidden=256, layers=4, ffn=512, heads=4, head_dim=64,
                                linear=(2, 4, 32, 32, 4))
    return str(write_model(str(tmp_path / "qwen35.gguf"), shape, "Q4_K_M", show_progress=False))


@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_hybrid_stack_equals_python_layers(monkeypatch, tmp_path, quantization):
    """Qwen3.5's layers in the stack: the Gated DeltaNet kernel on the step's state slots,
    attention with its output gate and partial rotary; bit for bit the Python layers."""
    _assert_same(monkeypatch, _qwen35_file(tmp_path), quantization=quantization)


def test_hybrid_stack_saves_states_for_the_prefix_cache(monkeypatch, tmp_path):
    """With prefix caching, decode steps save states at block ends from the stack too: a
    second pass restores them (through the Python layers, for a restoring step) and every
    token and logprob equals an engine that runs no stack."""
    path = _qwen35_file(tmp_path)
    monkeypatch.setenv("PAGODA_DECODE_STACK", "1")
    results = []
    for use_stack in (True, False):
        # (2048 blocks: room for 35 saved states, more than the 16 the two passes save, so the
        # hits and restores are those of a pool sized from memory)
        llm = LLM(path, show_progress=False, skip_tokenizer_init=True, block_size=4, num_threads=1,
                  num_kv_blocks=8 * NUM_KV_BLOCKS)
        engine = llm.engine
        if not use_stack:
            engine.runner.model.decode_stack = None
        else:
            assert engine.runner.model.decode_stack is not None
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
        outs = []
        for _ in range(2):
            outs += [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                                        use_tqdm=False)]
        assert engine.kv_manager.prefix_hits > 0 and engine.scheduler.checkpoints.num_restores > 0
        engine.check_integrity()
        results.append(outs)
    for g, w in zip(*results, strict=True):
        assert g.token_ids == w.token_ids
        for a, b in zip(g.logprobs, w.logprobs, strict=True):
            assert {t: lp.logprob for t, lp in a.items()} == {t: lp.logprob for t, lp in b.items()}


def _scaled_file(tmp_path, name: str, **changes) -> str:
    import dataclasses

    from pagoda.bench.gguf_files import SHAPES

    shape = dataclasses.replace(SHAPES[name], **changes)
    return str(write_model(str(tmp_path / f"{name}.gguf"), shape, "Q4_K_M", show_progress=False))


# The gguf mode with an int8 cache in the default run (the repacked products, the chunked
# layers' metadata); the other two repeat its layers through other kernels (make test-all).
@pytest.mark.parametrize(("quantization", "kv_cache_dtype"), [
    pytest.param("none", "auto", marks=pytest.mark.slow), ("gguf", "int8"),
    pytest.param("int8", "auto", marks=pytest.mark.slow)])
def test_llama4_stack_equals_python_layers(monkeypatch, tmp_path, quantization, kv_cache_dtype):
    """Llama 4's layers in the stack: experts (top-1, the weight on the expert's input) and a
    shared expert, weightless q/k norms on the RoPE layers, the NoPE layer's per-token query
    scale, chunked attention (a chunk of 16 positions and a temperature floor of 4 here: prompts
    and decodes cross chunk boundaries, the chunked layers reading their own block tables); an int8
    KV cache written as the backend writes it on the layer without RoPE."""
    from pagoda.model.models import llama4

    monkeypatch.setattr(llama4, "GGUF_CHUNK", 16)   # (the int8 calibration's blocks are 16 positions)
    monkeypatch.setattr(llama4, "GGUF_TEMPERATURE", (4.0, 0.5))   # query scales past 1 from position 3
    path = _scaled_file(tmp_path, "llama4-scout-2b", hidden=256, layers=4, heads=4, kv_heads=2, ffn=512,
                        head_dim=64, experts=4, expert_ffn=256)
    _assert_same(monkeypatch, path, perturb=True, quantization=quantization, kv_cache_dtype=kv_cache_dtype)


@pytest.mark.parametrize(("kv_cache_dtype", "quantization"), [("auto", "gguf"), ("auto", "int8")])
def test_gemma4_stack_equals_python_layers(monkeypatch, tmp_path, kv_cache_dtype, quantization):
    """Gemma 4's 26B-A4B-shaped layers in the stack: sandwich norms, tanh-GELU MLPs, the
    experts beside the dense MLP (routed on a normed, scaled stream, per-expert scales),
    values from keys normed without a weight, global layers with wider heads, layer scalars."""
    path = _scaled_file(tmp_path, "gemma4-moe-4b", hidden=256, layers=3, heads=4, kv_heads=2, ffn=512,
                        head_dim=64, experts=8, experts_used=2, expert_ffn=256, sliding_window=8,
                        global_head_dim=128, global_kv_heads=1, window_period=2)
    _assert_same(monkeypatch, path, perturb=True, quantization=quantization, kv_cache_dtype=kv_cache_dtype)
