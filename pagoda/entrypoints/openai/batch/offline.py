"""``pagoda run-batch -i IN.jsonl -o OUT.jsonl``: a batch file run offline (vLLM's run-batch).

The engine starts in this process, every line runs through the same routes `pagoda serve`
has (so a line gets exactly the response it would get over HTTP), and OUT gets one result
line per input line, in the input's order. Unlike the Batch API, a failed request is a line
of the output too: its ``response`` holds the status and the error body, and its ``error``
the error object. Lines may mix the batch endpoints. ``-`` reads stdin / writes stdout.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from pagoda.config import EngineConfig
from pagoda.entrypoints.openai.batch.lines import is_success, read_input, run_line

# Lines in flight at once: enough to keep the engine's batch full, few enough to bound memory.
DEFAULT_CONCURRENCY = 256


class BatchFileError(ValueError):
    """The input file is not a batch file; the message lists its problems."""


def _read(path: str) -> bytes:
    if path == "-":
        return sys.stdin.buffer.read()
    with open(path, "rb") as f:
        return f.read()


def _write(path: str, data: bytes) -> None:
    if path == "-":
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
        return
    with open(path, "wb") as f:
        f.write(data)


async def run_batch_file(config: EngineConfig, input_path: str, output_path: str, served_model_name: str,
                         concurrency: int = DEFAULT_CONCURRENCY) -> tuple[int, int]:  # fmt: skip
    """Run every line of ``input_path`` and write the results; (succeeded, failed)."""
    lines, errors = read_input(_read(input_path), None, max_lines=sys.maxsize)
    if errors:
        raise BatchFileError("the input is not a batch file:\n" + "\n".join(
            f"  line {e['line']}: {e['message']}" if e["line"] else f"  {e['message']}" for e in errors))
    from pagoda.engine.async_llm import AsyncLLM
    from pagoda.entrypoints.openai.api_server import ServerConfig, build_app

    engine = AsyncLLM.from_config(config, log_stats=False, log_requests=False)
    try:
        app = build_app(engine, ServerConfig(served_model_name))
        gate = asyncio.Semaphore(concurrency)

        async def one(line: Any) -> dict[str, Any]:
            async with gate:
                result = await run_line(app, line, tenant=None, background=False)
            if not is_success(result):
                body = result["response"]["body"]
                result["error"] = body.get("error") if isinstance(body, dict) else {"message": str(body)}
            return result

        results = await asyncio.gather(*(one(line) for line in lines))
    finally:
        await engine.shutdown()
    _write(output_path, b"".join(json.dumps(r).encode() + b"\n" for r in results))
    ok = sum(1 for r in results if is_success(r))
    return ok, len(results) - ok
