"""The `pagoda` command: serve, router, generate, chat, run, list, ps, bench."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping

from pagoda.config import GROUPS, EngineConfig
from pagoda.config.options import (
    add_option_groups,
    apply_config_file,
    apply_environment,
    config_file_argument,
    option_values,
)
from pagoda.config.pooling import POOLING_TYPES
from pagoda.config.units import parse_size, positive_float

def _lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, path


def add_engine_args(p: argparse.ArgumentParser, positional_model: bool = False,
                    command: str | None = None) -> dict[str, argparse._ArgumentGroup]:
    """The engine's options (pagoda/config/engine.py), one argument group per option group,
    and the command-line spellings that fold into options (--master-addr/--master-port,
    --pooling-type, --normalize, --matryoshka-dimensions)."""
    p.add_argument("--config", default=None, metavar="FILE.yaml",
                   help="read options from a YAML file (keys as the flags: max-model-len: 4096); the environment "
                        "(PAGODA_<OPTION>) and the command line win over it")
    groups = add_option_groups(p, GROUPS, command, positional=("model",) if positional_model else ())
    model = groups["ModelOptions"]
    model.add_argument("--pooling-type", default=None, choices=POOLING_TYPES,
                       help="--task embed: pool the last token's, the mean of all, or the first token's hidden "
                            "state (default: the checkpoint's sentence-transformers config, else LAST)")
    model.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                       help="--task embed: L2-normalise vectors (default: the checkpoint's Normalize module in a "
                            "sentence-transformers layout, else on)")
    model.add_argument("--matryoshka-dimensions", default=None, metavar="any|N,N,...",
                       help="--task embed: let requests ask for truncated vectors ('dimensions'): any width, or "
                            "only these (default: the checkpoint's is_matryoshka / matryoshka_dimensions)")
    par = groups["ParallelOptions"]
    par.add_argument("--master-addr", default=None, help="node 0's address for the rendezvous")
    par.add_argument("--master-port", type=int, default=None, help="node 0's rendezvous port")
    return groups


def _init_method(args: argparse.Namespace) -> str | None:
    init = getattr(args, "distributed_init_method", None)
    addr, port = getattr(args, "master_addr", None), getattr(args, "master_port", None)
    if addr is None and port is None:
        return init
    if init is not None:
        raise ValueError("give either --distributed-init-method or --master-addr/--master-port, not both")
    if addr is None or port is None:
        raise ValueError("--master-addr and --master-port go together")
    return f"tcp://{addr}:{port}"


def _pooler_overrides(args: argparse.Namespace) -> dict | str | None:
    """--override-pooler-config with --pooling-type / --normalize / --matryoshka-dimensions on top."""
    from pagoda.pooling import PoolerOverrides

    base = PoolerOverrides.parse(getattr(args, "override_pooler_config", None)) or PoolerOverrides()
    fields = {k: v for k, v in vars(base).items() if v is not None}
    if getattr(args, "pooling_type", None) is not None:
        fields["pooling_type"] = args.pooling_type
    if getattr(args, "normalize", None) is not None:
        fields["normalize"] = args.normalize
    dims = getattr(args, "matryoshka_dimensions", None)
    if dims is not None:
        fields["is_matryoshka"] = True
        if dims.strip().lower() != "any":
            fields["matryoshka_dimensions"] = dims
    return fields or None


def config_from_args(args: argparse.Namespace, **extra) -> EngineConfig:
    if getattr(args, "data_parallel_size", 1) > 1 and getattr(args, "command", None) != "serve" \
            and "data_parallel_size" not in extra:
        raise ValueError("--data-parallel-size applies to `pagoda serve` (and bench serve) only")
    values = option_values(args, GROUPS)
    values["distributed_init_method"] = _init_method(args)
    values["override_pooler_config"] = _pooler_overrides(args)
    return EngineConfig(**{**values, **extra})


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
    try:
        if args.chat:
            outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], _params(args))
        else:
            outs = llm.generate(prompts, _params(args))
    finally:
        llm.shutdown()
    for out in outs:
        print(out.outputs[0].text)
        if len(outs) > 1:
            print("---")
    return 0


def cmd_run_batch(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from pagoda.entrypoints.openai.batch.offline import BatchFileError, run_batch_file
    from pagoda.entrypoints.openai.launch import default_served_model_name
    from pagoda.hub.fetch import localize

    config = localize(config_from_args(args))
    try:
        ok, failed = asyncio.run(run_batch_file(config, args.input_file, args.output_file,
                                                default_served_model_name(config), args.max_concurrency))
    except BatchFileError as e:
        print(f"pagoda run-batch: {e}", file=sys.stderr)
        return 2
    logging.getLogger("pagoda").info("run-batch: %d requests succeeded, %d failed", ok, failed)
    print(f"pagoda run-batch: {ok} succeeded, {failed} failed -> {args.output_file}", file=sys.stderr)
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

    if args.lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    if args.allow_runtime_lora and not args.enable_lora:
        raise ValueError("--allow-runtime-lora needs --enable-lora")
    if args.allow_runtime_lora and not args.lora_root:
        raise ValueError("--allow-runtime-lora needs at least one --lora-root DIR (the folders adapters may be "
                         "loaded from)")
    if args.lora_root and not args.allow_runtime_lora:
        raise ValueError("--lora-root is for --allow-runtime-lora (adapters loaded at run time)")
    from pagoda.hub.fetch import localize

    return run_server(args, localize(config_from_args(args)))


def cmd_warmup(args: argparse.Namespace) -> int:
    """Build what pagoda builds on first use (its C++ CPU kernels), so that the first
    `pagoda serve` starts at once; `make install` runs it."""
    import time

    from pagoda.ops import cpu_kernels

    start = time.monotonic()
    module = cpu_kernels.kernels()
    if module is None:
        print(f"pagoda warmup: no CPU kernels here ({cpu_kernels.error()}); the engine uses its plain-torch paths")
        return 0
    print(f"pagoda warmup: CPU kernels ready in {time.monotonic() - start:.0f} s ({module.__file__})")
    return 0


def cmd_router(args: argparse.Namespace) -> int:
    from pagoda.entrypoints.kv_transfer.router import run_router

    return run_router(args)


def _add_server_args(serve: argparse.ArgumentParser, groups: dict[str, argparse._ArgumentGroup]) -> None:
    """``pagoda serve``'s own flags (the HTTP server's, not the engine's), in groups."""
    http = serve.add_argument_group("server", "The HTTP server: address, keys, limits, shutdown.")
    http.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    http.add_argument("--port", type=int, default=8000, help="the port to listen on")
    http.add_argument("--api-key", default=None, help="require this Bearer key on /v1/* (or PAGODA_API_KEY)")
    http.add_argument("--api-key-on-internal-endpoints", action="store_true",
                      help="require --api-key on /metrics, /dashboard and /debug too (open by default, for "
                           "scrapers; they never show prompt or output text)")
    http.add_argument("--max-num-queued-requests", type=int, default=None,
                      help="bound on requests waiting for their first token; excess gets 429")
    http.add_argument("--request-timeout", type=float, default=None, help="seconds; longer requests are aborted")
    http.add_argument("--shutdown-timeout", type=float, default=30.0,
                      help="on SIGTERM, seconds to let in-flight requests finish")
    http.add_argument("--uvicorn-log-level", default="warning", help="uvicorn's log level")
    http.add_argument("--enable-debug-endpoints", action="store_true",
                      help="add POST /debug/check_integrity (internal, for soak tests; do not expose)")
    api = serve.add_argument_group("API", "How requests and responses are read and written.")
    from pagoda.entrypoints.openai.tool_parsers import AUTO, DEFAULT_TOOL_PARSER, TOOL_PARSERS

    api.add_argument("--tool-call-parser", default=DEFAULT_TOOL_PARSER, choices=[*sorted(TOOL_PARSERS), AUTO],
                     help="the format tool calls are written in by the model and read from its output "
                          "(hermes: Hermes / Qwen's <tool_call>{...}</tool_call>; mistral: [TOOL_CALLS][{...}]; "
                          "llama3_json: Llama 3's {\"name\": ..., \"parameters\": ...}; granite: "
                          "<|tool_call|>[{...}]; deepseek_v3, deepseek_v31: DeepSeek's tool-call tokens; kimi_k2: "
                          "Kimi K2's; qwen3_coder: Qwen3-Coder / Qwen3.5's <function=...><parameter=...>; glm45, "
                          "glm47: GLM-4.5 / 4.6's and GLM-4.7's <tool_call>NAME<arg_key>...<arg_value>...; "
                          "minimax_m2: MiniMax-M2's <minimax:tool_call><invoke name=...><parameter name=...>; "
                          "openai: GPT-OSS's Harmony messages to=functions.NAME, always used for GPT-OSS; auto: "
                          "the format the chat template writes, named in the log)")
    from pagoda.reasoning import REASONING_PARSERS

    api.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                     help="split the model's reasoning (<think>...</think>) from its answer: reasoning_content "
                          "in chat completions, thinking blocks in /v1/messages (the template opens <think>: "
                          "deepseek_r1, glm47, minimax_m2, ernie45; both tags in the output: qwen3, glm45, "
                          "hunyuan_a13b, mistral's [THINK], seed_oss' <seed:think>, granite's 'Here is my thought "
                          "process:'; minimax_m2_append_think: all content, after <think>; openai_gptoss: GPT-OSS's "
                          "Harmony analysis channel, always used for GPT-OSS)")
    api.add_argument("--responses-store-max-entries", type=int, default=1024,
                     help="/v1/responses with store (OpenAI's default): keep at most this many responses in "
                          "memory, least recently used evicted first (0: store nothing)")
    api.add_argument("--responses-store-max-bytes", type=int, default=64 << 20,
                     help="... and at most this many bytes of them (their JSON size)")
    api.add_argument("--enable-force-include-usage", action="store_true",
                     help="end every stream with a usage chunk, even without stream_options.include_usage")
    api.add_argument("--enable-per-request-metrics", action="store_true",
                     help="vLLM's per-request timings: a 'metrics' object (time_to_first_token_ms, "
                          "generation_time_ms, queue_time_ms, mean_itl_ms, tokens_per_second) on chat, completions "
                          "and responses of one sequence (streams: on the usage chunk / response.completed)")
    api.add_argument("--enable-prompt-tokens-details", action="store_true",
                     help="vLLM's flag for usage.prompt_tokens_details.cached_tokens, which pagoda always reports "
                          "(as OpenAI does); accepted so that vLLM command lines run unchanged")
    from pagoda.entrypoints.openai.batch import (
        DEFAULT_BATCH_MAX_CONCURRENCY,
        DEFAULT_BATCH_MAX_LINES,
        DEFAULT_FILE_MAX_BYTES,
    )

    batch = serve.add_argument_group("files and batches", "OpenAI's Files API (/v1/files) and Batch API "
                                     "(/v1/batches), kept on disk; batches run behind live traffic and resume "
                                     "after a restart (docs/serving.md).")
    batch.add_argument("--file-storage-path", default=None, metavar="DIR",
                       help="keep uploaded files and batches in DIR and serve the Files and Batch APIs (off "
                            "without it); clients name files only by id, never by path")
    batch.add_argument("--file-max-bytes", type=parse_size, default=DEFAULT_FILE_MAX_BYTES, metavar="SIZE",
                       help="the largest file an upload may be (e.g. 200MB)")
    batch.add_argument("--batch-max-lines", type=int, default=DEFAULT_BATCH_MAX_LINES, metavar="N",
                       help="the most requests one batch may hold")
    batch.add_argument("--batch-max-concurrency", type=int, default=DEFAULT_BATCH_MAX_CONCURRENCY, metavar="N",
                       help="a batch's requests running at once (they also wait while a live request waits "
                            "for its first token)")
    lora = groups["LoRAOptions"]
    lora.add_argument("--lora-modules", nargs="+", type=_lora_module, default=[], metavar="NAME=PATH",
                      help="LoRA adapters to load at start (needs --enable-lora), each served as model NAME")
    lora.add_argument("--allow-runtime-lora", action="store_true",
                      help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (off by default: a "
                           "client could otherwise make the server read any folder); needs --lora-root")
    lora.add_argument("--lora-root", nargs="+", action="extend", default=[], metavar="DIR",
                      help="with --allow-runtime-lora: the only folders adapters may be loaded from (symlinks "
                           "are followed before the check; repeatable)")
    many = serve.add_argument_group("several models", "One server over several models, each loaded on first use "
                                    "in an engine core process of its own (Ollama's way; docs/local.md).")
    many.add_argument("--models-dir", default=None, metavar="DIR",
                      help="serve every model in DIR (GGUF files, HF folders), each request naming its model")
    many.add_argument("--models-max", type=int, default=None, metavar="N",
                      help="at most N models loaded at once, the least recently used idle one unloaded for "
                           "another; without a model or --models-dir: serve every model of the stores "
                           "(`pagoda list`) (default with --models-dir: 3, as Ollama on a CPU)")
    many.add_argument("--keep-alive", default="5m", metavar="DURATION",
                      help="how long a model stays loaded after its last request (Ollama's keep_alive: 5m, 1h, "
                           "30s; 0: unload at once; -1: keep); a request's keep_alive wins")
    many.add_argument("--model-load-timeout", type=positive_float, default=300.0, metavar="SECONDS",
                      help="how long a request waits for its model to load (or for room to load it)")
    logs = serve.add_argument_group("logging", "What the server logs.")
    logs.add_argument("--disable-log-requests", action="store_true",
                      help="do not log a line (id, queue time, TTFT, tokens, finish reason) per finished request")
    logs.add_argument("--disable-log-stats", action="store_true",
                      help="do not log the periodic throughput / queue / KV cache line")
    logs.add_argument("--log-stats-interval", type=positive_float, default=10.0,
                      help="seconds between two periodic stats lines while busy")
    logs.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                      help="send an OpenTelemetry span per finished request (gen_ai.* attributes; a child of the "
                           "request's traceparent) to this OTLP collector: host:port or http(s)://host:port over "
                           "gRPC, a URL ending in /v1/traces over HTTP/protobuf, or as OTEL_EXPORTER_OTLP_TRACES_"
                           "PROTOCOL says (docs/deploy.md); needs pip install 'pagoda[otel]'")


def build_parser(with_bench_commands: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", description="LLM inference and serving engine")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server", usage="pagoda serve [model] [options]")
    _add_server_args(serve, add_engine_args(serve, positional_model=True, command="serve"))
    serve.set_defaults(func=cmd_serve)

    router = sub.add_parser("router", help="one OpenAI endpoint over prefill and decode instances (prefill-decode "
                                           "disaggregation, docs/parallel.md)")
    router.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                        help="base URLs of `pagoda serve --kv-role prefill` instances")
    router.add_argument("--decode", nargs="+", required=True, metavar="URL",
                        help="base URLs of `pagoda serve --kv-role decode` instances")
    router.add_argument("--host", default="127.0.0.1")
    router.add_argument("--port", type=int, default=8000)
    router.add_argument("--max-attempts", type=int, default=3,
                        help="instance pairs a request is tried on while nothing has reached the client")
    router.add_argument("--cooldown", type=positive_float, default=5.0,
                        help="seconds an unreachable instance is skipped")
    router.add_argument("--startup-timeout", type=positive_float, default=120.0,
                        help="seconds to wait at start for a prefill and a decode instance to answer")
    router.add_argument("--uvicorn-log-level", default="warning")
    router.set_defaults(func=cmd_router)

    warmup = sub.add_parser("warmup", help="build pagoda's CPU kernels now rather than at the first start "
                                           "(about 1-2.5 minutes on 2 cores, once per machine)")
    warmup.set_defaults(func=cmd_warmup)

    gen = sub.add_parser("generate", help="generate offline from prompts (arguments or stdin lines)")
    add_engine_args(gen, command="generate")
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat message")
    _sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    batch = sub.add_parser("run-batch", help="run a batch file (OpenAI's batch format) offline: one result "
                                             "line per request, errors included (vLLM's run-batch)")
    add_engine_args(batch, command="run-batch")
    batch.add_argument("-i", "--input-file", required=True, metavar="IN.jsonl",
                       help="the requests, a JSON line each: {custom_id, method: POST, url, body} ('-': stdin)")
    batch.add_argument("-o", "--output-file", required=True, metavar="OUT.jsonl",
                       help="the results, in the input's order ('-': stdout)")
    batch.add_argument("--max-concurrency", type=int, default=256, metavar="N",
                       help="requests in flight at once")
    batch.set_defaults(func=cmd_run_batch)

    chat = sub.add_parser("chat", help="interactive chat in the terminal")
    add_engine_args(chat, command="chat")
    chat.add_argument("--system", default=None, help="system prompt")
    _sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    from pagoda.entrypoints.local import add_local_commands

    add_local_commands(sub, add_engine_args, config_from_args)

    bench = sub.add_parser("bench", help="benchmarks")
    if with_bench_commands:
        from pagoda.bench.commands import add_bench_commands

        add_bench_commands(bench.add_subparsers(dest="bench_command", required=True),
                           add_engine_args, config_from_args)
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str],
               environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """The command line over the environment over a --config file over the defaults
    (docs/configuration.md). ``PAGODA_*`` variables configure ``pagoda serve`` (as containers
    and orchestrators configure a server); a --config file any command with engine options."""
    command = _subparser(parser, argv)
    if command is not None:
        path = config_file_argument(argv)
        if path is not None:
            apply_config_file(command, path)
        if command.prog.split()[-1] == "serve":
            apply_environment(command, os.environ if environ is None else environ)
    return parser.parse_args(argv)


def _subparser(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser | None:
    """The parser of the (sub)command ``argv`` names, following nested subcommands."""
    found = None
    rest = list(argv)
    current = parser
    while True:
        subs = [a for a in current._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            return found
        word = next((w for w in rest if not w.startswith("-")), None)
        if word is None or word not in subs[0].choices:
            return found
        current = found = subs[0].choices[word]
        rest = rest[rest.index(word) + 1:]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # The benchmarks' options come from their modules, which import torch: built only for
    # `pagoda bench`, so that `pagoda serve` starts its engine core before any torch import.
    parser = build_parser(with_bench_commands=bool(argv) and argv[0] == "bench")
    try:
        args = parse_args(parser, argv)
    except ValueError as e:   # a --config file's
        print(f"pagoda: error: {e}", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as e:
        print(f"pagoda: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
