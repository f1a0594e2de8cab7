"""docs/configuration.md, made from the option definitions: ``python -m
pagoda.entrypoints.options_reference > docs/configuration.md`` (a test keeps it current)."""

from __future__ import annotations

import argparse

from pagoda.config import GROUPS
from pagoda.config.options import reference_markdown


def serve_parser() -> argparse.ArgumentParser:
    from pagoda.entrypoints.cli import build_parser

    parser = build_parser(with_bench_commands=False)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def main() -> None:
    print(reference_markdown(serve_parser(), GROUPS, env_commands="`pagoda serve`"), end="")


if __name__ == "__main__":
    main()
