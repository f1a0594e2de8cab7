"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5 against transformers on tiny random checkpoints: the same pixels
(cut into patches by the model as transformers' processor cuts them), the same prompt tokens,
greedy tokens and log-probabilities equal with the tower's windows and the language model's
M-RoPE (an image's tokens at three positions, the text after it shifted), with prompts chunked
inside an image and a second turn from the prefix cache."""

from __future__ import annotations

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.model.models.qwen2_vl import _patches, _windows, mrope_positions
from pagoda.multimodal.processors import load_image_processor
from tests.multimodal.checkpoints import assert_chat_equals, hf_greedy, qwen2_vl_inputs, random_image, write_qwen2_vl

transformers = pytest.importorskip("transformers")

QUESTION = "Describe this picture in a few careful words, please."


_CLASSES = {"2": "Qwen2VLForConditionalGeneration", "2.5": "Qwen2_5_VLForConditionalGeneration",
            "3": "Qwen3VLForConditionalGeneration", "3moe": "Qwen3VLMoeForConditionalGeneration",
            "3.5": "Qwen3_5ForConditionalGeneration"}


@pytest.fixture(scope="module", params=list(_CLASSES))
def qwen(request, tmp_path_factory):
    path = write_qwen2_vl(str(tmp_path_factory.mktemp("qwenvl")), request.param)
    return path, getattr(transformers, _CLASSES[request.param]).from_pretrained(path).float().eval(), request.param


def _turn(*parts):
    return [{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}]


@pytest.mark.parametrize("size", [(90, 50), (16, 16), (300, 40), (33, 97)])
def test_patches_equal_transformers(qwen, size):
    """The processor's 8-bit pixels, normalised and cut by the model: transformers' pixel
    values, bit for bit, and one token per 16 x 16 cell."""
    path, _, _ = qwen
    image = random_image(*size, seed=sum(size))
    want = qwen2_vl_inputs(path, "<|image_pad|>", [image])
    got = load_image_processor(path).process(image)
    t, h, w = want["image_grid_thw"][0].tolist()
    assert got.pixels.shape == (1, 3, h * 8, w * 8) and got.num_embeds == h * w // 4
    patches = _patches(torch.from_numpy(got.pixels[0]), 8, 2, 2)
    assert torch.equal(patches, want["pixel_values"])


def test_windows_and_positions():
    """Windows of 2 x 2 cells over a 3 x 5 grid: row by row, cut short at the edges, grouped
    by length; M-RoPE positions: text counts on from an image's start plus its larger side."""
    order, groups = _windows(3, 5, 2, 4)
    assert order.tolist() == [0, 1, 5, 6, 2, 3, 7, 8, 4, 9, 10, 11, 12, 13, 14]
    lengths = sorted(g.shape[1] for g in groups)
    assert lengths == [4, 8, 16] and sum(g.numel() for g in groups) == 15 * 4
    assert _windows(2, 2, 2, 4) is None
    pos, delta = mrope_positions(9, [(2, 2, 3)])   # two text tokens, a 2 x 3 image, one text token
    assert pos.tolist() == [[0, 1, 2, 2, 2, 2, 2, 2, 5], [0, 1, 2, 2, 2, 3, 3, 3, 5], [0, 1, 2, 3, 4, 2, 3, 4, 5]]
    assert delta == 6 - 9


@pytest.mark.parametrize("budget", [7, 512])
def test_greedy_equal_transformers_with_chunks_inside_images(qwen, budget):
    """Two images of different shapes in one prompt: tokens and log-probabilities equal to
    transformers'; budget 7 splits both images across steps (positions of three rows in
    some steps, one in others); a second turn hits the prefix cache and encodes nothing."""
    path, model, _ = qwen
    images = [random_image(90, 50, seed=3), random_image(40, 70, seed=4)]
    tok = transformers.AutoTokenizer.from_pretrained(path)
    prompt = tok.apply_chat_template(_turn({"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}),
                                     add_generation_prompt=True, tokenize=False)
    inputs = qwen2_vl_inputs(path, prompt, images)
    want, want_lp = hf_greedy(model, inputs)
    llm = LLM(path, show_progress=False, num_kv_blocks=256, block_size=4, max_num_batched_tokens=budget)
    ours = _turn({"type": "image_pil", "image_pil": images[0]}, {"type": "text", "text": "and"},
                 {"type": "image_pil", "image_pil": images[1]})
    assert_chat_equals(llm, ours, inputs, want, want_lp, images=2)


def test_text_only_prompts_are_plain_rope(qwen):
    """Without images the positions are the tokens' indices: equal to transformers too."""
    path, model, _ = qwen
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ids = tok.apply_chat_template(_turn(), add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    with torch.inference_mode():
        want = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    llm = LLM(path, show_progress=False, num_kv_blocks=64, block_size=4)
    [out] = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                         use_tqdm=False)
    assert out.outputs[0].token_ids == want


def test_ngram_drafts_after_an_image_keep_greedy_tokens(qwen):
    """n-gram drafts verified at the shifted positions of the text after an image: the same
    tokens as without drafts (random weights repeat themselves, so there are drafts to verify)."""
    path, _, version = qwen
    if version == "3.5":
        pytest.skip("this Qwen3.5 checkpoint's random weights never repeat a token: no drafts to verify")
    image = random_image(60, 60, seed=9)
    ours = _turn({"type": "image_pil", "image_pil": image})
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = []
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}):
        llm = LLM(path, show_progress=False, num_kv_blocks=128, block_size=4, speculative_config=spec)
        [out] = llm.chat(ours, params, use_tqdm=False)
        outs.append(out.outputs[0].token_ids)
    assert outs[0] == outs[1]
    stats = llm.engine.scheduler.make_stats()
    assert stats.spec_num_draft_tokens > 0, "no drafts: the test checks nothing"


def test_qwen25_vl_over_http_equals_the_offline_engine(tmp_path):
    """Qwen2.5-VL on a real server (loopback) with the official client: an image as a data
    URL gives the offline engine's tokens (itself equal to transformers, above); an image too
    small for one cell after resizing is still served (resized up to the pixel floor)."""
    import base64

    import openai

    from pagoda.config import EngineConfig
    from tests.e2e.server_utils import real_engine_server
    from tests.e2e.test_real_engine import _wait_idle

    path = write_qwen2_vl(str(tmp_path / "qwen25vl"))
    image = random_image(70, 45, seed=2)
    url = "data:image/png;base64," + base64.b64encode(_png(image)).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": QUESTION}]}]
    offline = LLM(path, show_progress=False, num_kv_blocks=64, block_size=16)
    [want] = offline.chat(messages, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    config = EngineConfig(model=path, show_progress=False, num_kv_blocks=64, block_size=16, max_model_len=512)
    with real_engine_server(config, served_model_name="qwen") as (_, running):
        with openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="x", max_retries=0, timeout=120) as client:
            r = client.chat.completions.create(model="qwen", messages=messages, max_tokens=8, temperature=0,
                                               extra_body={"ignore_eos": True, "return_token_ids": True})
            assert r.choices[0].token_ids == want.outputs[0].token_ids
            assert r.usage.prompt_tokens == len(want.prompt_token_ids)
            tiny = "data:image/png;base64," + base64.b64encode(_png(random_image(3, 5, seed=1))).decode()
            small = client.chat.completions.create(model="qwen", max_tokens=2, messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": tiny}}]}])
            assert small.usage.prompt_tokens > 4   # at least the 4 cells of the 1024-pixel floor
            _wait_idle(running)


def _png(image) -> bytes:
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def test_gguf_with_mmproj_equals_transformers(qwen, tmp_path):
    """llama.cpp's pair (a "qwen2vl", "qwen3vl" or "qwen35" GGUF with M-RoPE sections, and a
    "qwen2.5vl_merger" or "qwen3vl_merger" projector file, as its converter writes them):
    served as the family with its tower, the same prompt and greedy tokens as transformers in
    the exact and gguf modes (Qwen2.5-VL's 32-pixel windows in the file's window_size key;
    files at the converter's 112 were checked by hand against its own output)."""
    from tests.multimodal.checkpoints import write_qwen_vl_gguf

    path, model, version = qwen
    if version == "2":
        pytest.skip("llama.cpp's converter cannot write this Qwen2-VL checkpoint's projector: nothing to mirror")
    if version == "3moe":
        pytest.skip("the tests' GGUF writer takes experts one by one (Qwen3-VL's projector is tested with its dense model)")
    text, mmproj = write_qwen_vl_gguf(path, str(tmp_path), version)
    image = random_image(200, 60, seed=3)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    prompt = tok.apply_chat_template(_turn({"type": "image"}), add_generation_prompt=True, tokenize=False)
    inputs = qwen2_vl_inputs(path, prompt, [image])
    assert inputs["image_grid_thw"].tolist() == [[1, 8, 24]]
    with torch.inference_mode():
        want = model.generate(**inputs, max_new_tokens=8, do_sample=False)[0, inputs["input_ids"].shape[1]:].tolist()
    for mode in ("none", "gguf"):
        llm = LLM(text, mmproj=mmproj, quantization=mode, show_progress=False, num_kv_blocks=64, block_size=4,
                  max_num_batched_tokens=16)
        assert type(llm.engine.runner.model).__name__ == _CLASSES[version]
        [out] = llm.chat(_turn({"type": "image_pil", "image_pil": image}),
                         SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
        assert out.outputs[0].token_ids == want, mode
