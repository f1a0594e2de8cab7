"""OpenVINO GenAI, offline, on token ids: run by compare.py with the OpenVINO venv's python
(`<cache>/openvino-venv`, see peers.install_openvino), never in pagoda's venv.

    python ov_runner.py SPEC.json        # prints one JSON line (the last line of stdout)

SPEC: {"model_dir": an IR folder from peers.openvino_ir, "variant": "fp32-f32" | "fp32" |
"int8" | "int4", "mode": "throughput" | "latency", "prompts": [[token ids], ...],
"output_len": N, "max_num_seqs": C}.

- throughput: every prompt handed at once to one ContinuousBatchingPipeline.generate()
  (greedy, ignore_eos, max_new_tokens = output_len), at most C sequences scheduled at a time
  (SchedulerConfig.max_num_seqs: the counterpart of a served run's max concurrency).
- latency: one prompt after another through LLMPipeline (single stream); a streamer
  timestamps the first token of each (TTFT) and the others (TPOT).

Variants: fp32-f32 is the fp32 IR run in f32 (INFERENCE_PRECISION_HINT f32 and an f32 KV
cache: the full-precision counterpart of pagoda's and HF's fp32); fp32 is the fp32 IR at
OpenVINO's CPU defaults (bf16 inference on CPUs with bf16/AMX, u8 KV cache); int8 and int4
are the weight-compressed IRs at the same defaults (activations dynamically quantised).
Threads are OpenVINO's own choice (all cores). One warm-up generate() first, discarded.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import openvino as ov
import openvino_genai as ov_genai

from runner_stats import peak_rss_mb, summary

# variant -> CPU properties given to the pipeline (the rest stay at OpenVINO's defaults)
VARIANT_PROPERTIES = {
    "fp32-f32": {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"},
    "fp32": {},
    "int8": {},
    "int4": {},
}
PIPELINES = {"latency": "LLMPipeline, single stream", "throughput": "ContinuousBatchingPipeline"}
REPORTED = ("INFERENCE_NUM_THREADS", "INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION",
            "NUM_STREAMS", "PERFORMANCE_HINT", "DYNAMIC_QUANTIZATION_GROUP_SIZE")


def greedy_config(output_len: int) -> ov_genai.GenerationConfig:
    cfg = ov_genai.GenerationConfig()
    cfg.max_new_tokens = output_len
    cfg.min_new_tokens = output_len
    cfg.ignore_eos = True
    cfg.do_sample = False
    return cfg


def ids_tensor(ids: list[int]) -> ov.Tensor:
    return ov.Tensor(np.asarray([ids], dtype=np.int64))


def _text(value: object) -> str:
    return value.get_type_name() if isinstance(value, ov.Type) else str(value)


def cpu_properties(props: dict[str, str]) -> dict[str, str]:
    """What the CPU plugin resolves for a model compiled with the pipeline's properties:
    threads, precisions, streams. The pipelines do not expose their compiled model, so a
    one-op model stands in (these values depend on the properties and the CPU, not on the
    model)."""
    core = ov.Core()
    x = ov.opset13.parameter([1, 8], ov.Type.f32)
    compiled = core.compile_model(ov.Model([ov.opset13.relu(x)], [x]), "CPU", props)
    out = {}
    for key in REPORTED:
        try:
            out[key] = _text(compiled.get_property(key))
        except RuntimeError:
            try:
                out[key] = _text(core.get_property("CPU", key))
            except RuntimeError:
                pass
    out["OPTIMIZATION_CAPABILITIES"] = " ".join(core.get_property("CPU", "OPTIMIZATION_CAPABILITIES"))
    return out


class TimingStreamer(ov_genai.StreamerBase):
    """Timestamps of every write (a token, or a list of them) since start(): the first is
    the TTFT, the rest the TPOT."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[tuple[float, int]] = []

    def start(self) -> None:
        self.times = []
        self.t0 = time.perf_counter()

    def write(self, token):  # noqa: ANN001 (int or list of ints)
        n = len(token) if isinstance(token, (list, tuple)) else 1
        self.times.append((time.perf_counter(), n))
        return ov_genai.StreamingStatus.RUNNING

    def end(self) -> None:
        pass


def run_throughput(spec: dict, props: dict[str, str]) -> dict:
    sched = ov_genai.SchedulerConfig()
    sched.max_num_seqs = int(spec["max_num_seqs"])
    t0 = time.perf_counter()
    pipe = ov_genai.ContinuousBatchingPipeline(spec["model_dir"], sched, "CPU", props)
    load_s = time.perf_counter() - t0
    prompts, out_len = spec["prompts"], int(spec["output_len"])
    pipe.generate([ids_tensor(prompts[0][:16])], [greedy_config(4)])   # warm-up, discarded
    tensors = [ids_tensor(p) for p in prompts]
    configs = [greedy_config(out_len)] * len(prompts)
    start = time.perf_counter()
    results = pipe.generate(tensors, configs)
    elapsed = time.perf_counter() - start
    tokens = [list(r.m_generation_ids[0]) for r in results]
    return {"elapsed_s": elapsed, "load_s": load_s, "tokens": tokens,
            "scheduler": {"max_num_seqs": sched.max_num_seqs, "max_num_batched_tokens": sched.max_num_batched_tokens,
                          "dynamic_split_fuse": sched.dynamic_split_fuse, "cache_size": sched.cache_size,
                          "enable_prefix_caching": sched.enable_prefix_caching}}


def run_latency(spec: dict, props: dict[str, str]) -> dict:
    t0 = time.perf_counter()
    pipe = ov_genai.LLMPipeline(spec["model_dir"], "CPU", **props)
    load_s = time.perf_counter() - t0
    prompts, out_len = spec["prompts"], int(spec["output_len"])
    pipe.generate(ids_tensor(prompts[0][:16]), greedy_config(4))      # warm-up, discarded
    cfg, streamer = greedy_config(out_len), TimingStreamer()
    ttft, tpot, e2e, tokens = [], [], [], []
    start = time.perf_counter()
    for p in prompts:
        streamer.start()
        res = pipe.generate(ids_tensor(p), cfg, streamer)
        done = time.perf_counter()
        first = streamer.times[0][0] if streamer.times else done
        ttft.append((first - streamer.t0) * 1000)
        e2e.append((done - streamer.t0) * 1000)
        n = len(res.tokens[0])
        if n > 1:
            tpot.append((done - first) * 1000 / (n - 1))
        tokens.append(list(res.tokens[0]))
    elapsed = time.perf_counter() - start
    return {"elapsed_s": elapsed, "load_s": load_s, "tokens": tokens, "ttft": ttft, "tpot": tpot, "e2e": e2e}


def main(argv: list[str]) -> int:
    with open(argv[1]) as f:
        spec = json.load(f)
    variant, mode = spec["variant"], spec["mode"]
    props = VARIANT_PROPERTIES[variant]
    r = run_latency(spec, props) if mode == "latency" else run_throughput(spec, props)
    prompts = spec["prompts"]
    n_in = sum(map(len, prompts))
    n_out = sum(map(len, r["tokens"]))
    elapsed = r["elapsed_s"]
    out = {
        "engine": f"openvino-genai {variant} ({PIPELINES[mode]})",
        "variant": variant, "mode": mode, "model_dir": spec["model_dir"],
        "num_prompts": len(prompts), "input_tokens": n_in, "output_tokens": n_out,
        "elapsed_s": round(elapsed, 3), "load_s": round(r["load_s"], 3),
        "requests_per_s": round(len(prompts) / elapsed, 3),
        "output_tokens_per_s": round(n_out / elapsed, 2),
        "total_tokens_per_s": round((n_in + n_out) / elapsed, 2),
        "peak_rss_mb": peak_rss_mb(),
        "openvino_version": ov.get_version(), "openvino_genai_version": ov_genai.get_version(),
        "properties_set": props, "cpu_properties": cpu_properties(props),
        "first_tokens": r["tokens"][0][:16],
    }
    if "scheduler" in r:
        out["scheduler"] = r["scheduler"]
    if mode == "latency":
        out.update(ttft_ms=summary(r["ttft"]), e2el_ms=summary(r["e2e"]))
        if r["tpot"]:
            out["tpot_ms"] = summary(r["tpot"])
    if spec.get("return_tokens"):
        out["tokens"] = r["tokens"]
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
