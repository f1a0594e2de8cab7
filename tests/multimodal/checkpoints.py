"""Tiny random vision-language checkpoints of real architectures, saved with their own
processors (transformers' PIL image processors) and the bundled SmolLM2 tokenizer with each
family's image tokens added, so prompts, pixels and placeholders are the family's own."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile

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


@functools.lru_cache(maxsize=None)
def _base_tokenizer_dir() -> str:
    """The bundled GGUF's tokenizer saved as an HF folder, once a process (reading it from
    the GGUF takes seconds; from the folder, a fraction of one)."""
    import transformers

    gguf = default_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    out = tempfile.mkdtemp(prefix="pagoda-tokenizer-")
    atexit.register(shutil.rmtree, out, True)
    tok.save_pretrained(out)
    return out


def _tokenizer(extra: list[str]):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(_base_tokenizer_dir())
    tok.add_special_tokens({"additional_special_tokens": extra})
    return tok


def _save_random(model_cls, config, out: str) -> None:
    """The model of ``config`` with weights of N(0, 0.2), seeded: wide enough that an image
    changes the tokens."""
    torch.manual_seed(0)
    model = model_cls(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(out)


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
    _save_random(transformers.Idefics3ForConditionalGeneration, config, out)
    images = Idefics3ImageProcessorPil(size={"longest_edge": 128}, max_image_size={"longest_edge": 64},
                                       do_image_splitting=split)
    processor = transformers.Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=16,
                                               chat_template=IDEFICS3_TEMPLATE)
    processor.save_pretrained(out)
    return out


def hf_greedy(model, inputs: dict, max_new_tokens: int = 10) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens for ``inputs`` and each one's log-probability."""
    with torch.inference_mode():
        gen = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    want = gen.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    return want, [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(gen.logits, want)]


def assert_chat_equals(llm, messages: list, inputs: dict, want: list[int], want_logprobs: list[float],
                       images: int) -> None:  # fmt: skip
    """``llm`` serves ``messages`` with transformers' prompt, greedy tokens and log-probabilities
    (``inputs``, ``want``); a second time from the prefix cache, its ``images`` encoded once."""
    from pagoda import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=len(want), ignore_eos=True, logprobs=0)
    [out] = llm.chat(messages, params, use_tqdm=False)
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert out.outputs[0].token_ids == want
    got = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, want)]
    assert np.allclose(got, want_logprobs, atol=2e-3), (got, want_logprobs)
    [again] = llm.chat(messages, params, use_tqdm=False)
    assert again.outputs[0].token_ids == want and again.num_cached_tokens > 0
    assert llm.engine.runner.encoder_cache.misses == images


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
    _save_random(transformers.LlavaForConditionalGeneration, config, out)
    images = LlavaImageProcessorPil(size={"shortest_edge": 40}, crop_size={"height": 32, "width": 32}, do_pad=pad)
    processor = transformers.LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=8,
                                            vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                            chat_template=LLAVA_TEMPLATE)
    processor.save_pretrained(out)
    return out


# Gemma 3's chat template, shortened: turns between <start_of_turn> and <end_of_turn>, an
# image part written as <start_of_image> (the processor expands it).
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>{{ 'model' if message['role'] == 'assistant' "
    "else message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<start_of_image>{% else %}"
    "{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def write_gemma3(out: str) -> str:
    """A Gemma 3 checkpoint with its vision tower: 28-pixel images in 7-pixel patches (a 4x4
    grid) pooled to 4 image tokens, a 6-layer language model with a sliding window of 16 on
    five layers of six (so prompts with an image cross the window)."""
    import transformers
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    specials = {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"}
    tok = _tokenizer(["<start_of_turn>", "<end_of_turn>", *specials.values()])
    tok._set_model_specific_special_tokens(specials)   # tok.image_token, .boi_token_id...: saved with it
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=6, head_dim=32,
                num_attention_heads=4, num_key_value_heads=2, sliding_window=16, query_pre_attn_scalar=32,
                max_position_embeddings=2048)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28,
                  patch_size=7)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_id=tok.image_token_id, boi_token_id=tok.boi_token_id,
                                       eoi_token_id=tok.eoi_token_id)
    _save_random(transformers.Gemma3ForConditionalGeneration, config, out)
    images = Gemma3ImageProcessorPil(size={"height": 28, "width": 28})
    processor = transformers.Gemma3Processor(image_processor=images, tokenizer=tok, image_seq_length=4,
                                             chat_template=GEMMA3_TEMPLATE)
    processor.save_pretrained(out)
    return out


# Qwen2-VL's chat template, shortened: ChatML turns, an image part written as one
# <|image_pad|> between <|vision_start|> and <|vision_end|> (the processor expands it).
QWEN2_VL_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_qwen2_vl(out: str, version: str = "2.5", window: int = 32) -> str:
    """A Qwen2.5-VL (or Qwen2-VL, ``version`` "2", Qwen3-VL, "3", Qwen3.5, "3.5") checkpoint: 8-pixel patches merged 2 x 2
    (a token per 16 x 16 pixels), images resized to between 4 and 64 tokens' area; Qwen2.5-VL's
    tower with windows of ``window`` pixels (2 x 2 tokens) on two layers of four; a language model whose head has
    M-RoPE sections (2, 3, 3). Saved without transformers' processor class (it needs
    torchvision for videos): the tokenizer with the template, and the image processor's config."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = _tokenizer(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    ids = {name: tok.convert_tokens_to_ids(f"<|{name.removesuffix('_token_id')}|>") for name in
           ("image_pad_token_id", "video_pad_token_id", "vision_start_token_id", "vision_end_token_id")}
    tokens = dict(image_token_id=ids["image_pad_token_id"], video_token_id=ids["video_pad_token_id"],
                  vision_start_token_id=ids["vision_start_token_id"], vision_end_token_id=ids["vision_end_token_id"])
    if version == "2":
        vision = dict(depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2, patch_size=8,
                      spatial_merge_size=2, temporal_patch_size=2)
        config = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, **tokens)
        _save_random(transformers.Qwen2VLForConditionalGeneration, config, out)
    elif version in ("3", "3moe"):
        # Qwen3-VL: Qwen3's language model (three layers; "3moe": Qwen3-MoE's, 4 experts, 2 a
        # token), deepstack features of both tower layers added after its first two.
        text.update(num_hidden_layers=3, head_dim=16,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                     "mrope_interleaved": True})
        if version == "3moe":
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, decoder_sparse_step=1)
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8, spatial_merge_size=2,
                      temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16,
                      deepstack_visual_indexes=[0, 1])
        moe = "Moe" if version == "3moe" else ""
        config = getattr(transformers, f"Qwen3VL{moe}Config")(text_config=text, vision_config=vision, **tokens)
        _save_random(getattr(transformers, f"Qwen3VL{moe}ForConditionalGeneration"), config, out)
    elif version == "3.5":
        # Qwen3.5's hybrid language model: Gated DeltaNet layers between gated attention
        # layers whose partial RoPE (16 of 32 dimensions) interleaves the M-RoPE rows.
        text.update(num_hidden_layers=4, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=8, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                    layer_types=["linear_attention"] * 3 + ["full_attention"],   # (llama.cpp's files: every 4th)
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                     "mrope_section": [3, 3, 2], "mrope_interleaved": True})
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8, spatial_merge_size=2,
                      temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16)
        config = transformers.Qwen3_5Config(text_config=text, vision_config=vision, **tokens)
        _save_random(transformers.Qwen3_5ForConditionalGeneration, config, out)
    else:
        vision = dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8, spatial_merge_size=2,
                      temporal_patch_size=2, window_size=window, out_hidden_size=64, fullatt_block_indexes=[1, 3])
        config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **tokens)
        _save_random(transformers.Qwen2_5_VLForConditionalGeneration, config, out)
    tok.chat_template = QWEN2_VL_TEMPLATE
    tok.save_pretrained(out)
    Qwen2VLImageProcessorPil(patch_size=8, merge_size=2, temporal_patch_size=2, min_pixels=16 * 16 * 4,
                             max_pixels=16 * 16 * 64).save_pretrained(out)
    return out


def qwen2_vl_inputs(path: str, prompt: str, images: list) -> dict:
    """transformers' inputs for a Qwen2-VL checkpoint of ``write_qwen2_vl`` (its processor's
    work without the processor class): pixels, grids, and the prompt with each image's
    ``<|image_pad|>`` repeated once per token."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = transformers.AutoTokenizer.from_pretrained(path)
    pixels = Qwen2VLImageProcessorPil.from_pretrained(path)(images=images, return_tensors="pt")
    parts = prompt.split("<|image_pad|>")
    text = parts[0]
    for grid, rest in zip(pixels["image_grid_thw"], parts[1:]):
        text += "<|image_pad|>" * (int(grid.prod()) // 4) + rest
    ids = tok(text, return_tensors="pt")["input_ids"]
    image_token = tok.convert_tokens_to_ids("<|image_pad|>")
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=(ids == image_token).int(),
                **pixels)


# Gemma 4's chat template, shortened: turns between <|turn>role and <turn|>, an image part
# written as <|image|> (the processor expands it between <|image> and <image|>).
GEMMA4_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|turn>{{ 'model' if message['role'] == 'assistant' "
    "else message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<|image|>{% else %}"
    "{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<turn|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)


def write_gemma4(out: str, per_layer: bool = False, bidirectional: bool = False) -> str:
    """A Gemma 4 checkpoint with its vision tower: 4-pixel patches pooled 2 x 2 (an image
    token per 8 x 8 pixels, at most 70 of them), clipped linears, standardised soft tokens;
    a 6-layer language model with a window of 16 on five layers of six. ``per_layer``: E2B /
    E4B's per-layer inputs and shared KV; ``bidirectional``: the 26B / 31B's image tokens
    attending to each other both ways."""
    import transformers
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    specials = {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>"}
    tok = _tokenizer(["<|turn>", "<turn|>", *specials.values()])
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=2048, num_hidden_layers=6, head_dim=32,
                global_head_dim=64, sliding_window=16, final_logit_softcapping=30.0, pad_token_id=0,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                use_bidirectional_attention="vision" if bidirectional else None)
    if per_layer:
        text.update(layer_types=["sliding_attention", "full_attention"] * 3, hidden_size_per_layer_input=16,
                    vocab_size_per_layer_input=len(tok), num_kv_shared_layers=2, use_double_wide_mlp=True)
    else:
        text.update(hidden_size_per_layer_input=0, num_global_key_value_heads=1, attention_k_eq_v=True)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, patch_size=4, pooling_kernel_size=2,
                  position_embedding_size=64, use_clipped_linears=True, standardize=True)
    config = transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None,
                                       image_token_id=tok.convert_tokens_to_ids(specials["image_token"]),
                                       boi_token_id=tok.convert_tokens_to_ids(specials["boi_token"]),
                                       eoi_token_id=tok.convert_tokens_to_ids(specials["eoi_token"]))
    torch.manual_seed(0)
    model = transformers.Gemma4ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.2)
        for name, b in model.named_buffers():   # the clipping bounds: wide, but not infinite
            if name.endswith(("input_min", "output_min")):
                b.fill_(-3.0)
            elif name.endswith(("input_max", "output_max")):
                b.fill_(3.0)
            elif name.endswith("std_bias"):
                b.normal_(0, 0.5)
            elif name.endswith("std_scale"):
                b.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    tok.chat_template = GEMMA4_TEMPLATE
    tok.save_pretrained(out)
    Gemma4ImageProcessorPil(patch_size=4, pooling_kernel_size=2, max_soft_tokens=70).save_pretrained(out)
    return out


def gemma4_inputs(path: str, prompt: str, images: list) -> dict:
    """transformers' inputs for a checkpoint of ``write_gemma4`` (its processor's work without
    the processor class, which needs torchvision for videos)."""
    import transformers
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    tok = transformers.AutoTokenizer.from_pretrained(path)
    pixels = Gemma4ImageProcessorPil.from_pretrained(path)(images=images, return_tensors="pt")
    parts = prompt.split("<|image|>")
    text = parts[0]
    for n, rest in zip(pixels["num_soft_tokens_per_image"], parts[1:]):
        text += "<|image>" + "<|image|>" * int(n) + "<image|>" + rest
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    image_token = tok.convert_tokens_to_ids("<|image|>")
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=(ids == image_token).long(),
                pixel_values=pixels["pixel_values"], image_position_ids=pixels["image_position_ids"])


MISTRAL3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}[INST]{% if message['content'] "
    "is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' "
    "%}[IMG]{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}[/INST]{% else %}{{ message['content'] }}"
    "{{ eos_token }}{% endif %}{% endfor %}"
)


def write_mistral3(out: str) -> str:
    """A Mistral 3 checkpoint: a Pixtral tower of 4-pixel patches (three layers, the last
    read), a 2 x 2 patch merger (a token per 8 x 8 pixels), a Mistral language model; images
    shrunk to a longest edge of 64 and rounded up to whole 8-pixel cells."""
    import transformers
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    tok = _tokenizer(["[IMG]", "[IMG_BREAK]", "[IMG_END]", "[INST]", "[/INST]"])
    text = dict(model_type="mistral", vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=2048, rms_norm_eps=1e-5, sliding_window=None,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, image_size=64,
                  patch_size=4, head_dim=16, hidden_act="silu")
    config = transformers.Mistral3Config(text_config=text, vision_config=vision, spatial_merge_size=2,
                                         image_token_id=tok.convert_tokens_to_ids("[IMG]"), vision_feature_layer=-1)
    _save_random(transformers.Mistral3ForConditionalGeneration, config, out)
    tok.chat_template = MISTRAL3_TEMPLATE
    tok.save_pretrained(out)
    PixtralImageProcessorPil(patch_size={"height": 4, "width": 4}, size={"longest_edge": 64}).save_pretrained(out)
    with open(os.path.join(out, "processor_config.json"), "w") as f:   # (the processor's own settings)
        f.write('{"processor_class": "PixtralProcessor", "patch_size": 4, "spatial_merge_size": 2}')
    return out


def mistral3_inputs(path: str, prompt: str, images: list) -> dict:
    """transformers' inputs for a checkpoint of ``write_mistral3`` (PixtralProcessor's work:
    the image processor at patch x merge, each [IMG] expanded row by row)."""
    import transformers
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    tok = transformers.AutoTokenizer.from_pretrained(path)
    pixels = PixtralImageProcessorPil.from_pretrained(path)(images=images, patch_size={"height": 8, "width": 8},
                                                            return_tensors="pt")
    parts = prompt.split("[IMG]")
    text = parts[0]
    for (h, w), rest in zip(pixels["image_sizes"].tolist(), parts[1:]):
        text += ((("[IMG]" * (w // 8)) + "[IMG_BREAK]") * (h // 8))[:-len("[IMG_BREAK]")] + "[IMG_END]" + rest
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), **pixels)


def write_idefics3_gguf(hf_dir: str, out_dir: str) -> tuple[str, str]:
    """The checkpoint of ``write_idefics3`` as llama.cpp's converter writes it: the language
    model as a "llama" GGUF (Q/K permuted) with its tokenizer (the bundled vocabulary, the
    image tokens added as control tokens, SmolVLM's chat template), and the tower and
    connector as a "clip" projector file (``--mmproj``) under llama.cpp's names and keys
    (checked against the files its convert_hf_to_gguf.py writes for this checkpoint).
    Returns (language model, projector) paths."""
    import transformers

    vlm = transformers.Idefics3ForConditionalGeneration.from_pretrained(hf_dir).float().eval()
    processor = transformers.AutoProcessor.from_pretrained(hf_dir)
    text_path = _write_text_gguf(vlm, vlm.model.text_model, transformers.LlamaConfig, transformers.LlamaForCausalLM,
                                 os.path.join(out_dir, "smolvlm-text.gguf"), "llama",
                                 _gguf_tokenizer(processor.tokenizer, IDEFICS3_TEMPLATE))
    proj_path = os.path.join(out_dir, "smolvlm-mmproj.gguf")
    _write_clip(proj_path, "idefics3", vlm.config, processor.image_processor, vlm.model.vision_model,
                {"mm.model.fc.weight": vlm.model.connector.modality_projection.proj.weight},
                {"projector.scale_factor": vlm.config.scale_factor,
                 "preproc_image_size": processor.image_processor.size["longest_edge"]})
    return text_path, proj_path


def _write_text_gguf(vlm, language_model, config_cls, model_cls, path: str, gguf_arch: str, tokenizer) -> str:
    """The language model of ``vlm`` as its own causal LM (saved beside ``path``), written as
    a GGUF file of ``gguf_arch`` with the ``tokenizer`` writer's keys."""
    from tests.model.hf_to_gguf import write_gguf

    text_dir = os.path.join(os.path.dirname(path), "text")
    text = model_cls(config_cls(**vlm.config.text_config.to_dict())).float().eval()
    state = {f"model.{k}": v for k, v in language_model.state_dict().items()}
    state["lm_head.weight"] = vlm.lm_head.weight
    text.load_state_dict(state)
    text.save_pretrained(text_dir)
    return write_gguf(text, path, gguf_arch, text_dir, extra=tokenizer)


def _gguf_tokenizer(hf_tok, template: str):
    """The writer callback of a GGUF tokenizer: the bundled vocabulary with ``hf_tok``'s added
    tokens (control tokens, as llama.cpp's converter writes special added tokens)."""
    from pagoda.hub.gguf_file import GGUFFile

    base = GGUFFile(default_model_path())
    md = dict(base.metadata)
    base.close()
    tokens = list(md["tokenizer.ggml.tokens"])
    types = list(md["tokenizer.ggml.token_type"])
    for token, i in sorted(hf_tok.get_added_vocab().items(), key=lambda kv: kv[1]):
        if i >= len(tokens):
            assert i == len(tokens), (token, i)
            tokens.append(token)
            types.append(3)

    def tokenizer(w) -> None:
        w.add_tokenizer_model(md["tokenizer.ggml.model"])
        w.add_tokenizer_pre(md["tokenizer.ggml.pre"])
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(list(md["tokenizer.ggml.merges"]))
        w.add_bos_token_id(md["tokenizer.ggml.bos_token_id"])
        w.add_eos_token_id(md["tokenizer.ggml.eos_token_id"])
        w.add_chat_template(template)

    return tokenizer


def _write_clip(path: str, projector: str, config, image_processor, tower, projector_tensors: dict,
                extra_keys: dict) -> None:
    """A "clip" projector file (``--mmproj``) as llama.cpp's converter writes it: the SigLIP
    tower under its v.* names, the projector's tensors, the geometry and processor settings
    in clip.vision.* keys (checked against the converter's own output for each type)."""
    from gguf import GGUFWriter

    v = config.vision_config
    w = GGUFWriter(path, "clip")
    w.add_type("mmproj")
    w.add_bool("clip.has_vision_encoder", True)
    for key, value in (("image_size", v.image_size), ("patch_size", v.patch_size),
                       ("embedding_length", v.hidden_size), ("feed_forward_length", v.intermediate_size),
                       ("block_count", v.num_hidden_layers), ("attention.head_count", v.num_attention_heads),
                       ("projection_dim", config.text_config.hidden_size), *extra_keys.items()):
        w.add_uint32(f"clip.vision.{key}", int(value))
    w.add_float32("clip.vision.attention.layer_norm_epsilon", v.layer_norm_eps)
    w.add_array("clip.vision.image_mean", [float(x) for x in image_processor.image_mean])
    w.add_array("clip.vision.image_std", [float(x) for x in image_processor.image_std])
    w.add_string("clip.projector_type", projector)
    w.add_bool("clip.use_gelu", True)
    layer = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.out_proj": "attn_out", "layer_norm1": "ln1", "layer_norm2": "ln2", "mlp.fc1": "ffn_up",
             "mlp.fc2": "ffn_down"}
    other = {"embeddings.patch_embedding": "v.patch_embd", "embeddings.position_embedding": "v.position_embd",
             "post_layernorm": "v.post_ln"}
    for name, t in tower.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if module.startswith("head"):   # SigLIP's pooling head: the converter drops it
            continue
        if module.startswith("encoder.layers."):
            i, part = module[len("encoder.layers."):].split(".", 1)
            gguf_name = f"v.blk.{i}.{layer[part]}"
        else:
            gguf_name = other[module]
        w.add_tensor(f"{gguf_name}.{leaf}", np.ascontiguousarray(t.detach().float().numpy()))
    for name, t in projector_tensors.items():
        w.add_tensor(name, np.ascontiguousarray(t.detach().float().numpy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_gemma3_gguf(hf_dir: str, out_dir: str) -> tuple[str, str]:
    """The checkpoint of ``write_gemma3`` as llama.cpp's converter writes it: the language model
    as a "gemma3" GGUF (its norms as 1 + w) with its tokenizer and chat template, and the tower
    and projector as a "gemma3" projector file (the soft-embedding norm as 1 + w, the
    projection as stored; checked against the converter's output for this checkpoint).
    Returns (language model, projector) paths."""
    import transformers

    vlm = transformers.Gemma3ForConditionalGeneration.from_pretrained(hf_dir).float().eval()
    processor = transformers.AutoProcessor.from_pretrained(hf_dir)
    text_path = _write_text_gguf(vlm, vlm.model.language_model, transformers.Gemma3TextConfig,
                                 transformers.Gemma3ForCausalLM, os.path.join(out_dir, "gemma3-text.gguf"), "gemma3",
                                 _gguf_tokenizer(processor.tokenizer, GEMMA3_TEMPLATE))
    proj_path = os.path.join(out_dir, "gemma3-mmproj.gguf")
    p = vlm.model.multi_modal_projector
    v = vlm.config.vision_config
    scale = (v.image_size // v.patch_size) // int(vlm.config.mm_tokens_per_image ** 0.5)
    _write_clip(proj_path, "gemma3", vlm.config, processor.image_processor, vlm.model.vision_tower,
                {"mm.input_projection.weight": p.mm_input_projection_weight,
                 "mm.soft_emb_norm.weight": p.mm_soft_emb_norm.weight + 1},
                {"projector.scale_factor": scale} if scale != 4 else {})
    return text_path, proj_path


def write_qwen_vl_gguf(hf_dir: str, out_dir: str, version: str = "2.5") -> tuple[str, str]:
    """The checkpoint of ``write_qwen2_vl`` as llama.cpp's converter writes it: the language
    model as a "qwen2vl" GGUF (Qwen2.5-VL), "qwen3vl" (Qwen3-VL) or "qwen35" (Qwen3.5) with its tokenizer,
    chat template and M-RoPE sections (``rope.dimension_sections``), and the tower as a
    "qwen2.5vl_merger" / "qwen3vl_merger" projector file: q, k and v split (Qwen2.5-VL), Qwen3-VL's
    deepstack mergers named by the tower layer they read, the
    patch embedding's Conv3D split into two Conv2D kernels, the merger as ``mm.0`` / ``mm.2``
    and ``v.post_ln`` (checked against the files its convert_hf_to_gguf.py writes for these
    checkpoints; its Qwen3.5 text converter needs a tokenizer it knows, so that file is
    pagoda's writer's). Returns (language model, projector) paths."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    qwen3 = version in ("3", "3.5")
    cls = {"2.5": transformers.Qwen2_5_VLForConditionalGeneration, "3": transformers.Qwen3VLForConditionalGeneration,
           "3.5": transformers.Qwen3_5ForConditionalGeneration}[version]
    vlm = cls.from_pretrained(hf_dir).float().eval()
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    images = Qwen2VLImageProcessorPil.from_pretrained(hf_dir)
    sections = list(vlm.config.text_config.rope_parameters["mrope_section"]) + [0]
    tokenizer = _gguf_tokenizer(tok, QWEN2_VL_TEMPLATE)

    def keys(w) -> None:
        tokenizer(w)
        w.add_array(f"{w.arch}.rope.dimension_sections", sections)
        if version == "3":
            w.add_uint32(f"{w.arch}.n_deepstack_layers", len(vlm.config.vision_config.deepstack_visual_indexes))

    text_path = os.path.join(out_dir, f"qwen{version}-text.gguf")
    if version == "3":
        _write_text_gguf(vlm, vlm.model.language_model, transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
                         text_path, "qwen3vl", keys)
    elif qwen3:
        from tests.model.hybrid_qwen3_5 import write_qwen35_gguf

        text_dir = os.path.join(out_dir, "text")
        text = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**vlm.config.text_config.to_dict()))
        state = {f"model.{k}": v for k, v in vlm.model.language_model.state_dict().items()}
        state["lm_head.weight"] = vlm.lm_head.weight
        text.load_state_dict(state)
        text.save_pretrained(text_dir)
        write_qwen35_gguf(text.float().eval(), text_path, text_dir, extra=keys)
    else:
        _write_text_gguf(vlm, vlm.model.language_model, transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
                         text_path, "qwen2vl", keys)
    proj_path = os.path.join(out_dir, f"qwen{version}-mmproj.gguf")
    _write_qwen_clip(proj_path, vlm, images, qwen3)
    return text_path, proj_path


def _write_qwen_clip(path: str, vlm, image_processor, qwen3: bool) -> None:
    from gguf import GGUFWriter

    v = vlm.config.vision_config
    w = GGUFWriter(path, "clip")
    w.add_type("mmproj")
    w.add_bool("clip.has_vision_encoder", True)
    side = int(v.num_position_embeddings ** 0.5) * v.patch_size if qwen3 else 560
    for key, value in (("projection_dim", vlm.config.text_config.hidden_size), ("image_size", side),
                       ("patch_size", v.patch_size), ("embedding_length", v.hidden_size),
                       ("feed_forward_length", v.intermediate_size), ("block_count", v.depth),
                       ("attention.head_count", v.num_heads)):
        w.add_uint32(f"clip.vision.{key}", int(value))
    w.add_array("clip.vision.image_mean", [float(x) for x in image_processor.image_mean])
    w.add_array("clip.vision.image_std", [float(x) for x in image_processor.image_std])
    if qwen3:
        w.add_string("clip.projector_type", "qwen3vl_merger")
        w.add_bool("clip.use_gelu", True)
        w.add_uint32("clip.vision.spatial_merge_size", v.spatial_merge_size)
        w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
        deepstack = list(getattr(v, "deepstack_visual_indexes", None) or [])
        w.add_array("clip.vision.is_deepstack_layers", [i in deepstack for i in range(v.depth)])
    else:
        w.add_string("clip.projector_type", "qwen2.5vl_merger")
        w.add_bool("clip.use_silu", True)
        w.add_uint32("clip.vision.n_wa_pattern", v.fullatt_block_indexes[0] + 1)
        w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
        if v.window_size != 112:   # (llama.cpp's key; its converter writes none: 112 is its default)
            w.add_uint32("clip.vision.window_size", v.window_size)
    parts = {"attn.proj": "attn_out", "norm1": "ln1", "norm2": "ln2", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.linear_fc1": "ffn_up",
             "mlp.linear_fc2": "ffn_down", "attn.qkv": "attn_qkv"}
    other = {"merger.ln_q": "v.post_ln", "merger.norm": "v.post_ln", "merger.mlp.0": "mm.0", "merger.mlp.2": "mm.2",
             "merger.linear_fc1": "mm.0", "merger.linear_fc2": "mm.2", "patch_embed.proj": "v.patch_embd",
             "pos_embed": "v.position_embd"}

    def add(name: str, t) -> None:
        w.add_tensor(name, np.ascontiguousarray(t.detach().float().numpy()))

    for name, t in vlm.model.visual.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if module == "patch_embed.proj" and leaf == "weight":   # Conv3D -> two Conv2D kernels
            add("v.patch_embd.weight", t[:, :, 0])
            add("v.patch_embd.weight.1", t[:, :, 1])
        elif module.startswith("deepstack_merger_list."):   # named by the tower layer each reads
            k, part = module[len("deepstack_merger_list."):].split(".", 1)
            add(f"v.deepstack.{deepstack[int(k)]}.{part.replace('linear_', '')}.{leaf}", t)
        elif module.startswith("blocks."):
            i, part = module[len("blocks."):].split(".", 1)
            if part == "attn.qkv" and not qwen3:   # q, k and v split
                for j, t3 in zip("qkv", t.chunk(3, dim=0)):
                    add(f"v.blk.{i}.attn_{j}.{leaf}", t3)
            else:
                add(f"v.blk.{i}.{parts[part]}.{leaf}", t)
        else:
            add(f"{other[module]}.{leaf}", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_gemma4_gguf(hf_dir: str, out_dir: str) -> tuple[str, str]:
    """The checkpoint of ``write_gemma4`` as llama.cpp's converter writes it: the language
    model as a "gemma4" GGUF with its tokenizer and chat template, and the tower as a
    "gemma4v" projector file (the patch embedding in Conv2D layout, the clipping bounds as
    [1] tensors, the geometry it leaves out to be read from the tensors; checked against the
    converter's output for this checkpoint). Returns (language model, projector) paths."""
    import transformers
    from gguf import GGUFWriter

    vlm = transformers.Gemma4ForConditionalGeneration.from_pretrained(hf_dir).float().eval()
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    text_path = _write_text_gguf(vlm, vlm.model.language_model, transformers.Gemma4TextConfig,
                                 transformers.Gemma4ForCausalLM, os.path.join(out_dir, "gemma4-text.gguf"), "gemma4",
                                 _gguf_tokenizer(tok, GEMMA4_TEMPLATE))
    proj_path = os.path.join(out_dir, "gemma4-mmproj.gguf")
    v = vlm.config.vision_config
    w = GGUFWriter(proj_path, "clip")
    w.add_type("mmproj")
    w.add_bool("clip.has_vision_encoder", True)
    for key, value in (("projection_dim", vlm.config.text_config.hidden_size), ("image_size", 224),
                       ("patch_size", v.patch_size), ("embedding_length", v.hidden_size),
                       ("feed_forward_length", v.intermediate_size), ("block_count", v.num_hidden_layers),
                       ("attention.head_count", v.num_attention_heads)):
        w.add_uint32(f"clip.vision.{key}", int(value))
    w.add_array("clip.vision.image_mean", [0.0, 0.0, 0.0])
    w.add_array("clip.vision.image_std", [1.0, 1.0, 1.0])
    w.add_string("clip.vision.projector_type", "gemma4v")
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    if v.pooling_kernel_size != 3:   # (llama.cpp's key; its converter writes none: 3 is its default)
        w.add_uint32("clip.vision.projector.scale_factor", v.pooling_kernel_size)
    # The processor's budget (70 soft tokens) as llama.cpp's pixel key, which its converter
    # leaves out for Gemma 4 (pagoda then reads 280, the HF processor's default).
    w.add_uint32("clip.vision.image_max_pixels", 70 * (v.patch_size * v.pooling_kernel_size) ** 2)
    parts = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_out", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "ln1", "post_attention_layernorm": "attn_post_norm",
             "pre_feedforward_layernorm": "ln2", "post_feedforward_layernorm": "ffn_post_norm",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    state = {**{f"vision_tower.{k}": t for k, t in vlm.model.vision_tower.state_dict().items()},
             "embed_vision.embedding_projection.weight": vlm.model.embed_vision.embedding_projection.weight}
    for name, t in state.items():
        t = t.detach().float()
        if name.startswith("vision_tower.encoder.layers."):
            i, rest = name[len("vision_tower.encoder.layers."):].split(".", 1)
            module, _, leaf = rest.replace(".linear.weight", ".weight").rpartition(".")
            gguf_name = f"v.blk.{i}.{parts[module]}.{leaf}"
            t = t.reshape(1) if t.dim() == 0 else t
        elif name.endswith("patch_embedder.input_proj.weight"):
            p = v.patch_size
            gguf_name, t = "v.patch_embd.weight", t.reshape(t.shape[0], p, p, 3).permute(0, 3, 1, 2)
        else:
            gguf_name = {"vision_tower.patch_embedder.position_embedding_table": "v.position_embd.weight",
                         "vision_tower.std_bias": "v.std_bias", "vision_tower.std_scale": "v.std_scale",
                         "embed_vision.embedding_projection.weight": "mm.input_projection.weight"}[name]
        w.add_tensor(gguf_name, np.ascontiguousarray(t.numpy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return text_path, proj_path
