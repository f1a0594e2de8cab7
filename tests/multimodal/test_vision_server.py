"""Images through the OpenAI chat API on a real server (loopback) with the official client:
base64 data URLs, the same greedy tokens as the offline engine (itself equal to
transformers, test_idefics3.py), streaming, a second request with the same image served
from the prefix cache, and every bad image a 400 naming its part with nothing leaked."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import openai
import pytest

from pagoda import LLM, SamplingParams
from tests.e2e.server_utils import real_engine_server
from tests.e2e.test_real_engine import _wait_idle
from tests.multimodal.checkpoints import random_image, write_idefics3

MODEL = "tiny-smolvlm"


def _png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _huge_png() -> bytes:
    """A valid 1x1 PNG whose header claims 100000 x 100000 pixels (CRC fixed)."""
    data = bytearray(_png(random_image(1, 1)))
    at = data.index(b"IHDR")
    data[at + 4:at + 12] = struct.pack(">II", 100_000, 100_000)
    data[at + 17:at + 21] = struct.pack(">I", zlib.crc32(bytes(data[at:at + 17])))
    return bytes(data)


def _gif(frames: int) -> bytes:
    buf = io.BytesIO()
    images = [random_image(8, 8, seed=s).convert("P") for s in range(frames)]
    images[0].save(buf, format="GIF", save_all=True, append_images=images[1:], duration=50)
    return buf.getvalue()


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return write_idefics3(str(tmp_path_factory.mktemp("smolvlm")))


@pytest.fixture(scope="module")
def server(vlm_dir):
    from pagoda.config import EngineConfig

    config = EngineConfig(model=vlm_dir, show_progress=False, num_kv_blocks=128, block_size=16, max_model_len=1024,
                          limit_mm_per_prompt='{"image": 2}')
    with real_engine_server(config, served_model_name=MODEL) as (engine, running):
        yield engine, running


@pytest.fixture
def client(server):
    _, running = server
    with openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


def _ask(url: str, text: str = "What is this?", detail: str | None = None) -> list[dict]:
    image = {"url": url} if detail is None else {"url": url, "detail": detail}
    return [{"role": "user", "content": [{"type": "image_url", "image_url": image}, {"type": "text", "text": text}]}]


def test_data_url_image_equals_the_offline_engine(vlm_dir, server, client):
    _, running = server
    image = random_image(100, 60, seed=1)
    offline = LLM(vlm_dir, show_progress=False, num_kv_blocks=64, block_size=16)
    [want] = offline.chat(_ask(_data_url(_png(image))), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                          use_tqdm=False)
    kwargs = dict(model=MODEL, messages=_ask(_data_url(_png(image))), max_tokens=12, temperature=0,
                  extra_body={"ignore_eos": True, "return_token_ids": True})
    r = client.chat.completions.create(**kwargs)
    assert r.choices[0].token_ids == want.outputs[0].token_ids
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    # Streamed, the same text; the second time the image's blocks come from the cache.
    stream = client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    usage = chunks[-1].usage
    assert usage.prompt_tokens_details.cached_tokens == (len(want.prompt_token_ids) - 1) // 16 * 16
    # detail "low": one tile, fewer tokens, still served.
    low = client.chat.completions.create(**{**kwargs, "messages": _ask(_data_url(_png(image)), detail="low")})
    assert low.usage.prompt_tokens < r.usage.prompt_tokens
    _wait_idle(running)


@pytest.mark.parametrize("url, says", [
    (_data_url(b"not an image at all"), "not an image"),
    (_data_url(_png(random_image(64, 64))[:60]), "could not be decoded"),
    ("data:image/png;base64,", "empty"),
    ("data:image/png;base64,@@@@", "not valid base64"),
    (_data_url(_huge_png()), "the limit is 40000000 pixels"),
    (_data_url(_gif(3), "image/gif"), "animated"),
    (_data_url(b"hello", "text/plain"), "not an image"),
    ("https://example.com/cat.png", "fetches no image URLs"),
])  # fmt: skip
def test_bad_images_are_400s_naming_the_part(server, client, url, says):
    _, running = server
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=_ask(url), max_tokens=4)
    body = err.value.body
    assert err.value.status_code == 400 and body["param"] == "messages.[0].content.[0]", body
    assert says in body["message"]
    _wait_idle(running)


def test_image_limits_and_marker_mismatch(server, client):
    _, running = server
    url = _data_url(_png(random_image(32, 32)))
    three = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}] * 3}]
    with pytest.raises(openai.BadRequestError, match="at most 2 image"):
        client.chat.completions.create(model=MODEL, messages=three, max_tokens=4)
    # Text that writes the image marker itself: the count no longer matches the images.
    with pytest.raises(openai.BadRequestError, match="image placeholder|image tokens"):
        client.chat.completions.create(model=MODEL, messages=_ask(url, "look: <image>"), max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="detail must be"):
        client.chat.completions.create(model=MODEL, messages=_ask(url, detail="ultra"), max_tokens=4)
    ok = client.chat.completions.create(model=MODEL, messages=_ask(url), max_tokens=4)
    assert ok.choices[0].finish_reason in ("length", "stop")
    _wait_idle(running)


def test_ollama_and_anthropic_images_equal_the_openai_route(server, client):
    """The same image through Ollama's ``images`` (chat and generate) and an Anthropic base64
    ``image`` block, with the official clients: the same prompt and greedy text as OpenAI's
    image_url; their bad images are 400s too."""
    import anthropic
    import ollama

    _, running = server
    png = _png(random_image(90, 50, seed=7))
    b64 = base64.b64encode(png).decode()
    want = client.chat.completions.create(model=MODEL, messages=_ask(_data_url(png), "Describe it."), max_tokens=8,
                                          temperature=0, extra_body={"ignore_eos": True})
    oc = ollama.Client(host=running.base_url, timeout=120)
    options = {"temperature": 0, "num_predict": 8}
    # Ollama puts a message's images before its text, as the OpenAI request above does.
    chat = oc.chat(model=MODEL, messages=[{"role": "user", "content": "Describe it.", "images": [b64]}],
                   options=options)
    gen = oc.generate(model=MODEL, prompt="Describe it.", images=[b64], options=options)
    ac = anthropic.Anthropic(base_url=running.base_url, api_key="x", max_retries=0)
    msg = ac.messages.create(model=MODEL, max_tokens=8, extra_body={"temperature": 0}, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
        {"type": "text", "text": "Describe it."}]}])  # fmt: skip
    text = want.choices[0].message.content
    if want.choices[0].finish_reason == "length":
        assert chat.message.content == gen.response == msg.content[0].text == text
    # (Anthropic counts the prompt's cached tokens apart.)
    anthropic_prompt = msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    assert chat.prompt_eval_count == gen.prompt_eval_count == anthropic_prompt == want.usage.prompt_tokens
    with pytest.raises(ollama.ResponseError) as err:
        oc.chat(model=MODEL, messages=[{"role": "user", "content": "x", "images": ["aGVsbG8="]}])
    assert err.value.status_code == 400 and "not an image" in str(err.value)
    with pytest.raises(anthropic.BadRequestError, match="not an image"):
        ac.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "aGVsbG8="}}]}])
    _wait_idle(running)


def test_responses_input_image_equals_chat(server, client):
    _, running = server
    png = _png(random_image(70, 90, seed=8))
    want = client.chat.completions.create(model=MODEL, messages=_ask(_data_url(png), "Describe it."), max_tokens=8,
                                          temperature=0)
    r = client.responses.create(model=MODEL, max_output_tokens=8, temperature=0, input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": _data_url(png)}, {"type": "input_text", "text": "Describe it."}]}])
    assert r.usage.input_tokens == want.usage.prompt_tokens
    assert r.output_text == want.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="file_id"):
        client.responses.create(model=MODEL, input=[{"role": "user", "content": [
            {"type": "input_image", "file_id": "file-1"}]}])
    _wait_idle(running)


def test_encoder_metrics(server, client):
    """/metrics counts images encoded, encoder-cache hits and encoder seconds: a resent image
    whose prompt is not cached (another question after it) is read from the encoder cache."""
    import httpx

    _, running = server

    def metric(name: str) -> float:
        text = httpx.get(f"{running.base_url}/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"pagoda:{name}"))

    url = _data_url(_png(random_image(50, 50, seed=21)))
    runs, hits = metric("encoder_runs_total"), metric("encoder_cache_hits_total")
    client.chat.completions.create(model=MODEL, messages=_ask(url, "One?"), max_tokens=2)
    assert metric("encoder_runs_total") == runs + 1 and metric("encoder_seconds_total") > 0
    # The same image after other text: no prefix hit on its blocks, the encoder cache answers.
    other = [{"role": "user", "content": [{"type": "text", "text": "First this."},
                                          {"type": "image_url", "image_url": {"url": url}}]}]
    client.chat.completions.create(model=MODEL, messages=other, max_tokens=2)
    assert metric("encoder_runs_total") == runs + 1 and metric("encoder_cache_hits_total") > hits
    _wait_idle(running)


def test_pagoda_run_sends_an_image_with_the_first_prompt(server, client, tmp_path):
    """`pagoda run MODEL --image PATH`: the first prompt carries the image (the same prompt
    and text as the OpenAI route), later turns resend it from the history."""
    import argparse

    from pagoda.entrypoints.local import TerminalChat, add_run_args
    from pagoda.hub.stores import NO_DEFAULTS

    engine, running = server
    png = _png(random_image(60, 40, seed=31))
    path = tmp_path / "picture.png"
    path.write_bytes(png)
    parser = argparse.ArgumentParser()
    add_run_args(parser)
    args = parser.parse_args(["--image", str(path), "--temperature", "0", "--max-tokens", "6"])
    out = io.StringIO()
    chat = TerminalChat(engine, NO_DEFAULTS, args, out)
    reply = running.call(chat.reply("What is it?"))
    chat.remember("What is it?", reply)
    want = client.chat.completions.create(model=MODEL, messages=_ask(_data_url(png), "What is it?"), max_tokens=6,
                                          temperature=0)
    assert reply.prompt_tokens == want.usage.prompt_tokens and reply.text == want.choices[0].message.content
    assert out.getvalue() == reply.text
    second = running.call(chat.reply("And then?"))
    assert second.prompt_tokens > reply.prompt_tokens + reply.generated_tokens
    with pytest.raises(ValueError, match="--image"):
        TerminalChat(engine, NO_DEFAULTS, parser.parse_args(["--image", str(tmp_path / "none.png")]), out)
    _wait_idle(running)


def test_bench_serve_random_mm(server, vlm_dir, tmp_path):
    """`pagoda bench serve --dataset random-mm`: a new random image before each prompt's text;
    every request is served and counted; a malformed --image-size is refused."""
    import json

    from pagoda.entrypoints.cli import build_parser

    _, running = server
    out = tmp_path / "result.json"
    args = build_parser().parse_args(
        ["bench", "serve", "--base-url", running.base_url, "--endpoint", "/v1/chat/completions", "--no-progress",
         "--ignore-eos", "--dataset", "random-mm", "--image-size", "70x40", "--num-prompts", "4",
         "--max-concurrency", "2", "--input-len", "8", "--output-len", "4", "--num-warmups", "0",
         "--tokenizer", vlm_dir, "--save-result", str(out)])  # fmt: skip
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    assert report["workload"]["dataset"] == "random-mm" and report["workload"]["image_size"] == [70, 40]
    m = report["points"][0]["metrics"]
    assert (m["completed"], m["failed"], m["total_output_tokens"]) == (4, 0, 16)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "serve", "--image-size", "70by40"])
    _wait_idle(running)
