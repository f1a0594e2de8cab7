"""``GET /v1/kv_transfer/info`` on an instance with a KV role: what a router needs to pair it.

    {"kv_role": "prefill", "kv_address": "tcp://10.0.0.5:7100", "model": "SmolLM2-135M-Instruct",
     "block_size": 64, "max_model_len": 8192}

``kv_address`` is the prefill instance's KV endpoint (null on a decode instance), which the
router hands to the decode instance with each request.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from pagoda.engine.client import EngineClient


def add_kv_transfer_routes(app: FastAPI, engine: EngineClient, served_model_name: str) -> None:
    from pagoda.engine.async_llm import AsyncLLM

    # The engine core's Ready message says where its KV endpoint listens (one core: AsyncLLM).
    kv_address = engine.info.kv_address if isinstance(engine, AsyncLLM) else None

    @app.get("/v1/kv_transfer/info")
    async def kv_transfer_info() -> dict[str, Any]:
        return {
            "kv_role": engine.config.kv_role,
            "kv_address": kv_address,
            "model": served_model_name,
            "block_size": engine.config.block_size,
            "max_model_len": engine.max_model_len,
        }
