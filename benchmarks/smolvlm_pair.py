"""Issue #50's checkpoint: a SmolVLM-256M-shaped Idefics3 model with random weights, as an
HF folder and as the GGUF + mmproj pair llama.cpp's own converter writes from it.

The shapes are SmolVLM-256M-Instruct's: a SigLIP tower of 12 layers, 768 wide, 512-pixel
tiles of 16-pixel patches, a pixel shuffle of 4 (64 image tokens a tile), SmolLM2-135M's
language model (30 layers, 576 wide), images resized to a longest edge of 2048 and split
into 512-pixel tiles plus a global one (a 384x384 image: 16 tiles + 1, 1,088 image tokens).
The tokenizer is the bundled SmolLM2 one with SmolVLM's image tokens added.

    python benchmarks/smolvlm_pair.py OUT_DIR [--text-type q8_0] [--mmproj-type f16]

writes OUT_DIR/hf (the folder), OUT_DIR/smolvlm-256m-<type>.gguf and
OUT_DIR/mmproj-smolvlm-256m-<type>.gguf, using convert_hf_to_gguf.py from the llama.cpp
sources `compare.py install llama-server` unpacked (its gguf-py on the path).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import peers  # noqa: E402  (benchmarks/peers.py)


def write_hf(out: str) -> str:
    import torch
    import transformers
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    from tests.multimodal.checkpoints import IDEFICS3_TEMPLATE, _tokenizer

    tok = _tokenizer(["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
                     + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)])
    text = dict(vocab_size=len(tok), hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5,
                rope_theta=100000.0, tie_word_embeddings=False, architectures=["VLlama3ForCausalLM"])
    vision = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                  image_size=512, patch_size=16)
    config = transformers.Idefics3Config(text_config=text, vision_config=vision, scale_factor=4,
                                         image_token_id=tok.convert_tokens_to_ids("<image>"),
                                         architectures=["Idefics3ForConditionalGeneration"])
    torch.manual_seed(0)
    transformers.Idefics3ForConditionalGeneration(config).to(torch.bfloat16).eval().save_pretrained(out)
    images = Idefics3ImageProcessorPil(size={"longest_edge": 2048}, max_image_size={"longest_edge": 512},
                                       do_image_splitting=True)
    transformers.Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=64,
                                   chat_template=IDEFICS3_TEMPLATE).save_pretrained(out)
    # llama.cpp's converter picks the language model's class from text_config.architectures.
    with open(os.path.join(out, "config.json")) as f:
        saved = json.load(f)
    saved["text_config"]["architectures"] = ["VLlama3ForCausalLM"]
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(saved, f, indent=2)
    return out


def convert(hf: str, out: str, outtype: str, mmproj: bool, cache: str) -> str:
    sources = sorted(glob.glob(os.path.join(cache, "src", "llama_cpp_python-*", "vendor", "llama.cpp")))
    if not sources:
        raise SystemExit("llama.cpp's sources are missing: run `benchmarks/compare.py install llama-server` first")
    src = sources[-1]
    cmd = [sys.executable, os.path.join(src, "convert_hf_to_gguf.py"), hf, "--outfile", out, "--outtype", outtype]
    if mmproj:
        cmd.append("--mmproj")
    env = {**os.environ, "PYTHONPATH": os.path.join(src, "gguf-py")}
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--text-type", default="q8_0", help="the language model's --outtype")
    ap.add_argument("--mmproj-type", default="f16", help="the projector file's --outtype")
    ap.add_argument("--cache-dir", default=peers.DEFAULT_CACHE)
    args = ap.parse_args(argv)
    hf = os.path.join(args.out, "hf")
    if not os.path.isfile(os.path.join(hf, "config.json")):
        write_hf(hf)
    text = os.path.join(args.out, f"smolvlm-256m-{args.text_type}.gguf")
    proj = os.path.join(args.out, f"mmproj-smolvlm-256m-{args.mmproj_type}.gguf")
    if not os.path.isfile(text):
        convert(hf, text, args.text_type, False, args.cache_dir)
    if not os.path.isfile(proj):
        convert(hf, proj, args.mmproj_type, True, args.cache_dir)
    print(json.dumps({"hf": hf, "gguf": text, "mmproj": proj}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
