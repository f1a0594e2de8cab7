"""Smoke test of the built image (`make image-test`): the server starts inside it, answers
/health and a chat completion through the official `openai` client, runs as the image's
non-root user, passes the image's own HEALTHCHECK, and on SIGTERM finishes the request in
flight and exits 0.

`podman run` is refused by these sandboxes (their rlimits and cgroups), so the container
runs with `buildah run --isolation chroot --network host`: the image's filesystem,
environment, user and entrypoint (read from the image, not restated here), without
namespaces or cgroups. Its server listens on a free loopback port.

    python deploy/container/image_test.py [IMAGE]       (default localhost/pagoda:latest)
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import openai

STARTUP_TIMEOUT_S = 300.0


def sh(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health(port: int) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status
    except OSError:
        return None


def processes_under(root: int) -> list[int]:
    """root and its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().split("\0")[:-1]
    except OSError:
        return []


def uid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise RuntimeError(f"no Uid for {pid}")


def check(cond: bool, what: str) -> None:
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        raise SystemExit(1)


def main() -> int:
    image = sys.argv[1] if len(sys.argv) > 1 else "localhost/pagoda:latest"
    config = json.loads(sh("podman", "image", "inspect", "--format", "{{json .Config}}", image))
    entrypoint, cmd = config.get("Entrypoint") or [], config.get("Cmd") or []
    user = config.get("User", "")
    print(f"image {image}: user {user!r}, entrypoint {entrypoint} {cmd}", flush=True)
    check(user not in ("", "root", "0", "0:0"), "the image names a non-root user")
    healthcheck = (sh("podman", "image", "inspect", "--format", "{{json .Config.Healthcheck}}", image))
    check(healthcheck not in ("", "null"), "the image has a HEALTHCHECK")
    health_cmd = json.loads(healthcheck)["Test"]

    port = free_port()
    container = sh("buildah", "from", "--pull-never", image)
    run = ["buildah", "run", "--isolation", "chroot", "--network", "host",
           # (tini is not PID 1 here: it reaps as a subreaper instead, and says nothing)
           "--env", "TINI_SUBREAPER=1",
           "--env", "PAGODA_HOST=127.0.0.1", "--env", f"PAGODA_PORT={port}", container, "--"]
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"pagoda-image-test-{port}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(run + entrypoint + cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while health(port) != 200:
            if proc.poll() is not None:
                check(False, f"the server stays up (exited {proc.returncode}; log {log.name})")
            if time.monotonic() > deadline:
                check(False, f"/health within {STARTUP_TIMEOUT_S:.0f} s (log {log.name})")
            time.sleep(1)
        check(True, f"/health answers 200 on 127.0.0.1:{port}")

        tree = processes_under(proc.pid)
        tini = next((p for p in tree if cmdline(p)[:1] == ["/usr/bin/tini"]), None)
        server = next((p for p in tree if any(a.endswith("/pagoda") for a in cmdline(p)[:2])
                       and "serve" in cmdline(p)), None)
        check(tini is not None and server is not None, f"tini runs the server (processes {tree})")
        check(uid(server) != 0 and uid(tini) != 0, f"the server runs as uid {uid(server)}, not root")

        hc = subprocess.run(["buildah", "run", "--isolation", "chroot", "--network", "host",
                             "--env", f"PAGODA_PORT={port}", container, "--"]
                            + (["/bin/sh", "-c", health_cmd[1]] if health_cmd[0] == "CMD-SHELL" else health_cmd[1:]),
                            check=False, capture_output=True, text=True)
        check(hc.returncode == 0, f"the image's HEALTHCHECK passes ({hc.stderr.strip()[-200:]})")

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                               max_tokens=16, temperature=0)
        text = reply.choices[0].message.content or ""
        check(bool(text.strip()) and reply.usage.completion_tokens > 0, f"a chat completion: {text!r}")

        # SIGTERM (to tini, PID 1 in a real container) while a request streams: it finishes.
        streamed: dict[str, object] = {}
        first_token = threading.Event()

        def stream() -> None:
            chunks = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Count from one to fifty."}],
                max_tokens=128, temperature=0, stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True})
            for chunk in chunks:
                first_token.set()
                if chunk.usage is not None:
                    streamed["tokens"] = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    if choice.finish_reason:
                        streamed["finish"] = choice.finish_reason

        reader = threading.Thread(target=stream)
        reader.start()
        check(first_token.wait(timeout=60), "a streamed request is under way")
        os.kill(tini, signal.SIGTERM)
        reader.join(timeout=120)
        check(streamed.get("finish") == "length" and streamed.get("tokens") == 128,
              f"the request in flight at SIGTERM finished: {streamed}")
        code = proc.wait(timeout=120)
        check(code == 0, f"the container exits 0 after draining (got {code})")
        check(health(port) is None, "the port is closed afterwards")
        return 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        subprocess.run(["buildah", "rm", container], check=False, capture_output=True)
        log.close()


if __name__ == "__main__":
    sys.exit(main())
