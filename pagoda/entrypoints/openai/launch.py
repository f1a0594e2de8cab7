"""`pagoda serve`: start the engine, then serve it until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import TYPE_CHECKING

from pagoda.config import EngineConfig

if TYPE_CHECKING:
    from pagoda.engine.core_proc import CoreProcess

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


async def _main(args: argparse.Namespace, config: EngineConfig, core: CoreProcess | None = None) -> None:
    from pagoda.engine.client import EngineClient
    from pagoda.entrypoints.openai.server import ServerConfig, serve
    from pagoda.hub.stores import model_defaults
    from pagoda.tenants import load_api_keys_file

    options = dict(
        log_stats=not getattr(args, "disable_log_stats", False),
        log_stats_interval=getattr(args, "log_stats_interval", 10.0),
        log_requests=not getattr(args, "disable_log_requests", False),
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
    await serve(engine, ServerConfig(
        served_model_name=args.served_model_name or default_served_model_name(config),
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
        allow_runtime_lora=getattr(args, "allow_runtime_lora", False),
        lora_roots=tuple(getattr(args, "lora_root", None) or ()),
    ))  # fmt: skip


def run_server(args: argparse.Namespace, config: EngineConfig) -> int:
    """Returns the exit status: 0 after a graceful shutdown."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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
    core = None
    if config.data_parallel_size == 1:
        # Start the engine core first: its imports and weight loading overlap this
        # process's imports of the API stack.
        from pagoda.engine.core_proc import start_core_process

        core = start_core_process(config)
    asyncio.run(_main(args, config, core))
    return 0
