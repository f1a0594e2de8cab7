"""Tiny random vision-language checkpoints of real architectures, saved with their own
processors (transformers' PIL image processors) and the bundled SmolLM2 tokenizer with each
family's image tokens added, so prompts, pixels and placeholders are the family's own."""

from __future__ import annotations

import os

import numpy as np
import torch
from PIL import Image

from pagoda.hub.paths import default_model_path

# SmolVLM's chat template (content parts: text and image), as its checkpoints ship it.
IDEFICS3_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def _tokenizer(extra: list[str]):
    import transformers

    gguf = default_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    tok.add_special_tokens({"additional_special_tokens": extra})
    return tok


def write_idefics3(out: str, split: bool = True) -> str:
    """An Idefics3 (SmolVLM) checkpoint: 64-pixel tiles of 8-pixel patches, a pixel shuffle
    of 2 (16 image tokens a tile), images resized to a longest edge of 128 and split."""
    import transformers
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tok = _tokenizer(["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
                     + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)])
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5,
                tie_word_embeddings=False)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=64,
                  patch_size=8)
    config = transformers.Idefics3Config(text_config=text, vision_config=vision, scale_factor=2,
                                         image_token_id=tok.convert_tokens_to_ids("<image>"))
    torch.manual_seed(0)
    model = transformers.Idefics3ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():   # wide enough that the image changes the tokens
            p.normal_(0, 0.2)
    model.save_pretrained(out)
    images = Idefics3ImageProcessorPil(size={"longest_edge": 128}, max_image_size={"longest_edge": 64},
                                       do_image_splitting=split)
    processor = transformers.Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=16,
                                               chat_template=IDEFICS3_TEMPLATE)
    processor.save_pretrained(out)
    return out


def random_image(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    return img if mode == "RGB" else img.convert(mode)


LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}USER: {% else %}ASSISTANT: {% endif %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>\n{% else %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% if message['role'] != 'user' %}</s>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def write_llava(out: str, pad: bool = False) -> str:
    """A LLaVA-1.5-shaped checkpoint: a CLIP tower of 32-pixel images in 8-pixel patches (16
    image tokens, the class token dropped), the next-to-last layer read, a Llama model; images
    resized on their shortest edge to 40 and centre-cropped to 32."""
    import transformers
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    tok = _tokenizer(["<image>"])
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, image_size=32,
                  patch_size=8, projection_dim=32)
    config = transformers.LlavaConfig(text_config=text, vision_config=vision,
                                      image_token_id=tok.convert_tokens_to_ids("<image>"))
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(out)
    images = LlavaImageProcessorPil(size={"shortest_edge": 40}, crop_size={"height": 32, "width": 32}, do_pad=pad)
    processor = transformers.LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=8,
                                            vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                            chat_template=LLAVA_TEMPLATE)
    processor.save_pretrained(out)
    return out
