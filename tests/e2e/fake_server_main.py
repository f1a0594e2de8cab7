"""`python -m tests.e2e.fake_server_main`: serve() a FakeEngine in this process, for signal tests.

Binds 127.0.0.1 port 0 itself, prints "PORT <n>" once listening, and "ENGINE SHUTDOWN" plus
the aborted request ids when serve() has returned.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys

from pagoda.entrypoints.openai import ServerConfig, serve
from tests.e2e.fake_engine import FakeEngine


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--step-delay", type=float, default=0.02)
    parser.add_argument("--shutdown-timeout", type=float, default=5.0)
    args = parser.parse_args()
    engine = FakeEngine(step_delay=args.step_delay)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)  # connections made before uvicorn starts wait in the backlog
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    config = ServerConfig("pagoda-test", port=0, shutdown_timeout=args.shutdown_timeout, uvicorn_log_level="warning")
    asyncio.run(serve(engine, config, sock=sock))
    print(f"ENGINE SHUTDOWN {engine.shut_down} ABORTED {len(engine.aborted)} FINISHED {len(engine.finished)}",
          flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
