"""The `pagoda` command: serve, router, generate, chat, run, list, ps, bench."""

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
                       help="HF model folder or .gguf file, or a name in $PAGODA_MODELS, the Hugging Face cache "
                            "(org/name[:QUANT]) or Ollama's store (name[:tag]) (default: the bundled "
                            "SmolLM2-135M-Instruct)")
    else:
        p.add_argument("--model", default=None,
                       help="HF model folder or .gguf file, or a model name (as `pagoda list` shows them; "
                            "default: bundled SmolLM2)")
    p.add_argument("--dtype", default="auto",
                   help="auto|float32|bfloat16|float16 (auto = float32 on CPU); bfloat16 on the CPU is the bf16 "
                        "mode (same as --quantization bf16): bfloat16 weights and GEMM inputs on oneDNN (AMX / "
                        "AVX512_BF16 where the CPU has them), float32 sums, norms and attention")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--quantization", default="none", choices=("none", "int8", "q4", "int4", "gguf", "bf16"),
                   help="none: exact (reference-equal output; on CPU in float32 a GGUF file's weights stay in "
                        "its blocks, memory-mapped, and are dequantized in cache to the same values; "
                        "elsewhere dequantized to --dtype at load); "
                        "gguf: a GGUF file's blocks (any type) times activations in int8 per group of 32, "
                        "llama.cpp's arithmetic; "
                        "int8: int8 weights per channel, activations int8 per token (16 outlier channels "
                        "per layer kept in float), perplexity within ~1.5 %% of fp32; the fastest mode on CPU, "
                        "for single streams and batches; q4 (alias int4): 4-bit groups of 32 (GGUF Q4_1 "
                        "scheme) with activations int8 per group of 32, the smallest weights (5 bits each), "
                        "perplexity within ~1 %%, slower prompts; bf16: see --dtype bfloat16. int8, q4, gguf and bf16 "
                        "use a float16 KV cache by default")
    p.add_argument("--num-threads", type=int, default=None,
                   help="a fixed number of torch threads for the engine (default: every core while the "
                        "machine is otherwise idle, one less while other processes want one; "
                        "OMP_NUM_THREADS if set)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="the token budget of one step (default: 512 on the CPU, 8192 on a GPU)")
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="the most logprobs / prompt_logprobs a request may ask for (vLLM's flag); -1: no bound, "
                        "so that a request may ask for the whole vocabulary with -1")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV block (default: 64 on CPU, 16 on GPU; prefix caching reuses whole blocks)")
    p.add_argument("--kv-cache-memory", type=parse_size, default=None,
                   help="KV cache budget, e.g. 2GiB (default: a quarter of free RAM, at most 4 GiB)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="explicit KV pool size in blocks")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat-template", default=None, help="a Jinja chat template string or file")
    p.add_argument("--speculative-config", default=None,
                   help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                        '(methods: ngram [prompt_lookup_min/max], layer_skip [num_layers], draft_model [model])')
    p.add_argument("--scheduling-policy", default="fcfs", choices=("fcfs", "priority", "fair"),
                   help="fcfs: arrival order; priority: lower request priority first, may preempt lower "
                        "priorities; fair: share each step's tokens across tenants by weight "
                        "(docs/scheduling.md)")
    p.add_argument("--max-long-partial-prefills", type=int, default=None,
                   help="at most this many prompts longer than --long-prefill-token-threshold are "
                        "chunk-prefilled at once (short prompts pass the others)")
    p.add_argument("--long-prefill-token-threshold", type=int, default=None,
                   help="a prompt with more tokens than this to compute is a long prefill; its chunk per "
                        "step is capped at this while others want the budget (default with "
                        "--max-long-partial-prefills: 4%% of the context length)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "float16", "int8", "fp8"),
                   help="auto: the model's dtype, or float16 with --quantization int8|q4|gguf; float16: half the "
                        "bytes of float32 KV (decode attention reads K/V in place, converting on load); "
                        "int8 / fp8 (e4m3): 8-bit K/V with a float32 scale per token "
                        "and head, about 4x the blocks of float32 KV in the same memory (2x of bf16)")
    p.add_argument("--attention-backend", default="auto", choices=("auto", "cpu", "torch", "triton"),
                   help="the attention kernels (vLLM's flag): auto = cpu (pagoda's C++ kernels) on the CPU, "
                        "triton on CUDA where triton is installed; torch = the reference (gathered contexts and "
                        "SDPA) on any device. The start-up log names the one chosen and why")
    p.add_argument("--enforce-eager", action="store_true",
                   help="on CUDA, run decode steps eagerly instead of replaying the CUDA graphs captured at "
                        "start-up (vLLM's flag; graphs need the triton attention backend)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="overlapped steps (vLLM's flag): schedule and launch the next step while the one before "
                        "runs, its sampled tokens passed on the device (default: on with --device cuda, off on "
                        "the CPU, where a step's work is all on the host)")
    p.add_argument("--preemption-mode", default="recompute", choices=("recompute", "swap", "auto"),
                   help="how a preempted request gives its KV blocks back: recompute them later, swap them "
                        "to host memory (--swap-space) and back, or auto: swap long ones, recompute short ones")
    p.add_argument("--swap-space", type=parse_size, default=0,
                   help="host memory for swapped-out KV blocks, e.g. 4GiB (needed by --preemption-mode swap|auto)")
    p.add_argument("--shared-prefix-file", default=None,
                   help="system prompts / texts whose prefix cache blocks stay shared across cache_salt "
                        "values (JSON array of strings, or text with '---' lines between entries)")

    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (PEFT format) on top of the model")
    p.add_argument("--max-loras", type=int, default=1,
                   help="LoRA adapters resident at once; one batch mixes requests of up to this many")
    p.add_argument("--max-lora-rank", type=int, default=16, help="largest LoRA rank accepted")
    emb = p.add_argument_group("embeddings (docs/embeddings.md)")
    emb.add_argument("--task", default="auto", choices=("auto", "generate", "embed"),
                     help="generate text, or embed (POST /v1/embeddings: the final hidden states pooled); auto: "
                          "embed for an embedding checkpoint (no LM head, or a sentence-transformers layout)")
    emb.add_argument("--pooling-type", default=None, choices=("LAST", "MEAN", "CLS"),
                     help="--task embed: pool the last token's, the mean of all, or the first token's hidden "
                          "state (default: the checkpoint's sentence-transformers config, else LAST)")
    emb.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                     help="--task embed: L2-normalise vectors (default: the checkpoint's Normalize module in a "
                          "sentence-transformers layout, else on)")
    emb.add_argument("--matryoshka-dimensions", default=None, metavar="any|N,N,...",
                     help="--task embed: let requests ask for truncated vectors ('dimensions'): any width, or "
                          "only these (default: the checkpoint's is_matryoshka / matryoshka_dimensions)")
    emb.add_argument("--override-pooler-config", default=None,
                     help='--task embed, vLLM\'s spelling: JSON of pooling_type, normalize, is_matryoshka, '
                          'matryoshka_dimensions (the flags above win over it)')
    par = p.add_argument_group("parallelism (docs/parallel.md)")
    par.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                     help="ranks that split each layer (torch.distributed: gloo on CPU, nccl on CUDA)")
    par.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                     help="stages that split the layers, each a process (or a TP group); "
                          "world = TP x PP ranks")
    par.add_argument("--enable-expert-parallel", action="store_true",
                     help="MoE models: each tensor-parallel rank holds whole experts "
                          "(default: every expert split by rows); with --data-parallel-size N "
                          "(TP=1), the N replicas share the experts and exchange tokens")
    par.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                     help="engine replicas behind one server, with prefix-aware routing (serve only)")
    par.add_argument("--nnodes", type=int, default=1, help="nodes the tensor/pipeline-parallel group spans")
    par.add_argument("--node-rank", type=int, default=0,
                     help="this node's index; 0 runs the server and engine core, others only workers")
    par.add_argument("--master-addr", default=None, help="node 0's address for the rendezvous")
    par.add_argument("--master-port", type=int, default=None, help="node 0's rendezvous port")
    par.add_argument("--distributed-init-method", default=None,
                     help="tcp://host:port or env:// (MASTER_ADDR/MASTER_PORT, as torchrun sets them); "
                          "alternative to --master-addr/--master-port")
    par.add_argument("--distributed-timeout", type=_positive_float, default=120.0,
                     help="seconds a collective waits for a peer before the engine reports it failed")
    par.add_argument("--threads-per-rank", type=int, default=None,
                     help="torch threads per rank or replica on CPU (default 1 when parallel, else all)")
    par.add_argument("--distributed-executor-backend", default="mp", choices=("mp", "ray"),
                     help="who starts the tensor-parallel workers: mp = subprocesses, ray = Ray actors in a "
                          "placement group (pip install 'pagoda[ray]')")
    par.add_argument("--data-parallel-backend", default="mp", choices=("mp", "ray"),
                     help="who starts the data-parallel engine cores: mp = subprocesses, ray = Ray actors "
                          "on this node")
    par.add_argument("--ray-address", default=None,
                     help="the Ray cluster to use (host:port of `ray start --head`); default: RAY_ADDRESS, "
                          "else a cluster started on this machine, else a new local one")


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
    parallel = {
        "tensor_parallel_size": getattr(args, "tensor_parallel_size", 1),
        "pipeline_parallel_size": getattr(args, "pipeline_parallel_size", 1),
        "enable_expert_parallel": getattr(args, "enable_expert_parallel", False),
        "data_parallel_size": getattr(args, "data_parallel_size", 1),
        "nnodes": getattr(args, "nnodes", 1),
        "node_rank": getattr(args, "node_rank", 0),
        "distributed_init_method": _init_method(args),
        "distributed_timeout": getattr(args, "distributed_timeout", 120.0),
        "threads_per_rank": getattr(args, "threads_per_rank", None),
        "distributed_executor_backend": getattr(args, "distributed_executor_backend", "mp"),
        "data_parallel_backend": getattr(args, "data_parallel_backend", "mp"),
        "ray_address": getattr(args, "ray_address", None),
    }
    parallel.update({k: extra.pop(k) for k in list(extra) if k in parallel})
    return EngineConfig(**parallel,
        model=args.model,
        served_model_name=getattr(args, "served_model_name", None),
        dtype=args.dtype,
        quantization=args.quantization,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_logprobs=getattr(args, "max_logprobs", 20),
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        num_kv_blocks=args.num_kv_blocks,
        enable_prefix_caching=args.enable_prefix_caching,
        seed=args.seed,
        chat_template=args.chat_template,
        num_threads=args.num_threads,
        speculative_config=args.speculative_config,
        scheduling_policy=args.scheduling_policy,
        max_long_partial_prefills=args.max_long_partial_prefills,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        shared_prefix_file=args.shared_prefix_file,
        kv_cache_dtype=args.kv_cache_dtype,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        preemption_mode=args.preemption_mode,
        swap_space=args.swap_space,
        api_keys_file=getattr(args, "api_keys_file", None),
        enable_lora=getattr(args, "enable_lora", False),
        max_loras=getattr(args, "max_loras", 1),
        max_lora_rank=getattr(args, "max_lora_rank", 16),
        task=getattr(args, "task", "auto"),
        override_pooler_config=_pooler_overrides(args),
        kv_role=getattr(args, "kv_role", None),
        kv_transfer_config=getattr(args, "kv_transfer_config", None),
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
    return run_server(args, config_from_args(args))


def cmd_router(args: argparse.Namespace) -> int:
    from pagoda.kv_transfer.router import run_router

    return run_router(args)


_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}


def env_defaults(parser: argparse.ArgumentParser, environ: dict[str, str] | os._Environ[str]) -> None:
    """``PAGODA_<FLAG>`` environment variables as the defaults of a command's flags (as
    containers and orchestrators configure a server): ``PAGODA_MAX_MODEL_LEN=4096`` is
    ``--max-model-len 4096``, ``PAGODA_MODEL`` the model, ``PAGODA_ENABLE_LORA=1`` a switch
    (1/true/yes/on or 0/false/no/off), a list flag's values separated by spaces. Flags on
    the command line win. A value the flag would refuse is an error naming the variable;
    ``PAGODA_*`` variables that name no flag (``PAGODA_CPU_ISA``, ...) are left alone."""
    defaults = {}
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or not action.dest or action.dest == argparse.SUPPRESS:
            continue
        name = f"PAGODA_{action.dest.upper()}"
        if name not in environ:
            continue
        raw = environ[name].strip()
        switch = isinstance(action, (argparse._StoreTrueAction, argparse.BooleanOptionalAction))
        if not raw and not switch:
            continue  # set but empty: as if unset
        try:
            if switch:
                if raw.lower() not in _TRUE | _FALSE:
                    raise argparse.ArgumentTypeError(f"expected 1/true/yes/on or 0/false/no/off, got {raw!r}")
                value: object = raw.lower() in _TRUE
            elif action.nargs in ("+", "*"):
                value = [_env_value(action, item) for item in raw.split()]
            else:
                value = _env_value(action, raw)
        except (argparse.ArgumentTypeError, ValueError) as e:
            parser.error(f"environment variable {name}: {e}")
        defaults[action.dest] = value
    parser.set_defaults(**defaults)


def _env_value(action: argparse.Action, raw: str) -> object:
    value = action.type(raw) if callable(action.type) else raw
    if action.choices is not None and value not in action.choices:
        raise argparse.ArgumentTypeError(f"{raw!r} is not one of {', '.join(map(str, action.choices))}")
    return value


def build_parser(with_bench_commands: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", description="LLM inference and serving engine")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(serve, positional_model=True)
    serve.add_argument("--lora-modules", nargs="+", type=_lora_module, default=[], metavar="NAME=PATH",
                       help="LoRA adapters to load at start (needs --enable-lora), each served as model NAME")
    serve.add_argument("--allow-runtime-lora", action="store_true",
                       help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (off by default: "
                            "a client could otherwise make the server read any folder); needs --lora-root")
    serve.add_argument("--lora-root", nargs="+", action="extend", default=[], metavar="DIR",
                       help="with --allow-runtime-lora: the only folders adapters may be loaded from "
                            "(symlinks are followed before the check; repeatable)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--api-key", default=None, help="require this Bearer key on /v1/* (or PAGODA_API_KEY)")
    serve.add_argument("--api-keys-file", default=None,
                       help="JSON or TOML: API key -> {tenant, weight, max_running, max_queued}; any key "
                            "is accepted and names the request's tenant (without it, an X-Tenant header "
                            "does)")
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
    from pagoda.reasoning import REASONING_PARSERS

    serve.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                       help="split the model's reasoning (<think>...</think>) from its answer: "
                            "reasoning_content in chat completions, thinking blocks in /v1/messages "
                            "(deepseek_r1: the template opens <think>; qwen3: both tags in the output)")
    serve.add_argument("--responses-store-max-entries", type=int, default=1024,
                       help="/v1/responses with store (OpenAI's default): keep at most this many responses in "
                            "memory, least recently used evicted first (0: store nothing)")
    serve.add_argument("--responses-store-max-bytes", type=int, default=64 << 20,
                       help="... and at most this many bytes of them (their JSON size)")
    serve.add_argument("--enable-force-include-usage", action="store_true",
                       help="end every stream with a usage chunk, even without stream_options.include_usage")
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
    pd = serve.add_argument_group("prefill-decode disaggregation (docs/parallel.md)")
    pd.add_argument("--kv-role", default=None, choices=("prefill", "decode"),
                    help="prefill: compute prompts and their first token, and keep their KV blocks for a decode "
                         "instance; decode: fetch those blocks and decode on (`pagoda router` pairs them); "
                         "default: neither (prefill and decode here)")
    pd.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                    help='the KV endpoint: on a prefill instance {"host", "port", "advertise_host", "timeout_s"} '
                         '(default 127.0.0.1, a free port, 30 s to fetch parked blocks), on a decode instance '
                         '{"transport": "auto|shm|tcp", "timeout_s"} (auto: shared memory on one host, else tcp)')
    serve.set_defaults(func=cmd_serve)
    env_defaults(serve, os.environ)

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
    router.add_argument("--cooldown", type=_positive_float, default=5.0,
                        help="seconds an unreachable instance is skipped")
    router.add_argument("--startup-timeout", type=_positive_float, default=120.0,
                        help="seconds to wait at start for a prefill and a decode instance to answer")
    router.add_argument("--uvicorn-log-level", default="warning")
    router.set_defaults(func=cmd_router)

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

    from pagoda.entrypoints.local import add_local_commands

    add_local_commands(sub, add_engine_args, config_from_args)

    bench = sub.add_parser("bench", help="benchmarks")
    if with_bench_commands:
        from pagoda.bench.commands import add_bench_commands

        add_bench_commands(bench.add_subparsers(dest="bench_command", required=True),
                           add_engine_args, config_from_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # The benchmarks' options come from their modules, which import torch: built only for
    # `pagoda bench`, so that `pagoda serve` starts its engine core before any torch import.
    args = build_parser(with_bench_commands=bool(argv) and argv[0] == "bench").parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as e:
        print(f"pagoda: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
