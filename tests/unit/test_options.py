"""Every engine option defined once (pagoda/config/engine.py): the command line's groups,
the PAGODA_* variables, --config files and docs/configuration.md all come from the same
fields; each group checks itself; what two groups say together is one table of rules."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from pagoda.config import GROUPS, CacheOptions, EngineConfig, ParallelOptions, SchedulerOptions
from pagoda.config.engine import RULES, Incompatible, Requires
from pagoda.config.options import options_of
from pagoda.entrypoints.cli import build_parser, config_from_args, main, parse_args
from pagoda.entrypoints.options_reference import main as reference_main
from pagoda.entrypoints.options_reference import serve_parser

ROOT = Path(__file__).resolve().parents[2]


def test_every_engine_field_is_an_option_of_one_group():
    declared = [o.name for g in GROUPS for o in options_of(g)]
    assert len(declared) == len(set(declared))
    assert set(declared) == {f.name for f in dataclasses.fields(EngineConfig)}
    for g in GROUPS:
        for o in options_of(g):
            assert o.spec.help, f"{o.name} has no help"


def test_serve_help_is_grouped_by_option_group():
    parser = serve_parser()
    by_title = {g.title: {a.dest for a in g._group_actions} for g in parser._action_groups}
    for group in GROUPS:
        flags = {o.name for o in options_of(group) if o.takes("serve")}
        if flags:
            assert flags <= by_title[group.TITLE], group.TITLE
    assert {"host", "port", "api_key"} <= by_title["server"]
    # the positional model and the aliases are the option's spellings
    args = parse_args(build_parser(with_bench_commands=False), ["serve", "/m.gguf", "-tp", "2", "--no-enable-prefix-caching"],
                      environ={})
    assert (args.model, args.tensor_parallel_size, args.enable_prefix_caching) == ("/m.gguf", 2, False)


def test_serve_only_options_are_not_offered_to_other_commands():
    parser = build_parser(with_bench_commands=False)
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--kv-role", "prefill"])
    args = parser.parse_args(["generate", "--max-num-seqs", "3"])
    assert not hasattr(args, "kv_role") and config_from_args(args).max_num_seqs == 3


def test_config_file_then_environment_then_command_line(tmp_path):
    path = tmp_path / "pagoda.yaml"
    path.write_text("max-model-len: 1024\nmax_num_seqs: 7\nport: 9001\nenable-prefix-caching: false\n"
                    "speculative-config: {method: ngram, num_speculative_tokens: 3}\n")
    parser = build_parser(with_bench_commands=False)
    args = parse_args(parser, ["serve", "--config", str(path), "--max-num-seqs", "9"],
                      environ={"PAGODA_MAX_MODEL_LEN": "2048", "PAGODA_PORT": ""})
    assert args.max_model_len == 2048          # environment over file
    assert args.max_num_seqs == 9              # command line over file
    assert args.port == 9001                   # file over default ("" is unset)
    assert args.enable_prefix_caching is False
    config = config_from_args(args)
    assert config.speculative_config.num_speculative_tokens == 3   # a JSON option written as YAML
    # other commands read a file too (without the server's keys), but not the environment
    engine_only = tmp_path / "engine.yaml"
    engine_only.write_text("max-model-len: 1024\n")
    gen = parse_args(build_parser(with_bench_commands=False), ["generate", f"--config={engine_only}"],
                     environ={"PAGODA_MAX_MODEL_LEN": "2048"})
    assert gen.max_model_len == 1024
    with pytest.raises(ValueError, match="'port' is not an option of this command"):
        parse_args(build_parser(with_bench_commands=False), ["generate", "--config", str(path)], environ={})


@pytest.mark.parametrize(("text", "message"), [
    ("max-model-len: 1024\nmax-num-seqz: 2\n", "'max-num-seqz' is not an option of this command"),
    ("quantization: fp3\n", "quantization: 'fp3' is not one of"),
    ("max-num-seqs: many\n", "max-num-seqs: invalid literal"),
    ("- max-num-seqs\n", "expected a mapping"),
    ("a: [\n", "not valid YAML"),
])
def test_a_bad_config_file_is_a_clear_error(tmp_path, capsys, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert main(["generate", "--config", str(path), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and message in err


def test_a_missing_config_file_is_named(tmp_path, capsys):
    assert main(["generate", "--config", str(tmp_path / "none.yaml")]) == 2
    assert "none.yaml" in capsys.readouterr().err


def test_each_group_checks_itself():
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        CacheOptions(block_size=0)
    with pytest.raises(ValueError, match="scheduling_policy must be fcfs, priority or fair"):
        SchedulerOptions(scheduling_policy="lottery")
    with pytest.raises(ValueError, match=r"node_rank must be in \[0, nnodes=1\)"):
        ParallelOptions(node_rank=1)
    config = EngineConfig(block_size=32, tensor_parallel_size=2)
    assert config.group(CacheOptions).block_size == 32
    assert config.group(ParallelOptions).world_size == 2


def test_rules_have_one_message_shape_and_all_are_reported():
    for rule in RULES:
        assert isinstance(rule, (Incompatible, Requires))
    with pytest.raises(ValueError) as e:
        EngineConfig(pipeline_parallel_size=2, enable_lora=True, kv_cache_dtype="int8")
    parts = str(e.value).split("; ")
    assert parts == ["--pipeline-parallel-size > 1 cannot be combined with --enable-lora: not supported yet",
                     "--pipeline-parallel-size > 1 cannot be combined with --kv-cache-dtype int8: not supported yet"]
    with pytest.raises(ValueError, match="^--preemption-mode swap needs --swap-space"):
        EngineConfig(preemption_mode="swap")


def test_every_rule_can_fire():
    """Each rule is reachable: a config that breaks only it (or it among others) is refused."""
    cases = {
        "--num-threads": dict(num_threads=2, tensor_parallel_size=2),
        "--enable-expert-parallel needs": dict(enable_expert_parallel=True),
        "--nnodes > 1 needs": dict(nnodes=2, tensor_parallel_size=2),
        "--kv-role prefill cannot be combined with --task embed": dict(kv_role="prefill", task="embed"),
        "--speculative-config cannot be combined with --enable-lora": dict(
            speculative_config={"method": "ngram", "num_speculative_tokens": 2}, enable_lora=True),
    }
    for message, kwargs in cases.items():
        with pytest.raises(ValueError, match=message.replace("+", r"\+")):
            EngineConfig(**kwargs)


def test_the_reference_page_is_current(capsys):
    reference_main()
    generated = capsys.readouterr().out
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == generated, ("docs/configuration.md is stale: python -m pagoda.entrypoints.options_reference "
                                    "> docs/configuration.md")
    for group in GROUPS:
        for o in options_of(group):
            if o.spec.cli:
                assert f"`{o.flag}`" in generated or f"`{o.name}` (positional)" in generated
                assert f"`{o.env}`" in generated


def test_help_text_survives_percent_signs():
    parser = serve_parser()
    text = parser.format_help()
    assert "4% of the context length" in text and "1.5% of fp32" in text
    assert isinstance(parser, argparse.ArgumentParser)


def _gguf_of(path, size: int, **bytes_of_type: int) -> str:
    """A GGUF file with one tensor of each named type holding about that many bytes, padded
    (sparse) to ``size`` bytes: the mode's choice reads the types and the size alone."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(path, "llama")
    for i, (name, nbytes) in enumerate(bytes_of_type.items()):
        qtype = gguf.GGMLQuantizationType[name]
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        blocks = max(1, nbytes // block_bytes)
        w.add_tensor(f"t{i}", np.zeros((1, blocks * block_bytes), dtype=np.uint8), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with open(path, "r+b") as f:
        f.truncate(size)
    return str(path)


def test_quantization_auto_picks_the_gguf_mode_for_large_gguf_files_on_the_cpu(tmp_path):
    from pagoda.model.auto_mode import GGUF_MODE_MIN_BYTES, auto_quantization, resolve_quantization

    small = tmp_path / "small.gguf"
    small.write_bytes(b"GGUF" + bytes(1000))
    large = _gguf_of(tmp_path / "large.gguf", GGUF_MODE_MIN_BYTES, Q4_K=60_000, Q6_K=20_000, Q8_0=30_000)
    assert auto_quantization(str(large), "cpu", "auto")[0] == "gguf"
    assert auto_quantization(str(small), "cpu", "auto")[0] == "none"
    assert auto_quantization(str(large), "cuda", "auto")[0] == "none"
    assert auto_quantization(str(large), "cpu", "float16")[0] == "none"
    assert auto_quantization(str(tmp_path), "cpu", "auto")[0] == "none"   # an HF folder
    config = EngineConfig()
    assert config.quantization == "auto"
    resolved, why = resolve_quantization(config, str(large))
    assert resolved.quantization == "gguf" and "gguf mode" in why and "--quantization none" in why
    assert resolved.resolved_kv_cache_dtype == "float16"
    assert resolve_quantization(EngineConfig(quantization="none"), str(large)) == (EngineConfig(quantization="none"),
                                                                                   None)
    # auto is no mode of its own: the bf16 mode and pipeline stages take it
    assert EngineConfig(dtype="bfloat16").quantization == "bf16"
    assert EngineConfig(pipeline_parallel_size=2).quantization == "auto"


def test_quantization_auto_keeps_the_exact_mode_for_files_mostly_of_other_types(tmp_path, monkeypatch):
    """Large GGUF files run in the gguf mode only when most of their quantized bytes are of the
    types it has kernels of its own for (Q4_K, Q6_K, MXFP4; without the repacked layouts,
    PAGODA_GGUF_REPACK=0 or no AVX-512 VNNI): of Q8_0, Q4_0, Q5_K, ... the exact mode is the
    faster there (docs/benchmarks.md). Float tensors are not counted; a file of float tensors
    alone keeps the size rule."""
    from pagoda.model.auto_mode import GGUF_MODE_MIN_BYTES, auto_quantization

    monkeypatch.setenv("PAGODA_GGUF_REPACK", "0")
    size = GGUF_MODE_MIN_BYTES
    q8 = _gguf_of(tmp_path / "q8.gguf", size, Q8_0=100_000, Q6_K=8_000, F32=50_000)
    mode, why = auto_quantization(q8, "cpu", "auto")
    assert mode == "none" and "mostly of Q8_0" in why and "--quantization gguf" in why
    assert auto_quantization(_gguf_of(tmp_path / "q40.gguf", size, Q4_0=60_000, Q4_K=40_000), "cpu", "auto")[0] == "none"
    assert auto_quantization(_gguf_of(tmp_path / "q5k.gguf", size, Q5_K=70_000, Q6_K=30_000), "cpu", "auto")[0] == "none"
    # at least half in those types: the gguf mode; float bytes do not dilute the share
    assert auto_quantization(_gguf_of(tmp_path / "q4km.gguf", size, Q4_K=51_000, Q8_0=49_000), "cpu", "auto")[0] == "gguf"
    assert auto_quantization(_gguf_of(tmp_path / "mx.gguf", size, MXFP4=80_000, F16=400_000, Q8_0=10_000),
                             "cpu", "auto")[0] == "gguf"
    assert auto_quantization(_gguf_of(tmp_path / "f16.gguf", size, F16=100_000), "cpu", "auto")[0] == "gguf"
    # the size rule first: a small file of Q4_K runs exact
    assert auto_quantization(_gguf_of(tmp_path / "small.gguf", 1 << 20, Q4_K=100_000), "cpu", "auto")[0] == "none"
    # a file that is no GGUF at all fails with the reader's error, naming it
    bad = tmp_path / "bad.gguf"
    with open(bad, "wb") as f:
        f.truncate(size)
    with pytest.raises(ValueError, match="bad.gguf: not a GGUF file"):
        auto_quantization(str(bad), "cpu", "auto")


def test_quantization_auto_counts_the_repacked_types_where_they_run(tmp_path, monkeypatch):
    """Where the gguf mode repacks every integer block type into the vector lanes (AVX-512
    VNNI), files mostly of any of them run in the gguf mode (faster there: docs/benchmarks.md);
    a file of types it has no kernels of its own for keeps the exact mode, and without the
    repacking (PAGODA_GGUF_REPACK=0, AVX2 CPUs) the rule counts Q4_K, Q6_K and MXFP4 alone."""
    from pagoda.model.auto_mode import GGUF_MODE_MIN_BYTES, auto_quantization
    from pagoda.ops import cpu_kernels

    if not cpu_kernels.has_avx512_vnni():
        pytest.skip("needs a CPU with AVX-512 VNNI")
    size = GGUF_MODE_MIN_BYTES
    q8 = _gguf_of(tmp_path / "q8.gguf", size, Q8_0=100_000, Q6_K=8_000, F32=50_000)
    assert auto_quantization(q8, "cpu", "auto")[0] == "gguf"
    assert auto_quantization(_gguf_of(tmp_path / "q40.gguf", size, Q4_0=60_000, Q6_K=10_000), "cpu", "auto")[0] == "gguf"
    assert auto_quantization(_gguf_of(tmp_path / "q41.gguf", size, Q4_1=60_000, Q5_0=50_000), "cpu", "auto")[0] == "gguf"
    assert auto_quantization(_gguf_of(tmp_path / "q5k.gguf", size, Q5_K=70_000, Q6_K=30_000), "cpu", "auto")[0] == "gguf"
    q3k = _gguf_of(tmp_path / "q3k.gguf", size, Q3_K=70_000, Q6_K=30_000)
    assert auto_quantization(q3k, "cpu", "auto")[0] == "gguf"
    assert auto_quantization(_gguf_of(tmp_path / "q2k.gguf", size, Q2_K=50_000, Q3_K=40_000), "cpu", "auto")[0] == "gguf"
    assert auto_quantization(_gguf_of(tmp_path / "q50.gguf", size, Q5_0=70_000, Q8_0=30_000), "cpu", "auto")[0] == "gguf"
    assert auto_quantization(_gguf_of(tmp_path / "q51.gguf", size, Q5_1=70_000, IQ4_XS=40_000), "cpu", "auto")[0] == "gguf"
    mode, why = auto_quantization(_gguf_of(tmp_path / "iq3.gguf", size, IQ3_S=70_000, Q6_K=20_000), "cpu", "auto")
    assert mode == "none" and "mostly of IQ3_S" in why and "Q2_K, Q3_K" in why
    monkeypatch.setenv("PAGODA_GGUF_REPACK", "0")
    assert auto_quantization(q8, "cpu", "auto")[0] == "none"
    mode, why = auto_quantization(q3k, "cpu", "auto")
    assert mode == "none" and "Q4_K, Q6_K, MXFP4, the types" in why
