"""pagoda's C++ CPU kernels (``pagoda/csrc/*.cpp``, one file per kernel family, declared
in ``kernels.h``), built on first use.

``torch.utils.cpp_extension.load`` compiles the sources once per machine (1-2.5 min on
2 cores) into torch's extension cache and reloads it from there
afterwards; concurrent processes wait on its lock. The kernels need AVX2 and
FMA; where the build fails or the CPU lacks them, ``kernels()`` returns None,
the reason is logged once, and callers use their plain-torch path.
``PAGODA_DISABLE_CPU_KERNELS=1`` forces the plain-torch paths (for comparisons).
Some kernels also have an AVX-512 VNNI version, compiled into the same module and
chosen at run time where the CPU has it (``has_avx512_vnni``);
``PAGODA_CPU_ISA=avx2`` keeps to the AVX2 versions (for comparisons and tests). The gguf
mode's repacked K-quant products of 16+ rows have an AMX int8 version too, chosen where
the CPU has the tiles and Linux grants them; ``PAGODA_CPU_ISA=avx512`` keeps to AVX-512 VNNI.

Images without a compiler (the container's runtime stage) ship the module prebuilt:
``python -m pagoda.ops.cpu_kernels --install DIR`` builds it and copies it into DIR, and
``PAGODA_KERNELS_DIR=DIR`` loads it from there when its name (the sources' hash) matches
these sources; otherwise the usual build runs.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parent.parent / "csrc"
_lock = threading.Lock()
_module: ModuleType | None = None
_error: str | None = None
_tried = False


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where it cannot be read); read
    once (every int8 layer asks at load)."""
    return frozenset(_cpu_flags())


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _build() -> ModuleType:
    flags = _cpu_flags()
    missing = {"avx2", "fma", "f16c"} - flags
    if missing:
        raise RuntimeError(f"the CPU lacks {', '.join(sorted(missing))}")
    import hashlib

    from torch.utils import cpp_extension

    # Every .cpp in pagoda/csrc is a source of the one module. The name carries a hash of
    # every source and header (names and contents), so a changed header (which torch's
    # own check of the sources does not see) or an added file builds afresh.
    sources = sorted(_CSRC.glob("*.cpp"))
    files = sorted(sources + list(_CSRC.glob("*.h")))
    digest = hashlib.sha256(b"".join(p.name.encode() + b"\0" + p.read_bytes() + b"\0" for p in files)).hexdigest()
    name = f"pagoda_cpu_kernels_{digest[:12]}"
    prebuilt = _prebuilt(name)
    if prebuilt is not None:
        return prebuilt
    # One build folder per checkout: the sources' paths are in the build files, so two
    # checkouts of the same sources sharing a folder would rebuild it in turn (and wait on
    # each other's lock).
    place = hashlib.sha256(str(_CSRC.resolve()).encode()).hexdigest()[:8]
    build_dir = Path(cpp_extension.get_default_build_root()) / name / place
    build_dir.mkdir(parents=True, exist_ok=True)
    clear_stale_lock(build_dir)
    fresh = not (build_dir / f"{name}.so").exists()
    if fresh:
        # The first use on a machine compiles them (for minutes, before anything else moves):
        # say so first.
        logger.warning("compiling pagoda's CPU kernels for this machine, once: about 1-2.5 minutes on 2 cores "
                       "(cached in %s; `python -m pagoda.ops.cpu_kernels --install DIR` with PAGODA_KERNELS_DIR=DIR "
                       "builds them ahead)", build_dir)
    start = time.monotonic()
    module = cpp_extension.load(
        name=name,
        sources=[str(p) for p in sources],
        build_directory=str(build_dir),
        # No FMA contraction of plain C++ arithmetic: the elementwise ops then round as
        # torch's do (the kernels' explicit FMA intrinsics are unaffected).
        extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off"],
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )
    if fresh:
        logger.warning("pagoda's CPU kernels compiled in %.0f s", time.monotonic() - start)
    return module


# A build takes 1-2.5 minutes on 2 cores and writes its objects as it goes.
STALE_LOCK_S = 600.0


def clear_stale_lock(build_dir: Path, now: float | None = None) -> bool:
    """Remove torch's build lock in ``build_dir`` when the build that took it is gone: the
    lock and every file beside it untouched for STALE_LOCK_S (a build that was killed).
    torch waits on a lock for ever, so a start after a killed build would hang. Returns
    whether it removed one."""
    lock = build_dir / "lock"
    now = time.time() if now is None else now
    try:
        newest = max(p.stat().st_mtime for p in build_dir.iterdir())
    except (OSError, ValueError):
        return False
    if not lock.exists() or now - newest < STALE_LOCK_S:
        return False
    logger.warning("removing a stale build lock %s: nothing in its folder changed for %.0f minutes (a build that "
                   "was stopped)", lock, (now - newest) / 60)
    lock.unlink(missing_ok=True)
    return True


def _prebuilt(name: str) -> ModuleType | None:
    """The module built for these sources in ``PAGODA_KERNELS_DIR``, if there is one."""
    folder = os.environ.get("PAGODA_KERNELS_DIR")
    path = Path(folder) / f"{name}.so" if folder else None
    if path is None or not path.is_file():
        return None
    import importlib.util

    import torch  # noqa: F401  (the module links against torch's libraries, loaded first)

    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as e:   # built against another Python or torch: built here instead
        logger.warning("the prebuilt kernels %s do not load here (%s): building them", path, e)
        return None
    return module


def install(folder: str) -> Path:
    """Builds the module (or finds it built) and copies it into ``folder``; returns its path."""
    import shutil

    module = _build()
    target = Path(folder) / Path(module.__file__).name
    target.parent.mkdir(parents=True, exist_ok=True)
    if Path(module.__file__).resolve() != target.resolve():
        shutil.copy2(module.__file__, target)
    return target


def kernels() -> ModuleType | None:
    """The compiled module, or None when it is unavailable (reason in ``error()``)."""
    global _module, _error, _tried
    if _tried:
        return _module
    with _lock:
        if _tried:
            return _module
        if os.environ.get("PAGODA_DISABLE_CPU_KERNELS") == "1":
            _error = "disabled by PAGODA_DISABLE_CPU_KERNELS=1"
        else:
            try:
                _module = _build()
            except Exception as exc:  # a compiler error, a missing ninja, an old CPU
                _error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc}"
                logger.warning("pagoda CPU kernels unavailable (%s); using plain torch", _error)
        _tried = True
        return _module


def error() -> str | None:
    return _error


def has_avx512_vnni() -> bool:
    """Whether the kernels' AVX-512 VNNI versions run here: the module is built, the CPU
    has AVX-512 (F, BW, DQ, VL) with VNNI, and ``PAGODA_CPU_ISA`` is not ``avx2``."""
    module = kernels()
    return module is not None and bool(module.avx512_enabled())


def use_decode_kernel(device, kv_dtype, model_dtype) -> bool:
    """Whether decode attention runs the in-place kernel: CPU, float32 queries, float32,
    float16 or int8 K/V (``kv_dtype``: the cache's storage type)."""
    import torch

    return (
        torch.device(device).type == "cpu"
        and kv_dtype in (torch.float32, torch.float16, torch.int8)
        and model_dtype == torch.float32
        and kernels() is not None
    )


# Linux x86-64: arch_prctl's system call and the request for the AMX tile data state.
_SYS_ARCH_PRCTL = 158
_ARCH_GET_XCOMP_PERM, _ARCH_REQ_XCOMP_PERM = 0x1022, 0x1023
_XFEATURE_XTILEDATA = 18


@functools.lru_cache(maxsize=1)
def amx_permitted() -> bool | None:
    """None where the CPU has no AMX; else whether this process may use the tiles. Linux
    hands the tile state to a process only on request (``arch_prctl(ARCH_REQ_XCOMP_PERM)``);
    oneDNN asks for it itself, and a refusal (an old kernel, a seccomp filter) silently
    sends its bf16 / int8 GEMMs to the AVX-512 paths, so pagoda asks once and says so."""
    if not {"amx_tile", "amx_bf16"} <= cpu_flags():
        return None
    import ctypes
    import platform

    if platform.machine() != "x86_64":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) != 0:
        return False
    granted = ctypes.c_ulong(0)
    libc.syscall(_SYS_ARCH_PRCTL, _ARCH_GET_XCOMP_PERM, ctypes.byref(granted))
    return bool(granted.value & (1 << _XFEATURE_XTILEDATA))


def onednn_units(kind: str) -> str:
    """The units oneDNN's ``kind`` (``bf16`` or ``int8``) GEMMs run on here, for the start-up
    log: what the CPU has, capped by ``ONEDNN_MAX_CPU_ISA`` where it is set."""
    flags = cpu_flags()
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    uncapped = cap in ("", "ALL", "DEFAULT")
    amx_ok = (uncapped or "AMX" in cap) and amx_permitted()
    if kind == "bf16":
        if amx_ok and "amx_bf16" in flags:
            return "AMX bf16 tiles"
        if "avx512_bf16" in flags and (uncapped or "BF16" in cap or "AMX" in cap):
            return "AVX512_BF16 dot products"
        return "float32 FMA (no bf16 units: converted)"
    if amx_ok and "amx_int8" in flags:
        return "AMX int8 tiles"
    if flags & {"avx512_vnni", "avx_vnni"} and cap not in ("AVX2", "AVX", "SSE41"):
        return "VNNI dot products"
    return "AVX2 integer multiply-adds"



if __name__ == "__main__":
    import argparse

    # Also run as a plain script (`python pagoda/ops/cpu_kernels.py --build`, which needs torch
    # and ninja alone, not the package's other dependencies): `make install` compiles the
    # kernels so while the rest of the dev environment installs.
    parser = argparse.ArgumentParser(description="build pagoda's CPU kernels ahead of use")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--install", metavar="DIR", help="copy the built module into DIR")
    what.add_argument("--build", action="store_true",
                      help="build them into torch's extension cache (what the first start would do)")
    args = parser.parse_args()
    if args.build:
        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        built = kernels()
        print(built.__file__ if built is not None else f"no CPU kernels here: {error()}")
    else:
        print(install(args.install))
