"""The `pagoda` command: serve, generate, chat, bench."""

from __future__ import annotations

import argparse
import os
import re
import sys

from pagoda.config import EngineConfig

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str) -> int:
    """'4GiB' -> 4294967296, '512M' -> 512000000, '1000' -> 1000."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4GiB, 512MiB, 1000000)")
    unit = (m.group(2) or "").lower().rstrip("b")
    return int(float(m.group(1)) * _UNITS[unit])


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, path


def add_engine_args(p: argparse.ArgumentParser, positional_model: bool = False) -> None:
    if positional_model:
        p.add_argument("model", nargs="?", default=None,
                       help="HF model folder or .gguf file (default: the bundled SmolLM2-135M-Instruct)")
    else:
        p.add_argument("--model", default=None, help="HF model folder or .gguf file (default: bundled SmolLM2)")
    p.add_argument("--dtype", default="auto", help="auto|float32|bfloat16|float16 (auto = float32 on CPU)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--quantization", default="none", choices=("none", "int8"),
                   help="none: exact (weights dequantized to --dtype, reference-equal output); "
                        "int8: dynamic int8 GEMMs on CPU (FBGEMM), 2-3x faster linear layers, "
                        "logits within a few percent of exact")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", type=parse_size, default=None,
                   help="KV cache budget, e.g. 2GiB (default: a quarter of free RAM, at most 4 GiB)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="explicit KV pool size in blocks")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat-template", default=None, help="a Jinja chat template string or file")
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (PEFT format) on top of the model")
    p.add_argument("--max-loras", type=int, default=1,
                   help="LoRA adapters resident at once; one batch mixes requests of up to this many")
    p.add_argument("--max-lora-rank", type=int, default=16, help="largest LoRA rank accepted")


def config_from_args(args: argparse.Namespace, **extra) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        served_model_name=getattr(args, "served_model_name", None),
        dtype=args.dtype,
        quantization=args.quantization,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        num_kv_blocks=args.num_kv_blocks,
        enable_prefix_caching=args.enable_prefix_caching,
        seed=args.seed,
        chat_template=args.chat_template,
        enable_lora=getattr(args, "enable_lora", False),
        max_loras=getattr(args, "max_loras", 1),
        max_lora_rank=getattr(args, "max_lora_rank", 16),
        **extra,
    )


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sampling-seed", type=int, default=None)


def _params(args):
    from pagoda import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed)


def cmd_generate(args: argparse.Namespace) -> int:
    from pagoda import LLM

    llm = LLM(**vars(config_from_args(args)))
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], _params(args))
    else:
        outs = llm.generate(prompts, _params(args))
    for out in outs:
        print(out.outputs[0].text)
        if len(outs) > 1:
            print("---")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from pagoda import LLM

    llm = LLM(**vars(config_from_args(args)))
    history: list[dict] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("pagoda chat: type a message, /reset to start over, Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if line.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        out = llm.chat(history, _params(args), use_tqdm=False)[0].outputs[0]
        print(out.text, flush=True)
        history.append({"role": "assistant", "content": out.text})


def cmd_serve(args: argparse.Namespace) -> int:
    from pagoda.entrypoints.openai.launch import run_server

    if args.api_key is None:
        args.api_key = os.environ.get("PAGODA_API_KEY") or None
    if args.lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    return run_server(args, config_from_args(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", description="LLM inference and serving engine")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(serve, positional_model=True)
    serve.add_argument("--lora-modules", nargs="+", type=_lora_module, default=[], metavar="NAME=PATH",
                       help="LoRA adapters to load at start (needs --enable-lora), each served as model NAME")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--api-key", default=None, help="require this Bearer key on /v1/* (or PAGODA_API_KEY)")
    serve.add_argument("--max-num-queued-requests", type=int, default=None,
                       help="bound on requests waiting for their first token; excess gets 429")
    serve.add_argument("--request-timeout", type=float, default=None, help="seconds; longer requests are aborted")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="on SIGTERM, seconds to let in-flight requests finish")
    serve.add_argument("--uvicorn-log-level", default="warning")
    from pagoda.entrypoints.openai.tool_parsers import DEFAULT_TOOL_PARSER, TOOL_PARSERS

    serve.add_argument("--tool-call-parser", default=DEFAULT_TOOL_PARSER, choices=sorted(TOOL_PARSERS),
                       help="the format tool calls are written in by the model and read from its output "
                            "(hermes: <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>)")
    serve.add_argument("--api-key-on-internal-endpoints", action="store_true",
                       help="require --api-key on /metrics, /dashboard and /debug too (open by default, "
                            "for scrapers; they never show prompt or output text)")
    serve.add_argument("--enable-debug-endpoints", action="store_true",
                       help="add POST /debug/check_integrity (internal, for soak tests; do not expose)")
    serve.add_argument("--disable-log-requests", action="store_true",
                       help="do not log a line (id, queue time, TTFT, tokens, finish reason) per finished request")
    serve.add_argument("--disable-log-stats", action="store_true",
                       help="do not log the periodic throughput / queue / KV cache line")
    serve.add_argument("--log-stats-interval", type=_positive_float, default=10.0,
                       help="seconds between two periodic stats lines while busy")
    serve.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="generate offline from prompts (arguments or stdin lines)")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat message")
    _sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat in the terminal")
    add_engine_args(chat)
    chat.add_argument("--system", default=None, help="system prompt")
    _sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    bench = sub.add_parser("bench", help="benchmarks")
    from pagoda.bench.commands import add_bench_commands

    add_bench_commands(bench.add_subparsers(dest="bench_command", required=True),
                       add_engine_args, config_from_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as e:
        print(f"pagoda: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
