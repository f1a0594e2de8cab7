"""`pagoda serve` starts its engine core before the API process imports torch, so the two
processes' start-up (torch in each, the weights in the core) overlaps on the machine's
cores. These tests hold the API side's modules to that: importing them, building the
CLI's parser and the tokenizer must not import torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


def _torch_imported_by(code: str) -> tuple[bool, str]:
    """Runs ``code`` in a fresh interpreter: whether torch got imported, and its output."""
    script = textwrap.dedent(code) + "\nimport sys\nprint('torch imported:', 'torch' in sys.modules)\n"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().endswith("torch imported: True"), out.stdout + out.stderr


def test_serve_path_imports_no_torch(default_model_path):
    imported, out = _torch_imported_by(f"""
        from pagoda.entrypoints.cli import build_parser, config_from_args
        args = build_parser(with_bench_commands=False).parse_args(["serve", {default_model_path!r}])
        config = config_from_args(args)
        import pagoda.engine.core_proc, pagoda.engine.async_llm, pagoda.entrypoints.openai.server
        from pagoda.tokenizer import load_tokenizer
        assert load_tokenizer(config).encode("hello")
    """)
    assert not imported, out


def test_lazy_packages_still_export_their_names():
    """The packages made lazy for this give the same names as before, on first use."""
    imported, out = _torch_imported_by("""
        from pagoda.spec_decode import SpeculativeConfig
        from pagoda.structured_output import GrammarError
        from pagoda.entrypoints.openai import serve
        from pagoda.spec_decode import build_proposer, NgramProposer
        from pagoda.structured_output import StructuredOutputManager
        import pagoda.spec_decode as s
        try:
            s.no_such_name
        except AttributeError as e:
            assert "no_such_name" in str(e)
        else:
            raise AssertionError("no AttributeError")
    """)
    assert imported, out  # build_proposer and the manager need torch: imported when asked for


@pytest.fixture
def default_model_path():
    from pagoda.hub.paths import default_model_path

    return default_model_path()
