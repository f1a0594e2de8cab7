"""`pagoda serve`: start the engine, then serve it until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import TYPE_CHECKING

from pagoda.config import EngineConfig

if TYPE_CHECKING:
    from pagoda.engine.core_proc import CoreProcess
    from pagoda.metrics.tracing import RequestTracer

logger = logging.getLogger(__name__)

# The bundled default model is served under its plain name.
DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"


def default_served_model_name(config: EngineConfig) -> str:
    """--served-model-name, else the model's file or folder name (without .gguf), or the
    name it was found by in a model store (e.g. ``qwen2.5:0.5b``, ``org/name:Q4_K_M``)."""
    if config.served_model_name:
        return config.served_model_name
    if config.model is None:
        return DEFAULT_SERVED_NAME
    from pagoda.hub.stores import resolve_model

    return resolve_model(config.model).name


async def _main(args: argparse.Namespace, config: EngineConfig, core: CoreProcess | None = None,
                tracer: RequestTracer | None = None) -> None:  # fmt: skip
    from pagoda.engine.client import EngineClient
    from pagoda.entrypoints.openai.server import serve

    options = dict(
        log_stats=not getattr(args, "disable_log_stats", False),
        log_stats_interval=getattr(args, "log_stats_interval", 10.0),
        log_requests=not getattr(args, "disable_log_requests", False),
        tracer=tracer,   # one for all data-parallel replicas
    )
    engine: EngineClient
    if config.data_parallel_size > 1:
        from pagoda.engine.dp_client import DataParallelLLM

        engine = DataParallelLLM.from_config(config, **options)
    else:
        from pagoda.engine.async_llm import AsyncLLM

        engine = AsyncLLM.from_config(config, **({"core": core} if core is not None else {}), **options)
    try:
        for name, path in getattr(args, "lora_modules", None) or []:
            await engine.add_lora(name, path)
            logger.info("loaded LoRA adapter %r from %s", name, path)
    except BaseException:
        await engine.shutdown()
        raise
    await serve(engine, server_config(args, config, args.served_model_name or default_served_model_name(config)))


def server_config(args: argparse.Namespace, config: EngineConfig, served_model_name: str):
    """The HTTP server's settings from `pagoda serve`'s flags, for the model ``config`` names."""
    from pagoda.entrypoints.openai.server import ServerConfig
    from pagoda.hub.stores import model_defaults
    from pagoda.tenants import load_api_keys_file

    return ServerConfig(
        served_model_name=served_model_name,
        host=args.host, port=args.port, api_key=args.api_key, max_num_queued_requests=args.max_num_queued_requests,
        request_timeout=args.request_timeout, shutdown_timeout=args.shutdown_timeout,
        uvicorn_log_level=args.uvicorn_log_level,
        tool_call_parser=getattr(args, "tool_call_parser", "hermes"),
        reasoning_parser=getattr(args, "reasoning_parser", None),
        responses_store_max_entries=getattr(args, "responses_store_max_entries", 1024),
        responses_store_max_bytes=getattr(args, "responses_store_max_bytes", 64 << 20),
        enable_debug_endpoints=getattr(args, "enable_debug_endpoints", False),
        api_key_on_internal_endpoints=getattr(args, "api_key_on_internal_endpoints", False),
        api_keys=load_api_keys_file(config.api_keys_file) if config.api_keys_file else None,
        model_defaults=model_defaults(config.model),
        enable_force_include_usage=getattr(args, "enable_force_include_usage", False),
        enable_per_request_metrics=getattr(args, "enable_per_request_metrics", False),
        allow_runtime_lora=getattr(args, "allow_runtime_lora", False),
        lora_roots=tuple(getattr(args, "lora_root", None) or ()),
        **_batch_settings(args),
    )  # fmt: skip


def _batch_settings(args: argparse.Namespace) -> dict[str, object]:
    """The Files and Batch APIs' flags that were given (the rest keep ServerConfig's defaults)."""
    names = ("file_storage_path", "file_max_bytes", "batch_max_lines", "batch_max_concurrency")
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


def multi_model(args: argparse.Namespace, config: EngineConfig) -> bool:
    """Whether `pagoda serve` serves several models: --models-dir, or --models-max without a model."""
    return getattr(args, "models_dir", None) is not None or (getattr(args, "models_max", None) is not None
                                                             and config.model is None)


def _check_multi_model(args: argparse.Namespace, config: EngineConfig) -> None:
    refused = [(config.model is not None, "a model argument (each request names its model)"),
               (config.served_model_name is not None, "--served-model-name"),
               (config.world_size > 1, "--tensor-parallel-size / --pipeline-parallel-size > 1"),
               (config.data_parallel_size > 1, "--data-parallel-size > 1"),
               (config.kv_role is not None, "--kv-role"),
               (config.enable_lora or bool(getattr(args, "lora_modules", None)), "--enable-lora / --lora-modules"),
               (config.node_rank > 0 or config.nnodes > 1, "--nnodes / --node-rank"),
               (getattr(args, "otlp_traces_endpoint", None) is not None, "--otlp-traces-endpoint"),
               (getattr(args, "file_storage_path", None) is not None, "--file-storage-path (the Batch API)")]
    names = [name for bad, name in refused if bad]
    if names:
        raise ValueError(f"serving several models (--models-dir / --models-max) cannot be combined with "
                         f"{', '.join(names)} yet")


async def _main_multi(args: argparse.Namespace, config: EngineConfig) -> None:
    import uvicorn

    from pagoda.entrypoints.openai.api_server import build_app
    from pagoda.entrypoints.openai.multi_model import (
        ModelRouter,
        catalogue_from_dir,
        catalogue_from_stores,
        parse_keep_alive,
        per_model_kv_budget,
    )
    from pagoda.entrypoints.openai.server import _ABORT_GRACE_S, PagodaServer

    models_max = args.models_max or 3
    catalogue = catalogue_from_dir(args.models_dir) if args.models_dir else catalogue_from_stores()
    base = per_model_kv_budget(config, models_max)

    def build(engine, slot):
        return build_app(engine, server_config(args, slot.config, slot.name))

    router = ModelRouter(catalogue, base, build, models_max, parse_keep_alive(args.keep_alive), args.model_load_timeout,
                         api_key=args.api_key)
    logger.info("serving %d model(s), at most %d loaded at once, kept %s after their last request: %s",
                len(catalogue), models_max, args.keep_alive, ", ".join(catalogue))
    uv = uvicorn.Config(router, host=args.host, port=args.port, log_level=args.uvicorn_log_level, lifespan="off",
                        timeout_graceful_shutdown=int(_ABORT_GRACE_S))
    server = PagodaServer(uv, router.state, args.shutdown_timeout)
    try:
        await server.serve()
    finally:
        await router.shutdown()


def run_server(args: argparse.Namespace, config: EngineConfig) -> int:
    """Returns the exit status: 0 after a graceful shutdown."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if multi_model(args, config):
        _check_multi_model(args, config)
        asyncio.run(_main_multi(args, config))
        return 0
    if config.node_rank > 0:
        # A worker node of a multi-node tensor-parallel group: no API server here.
        from pagoda.executor.multiproc import start_node_workers

        logger.info("node %d of %d: starting tensor-parallel workers for %s", config.node_rank,
                    config.nnodes, config.distributed_init_method)
        return start_node_workers(config)
    from pagoda.host import torchrun_rank

    launched = torchrun_rank()
    if launched is not None and launched[0] > 0:
        # torchrun started this process as a worker rank.
        from pagoda.executor.worker import run_worker

        return run_worker(config, launched[0], launched[2], config.distributed_init_method or "env://")
    # Before the engine core starts, so that a missing OpenTelemetry SDK is refused at once.
    tracer = _request_tracer(args, config)
    try:
        core = None
        if config.data_parallel_size == 1:
            # Start the engine core first: its imports and weight loading overlap this
            # process's imports of the API stack.
            from pagoda.engine.core_proc import start_core_process

            core = start_core_process(config)
        asyncio.run(_main(args, config, core, tracer))
    finally:
        if tracer is not None:
            tracer.shutdown()   # exports the spans still queued
    return 0


def _request_tracer(args: argparse.Namespace, config: EngineConfig) -> RequestTracer | None:
    """--otlp-traces-endpoint's tracer (ValueError with the install hint when the extra is missing)."""
    endpoint = getattr(args, "otlp_traces_endpoint", None)
    if endpoint is None:
        return None
    from pagoda.metrics.tracing import RequestTracer

    return RequestTracer(endpoint, args.served_model_name or default_served_model_name(config))
