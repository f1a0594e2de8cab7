"""Random-weight pre-quantized HF checkpoints (GPTQ, AWQ, FP8) of real model shapes, for
benchmarks against the GGUF files of pagoda.bench.gguf_files (issue #26).

    python -m pagoda.bench.hf_quant_files llama-3.2-1b OUT_DIR --format gptq|awq|fp8 [--seed N]

The shapes are gguf_files' table (``SHAPES``: their vocabularies replaced by the bundled
tokenizer's 49,152), the dense ones and Qwen3-MoE (every expert quantized, the router in
bfloat16); GPT-OSS is left out (its checkpoints use their own MXFP4 format). Each folder
holds what a quantizer's output holds:

- ``config.json``: the family's architecture (``LlamaForCausalLM``, ``Qwen2ForCausalLM``,
  ``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM``) with the format's ``quantization_config``:
  GPTQ 4 bits, groups of 128, ``sym`` false, ``desc_act`` false (v1 zeros, as AutoGPTQ and
  transformers write them); AWQ GEMM 4 bits, groups of 128, ``zero_point`` true; FP8 e4m3
  with 128 x 128 ``weight_block_size`` blocks and float32 ``weight_scale_inv``, dynamic
  activations;
- ``model.safetensors``: every projection in the format's layout (GPTQ ``qweight`` /
  ``qzeros`` / ``scales`` / ``g_idx``, AWQ's interleaved ``qweight`` / ``qzeros`` /
  ``scales``, FP8 ``weight`` / ``weight_scale_inv``); the embedding, the norms, Qwen2's
  q/k/v biases, the routers and an untied LM head in bfloat16 (quantizers leave them so);
- the bundled model's tokenizer as ``tokenizer.json``, ``tokenizer_config.json`` (its chat
  template, special tokens, ``add_bos_token``), ``special_tokens_map.json`` and
  ``generation_config.json`` (its end-of-generation tokens), so that ``pagoda serve DIR``
  needs no GGUF file.

Weights are random: 4-bit codes are random words (each nibble uniform in 0..15) with
zero-points near the middle (7..8, as a zero-mean weight's asymmetric quantization gets
them) and float16 scales of about 0.02 / 8 per quantum; FP8 codes are e4m3 roundings of
normal values with block scales of about 0.02 / 64 (a weight of standard deviation near
0.02, as gguf_files' random blocks). Speed and memory do not depend on the values; the
activations stay finite.

"The same weights" as the Q4_K_M / Q8_0 GGUF files cannot be literal: random weights of
different formats are different numbers. What is the same is the shape (every tensor's
dimensions, the tied embedding, the tokenizer) and the seed (``--seed``, gguf_files' too).

The file is written tensor by tensor: the safetensors header first (every tensor's dtype,
shape and offset are known from the shape), then each tensor generated and appended, so a
1B checkpoint needs about one tensor's memory, not the model's.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from pagoda.bench.gguf_files import SHAPES, ModelShape

FORMATS = ("gptq", "awq", "fp8")
GROUP_SIZE = 128                 # GPTQ / AWQ input channels per scale
FP8_BLOCK = (128, 128)           # FP8 weight_block_size
STD = 0.02                       # the standard deviation the weights stand for
# AWQ's GEMM packing: nibble k (from the lowest) of a word holds column 8j + AWQ_ORDER[k].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
CONTEXT = 8192                   # max_position_embeddings, as gguf_files' context_length

_ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
                  "qwen3": ("Qwen3ForCausalLM", "qwen3"), "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe")}
_SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int32: "I32",
                       torch.float8_e4m3fn: "F8_E4M3"}


def quantization_config(fmt: str) -> dict:
    """config.json's ``quantization_config`` of a format, as its quantizers write it."""
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": GROUP_SIZE, "sym": False, "desc_act": False,
                "checkpoint_format": "gptq", "damp_percent": 0.01, "static_groups": False,
                "true_sequential": True}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": GROUP_SIZE, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": None}
    if fmt == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(FP8_BLOCK), "modules_to_not_convert": ["lm_head"]}
    raise ValueError(f"format must be one of {', '.join(FORMATS)}; got {fmt!r}")


def hf_config(shape: ModelShape, fmt: str, vocab: int, bos_token_id: int | None, eos_token_id: int | None) -> dict:
    """config.json of a shape (transformers' fields for its family) with the format's quantization."""
    if shape.arch not in _ARCHITECTURES:
        raise ValueError(f"no HF checkpoint writer for architecture {shape.arch!r} "
                         f"(supported: {', '.join(_ARCHITECTURES)})")
    architecture, model_type = _ARCHITECTURES[shape.arch]
    config = {
        "architectures": [architecture], "model_type": model_type, "vocab_size": vocab,
        "hidden_size": shape.hidden, "intermediate_size": shape.ffn, "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_size,
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": shape.rope_theta,
        "max_position_embeddings": CONTEXT, "tie_word_embeddings": shape.tied, "torch_dtype": "bfloat16",
        "attention_bias": shape.qkv_bias, "attention_dropout": 0.0, "initializer_range": STD, "use_cache": True,
        "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
    }
    if shape.arch == "llama":
        config["mlp_bias"] = False
    if shape.arch in ("qwen2", "qwen3", "qwen3moe"):
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=shape.layers)
    if shape.experts:
        config.update(num_experts=shape.experts, num_experts_per_tok=shape.experts_used,
                      moe_intermediate_size=shape.expert_ffn, norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[], output_router_logits=False, router_aux_loss_coef=0.001)
    config["quantization_config"] = quantization_config(fmt)
    return config


# ---- the tensors ----------------------------------------------------------------------

@dataclass(frozen=True)
class Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    make: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


def _normal_bf16(shape: tuple[int, ...], g: torch.Generator, std: float = STD) -> torch.Tensor:
    """bfloat16 normals, made a chunk of rows at a time (an embedding's float32 copy is 4x its size)."""
    out = torch.empty(shape, dtype=torch.bfloat16)
    rows = out.view(shape[0], -1)
    for r0 in range(0, shape[0], 4096):
        r1 = min(shape[0], r0 + 4096)
        rows[r0:r1] = (torch.randn(r1 - r0, rows.shape[1], generator=g) * std).bfloat16()
    return out


def _random_words(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """int32 words of random bits: eight 4-bit codes each, every code uniform in 0..15."""
    return torch.randint(-2 ** 31, 2 ** 31 - 1, shape, generator=g, dtype=torch.int32)


def _pack(codes: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """4-bit codes [..., 8 n] -> int32 [..., n]: nibble k of word j the code of column 8j + order[k]."""
    c = codes.to(torch.int64).reshape(*codes.shape[:-1], -1, 8)
    words = torch.zeros(c.shape[:-1], dtype=torch.int64)
    for k, column in enumerate(order):
        words |= c[..., column] << (4 * k)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)   # the same bits, signed


def _zeros(groups: int, out_f: int, g: torch.Generator) -> torch.Tensor:
    """Zero-points near the middle of 0..15 (7 or 8), as a zero-mean weight's get them."""
    return torch.randint(7, 9, (groups, out_f), generator=g, dtype=torch.int32)


def _scales(groups: int, out_f: int, g: torch.Generator, per_quantum: float) -> torch.Tensor:
    return torch.rand(groups, out_f, generator=g) * per_quantum + per_quantum / 2   # 0.5x .. 1.5x


def projection_entries(fmt: str, prefix: str, out_f: int, in_f: int, g: torch.Generator) -> list[Entry]:
    """The checkpoint tensors of one linear layer ``prefix`` ([out_f, in_f]) in ``fmt``."""
    if fmt in ("gptq", "awq"):
        if in_f % GROUP_SIZE or out_f % 8:
            raise ValueError(f"{prefix}: {out_f} x {in_f} is not whole groups of {GROUP_SIZE} inputs and "
                             "words of 8 outputs")
        groups = in_f // GROUP_SIZE
        scale = STD / 8
        if fmt == "gptq":
            # v1 zeros (stored zero - 1), packed along the outputs in GPTQ's order.
            return [Entry(f"{prefix}.qweight", torch.int32, (in_f // 8, out_f),
                          lambda: _random_words((in_f // 8, out_f), g)),
                    Entry(f"{prefix}.qzeros", torch.int32, (groups, out_f // 8),
                          lambda: _pack((_zeros(groups, out_f, g) - 1) & 15)),
                    Entry(f"{prefix}.scales", torch.float16, (groups, out_f),
                          lambda: _scales(groups, out_f, g, scale).half()),
                    Entry(f"{prefix}.g_idx", torch.int32, (in_f,),
                          lambda: torch.arange(in_f, dtype=torch.int32) // GROUP_SIZE)]
        return [Entry(f"{prefix}.qweight", torch.int32, (in_f, out_f // 8),
                      lambda: _random_words((in_f, out_f // 8), g)),
                Entry(f"{prefix}.qzeros", torch.int32, (groups, out_f // 8),
                      lambda: _pack(_zeros(groups, out_f, g), AWQ_ORDER)),
                Entry(f"{prefix}.scales", torch.float16, (groups, out_f),
                      lambda: _scales(groups, out_f, g, scale).half())]
    if fmt == "fp8":
        b0, b1 = FP8_BLOCK
        blocks = (-(-out_f // b0), -(-in_f // b1))
        # Codes of N(0, 64) (|code| < 448 but for 7-sigma outliers, saturated) times ~0.02 / 64.
        return [Entry(f"{prefix}.weight", torch.float8_e4m3fn, (out_f, in_f),
                      lambda: (torch.randn(out_f, in_f, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)),
                Entry(f"{prefix}.weight_scale_inv", torch.float32, blocks,
                      lambda: _scales(*blocks, g, STD / 64))]
    raise ValueError(f"format must be one of {', '.join(FORMATS)}; got {fmt!r}")


def checkpoint_entries(shape: ModelShape, fmt: str, vocab: int, g: torch.Generator) -> list[Entry]:
    """Every tensor of the checkpoint, layer by layer, with a function making each."""
    h, hd = shape.hidden, shape.head_size
    q_out, kv_out = shape.heads * hd, shape.kv_heads * hd

    def bf16(name: str, dims: tuple[int, ...], ones: bool = False) -> Entry:
        return Entry(name, torch.bfloat16, dims,
                     (lambda: torch.ones(dims, dtype=torch.bfloat16)) if ones else (lambda: _normal_bf16(dims, g)))

    out = [bf16("model.embed_tokens.weight", (vocab, h))]
    for i in range(shape.layers):
        p = f"model.layers.{i}"
        out.append(bf16(f"{p}.input_layernorm.weight", (h,), ones=True))
        for proj, o in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
            out += projection_entries(fmt, f"{p}.self_attn.{proj}", o, h, g)
            if shape.qkv_bias:
                out.append(bf16(f"{p}.self_attn.{proj}.bias", (o,)))
        if shape.qk_norm:
            out += [bf16(f"{p}.self_attn.q_norm.weight", (hd,), ones=True),
                    bf16(f"{p}.self_attn.k_norm.weight", (hd,), ones=True)]
        out += projection_entries(fmt, f"{p}.self_attn.o_proj", h, q_out, g)
        out.append(bf16(f"{p}.post_attention_layernorm.weight", (h,), ones=True))
        if shape.experts:
            out.append(bf16(f"{p}.mlp.gate.weight", (shape.experts, h)))
            for e in range(shape.experts):
                f = shape.expert_ffn
                out += projection_entries(fmt, f"{p}.mlp.experts.{e}.gate_proj", f, h, g)
                out += projection_entries(fmt, f"{p}.mlp.experts.{e}.up_proj", f, h, g)
                out += projection_entries(fmt, f"{p}.mlp.experts.{e}.down_proj", h, f, g)
        else:
            out += projection_entries(fmt, f"{p}.mlp.gate_proj", shape.ffn, h, g)
            out += projection_entries(fmt, f"{p}.mlp.up_proj", shape.ffn, h, g)
            out += projection_entries(fmt, f"{p}.mlp.down_proj", h, shape.ffn, g)
    out.append(bf16("model.norm.weight", (h,), ones=True))
    if not shape.tied:
        out.append(bf16("lm_head.weight", (vocab, h)))
    return out


def write_safetensors(path: str, entries: list[Entry], show_progress: bool = False) -> int:
    """A safetensors file of ``entries``, in their order: the header (known from the dtypes
    and shapes), then each tensor made and written in turn. Returns the file's size."""
    from tqdm import tqdm

    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in entries:
        header[e.name] = {"dtype": _SAFETENSORS_DTYPES[e.dtype], "shape": list(e.shape),
                          "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)   # the data starts 8-aligned
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for e in tqdm(entries, desc=f"writing {os.path.basename(path)}", disable=not show_progress):
                t = e.make()
                if t.dtype != e.dtype or tuple(t.shape) != e.shape:
                    raise AssertionError(f"{e.name}: made {t.dtype} {tuple(t.shape)}, planned {e.dtype} {e.shape}")
                f.write(t.contiguous().view(torch.uint8).numpy().data)   # no copy of the bytes
    except BaseException:
        os.remove(tmp)
        raise
    os.replace(tmp, path)
    return os.path.getsize(path)


# ---- the tokenizer ----------------------------------------------------------------------

def write_tokenizer(out_dir: str, tokenizer_from: str | None = None) -> dict:
    """The GGUF file's tokenizer (default: the bundled model's), as pagoda rebuilds it from
    the file's metadata, saved as an HF fast-tokenizer folder: tokenizer.json, its
    tokenizer_config.json (special tokens, add_bos_token, the chat template),
    special_tokens_map.json and generation_config.json (every end-of-generation token).
    Returns the ids config.json names (vocab, bos, eos)."""
    from pagoda.hub.gguf_file import GGUFFile
    from pagoda.hub.paths import default_model_path
    from pagoda.tokenizer import Tokenizer

    metadata = GGUFFile(tokenizer_from or default_model_path()).metadata
    tok = Tokenizer.from_gguf_metadata(metadata)
    vocab = len(metadata["tokenizer.ggml.tokens"])
    if tok.backend.get_vocab_size(with_added_tokens=True) != vocab:
        raise ValueError(f"the tokenizer's vocabulary repeats token texts ({vocab} tokens in the GGUF file, "
                         f"{tok.backend.get_vocab_size(with_added_tokens=True)} distinct): tokenizer.json cannot "
                         "hold it")
    tok.backend.save(os.path.join(out_dir, "tokenizer.json"))
    specials = {name: tok.id_to_token(i) for name, i in (
        ("bos_token", tok.bos_token_id), ("eos_token", tok.eos_token_id), ("unk_token", tok.unk_token_id),
        ("pad_token", tok.pad_token_id)) if i is not None}
    added = {str(i): {"content": t.content, "lstrip": t.lstrip, "rstrip": t.rstrip, "normalized": t.normalized,
                      "single_word": t.single_word, "special": t.special}
             for i, t in sorted(tok.backend.get_added_tokens_decoder().items())}
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": tok.add_bos_token,
                        "add_eos_token": False, "clean_up_tokenization_spaces": False,
                        "model_max_length": CONTEXT, **specials, "added_tokens_decoder": added}
    if tok.chat_template is not None:
        tokenizer_config["chat_template"] = tok.chat_template
    eos_ids = sorted(tok.eos_token_ids)
    generation = {"bos_token_id": tok.bos_token_id, "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids,
                  "pad_token_id": tok.pad_token_id}
    for name, data in (("tokenizer_config.json", tokenizer_config), ("special_tokens_map.json", specials),
                       ("generation_config.json", generation)):
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, ensure_ascii=False)
    return {"vocab": vocab, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}


# ---- the folder -------------------------------------------------------------------------

def write_checkpoint(out_dir: str, shape_name: str | ModelShape, fmt: str, seed: int = 0,
                     tokenizer_from: str | None = None, show_progress: bool = True) -> str:
    """Write a random-weight ``fmt`` checkpoint folder of a named shape (or any dense or
    Qwen3-MoE ``ModelShape``) to ``out_dir`` (created; an existing checkpoint there is
    replaced). Peak memory: about one tensor."""
    if isinstance(shape_name, str) and shape_name not in SHAPES:
        raise ValueError(f"unknown shape {shape_name!r}; known: {', '.join(SHAPES)}")
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}; got {fmt!r}")
    shape = SHAPES[shape_name] if isinstance(shape_name, str) else shape_name
    if shape.gpt_oss:
        raise ValueError("GPT-OSS shapes are not written as GPTQ / AWQ / FP8 checkpoints (their releases use "
                         "MXFP4 experts; use pagoda.bench.gguf_files --type MXFP4)")
    if shape.arch not in _ARCHITECTURES:
        raise ValueError(f"no HF checkpoint writer for architecture {shape.arch!r} "
                         f"(supported: {', '.join(_ARCHITECTURES)})")
    os.makedirs(out_dir, exist_ok=True)
    ids = write_tokenizer(out_dir, tokenizer_from)
    g = torch.Generator().manual_seed(seed)
    entries = checkpoint_entries(shape, fmt, ids["vocab"], g)
    # config.json last: its presence marks a complete folder.
    config_path = os.path.join(out_dir, "config.json")
    if os.path.exists(config_path):
        os.remove(config_path)
    write_safetensors(os.path.join(out_dir, "model.safetensors"), entries, show_progress)
    config = hf_config(shape, fmt, ids["vocab"], ids["bos_token_id"], ids["eos_token_id"])
    with open(config_path, "w") as f:
        json.dump(config, f, indent=1)
    return out_dir


def iter_shapes() -> Iterator[str]:
    """The named shapes this module writes (gguf_files' table less GPT-OSS)."""
    return (name for name, s in SHAPES.items() if not s.gpt_oss and s.arch in _ARCHITECTURES)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Write random-weight pre-quantized HF checkpoints (GPTQ, AWQ, FP8) "
                                             "of real model shapes, with the bundled tokenizer.")
    ap.add_argument("shape", choices=sorted(iter_shapes()))
    ap.add_argument("out", help="output folder (created)")
    ap.add_argument("--format", required=True, choices=FORMATS)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    write_checkpoint(args.out, args.shape, args.format, seed=args.seed)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
