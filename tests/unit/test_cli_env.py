"""`pagoda serve` flags from PAGODA_<FLAG> environment variables (containers and
orchestrators configure the server so), and the C++ kernels loaded prebuilt from
PAGODA_KERNELS_DIR (the container's runtime stage has no compiler)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagoda.config.options import apply_environment
from pagoda.entrypoints.cli import build_parser, parse_args


def serve_args(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], *argv: str) -> argparse.Namespace:
    for key in [k for k in os.environ if k.startswith("PAGODA_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return parse_args(build_parser(with_bench_commands=False), ["serve", *argv])


def test_variables_are_typed_flag_defaults(monkeypatch):
    args = serve_args(monkeypatch, {
        "PAGODA_MODEL": "/models/m.gguf", "PAGODA_MAX_MODEL_LEN": "4096", "PAGODA_QUANTIZATION": "gguf",
        "PAGODA_ENABLE_LORA": "yes", "PAGODA_ENABLE_PREFIX_CACHING": "off", "PAGODA_HOST": "0.0.0.0",
        "PAGODA_LORA_MODULES": "a=/x b=/y", "PAGODA_API_KEY": "secret",
    })
    assert args.model == "/models/m.gguf"
    assert args.max_model_len == 4096
    assert args.quantization == "gguf"
    assert args.enable_lora is True and args.enable_prefix_caching is False
    assert args.host == "0.0.0.0"
    assert args.lora_modules == [("a", "/x"), ("b", "/y")]
    assert args.api_key == "secret"


def test_the_command_line_wins_and_empty_means_unset(monkeypatch):
    args = serve_args(monkeypatch, {"PAGODA_PORT": "9000", "PAGODA_QUANTIZATION": "", "PAGODA_MODEL": "/env.gguf"},
                      "/cli.gguf", "--port", "8001")
    assert args.port == 8001 and args.model == "/cli.gguf"
    assert args.quantization == "auto"   # the flag's own default


@pytest.mark.parametrize("env, message", [
    ({"PAGODA_QUANTIZATION": "fp3"}, "PAGODA_QUANTIZATION: 'fp3' is not one of"),
    ({"PAGODA_PORT": "eighty"}, "PAGODA_PORT"),
    ({"PAGODA_ENABLE_LORA": "maybe"}, "PAGODA_ENABLE_LORA: expected 1/true/yes/on"),
])
def test_a_bad_value_names_the_variable(monkeypatch, capsys, env, message):
    with pytest.raises(SystemExit) as exit_:
        serve_args(monkeypatch, env)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_variables_naming_no_flag_are_left_alone():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    apply_environment(parser, {"PAGODA_CPU_ISA": "avx2", "PAGODA_THREADS": "3"})
    assert vars(parser.parse_args([])) == {"threads": 3}


def test_prebuilt_kernels_load_from_their_folder(tmp_path):
    from pagoda.ops import cpu_kernels

    if cpu_kernels.kernels() is None:
        pytest.skip(f"no CPU kernels here: {cpu_kernels.error()}")
    installed = cpu_kernels.install(str(tmp_path / "kernels"))
    assert installed.is_file() and installed.parent == tmp_path / "kernels"
    # A fresh process with an empty extension cache: nothing to build from, so the module
    # it runs is the installed file.
    code = ("from pagoda.ops import cpu_kernels as c; m = c.kernels(); "
            "print(m.__file__ if m is not None else c.error()); print(m.avx512_enabled() in (0, 1, True, False))")
    env = dict(os.environ, PAGODA_KERNELS_DIR=str(installed.parent), TORCH_EXTENSIONS_DIR=str(tmp_path / "empty"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         check=False)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split()
    assert lines == [str(installed), "True"]
    assert not (tmp_path / "empty").exists() or not any((tmp_path / "empty").rglob("*.so"))


def test_a_first_build_of_the_kernels_is_said_before_it_starts(tmp_path, monkeypatch, caplog):
    """The first use on a machine compiles the C++ kernels for minutes: a warning says so
    before the compiler starts (and how long it took after); a cached build says nothing."""
    from torch.utils import cpp_extension

    from pagoda.ops import cpu_kernels

    if {"avx2", "fma", "f16c"} - cpu_kernels.cpu_flags():
        pytest.skip("the kernels need AVX2, FMA and F16C")
    monkeypatch.delenv("PAGODA_KERNELS_DIR", raising=False)
    monkeypatch.setattr(cpp_extension, "get_default_build_root", lambda: str(tmp_path))   # (not the real cache)
    said_before: list[bool] = []

    def load(name, build_directory, **kwargs):
        assert Path(build_directory).is_relative_to(tmp_path)
        said_before.append(any("compiling pagoda's CPU kernels" in r.getMessage() for r in caplog.records))
        (Path(build_directory) / f"{name}.so").write_bytes(b"")   # as a finished build leaves it
        return "module"

    monkeypatch.setattr(cpp_extension, "load", load)
    with caplog.at_level("WARNING", logger="pagoda.ops.cpu_kernels"):
        assert cpu_kernels._build() == "module"
        assert said_before == [True]
        assert any("compiled in" in r.getMessage() for r in caplog.records)
        caplog.clear()
        assert cpu_kernels._build() == "module"   # built already: nothing said
        assert said_before == [True, False] and not caplog.records


def test_a_stale_build_lock_is_removed_and_a_live_one_kept(tmp_path):
    """torch waits on its build lock for ever: a lock a killed build left behind (nothing in
    its folder changed for STALE_LOCK_S) is removed; one beside fresh files is a build running."""
    from pagoda.ops.cpu_kernels import STALE_LOCK_S, clear_stale_lock

    lock, obj = tmp_path / "lock", tmp_path / "gguf_blocks.o"
    lock.write_text("")
    obj.write_text("x")
    old = lock.stat().st_mtime - STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    assert not clear_stale_lock(tmp_path) and lock.exists()        # a file changed just now: a live build
    os.utime(obj, (old, old))
    assert clear_stale_lock(tmp_path) and not lock.exists()        # everything old: the build is gone
    assert not clear_stale_lock(tmp_path)                          # no lock, nothing to do
