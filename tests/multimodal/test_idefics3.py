"""Idefics3 (SmolVLM) against transformers on a tiny random checkpoint with its own
processor: the same pixel values and prompt tokens from the same image, greedy tokens equal
with the prompt chunked through the image's tokens, a second turn that resends the image
served from the prefix cache without running the encoder, and another image never hitting
the first one's blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.engine.messages import EngineCoreRequest
from pagoda.multimodal.inputs import ImageInput
from pagoda.multimodal.processors import expand_images, load_image_processor
from pagoda.validation import InvalidRequestError
from tests.multimodal.checkpoints import random_image, write_idefics3

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def idefics3_dir(tmp_path_factory):
    return write_idefics3(str(tmp_path_factory.mktemp("idefics3")))


@pytest.fixture(scope="module")
def hf(idefics3_dir):
    model = transformers.Idefics3ForConditionalGeneration.from_pretrained(idefics3_dir).float().eval()
    return model, transformers.AutoProcessor.from_pretrained(idefics3_dir)


def _user(*parts):
    return [{"role": "user", "content": list(parts)}]


def _hf_generate(hf, messages, images, max_tokens=10) -> tuple[list[int], list[int]]:
    model, processor = hf
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(images=[images] if images else None, text=[text], return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
    prompt = inputs["input_ids"][0].tolist()
    return prompt, out[0, len(prompt):].tolist()


@pytest.mark.parametrize("size", [(100, 60), (64, 64), (30, 200), (257, 129), (20, 20)])
def test_pixels_and_placeholders_equal_transformers(idefics3_dir, hf, size):
    """Resize, split into tiles plus the whole image, rescale, normalise: bit-equal pixels,
    and the prompt's tokens (rows and columns marked) equal to the processor's."""
    _, processor = hf
    image = random_image(*size, seed=sum(size))
    ours = load_image_processor(idefics3_dir)
    want = processor(images=[[image]], text=["User:<image>hi"], return_tensors="np")
    got = ours.process(image)
    assert got.pixels.shape == want["pixel_values"][0].shape
    assert np.array_equal(got.pixels, want["pixel_values"][0])
    image_token = processor.tokenizer.convert_tokens_to_ids("<image>")
    ids, inputs = expand_images("User:<image>hi", [image], ours, lambda t: processor.tokenizer(t)["input_ids"],
                                image_token)
    assert ids == want["input_ids"][0].tolist()
    [one] = inputs
    assert ids[one.offset] == image_token and ids[one.offset + one.length - 1] == image_token
    assert ids[one.offset:one.offset + one.length].count(image_token) == got.num_embeds == 16 * got.pixels.shape[0]
    # The request carries the 8-bit tiles (a quarter of float32's bytes); where the encoder
    # runs they become the same floats.
    assert one.itemsize == 1 and len(one.pixels) == got.pixels.size
    assert np.array_equal(one.float_pixels(), want["pixel_values"][0])


def test_greedy_equal_with_chunks_and_a_second_turn_from_the_cache(idefics3_dir, hf):
    """The prompt chunked 24 tokens at a time (an image's placeholders split across steps);
    then the conversation continues with the same image resent: its blocks come from the
    prefix cache and the encoder does not run again."""
    image = random_image(100, 60, seed=1)
    llm = LLM(idefics3_dir, show_progress=False, num_kv_blocks=64, block_size=16, max_num_batched_tokens=24)
    turn = _user({"type": "image"}, {"type": "text", "text": "What is in the picture?"})
    prompt, want = _hf_generate(hf, turn, [image])
    ours = [{"type": "image_pil", "image_pil": image}, {"type": "text", "text": "What is in the picture?"}]
    [out] = llm.chat(_user(*ours), GREEDY, use_tqdm=False)
    assert out.prompt_token_ids == prompt
    assert out.outputs[0].token_ids == want
    cache = llm.engine.runner.encoder_cache
    assert cache.misses == 1 and cache.hits >= 1   # later chunks of the image read the cache

    reply = llm.get_tokenizer().decode(out.outputs[0].token_ids)
    second = turn + [{"role": "assistant", "content": [{"type": "text", "text": reply}]},
                     {"role": "user", "content": [{"type": "text", "text": "And the colours?"}]}]
    prompt2, want2 = _hf_generate(hf, second, [image])
    cache.hits = 0
    ours2 = _user(*ours) + second[1:]
    [out2] = llm.chat(ours2, GREEDY, use_tqdm=False)
    assert out2.prompt_token_ids == prompt2 and out2.outputs[0].token_ids == want2
    # Every whole block of the first prompt came from the cache, image included.
    assert out2.num_cached_tokens == len(prompt) // 16 * 16
    assert cache.misses == 1 and cache.hits == 0
    llm.engine.scheduler.check_integrity()


def test_another_image_never_hits_the_first_ones_blocks(idefics3_dir, hf):
    """Same text, same placeholder tokens, another image: only the blocks before the image's
    first placeholder are shared; the tokens follow that image (transformers agrees)."""
    llm = LLM(idefics3_dir, show_progress=False, num_kv_blocks=64, block_size=4)
    text = "<|im_start|>User: look at this picture now:<image>Describe it.<end_of_utterance>\nAssistant:"
    outs = []
    for seed in (2, 3):
        image = random_image(64, 64, seed=seed)
        [out] = llm.generate({"prompt": text, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)
        _, processor = hf
        inputs = processor(images=[[image]], text=[text], return_tensors="pt")
        with torch.inference_mode():
            want = hf[0].generate(**inputs, max_new_tokens=10, do_sample=False)[0, inputs["input_ids"].shape[1]:]
        assert out.outputs[0].token_ids == want.tolist()
        outs.append(out)
    first_image = outs[0].prompt_token_ids.index(hf[1].tokenizer.convert_tokens_to_ids("<image>"))
    assert outs[1].num_cached_tokens == first_image // 4 * 4
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids


def test_images_survive_preemption_and_share_a_batch(idefics3_dir, hf):
    """Four requests with their own images and a text-only one in a pool too small for all:
    preempted requests recompute (the encoder again where its cache let the image go) and
    every output equals transformers'."""
    llm = LLM(idefics3_dir, show_progress=False, num_kv_blocks=24, block_size=16, max_num_batched_tokens=64,
              encoder_cache_budget=64)
    prompts, wants = [], []
    for seed in range(4):
        image = random_image(40 + 30 * seed, 70, seed=10 + seed)
        text = f"<|im_start|>User:<image>Question {seed}?<end_of_utterance>\nAssistant:"
        prompts.append({"prompt": text, "multi_modal_data": {"image": image}})
        _, want = _hf_generate(hf, _user({"type": "image"}, {"type": "text", "text": f"Question {seed}?"}), [image],
                               max_tokens=24)
        wants.append(want)
    prompts.append({"prompt": "<|im_start|>User: just text<end_of_utterance>\nAssistant:"})
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, want in zip(outs, wants):
        assert out.outputs[0].token_ids == want
    assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.scheduler.check_integrity()


def test_the_core_refuses_images_that_do_not_fit(idefics3_dir, tiny_llama_dir):
    """A request that bypassed the API: images on a text-only model, a span past the prompt,
    too few image tokens, pixels of a shape the tower cannot read: InvalidRequestError, and
    the engine serves on."""
    llm = LLM(idefics3_dir, show_progress=False, num_kv_blocks=32, block_size=16, skip_tokenizer_init=True)
    token = llm.engine.loaded.arch.vision["image_token_id"]
    pixels = np.zeros((1, 3, 64, 64), np.float32)
    good = ImageInput("h", 1, 16, pixels.tobytes(), pixels.shape)
    prompt = [5] + [token] * 16 + [7, 8]
    cases = {
        "span": (prompt, ImageInput("h", 10, 16, pixels.tobytes(), pixels.shape)),
        "tokens": ([5] + [token] * 15 + [7, 8, 9], good),
        "shape": (prompt, ImageInput("h", 1, 16, pixels.tobytes(), (1, 3, 60, 64))),
        "bytes": (prompt, ImageInput("h", 1, 16, b"\0" * 12, pixels.shape)),
    }
    for name, (ids, image) in cases.items():
        with pytest.raises(InvalidRequestError):
            llm.engine.add_request(EngineCoreRequest(name, ids, GREEDY, mm_inputs=[image]))
    [out] = llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 10
    text_only = LLM(tiny_llama_dir, show_progress=False, num_kv_blocks=16, skip_tokenizer_init=True)
    with pytest.raises(InvalidRequestError, match="takes text only"):
        text_only.engine.add_request(EngineCoreRequest("t", prompt, GREEDY, mm_inputs=[good]))


@pytest.mark.parametrize("mode", ["int8", "q4"])
def test_the_int8_mode_converts_the_tower_and_the_others_leave_it_in_float(idefics3_dir, mode):
    """The int8 mode's tower and connector are int8 too (outlier channels from a calibration
    image), its image embeddings close to the float tower's; q4 leaves them in float."""
    from pagoda.model.layers.quantization import Int8Linear

    llm = LLM(idefics3_dir, show_progress=False, num_kv_blocks=32, block_size=16, quantization=mode)
    model = llm.engine.runner.model
    tower = (type(model.vision_model.encoder.layers[0].self_attn.q_proj),
             type(model.connector.modality_projection.proj))
    assert tower == ((Int8Linear, Int8Linear) if mode == "int8" else (torch.nn.Linear, torch.nn.Linear))
    assert type(model.model.layers[0].self_attn.qkv_proj) is not torch.nn.Linear
    image = random_image(64, 64, seed=4)
    if mode == "int8":
        exact = LLM(idefics3_dir, show_progress=False, num_kv_blocks=32, block_size=16)
        pixels = torch.from_numpy(llm.image_processor.process(image).pixels)
        with torch.inference_mode():
            want, got = exact.engine.runner.model.embed_images(pixels), model.embed_images(pixels)
        assert float((got - want).norm() / want.norm()) < 0.03
    [out] = llm.generate({"prompt": "User:<image>hi", "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 10


@pytest.mark.parametrize("mode", ["none", "gguf"])
def test_gguf_with_mmproj_equals_transformers(idefics3_dir, hf, tmp_path, mode):
    """llama.cpp's pair of files (a "llama" GGUF with the tokenizer and chat template, and the
    "clip" projector file, --mmproj): served as the Idefics3 model, the same prompt tokens
    and greedy tokens as transformers, in the exact and the gguf modes."""
    from tests.multimodal.checkpoints import write_idefics3_gguf

    text, mmproj = write_idefics3_gguf(idefics3_dir, str(tmp_path))
    image = random_image(100, 60, seed=1)
    turn = _user({"type": "image"}, {"type": "text", "text": "What is in the picture?"})
    prompt, want = _hf_generate(hf, turn, [image])
    llm = LLM(text, mmproj=mmproj, quantization=mode, show_progress=False, num_kv_blocks=64, block_size=16,
              max_num_batched_tokens=24)
    assert type(llm.engine.runner.model).__name__ == "Idefics3ForConditionalGeneration"
    ours = [{"type": "image_pil", "image_pil": image}, {"type": "text", "text": "What is in the picture?"}]
    [out] = llm.chat(_user(*ours), GREEDY, use_tqdm=False)
    assert out.prompt_token_ids == prompt and out.outputs[0].token_ids == want
    with pytest.raises(ValueError, match="--mmproj goes with a GGUF language model"):
        LLM(idefics3_dir, mmproj=mmproj, show_progress=False, num_kv_blocks=16)
    with pytest.raises(ValueError, match="not a multimodal projector file"):
        LLM(text, mmproj=text, show_progress=False, num_kv_blocks=16)
