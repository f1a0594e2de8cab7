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
    assert usage.prompt_tokens_details.cached_tokens == len(want.prompt_token_ids) // 16 * 16
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
    ("https://example.com/cat.png", "only base64 data URLs"),
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
