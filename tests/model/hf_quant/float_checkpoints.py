"""Tiny FP8 and FP4 checkpoints for the tests, quantized by code that follows the
formats' definitions (not pagoda's loader): e4m3 weights with float32 scales per tensor,
per channel or per block (DeepSeek-V3), NVFP4's e2m1 codes packed two per byte with an
e4m3 scale per 16 weights under a float32 global scale, MXFP4's with an E8M0 exponent per
32 (compressed-tensors)."""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable

import torch
from safetensors.torch import load_file, save_file

from tests.model.test_reference import pagoda_prompt_logits

E4M3_MAX = 448.0
E2M1_MAX = 6.0
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
PROMPT = [1, 17, 300, 42, 9, 511, 128, 77, 3, 250]

# (name, float32 weight) -> (the checkpoint's tensors for the layer, the dequantized weight)
Quantizer = Callable[[str, torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]


def block_amax(w: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """max |w| over each rows x cols block (the last ones partial): [ceil(out / rows), ceil(in / cols)]."""
    out_f, in_f = w.shape
    padded = torch.zeros(math.ceil(out_f / rows) * rows, math.ceil(in_f / cols) * cols)
    padded[:out_f, :in_f] = w.abs()
    return padded.reshape(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols).amax(dim=(1, 3))


def expand(s: torch.Tensor, rows: int, cols: int, shape: torch.Size) -> torch.Tensor:
    return s.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[: shape[0], : shape[1]]


def fp8_quantizer(rows: int | None, cols: int | None, scale_name: str = "weight_scale_inv",
                  scale_dtype: torch.dtype = torch.float32, extra: dict[str, torch.Tensor] | None = None) -> Quantizer:
    """e4m3 weights, one scale per rows x cols block (None: the whole dimension); the
    scale is amax / 448 in ``scale_dtype``, w_q = saturate(round(w / scale))."""
    def quantize(name: str, w: torch.Tensor):
        r, c = rows or w.shape[0], cols or w.shape[1]
        scale = (block_amax(w, r, c) / E4M3_MAX).clamp_min(1e-12).to(scale_dtype)
        full = expand(scale.float(), r, c, w.shape)
        q = (w / full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        if rows is None and cols is None:
            scale = scale.reshape(())
        elif rows == 1 and cols is None:
            scale = scale.reshape(-1, 1)
        prefix = name[: -len(".weight")]
        tensors = {name: q, f"{prefix}.{scale_name}": scale}
        tensors.update({f"{prefix}.{k}": v.clone() for k, v in (extra or {}).items()})
        return tensors, q.float() * full
    return quantize


def e8m0_fp8_quantizer(rows: int, cols: int) -> Quantizer:
    """Block scales that are powers of two, stored as E8M0 (transformers' scale_fmt ue8m0)."""
    def quantize(name: str, w: torch.Tensor):
        scale = torch.exp2(torch.ceil(torch.log2((block_amax(w, rows, cols) / E4M3_MAX).clamp_min(1e-30))))
        full = expand(scale, rows, cols, w.shape)
        q = (w / full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        prefix = name[: -len(".weight")]
        return {name: q, f"{prefix}.weight_scale_inv": scale.to(torch.float8_e8m0fnu)}, q.float() * full
    return quantize


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """The nearest e2m1 value's 4-bit code (sign bit 3, magnitude index 0-7) of each x."""
    index = (x.abs().clamp(max=E2M1_MAX).unsqueeze(-1) - E2M1).abs().argmin(-1)
    return (index | (x < 0).long() << 3).to(torch.uint8)


def nvfp4_quantizer(extra: dict[str, torch.Tensor] | None = None) -> Quantizer:
    """NVFP4: global scale 448 * 6 / amax (float32); per group of 16 an e4m3 scale
    e4m3(amax_g / 6 * global); codes of w / (scale / global); byte i = code 2i | code 2i+1 << 4."""
    def quantize(name: str, w: torch.Tensor):
        global_scale = (E4M3_MAX * E2M1_MAX / w.abs().max()).reshape(1).float()
        scale = (block_amax(w, 1, 16) / E2M1_MAX * global_scale).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
        step = (scale.float() / global_scale).repeat_interleave(16, 1)
        codes = e2m1_codes(torch.where(step > 0, w / step, torch.zeros_like(w)))
        packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
        values = E2M1[(codes & 7).long()] * torch.where(codes >= 8, -1.0, 1.0)
        prefix = name[: -len(".weight")]
        tensors = {f"{prefix}.weight_packed": packed, f"{prefix}.weight_scale": scale,
                   f"{prefix}.weight_global_scale": global_scale}
        tensors.update({f"{prefix}.{k}": v.clone() for k, v in (extra or {}).items()})
        return tensors, values * step
    return quantize


def mxfp4_quantizer() -> Quantizer:
    """OCP MXFP4 as compressed-tensors stores it: per group of 32 an E8M0 exponent
    e = 127 + floor(log2(amax)) - 2 (e2m1's largest exponent), codes of w / 2^(e - 127)
    (saturating at 6), packed as NVFP4's."""
    def quantize(name: str, w: torch.Tensor):
        amax = block_amax(w, 1, 32).clamp_min(2.0 ** -100)
        exponent = (torch.floor(torch.log2(amax)) - 2).clamp(-127, 127)
        step = torch.exp2(exponent).repeat_interleave(32, 1)
        codes = e2m1_codes(w / step)
        packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
        values = E2M1[(codes & 7).long()] * torch.where(codes >= 8, -1.0, 1.0)
        prefix = name[: -len(".weight")]
        scale = (exponent + 127).to(torch.uint8)
        return {f"{prefix}.weight_packed": packed, f"{prefix}.weight_scale": scale}, values * step
    return quantize


def write_quantized(src: str, dst: str, quantize: Quantizer, qconfig: dict,
                    quantized: Callable[[str], bool] = lambda n: n.endswith(("_proj.weight", "_mqa.weight"))) -> str:
    """``src`` copied to ``dst`` with the weights ``quantized`` names in the format, and
    to ``dst + "-reference"`` with those weights dequantized (float32): the model the
    quantized one must compute. Returns the reference's path."""
    reference = dst + "-reference"
    shutil.copytree(src, dst)
    shutil.copytree(src, reference)
    for f in sorted(os.listdir(src)):
        if not f.endswith(".safetensors"):
            continue
        q_out, ref_out = {}, {}
        for name, t in load_file(os.path.join(src, f)).items():
            if quantized(name):
                tensors, dequantized = quantize(name, t.float())
                q_out.update(tensors)
                ref_out[name] = dequantized
            else:
                q_out[name] = ref_out[name] = t
        save_file(q_out, os.path.join(dst, f), metadata={"format": "pt"})
        save_file(ref_out, os.path.join(reference, f), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as fh:
        config = json.load(fh)
    config["quantization_config"] = qconfig
    with open(os.path.join(dst, "config.json"), "w") as fh:
        json.dump(config, fh)
    return reference


def tiny_dir(tmp_path_factory, name: str, config_class: str, **fields) -> str:
    """A tiny random float32 checkpoint whose dimensions are multiples of 128."""
    import transformers

    config = getattr(transformers, config_class)(
        vocab_size=512, hidden_size=128, intermediate_size=256, head_dim=32, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=256, initializer_range=0.3,
        **fields)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path, safe_serialization=True, max_shard_size="300KB")
    return str(path)


def greedy(model, ids: list[int], steps: int) -> list[int]:
    ids = list(ids)
    for _ in range(steps):
        ids.append(int(pagoda_prompt_logits(model, ids, [len(ids)])[-1].argmax()))
    return ids[-steps:]


def assert_same_model(model, reference) -> None:
    """Logits at every prompt position within 1e-3 (prompt at once and token by token),
    and the same greedy tokens."""
    ref = pagoda_prompt_logits(reference, PROMPT, [len(PROMPT)])
    for chunks in ([len(PROMPT)], [1] * len(PROMPT)):
        got = pagoda_prompt_logits(model, PROMPT, chunks)
        assert (got - ref).abs().max() <= 1e-3, (got - ref).abs().max()
    assert greedy(model, PROMPT, 4) == greedy(reference, PROMPT, 4)
