"""EngineConfig defaults that depend on the device."""

from __future__ import annotations

import pytest

from pagoda.config import EngineConfig


def test_block_size_defaults_to_64_tokens_on_cpu_and_16_on_gpu():
    assert EngineConfig().block_size == 64
    assert EngineConfig(device="cuda").block_size == 16
    assert EngineConfig(device="cuda:1").block_size == 16
    # An explicit size is kept on either device.
    assert EngineConfig(block_size=16).block_size == 16
    assert EngineConfig(device="cuda", block_size=32).block_size == 32
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        EngineConfig(block_size=0)


def test_cli_leaves_the_block_size_to_the_config():
    from pagoda.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve"])
    assert args.block_size is None
    assert build_parser().parse_args(["serve", "--block-size", "32"]).block_size == 32
