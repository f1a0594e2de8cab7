"""LLaVA against transformers on a tiny random checkpoint with its own processor: the same
pixels and prompt tokens, greedy tokens equal with the prompt chunked through the image, a
second turn served from the prefix cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.multimodal.processors import load_image_processor
from tests.multimodal.checkpoints import random_image, write_llava

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=[False, True], ids=["crop", "pad"])
def llava(request, tmp_path_factory):
    path = write_llava(str(tmp_path_factory.mktemp("llava")), pad=request.param)
    model = transformers.LlavaForConditionalGeneration.from_pretrained(path).float().eval()
    return path, model, transformers.AutoProcessor.from_pretrained(path)


@pytest.mark.parametrize("size", [(100, 60), (32, 32), (20, 70), (7, 5)])
def test_pixels_equal_transformers(llava, size):
    path, _, processor = llava
    image = random_image(*size, seed=sum(size))
    want = processor(images=[image], text=["USER: <image>\nhi"], return_tensors="np")["pixel_values"]
    got = load_image_processor(path).process(image)
    assert got.pixels.shape == want.shape and np.array_equal(got.pixels, want)
    assert got.num_embeds == 16


def test_greedy_equal_with_chunks_and_a_cached_second_turn(llava):
    path, model, processor = llava
    image = random_image(90, 50, seed=3)
    turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    text = processor.apply_chat_template(turn, add_generation_prompt=True)
    inputs = processor(images=[image], text=[text], return_tensors="pt")
    with torch.inference_mode():
        want = model.generate(**inputs, max_new_tokens=10, do_sample=False)[0, inputs["input_ids"].shape[1]:].tolist()
    llm = LLM(path, show_progress=False, num_kv_blocks=64, block_size=8, max_num_batched_tokens=12)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ours = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                         {"type": "text", "text": "What is this?"}]}]
    [out] = llm.chat(ours, params, use_tqdm=False)
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert out.outputs[0].token_ids == want
    [again] = llm.chat(ours, params, use_tqdm=False)
    assert again.outputs[0].token_ids == want and again.num_cached_tokens == (len(out.prompt_token_ids) - 1) // 8 * 8
    assert llm.engine.runner.encoder_cache.misses == 1


def test_the_int8_mode_converts_the_layers_the_tower_reads(llava):
    """int8: the tower layers the model reads (up to vision_feature_layer) and the projector
    in int8; the last layer, never run, stays as loaded."""
    from pagoda.model.layers.quantization import Int8Linear

    path, _, _ = llava
    llm = LLM(path, show_progress=False, num_kv_blocks=64, block_size=8, quantization="int8")
    model = llm.engine.runner.model
    layers = model.vision_tower.encoder.layers
    assert [type(layer.mlp.fc1) for layer in layers] == [Int8Linear, Int8Linear, torch.nn.Linear]
    assert type(model.multi_modal_projector.linear_2) is Int8Linear
    [out] = llm.generate({"prompt": "USER: <image>\nhi", "multi_modal_data": {"image": random_image(40, 30)}},
                         SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4
