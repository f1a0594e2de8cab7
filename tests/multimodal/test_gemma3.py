"""Gemma 3 with its vision tower against transformers on a tiny random checkpoint with its own
processor: the same pixels and prompt tokens, greedy tokens equal where an image's tokens
attend to each other in both directions (and the prompt crosses the sliding window), with
prompt chunks that never end inside an image, and a second turn from the prefix cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.attention.metadata import AttentionMetadata
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.request import Request
from pagoda.core.scheduler import Scheduler, SchedulerConfig
from pagoda.engine.messages import EngineCoreRequest
from pagoda.multimodal.inputs import ImageInput
from pagoda.multimodal.processors import load_image_processor
from pagoda.validation import InvalidRequestError
from tests.multimodal.checkpoints import random_image, write_gemma3

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
QUESTION = "Describe this picture in a few careful words, please, and then say what colour it is."


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    path = write_gemma3(str(tmp_path_factory.mktemp("gemma3")))
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(path).float().eval()
    return path, model, transformers.AutoProcessor.from_pretrained(path)


def _turn(image_part):
    return [{"role": "user", "content": [image_part, {"type": "text", "text": QUESTION}]}]


@pytest.mark.parametrize("size", [(100, 60), (28, 28), (20, 70)])
def test_pixels_equal_transformers(gemma3, size):
    path, _, processor = gemma3
    image = random_image(*size, seed=sum(size))
    want = processor(images=[image], text=["<start_of_image>"], return_tensors="np")["pixel_values"]
    got = load_image_processor(path).process(image)
    assert got.pixels.shape == want.shape == (1, 3, 28, 28) and np.array_equal(got.pixels, want)
    assert got.num_embeds == 4


@pytest.mark.parametrize("budget", [6, 256])
def test_greedy_equal_with_whole_image_chunks_and_a_cached_second_turn(gemma3, budget):
    path, model, processor = gemma3
    image = random_image(90, 50, seed=3)
    text = processor.apply_chat_template(_turn({"type": "image"}), add_generation_prompt=True)
    inputs = processor(images=[image], text=[text], return_tensors="pt")
    assert int(inputs["token_type_ids"].sum()) == 4
    with torch.inference_mode():
        gen = model.generate(**inputs, max_new_tokens=10, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    want = gen.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    # Each token's log-probability: the image's tokens must have seen each other (greedy
    # tokens alone do not tell, on random weights).
    want_logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(gen.logits, want)]
    # Budget 6: chunks of up to 6 tokens, and the image's 4 never split between two.
    llm = LLM(path, show_progress=False, num_kv_blocks=256, block_size=4, max_num_batched_tokens=budget)
    assert llm.engine.scheduler.config.whole_images
    ours = _turn({"type": "image_pil", "image_pil": image})
    [out] = llm.chat(ours, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0), use_tqdm=False)
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert len(out.prompt_token_ids) > 16   # past the local layers' window
    assert out.outputs[0].token_ids == want
    got_logprobs = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, want)]
    assert np.allclose(got_logprobs, want_logprobs, atol=2e-3), (got_logprobs, want_logprobs)
    [again] = llm.chat(ours, GREEDY, use_tqdm=False)
    assert again.outputs[0].token_ids == want and again.num_cached_tokens > 0
    assert llm.engine.runner.encoder_cache.misses == 1


def test_image_tokens_see_each_other(gemma3):
    """The mask the model runner builds for a chunk with an image: causal, and open within
    the image's span (transformers' OR(causal, same image)); the window cuts it on the local
    layers as it cuts the causal part."""
    meta = AttentionMetadata.build([10], [2], [[0, 1, 2]], 4, torch.device("cpu"))
    meta.open_spans({0: [(4, 8)]})
    chunk = meta.prefills[0]
    q = torch.arange(2, 12)[:, None]
    k = torch.arange(12)[None, :]
    image = (q >= 4) & (q < 8) & (k >= 4) & (k < 8)
    assert torch.equal(chunk.mask, (k <= q) | image)
    first, windowed = chunk.window_view(3)
    assert first == 0 and torch.equal(windowed, ((k <= q) | image) & (k > q - 3))
    with pytest.raises(ValueError, match="ends past"):
        AttentionMetadata.build([4], [0], [[0]], 4, torch.device("cpu")).open_spans({0: [(2, 6)]})


def _image_request(rid: str, offset: int, length: int, total: int) -> Request:
    pixels = np.zeros((1, 3, 4, 4), np.float32)
    return Request(rid, list(range(1, total + 1)), SamplingParams(max_tokens=4),
                   mm_inputs=[ImageInput(rid, offset, length, pixels.tobytes(), pixels.shape)])


def test_the_scheduler_never_ends_a_chunk_inside_an_image():
    """With whole_images, a chunk that would end inside an image ends before it; the next
    takes the image whole (past the long-prefill cap if need be, within the budget), also
    from inside it after a prefix hit; without it, chunks split images where the budget falls."""
    def chunks(whole: bool) -> list[int]:
        sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_model_len=64, whole_images=whole),
                          KVCacheManager(32, 4, False))
        sched.add_request(_image_request("a", 5, 6, 20))
        sizes = []
        while sched.requests["a"].num_computed_tokens < 20 and len(sizes) < 10:
            sizes.append(sched.schedule().num_scheduled_tokens.get("a", 0))
        return sizes

    assert chunks(False) == [8, 8, 4]
    assert chunks(True) == [5, 8, 7]       # up to the image, then the image and 2 more
    request = _image_request("b", 5, 6, 20)   # the image at positions 5..10
    assert Scheduler._whole_images(request, 5, 4, 8) == 6    # capped at 4: the image whole
    assert Scheduler._whole_images(request, 5, 4, 5) == 0    # the budget cannot hold it: wait
    assert Scheduler._whole_images(request, 8, 2, 8) == 3    # from inside it (a prefix hit): its rest
    assert Scheduler._whole_images(request, 0, 20, 20) == 20


def test_the_core_refuses_an_image_longer_than_a_step(gemma3):
    path, _, _ = gemma3
    llm = LLM(path, show_progress=False, num_kv_blocks=32, block_size=4, max_num_batched_tokens=3,
              skip_tokenizer_init=True)
    token = llm.engine.loaded.arch.vision["image_token_id"]
    pixels = np.zeros((1, 3, 28, 28), np.float32)
    image = ImageInput("h", 1, 4, pixels.tobytes(), pixels.shape)
    with pytest.raises(InvalidRequestError, match="both directions"):
        llm.engine.add_request(EngineCoreRequest("r", [5] + [token] * 4 + [7], GREEDY, mm_inputs=[image]))
    [out] = llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 10


@pytest.mark.parametrize("mode", ["none", "gguf"])
def test_gguf_with_mmproj_equals_transformers(gemma3, tmp_path, mode):
    """llama.cpp's pair (a "gemma3" GGUF and a "gemma3" projector file, the tensors and keys
    its converter writes for this checkpoint): served as Gemma 3 with its tower, the same
    prompt, tokens and log-probabilities as transformers in the exact and gguf modes."""
    from tests.multimodal.checkpoints import write_gemma3_gguf

    path, model, processor = gemma3
    text, mmproj = write_gemma3_gguf(path, str(tmp_path))
    image = random_image(90, 50, seed=5)
    prompt = processor.apply_chat_template(_turn({"type": "image"}), add_generation_prompt=True)
    inputs = processor(images=[image], text=[prompt], return_tensors="pt")
    with torch.inference_mode():
        gen = model.generate(**inputs, max_new_tokens=6, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    want = gen.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    llm = LLM(text, mmproj=mmproj, quantization=mode, show_progress=False, num_kv_blocks=64, block_size=4,
              max_num_batched_tokens=6)
    assert type(llm.engine.runner.model).__name__ == "Gemma3ForConditionalGeneration"
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    [out] = llm.chat(_turn({"type": "image_pil", "image_pil": image}), params, use_tqdm=False)
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist() and out.outputs[0].token_ids == want
    if mode == "none":
        want_lp = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(gen.logits, want)]
        got_lp = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, want)]
        assert np.allclose(got_lp, want_lp, atol=2e-3), (got_lp, want_lp)
