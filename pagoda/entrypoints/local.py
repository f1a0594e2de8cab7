"""Local use, as with Ollama: ``pagoda run`` (chat in the terminal), ``pagoda list`` (the
models found on this machine) and ``pagoda ps`` (what a running ``pagoda serve`` has loaded).

``pagoda run`` drives the same engine as ``pagoda serve`` (AsyncLLM, the engine core in its
own process) so that a reply streams token by token and Ctrl-C can abort it: the signal
cancels the task reading the stream, and closing the stream aborts the engine request, so
its KV blocks come back before the next prompt. The engine-core process ignores SIGINT (the
terminal sends it to the whole process group), which is what lets the chat go on.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from pagoda.engine.async_llm import AsyncLLM
    from pagoda.hub.stores import ModelDefaults

HELP = """Available commands:
  /set parameter NAME VALUE   Set a sampling parameter for the next replies: temperature, top_p,
                              top_k, min_p, repeat_penalty, seed, num_predict (Ollama's names)
  /set system TEXT            Set the system prompt
  /clear                      Clear the conversation (its history)
  /bye                        Exit (as do Ctrl-D and Ctrl-C at the prompt)
  /?                          Show this help (also /help)

Ctrl-C during a reply stops that reply.
"""


def add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", default=None,
                   help="answer this one prompt and exit (read from stdin when it is not a terminal)")
    p.add_argument("--system", default=None, help="system prompt (default: the model's own, if it has one)")
    p.add_argument("--temperature", type=float, default=None, help="default: the model's, else 1.0")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=None,
                   help="default: the model's num_predict, else what the context leaves")
    p.add_argument("--sampling-seed", type=int, default=None)
    p.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="an image for a vision-language model, sent with the first prompt (repeat for several)")
    p.add_argument("--verbose", action="store_true",
                   help="after each reply, print its prompt and generated token counts and speed")


@dataclass
class Reply:
    text: str
    prompt_tokens: int
    generated_tokens: int
    seconds: float


class TerminalChat:
    """One conversation with an engine: the history, and replies streamed to ``out``."""

    def __init__(self, engine: AsyncLLM, defaults: ModelDefaults, args: argparse.Namespace,
                 out: TextIO = sys.stdout) -> None:  # fmt: skip
        self.engine = engine
        self.defaults = defaults
        self.args = args
        self.out = out
        self.history: list[dict[str, Any]] = []
        self.system: str | None = args.system
        # SamplingParams fields set on the command line or with /set parameter.
        given = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                 "seed": args.sampling_seed, "max_tokens": args.max_tokens}  # fmt: skip
        self.overrides: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
        # --image files, sent with the first prompt (base64, as the other dialects send them).
        self.pending_images = [base64.b64encode(_read(p)).decode() for p in getattr(args, "image", [])]
        self._images = None

    def set_parameter(self, name: str, text: str) -> None:
        """``/set parameter NAME VALUE`` (Ollama's parameter names); ValueError for a bad one."""
        from pagoda.hub.stores import ollama_params

        try:
            value = json.loads(text)
        except ValueError:
            raise ValueError(f"{text!r} is not a number") from None
        sampling, _ = ollama_params({name: value}, "/set parameter")
        if not sampling:
            raise ValueError(f"{name} cannot be set here (it is not a sampling parameter)")
        self.overrides.update(sampling)

    def messages(self, user_text: str) -> list[dict[str, Any]]:
        """The conversation with a new user message: history, and a system prompt in front
        (--system, else the model's own)."""
        content: Any = user_text
        if self.pending_images:
            content = [*({"type": "image_base64", "image_base64": b} for b in self.pending_images),
                       {"type": "text", "text": user_text}]
        messages = [*self.history, {"role": "user", "content": content}]
        if self.system is not None:
            return [{"role": "system", "content": self.system}, *messages]
        return self.defaults.with_system(messages)

    def params(self, prompt_tokens: int):
        """The model's defaults, over which the command line's options apply."""
        from pagoda.sampling_params import SamplingParams

        kwargs = {**self.defaults.sampling, **self.overrides}
        room = max(self.engine.max_model_len - prompt_tokens, 1)
        limit = kwargs.get("max_tokens")
        kwargs["max_tokens"] = min(limit, room) if limit is not None else room
        return SamplingParams(**kwargs)

    async def reply(self, user_text: str) -> Reply:
        """Stream the answer to ``user_text`` to ``out``; cancelling this aborts the request."""
        from pagoda.entrypoints.openai.errors import APIError
        from pagoda.entrypoints.openai.images import ImagePrompts
        from pagoda.multimodal.prompts import has_image_parts

        tokenizer = self.engine.tokenizer
        messages = self.messages(user_text)
        if self._images is None:
            self._images = ImagePrompts(self.engine)
        images = None
        try:
            if self._images.processor is not None or has_image_parts(messages):
                images = self._images.take(messages)
                messages = images.messages
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            ids, mm_inputs = (self._images.expand(text, images) if images is not None and images.images
                              else (tokenizer.encode(text, add_special_tokens=False), []))
        except APIError as e:
            raise ValueError(e.message) from None
        params = self.params(len(ids))
        start = time.monotonic()
        pieces: list[str] = []
        generated = 0
        stream = self.engine.generate(f"run-{uuid.uuid4().hex[:16]}", text, ids, params, mm_inputs=mm_inputs)
        async with contextlib.aclosing(stream):
            async for out in stream:
                c = out.outputs[0]
                generated = len(c.token_ids)
                if c.delta_text:
                    pieces.append(c.delta_text)
                    self.out.write(c.delta_text)
                    self.out.flush()
        return Reply("".join(pieces), len(ids), generated, time.monotonic() - start)

    def remember(self, user_text: str, reply: Reply) -> None:
        # The first turn keeps its images: later turns resend them (served from the caches).
        user = self.messages(user_text)[-1]
        self.pending_images = []
        self.history += [user, {"role": "assistant", "content": reply.text}]


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"--image {path}: {e.strerror}") from None


def _interruptible(loop: asyncio.AbstractEventLoop, coro) -> Any:
    """Run ``coro`` to its end; Ctrl-C cancels it (CancelledError), not the whole program."""
    task = loop.create_task(coro)
    loop.add_signal_handler(signal.SIGINT, task.cancel)
    try:
        return loop.run_until_complete(task)
    finally:
        loop.remove_signal_handler(signal.SIGINT)


def _print_stats(reply: Reply) -> None:
    speed = reply.generated_tokens / reply.seconds if reply.seconds > 0 else 0.0
    print(f"prompt tokens: {reply.prompt_tokens}\ngenerated tokens: {reply.generated_tokens}\n"
          f"speed: {speed:.1f} tokens/s", file=sys.stderr)  # fmt: skip


def _turn(loop: asyncio.AbstractEventLoop, chat: TerminalChat, line: str) -> bool:
    """One prompt and its streamed reply; False if Ctrl-C stopped it (then it is not kept)."""
    try:
        reply = _interruptible(loop, chat.reply(line))
    except asyncio.CancelledError:
        print("\n(reply stopped)", flush=True)
        return False
    except ValueError as e:  # the request was refused, e.g. longer than the context
        print(f"\nerror: {e}", file=sys.stderr)
        return False
    print("\n", flush=True)
    if chat.args.verbose:
        _print_stats(reply)
    chat.remember(line, reply)
    return True


def _set(chat: TerminalChat, command: str) -> None:
    words = command.split(maxsplit=3)
    if len(words) >= 3 and words[1] == "system":
        chat.system = command.split(maxsplit=2)[2]
        print("Set the system prompt.")
    elif len(words) == 4 and words[1] == "parameter":
        try:
            chat.set_parameter(words[2], words[3])
        except ValueError as e:
            print(f"error: {e}")
            return
        print(f"Set parameter {words[2]!r} to {words[3]!r}.")
    else:
        print("Usage: /set parameter NAME VALUE, or /set system TEXT")


def _repl(loop: asyncio.AbstractEventLoop, chat: TerminalChat) -> int:
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401 (line editing and history for input())
    print("pagoda run: chat with the model; /? for help, /bye to exit.", file=sys.stderr)
    while True:
        try:
            line = input(">>> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        command = line.strip()
        if not command:
            continue
        if command == "/bye":
            return 0
        if command == "/clear":
            chat.history.clear()
            print("Cleared the conversation.")
        elif command in ("/?", "/help"):
            print(HELP, end="")
        elif command.startswith("/set "):
            _set(chat, command)
        elif command.startswith("/") and " " not in command:
            print(f"Unknown command {command!r}. Type /? for help.")
        else:
            _turn(loop, chat, line)


def cmd_run(args: argparse.Namespace, config) -> int:
    from pagoda.engine.async_llm import AsyncLLM
    from pagoda.hub.stores import model_defaults

    prompt = args.prompt
    if prompt is None and not sys.stdin.isatty():
        prompt = sys.stdin.read()
    # The engine core's INFO lines would land in the middle of the conversation.
    os.environ.setdefault("PAGODA_LOG_LEVEL", "WARNING")
    defaults = model_defaults(config.model)
    loop = asyncio.new_event_loop()

    async def start() -> AsyncLLM:
        return AsyncLLM.from_config(config, log_stats=False, log_requests=False)

    engine = loop.run_until_complete(start())
    try:
        try:
            chat = TerminalChat(engine, defaults, args)
        except ValueError as e:
            print(f"pagoda: error: {e}", file=sys.stderr)
            return 2
        if prompt is None:
            return _repl(loop, chat)
        if not prompt.strip():
            print("pagoda: error: the prompt is empty", file=sys.stderr)
            return 2
        return 0 if _turn(loop, chat, prompt) else 130
    finally:
        loop.run_until_complete(engine.shutdown())
        loop.close()


# ---------------------------------------------------------------------- pagoda list
def _human_size(size: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")


def _ago(timestamp: float, now: float) -> str:
    seconds = max(now - timestamp, 0)
    for span, unit in ((86400 * 365, "year"), (86400 * 30, "month"), (86400 * 7, "week"), (86400, "day"),
                       (3600, "hour"), (60, "minute")):  # fmt: skip
        if seconds >= span:
            n = int(seconds // span)
            return f"{n} {unit}{'s' if n > 1 else ''} ago"
    return "just now"


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("   ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows)


def cmd_list(args: argparse.Namespace) -> int:
    from pagoda.hub.stores import (
        hf_hub_cache,
        list_models,
        models_folder,
        ollama_models,
    )

    models = list_models()
    if not models:
        print(f"no models found in {models_folder()} ($PAGODA_MODELS), {hf_hub_cache()} (Hugging Face cache) "
              f"or {ollama_models()} (Ollama)", file=sys.stderr)  # fmt: skip
        return 0
    now = time.time()
    rows = [("NAME", "SIZE", "MODIFIED", "WHERE")]
    rows += [(m.name, _human_size(m.size), _ago(m.modified, now), m.where) for m in models]
    print(_table(rows))
    return 0


# ---------------------------------------------------------------------- pagoda pull / rm
def cmd_pull(args: argparse.Namespace) -> int:
    from pagoda.hub.fetch import fetch_hf, name_kind, pull_ollama

    kind = name_kind(args.name)
    if kind == "hub":
        resolved = fetch_hf(args.name, revision=args.revision, hf_file=args.hf_file, progress=True, force=True)
    elif kind == "ollama":
        if args.revision or args.hf_file:
            raise ValueError("--revision and --hf-file apply to Hub names (ORG/NAME)")
        resolved = pull_ollama(args.name, insecure=args.insecure, progress=True)
    else:
        raise ValueError(f"{args.name!r} is neither a Hub name (ORG/NAME[:QUANT]) nor an Ollama name (NAME[:TAG])")
    print(f"pulled {resolved.name}: {resolved.path}")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    from pagoda.hub.fetch import remove_model

    for name in args.name:
        removed = remove_model(name)
        print(f"deleted {name} ({len(removed)} file{'s' if len(removed) != 1 else ''}: {removed[0]}"
              f"{', ...' if len(removed) > 1 else ''})")
    return 0


# ---------------------------------------------------------------------- pagoda ps
def cmd_ps(args: argparse.Namespace) -> int:
    import httpx

    base = f"http://{args.host}:{args.port}"
    api_key = args.api_key or os.environ.get("PAGODA_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with httpx.Client(base_url=base, timeout=args.timeout, headers=headers) as client:
            health = client.get("/health")
            models = client.get("/v1/models")
    except httpx.HTTPError as e:
        print(f"no pagoda server is running at {base} ({type(e).__name__}: {e}); start one with "
              f"`pagoda serve MODEL --host {args.host} --port {args.port}`", file=sys.stderr)  # fmt: skip
        return 1
    if models.status_code == 401:
        print(f"the server at {base} wants an API key: pass --api-key or set PAGODA_API_KEY", file=sys.stderr)
        return 1
    try:
        cards = models.json()["data"]
    except (ValueError, KeyError, TypeError):
        print(f"the server at {base} did not answer /v1/models as pagoda does (HTTP {models.status_code})",
              file=sys.stderr)  # fmt: skip
        return 1
    status = "healthy" if health.status_code == 200 else f"unhealthy (HTTP {health.status_code})"
    try:
        several = "models_loaded" in health.json()
    except ValueError:
        several = False
    if several:   # a server of several models (--models-dir): what is loaded, and until when
        with httpx.Client(base_url=base, timeout=args.timeout, headers=headers) as client:
            loaded = client.get("/api/ps").json()["models"]
        rows = [("NAME", "CONTEXT", "UNTIL", "STATUS")]
        rows += [(m["name"], str(m.get("context_length", "?")), m.get("expires_at", "?"), status) for m in loaded]
        print(_table(rows))
        return 0 if health.status_code == 200 else 1
    rows = [("NAME", "CONTEXT", "PARENT", "STATUS")]
    rows += [(c.get("id", "?"), str(c.get("max_model_len", "?")), c.get("parent") or "-", status) for c in cards]
    print(_table(rows))
    return 0 if health.status_code == 200 else 1


def _localized(config):
    """As `ollama run`: a model no store holds is fetched first (a Hub name from the Hub, an
    Ollama name from its registry)."""
    from pagoda.hub.fetch import localize

    return localize(config, pull_ollama_names=True)


def add_local_commands(sub: argparse._SubParsersAction, add_engine_args, config_from_args) -> None:
    """``run``, ``list`` and ``ps`` on the ``pagoda`` command's subparsers."""
    run = sub.add_parser("run", help="chat with a model in the terminal (as `ollama run`)")
    add_engine_args(run, positional_model=True)
    add_run_args(run)
    run.set_defaults(func=lambda args: cmd_run(args, _localized(config_from_args(args))))

    pull = sub.add_parser("pull", help="fetch a model: ORG/NAME[:QUANT] from the Hugging Face Hub, NAME[:TAG] from "
                                       "Ollama's registry (as `ollama pull`)")
    pull.add_argument("name", help="ORG/NAME or ORG/NAME:QUANT (the Hub), NAME[:TAG] or HOST/NAMESPACE/NAME[:TAG] "
                                   "(Ollama's registry)")
    pull.add_argument("--revision", default=None, help="the Hub revision: a branch, tag or commit (default: main)")
    pull.add_argument("--hf-file", default=None, help="the GGUF file of a Hub repository to fetch")
    pull.add_argument("--insecure", action="store_true", help="reach an Ollama registry over http (a local one)")
    pull.set_defaults(func=cmd_pull)

    rm = sub.add_parser("rm", help="delete a model from the store that holds it (as `ollama rm`)")
    rm.add_argument("name", nargs="+", help="a name as `pagoda list` shows it")
    rm.set_defaults(func=cmd_rm)

    lst = sub.add_parser("list", help="the models found in $PAGODA_MODELS, the Hugging Face cache and Ollama's store")
    lst.set_defaults(func=cmd_list)

    ps = sub.add_parser("ps", help="what a running `pagoda serve` has loaded")
    ps.add_argument("--host", default="127.0.0.1")
    ps.add_argument("--port", type=int, default=8000)
    ps.add_argument("--api-key", default=None, help="the server's API key (or PAGODA_API_KEY)")
    ps.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the server")
    ps.set_defaults(func=cmd_ps)
