"""Gemma 4 with its vision tower against transformers on tiny random checkpoints with its own
image processor: the same pixels, prompt tokens, greedy tokens and log-probabilities, with the
tower's clipped linears and standardised soft tokens; E2B-style per-layer inputs (an image
token's are the pad token's) and the 26B-style bidirectional image attention; prompts chunked
(never inside an image where it attends both ways) and a second turn from the prefix cache."""

from __future__ import annotations

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.multimodal.processors import load_image_processor
from tests.multimodal.checkpoints import assert_chat_equals, gemma4_inputs, hf_greedy, random_image, write_gemma4

transformers = pytest.importorskip("transformers")

QUESTION = "Describe this picture in a few careful words, please."
VARIANTS = {"31b": {}, "e2b": {"per_layer": True}, "26b": {"bidirectional": True}}


@pytest.fixture(scope="module", params=list(VARIANTS))
def gemma4(request, tmp_path_factory):
    path = write_gemma4(str(tmp_path_factory.mktemp("gemma4")), **VARIANTS[request.param])
    return path, transformers.Gemma4ForConditionalGeneration.from_pretrained(path).float().eval(), request.param


def _turn(*parts):
    return [{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}]


@pytest.mark.parametrize("size", [(90, 50), (8, 8), (300, 20), (20, 300), (33, 97)])
def test_pixels_equal_transformers(gemma4, size):
    """The processor's pixels, cut into patches as the model cuts them: transformers' pixel
    values (its padding dropped) bit for bit, one image token per 8 x 8-pixel cell."""
    path, _, variant = gemma4
    if variant != "31b":
        pytest.skip("the processor is the same for every variant")
    image = random_image(*size, seed=sum(size))
    want = gemma4_inputs(path, "<|image|>", [image])
    got = load_image_processor(path).process(image)
    _, c, h, w = got.pixels.shape
    patches = torch.from_numpy(got.pixels[0]).reshape(c, h // 4, 4, w // 4, 4).permute(1, 3, 2, 4, 0).reshape(-1, 48)
    n = patches.shape[0]
    assert torch.equal(patches, want["pixel_values"][0, :n]) and (want["image_position_ids"][0, n:] == -1).all()
    assert got.num_embeds == n // 4 == int(want["mm_token_type_ids"].sum())


@pytest.mark.parametrize("budget", [9, 512])
def test_greedy_equal_transformers(gemma4, budget):
    path, model, variant = gemma4
    image = random_image(90, 50, seed=3)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    prompt = tok.apply_chat_template(_turn({"type": "image"}), add_generation_prompt=True, tokenize=False)
    inputs = gemma4_inputs(path, prompt, [image])
    want, want_lp = hf_greedy(model, inputs)
    if variant == "26b" and budget == 9:
        budget = 80   # the image's 66 tokens go in one step where they attend both ways
    llm = LLM(path, show_progress=False, num_kv_blocks=256, block_size=4, max_num_batched_tokens=budget)
    assert llm.engine.scheduler.config.whole_images == (variant == "26b")
    assert_chat_equals(llm, _turn({"type": "image_pil", "image_pil": image}), inputs, want, want_lp, images=1)


def test_gguf_with_mmproj_equals_transformers(gemma4, tmp_path):
    """llama.cpp's pair (a "gemma4" GGUF and a "gemma4v" projector file, as its converter writes
    them): served as Gemma 4 with its tower, the same prompt and greedy tokens as transformers
    in the exact and gguf modes; image tokens attending both ways where the model has no
    per-layer inputs (llama.cpp's rule: its files do not say)."""
    from tests.multimodal.checkpoints import write_gemma4_gguf

    path, model, variant = gemma4
    if variant == "31b":
        pytest.skip("a model without per-layer inputs and causal image tokens: no published Gemma 4 is one")
    text, mmproj = write_gemma4_gguf(path, str(tmp_path))
    image = random_image(90, 50, seed=5)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    prompt = tok.apply_chat_template(_turn({"type": "image"}), add_generation_prompt=True, tokenize=False)
    inputs = gemma4_inputs(path, prompt, [image])
    with torch.inference_mode():
        want = model.generate(**inputs, max_new_tokens=6, do_sample=False)[0, inputs["input_ids"].shape[1]:].tolist()
    for mode in ("none", "gguf"):
        llm = LLM(text, mmproj=mmproj, quantization=mode, show_progress=False, num_kv_blocks=256, block_size=4,
                  max_num_batched_tokens=128)
        assert type(llm.engine.runner.model).__name__ == "Gemma4ForConditionalGeneration"
        assert llm.engine.scheduler.config.whole_images == (variant == "26b")
        [out] = llm.chat(_turn({"type": "image_pil", "image_pil": image}),
                         SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
        assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
        assert out.outputs[0].token_ids == want, mode
