"""Local use with the real model, found by name in stores written as their tools write them
(tests/fake_stores.py): ``LLM(name)``, ``pagoda serve NAME`` with ``pagoda ps``, and
``pagoda run NAME`` driven in a terminal (tmux)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from pagoda import LLM, SamplingParams
from pagoda.entrypoints.cli import main
from tests.fake_stores import OLLAMA_PARAMS, OLLAMA_SYSTEM, build_stores

REPO = Path(__file__).resolve().parents[2]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# What the smollm2 store model's params layer says, spelt out.
EXPLICIT = SamplingParams(temperature=0, top_k=1, stop=["."], max_tokens=OLLAMA_PARAMS["num_predict"])


@pytest.fixture(scope="module")
def stores(tmp_path_factory, default_model_path, tiny_llama_dir):
    stores = build_stores(tmp_path_factory.mktemp("stores"), default_model_path, tiny_llama_dir)
    with pytest.MonkeyPatch.context() as mp:
        for key, value in stores.env().items():
            mp.setenv(key, value)
        yield stores


def _env(stores) -> dict[str, str]:
    return {**os.environ, **stores.env(), "PYTHONPATH": str(REPO)}


# ---------------------------------------------------------------------- LLM(name)
def test_llm_by_ollama_name_applies_its_layers(stores):
    llm = LLM("smollm2", num_kv_blocks=32, show_progress=False)
    try:
        assert llm.engine.max_model_len == OLLAMA_PARAMS["num_ctx"]  # the params layer's num_ctx
        by_default = llm.chat(QUESTION, use_tqdm=False)[0]
        explicit = llm.chat([{"role": "system", "content": OLLAMA_SYSTEM}, *QUESTION], EXPLICIT, use_tqdm=False)[0]
        # The system layer and the params layer, applied, are the same request spelt out.
        assert by_default.prompt_token_ids == explicit.prompt_token_ids
        assert by_default.outputs[0].token_ids == explicit.outputs[0].token_ids
        assert by_default.outputs[0].text == explicit.outputs[0].text
        # ... and they did something: the stop string ended the answer where it first came.
        unstopped = llm.chat([{"role": "system", "content": OLLAMA_SYSTEM}, *QUESTION],
                             SamplingParams(temperature=0, max_tokens=OLLAMA_PARAMS["num_predict"]),
                             use_tqdm=False)[0].outputs[0].text  # fmt: skip
        assert by_default.outputs[0].finish_reason == "stop"
        assert unstopped.startswith(by_default.outputs[0].text + ".")
        # A conversation's own system message replaces the default one.
        other = llm.chat([{"role": "system", "content": "Be brief."}, *QUESTION], use_tqdm=False)[0]
        assert other.prompt_token_ids != by_default.prompt_token_ids
    finally:
        llm.shutdown()


def test_llm_by_hf_cache_name(stores, tiny_llama_dir):
    prompt = {"prompt_token_ids": [1, 5, 9, 13]}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    by_name = LLM("org/tiny", skip_tokenizer_init=True, num_kv_blocks=16, show_progress=False)
    assert by_name.engine.loaded.path.startswith(str(stores.hf.root))
    by_path = LLM(tiny_llama_dir, skip_tokenizer_init=True, num_kv_blocks=16, show_progress=False)
    assert by_name.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == \
        by_path.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids


# ---------------------------------------------------------------------- pagoda serve NAME, pagoda ps
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(proc: subprocess.Popen, base: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"pagoda serve exited with {proc.returncode}: {proc.stderr.read()[-3000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError("pagoda serve did not become healthy in time")


def test_serve_by_name_and_ps(stores, capsys):
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", "smollm2", "--port", str(port),
         "--num-kv-blocks", "32", "--disable-log-stats"],
        env=_env(stores), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        _wait_healthy(proc, base)
        assert main(["ps", "--port", str(port)]) == 0
        rows = [line.split() for line in capsys.readouterr().out.splitlines()]
        assert rows == [["NAME", "CONTEXT", "PARENT", "STATUS"], ["smollm2:latest", "1024", "-", "healthy"]]
        with openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120) as client:
            by_default = client.chat.completions.create(model="smollm2:latest", messages=QUESTION)
            explicit = client.chat.completions.create(
                model="smollm2:latest", messages=[{"role": "system", "content": OLLAMA_SYSTEM}, *QUESTION],
                temperature=0, stop=["."], max_tokens=OLLAMA_PARAMS["num_predict"], extra_body={"top_k": 1},
            )  # fmt: skip
        assert by_default.choices[0].message.content == explicit.choices[0].message.content
        assert by_default.usage.prompt_tokens == explicit.usage.prompt_tokens
        assert by_default.choices[0].finish_reason == "stop"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert proc.returncode == 0
    assert main(["ps", "--port", str(port)]) == 1
    assert f"no pagoda server is running at {base}" in capsys.readouterr().err


# ---------------------------------------------------------------------- pagoda run NAME in a terminal
class Terminal:
    """A command in a tmux session of its own (a pseudo-terminal): keys in, screen out."""

    def __init__(self, tmp_path: Path, command: list[str], env: dict[str, str]) -> None:
        self.sock = str(tmp_path / "tmux.sock")
        # The pane stays after its command ends, so that its exit status can be read.
        conf = tmp_path / "tmux.conf"
        conf.write_text("set -g remain-on-exit on\n")
        subprocess.run(["tmux", "-S", self.sock, "-f", str(conf), "new-session", "-d", "-x", "150", "-y", "50",
                        *command], env=env, check=True)  # fmt: skip

    def exit_status(self) -> int | None:
        """The command's exit status once it ended, else None."""
        fields = subprocess.run(["tmux", "-S", self.sock, "display-message", "-p", "#{pane_dead} #{pane_dead_status}"],
                                capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
        return int(fields[1]) if fields[:1] == ["1"] and len(fields) == 2 else None

    def wait_exit(self, timeout: float = 60.0) -> int:
        deadline = time.monotonic() + timeout
        while (status := self.exit_status()) is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"the command did not exit; the screen:\n{self.screen()}")
            time.sleep(0.1)
        return status

    def screen(self) -> str:
        return subprocess.run(["tmux", "-S", self.sock, "capture-pane", "-p", "-J", "-S", "-2000"],
                              capture_output=True, text=True, check=True).stdout  # fmt: skip

    def send(self, *keys: str) -> None:
        subprocess.run(["tmux", "-S", self.sock, "send-keys", *keys], check=True)

    def wait(self, predicate, timeout: float = 120.0, what: str = "") -> str:
        deadline = time.monotonic() + timeout
        while True:
            screen = self.screen()
            if predicate(screen):
                return screen
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; the screen:\n{screen}")
            time.sleep(0.1)

    def close(self) -> None:
        subprocess.run(["tmux", "-S", self.sock, "kill-server"], check=False)


def _stats(screen: str) -> list[tuple[int, int]]:
    return [(int(p), int(g)) for p, g in re.findall(r"prompt tokens: (\d+)\ngenerated tokens: (\d+)", screen)]


def _prompts(screen: str) -> int:
    return len(re.findall(r"^>>> ", screen, re.MULTILINE))


@pytest.mark.slow  # five replies: 6 s on an idle machine, over a minute on a busy one
@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux for a pseudo-terminal")
def test_run_chats_in_the_terminal(stores, tmp_path):
    # No length limit at first: the reply to stop with Ctrl-C could run to the context's end.
    term = Terminal(tmp_path, [sys.executable, "-m", "pagoda.entrypoints.cli", "run", "myns/plain:v1",
                               "--temperature", "0", "--verbose", "--max-model-len", "1024", "--num-kv-blocks", "32"],
                    _env(stores))  # fmt: skip
    try:
        term.wait(lambda s: _prompts(s) == 1, 180, "the first prompt")
        term.send("/?", "Enter")
        term.wait(lambda s: "/clear" in s and _prompts(s) == 2, what="the help")
        # A long answer, stopped by Ctrl-C once its first words are on the screen (so it streams).
        term.send("Tell me a long story about a dragon.", "Enter")
        term.wait(lambda s: re.search(r"^>>> Tell me a long story about a dragon\.\n.*\S", s, re.MULTILINE)
                  is not None, what="the reply to start")  # fmt: skip
        term.send("C-c")
        screen = term.wait(lambda s: "(reply stopped)" in s and _prompts(s) == 3, what="the prompt after Ctrl-C")
        assert _stats(screen) == []  # the stopped reply printed no stats: it did not run to its end
        term.send("/set parameter mirostat 1", "Enter")
        term.wait(lambda s: "'mirostat' is not supported" in s and _prompts(s) == 4, what="the refused parameter")
        term.send("/set parameter num_predict 24", "Enter")
        term.wait(lambda s: "Set parameter 'num_predict'" in s and _prompts(s) == 5, what="/set parameter")
        # The next turns work, and the second one carries the first in its prompt (history).
        term.send("Say hello.", "Enter")
        screen = term.wait(lambda s: len(_stats(s)) == 1 and _prompts(s) == 6, what="the first full reply")
        assert _stats(screen)[0][1] <= 24
        term.send("Say it again.", "Enter")
        screen = term.wait(lambda s: len(_stats(s)) == 2 and _prompts(s) == 7, what="the second reply")
        (first_prompt, first_generated), (second_prompt, _) = _stats(screen)
        assert second_prompt > first_prompt + first_generated
        # After /clear the same question has the same prompt as the first time: no history,
        # and the stopped turn was never part of it.
        term.send("/clear", "Enter")
        term.wait(lambda s: "Cleared the conversation." in s and _prompts(s) == 8, what="/clear")
        term.send("Say hello.", "Enter")
        screen = term.wait(lambda s: len(_stats(s)) == 3 and _prompts(s) == 9, what="the reply after /clear")
        assert _stats(screen)[2][0] == first_prompt
        term.send("/bye", "Enter")
        assert term.wait_exit() == 0
    finally:
        term.close()


# Slow (make test-all): in make test's runs its Ctrl-C at the prompt went unanswered now and
# then (three runs of four on two workers, once run alone right after other tests of this
# file under make); alone, on a loaded machine, with SIGINT ignored or blocked in pytest's
# process, it passes. Cause not found yet: kept out of the default run until it is.
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux for a pseudo-terminal")
def test_run_ctrl_c_at_the_prompt_and_one_shot(stores, tmp_path):
    command = [sys.executable, "-m", "pagoda.entrypoints.cli", "run", "mine"]
    term = Terminal(tmp_path, [*command, "--num-kv-blocks", "32"], _env(stores))
    try:
        term.wait(lambda s: _prompts(s) == 1, 180, "the prompt")
        term.send("C-c")
        assert term.wait_exit() == 0
    finally:
        term.close()
    # With a prompt: answer once and exit, as `ollama run MODEL "question"`.
    done = subprocess.run([*command, "What is the capital of France?", "--temperature", "0", "--max-tokens", "12",
                           "--num-kv-blocks", "32"],
                          env=_env(stores), capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    llm_answer = done.stdout.strip()
    assert llm_answer and ">>>" not in done.stdout


def test_run_stopped_reply_gives_every_block_back(stores):
    """What Ctrl-C does in ``pagoda run``: the reply's task is cancelled, and the engine
    request is aborted at once, its KV blocks free for the next prompt."""
    import argparse
    import asyncio
    import io

    from pagoda.config import EngineConfig
    from pagoda.engine.async_llm import AsyncLLM
    from pagoda.entrypoints.local import TerminalChat, add_run_args
    from pagoda.hub.stores import model_defaults

    parser = argparse.ArgumentParser()
    add_run_args(parser)
    config = EngineConfig(model="myns/plain:v1", num_kv_blocks=32, max_model_len=1024, show_progress=False)

    async def scenario() -> None:
        engine = AsyncLLM.from_config(config, multiprocess=False, log_stats=False, log_requests=False)
        try:
            out = io.StringIO()
            chat = TerminalChat(engine, model_defaults(config.model), parser.parse_args([]), out)
            task = asyncio.create_task(chat.reply("Tell me a long story about a dragon."))
            while not out.getvalue():
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert engine.num_unfinished_requests == 0
            deadline = time.monotonic() + 10
            while (stats := engine.latest_stats()).num_free_blocks != stats.num_blocks or stats.num_running_reqs:
                assert time.monotonic() < deadline, f"blocks not given back: {stats}"
                await asyncio.sleep(0.05)
            # And the conversation goes on.
            chat.set_parameter("num_predict", "4")
            assert (await chat.reply("Hi!")).generated_tokens <= 4
        finally:
            await engine.shutdown()

    asyncio.run(scenario())
