"""Mistral 3 (Pixtral's tower, a patch merger, a Mistral language model) against transformers
on a tiny random checkpoint: the same pixels and prompt (rows of [IMG] ended by [IMG_BREAK] and
[IMG_END]), greedy tokens and log-probabilities, with prompts chunked inside an image and a
second turn from the prefix cache."""

from __future__ import annotations

import numpy as np
import pytest

from pagoda import LLM
from pagoda.multimodal.processors import load_image_processor
from tests.multimodal.checkpoints import (assert_chat_equals, hf_greedy, mistral3_inputs, random_image,
                                          write_mistral3)

transformers = pytest.importorskip("transformers")

QUESTION = "Describe this picture in a few careful words, please."


@pytest.fixture(scope="module")
def mistral3(tmp_path_factory):
    path = write_mistral3(str(tmp_path_factory.mktemp("mistral3")))
    return path, transformers.Mistral3ForConditionalGeneration.from_pretrained(path).float().eval()


def _turn(*parts):
    return [{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}]


@pytest.mark.parametrize("size", [(90, 50), (8, 8), (300, 20), (13, 37)])
def test_pixels_equal_transformers(mistral3, size):
    path, _ = mistral3
    image = random_image(*size, seed=sum(size))
    want = mistral3_inputs(path, "[IMG]", [image])
    got = load_image_processor(path).process(image)
    assert got.pixels.shape == tuple(want["pixel_values"].shape) and np.array_equal(got.pixels, want["pixel_values"])
    h, w = want["image_sizes"][0].tolist()
    assert got.num_embeds == (h // 8) * (w // 8)


@pytest.mark.parametrize("budget", [7, 512])
def test_greedy_equal_transformers(mistral3, budget):
    path, model = mistral3
    image = random_image(90, 50, seed=3)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    prompt = tok.apply_chat_template(_turn({"type": "image"}), add_generation_prompt=True, tokenize=False)
    inputs = mistral3_inputs(path, prompt, [image])
    want, want_lp = hf_greedy(model, inputs)
    llm = LLM(path, show_progress=False, num_kv_blocks=256, block_size=4, max_num_batched_tokens=budget)
    assert_chat_equals(llm, _turn({"type": "image_pil", "image_pil": image}), inputs, want, want_lp, images=1)
