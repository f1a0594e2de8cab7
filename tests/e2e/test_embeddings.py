"""POST /v1/embeddings on the real server over the bundled model served with --task embed (mean
pooling, chunked prefill), driven by the official openai client; and its refusals.

Mean pooling of this model puts each of three paraphrase pairs closer to each other than
to any other sentence (checked offline before asserting it: cosine 0.91-0.95 within a
pair, at most 0.83 across).
"""

from __future__ import annotations

import base64
import struct
import time

import httpx
import openai
import pytest
import torch

from pagoda.config import EngineConfig
from pagoda.entrypoints.openai.embedding_protocol import encode_base64
from tests.e2e.server_utils import real_engine_server, running_server

MODEL = "smollm2-embed"
PAIRS = [
    ("The cat sat on the mat.", "A cat was sitting on the rug."),
    ("The stock market fell sharply today.", "Shares dropped steeply on Wall Street this afternoon."),
    ("How do I bake bread at home?", "What is a simple recipe for homemade bread?"),
]
SENTENCES = [s for pair in PAIRS for s in pair]
MAX_MODEL_LEN = 256
ENGINE = {"task": "embed", "override_pooler_config": {"pooling_type": "MEAN"}, "show_progress": False,
          "num_kv_blocks": 64, "block_size": 16, "max_model_len": MAX_MODEL_LEN, "max_num_batched_tokens": 32}


@pytest.fixture(scope="module")
def real_server():
    with real_engine_server(EngineConfig(**ENGINE), served_model_name=MODEL) as (engine, running):
        yield engine, running


@pytest.fixture
def client(real_server):
    _, running = real_server
    with openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


def _wait_all_blocks_free(running, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = httpx.get(f"{running.base_url}/v1/engine/stats", timeout=10).json()
        if (stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0
                and stats["num_free_blocks"] == stats["num_blocks"] > 0):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle with every block free: {stats}")
        time.sleep(0.05)


def test_openai_sdk_float_and_base64(real_server, client):
    _, running = real_server
    assert [m.id for m in client.models.list().data] == [MODEL]
    floats = client.embeddings.create(model=MODEL, input=SENTENCES, encoding_format="float")
    # No encoding_format: the SDK asks for base64 and decodes it (little-endian float32).
    decoded = client.embeddings.create(model=MODEL, input=SENTENCES)
    assert floats.object == "list" and floats.model == MODEL
    assert [d.index for d in floats.data] == list(range(len(SENTENCES)))
    for f, d in zip(floats.data, decoded.data):
        assert len(f.embedding) == 576  # SmolLM2-135M's hidden size
        # Two requests: the engine's thread count may differ between them (its governor), which
        # reorders float sums; the encodings themselves are exact (checked below).
        assert f.embedding == pytest.approx(d.embedding, abs=1e-6, rel=0)
        assert sum(v * v for v in f.embedding) == pytest.approx(1.0, abs=1e-5)
    raw = httpx.post(f"{running.base_url}/v1/embeddings", timeout=60,
                     json={"input": SENTENCES[0], "encoding_format": "base64", "user": "someone"}).json()
    data = base64.b64decode(raw["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(data) // 4}f", data)) == pytest.approx(floats.data[0].embedding, abs=1e-6)
    assert encode_base64(floats.data[0].embedding) != encode_base64(floats.data[1].embedding)
    assert base64.b64decode(encode_base64([1.0, -2.5])) == struct.pack("<2f", 1.0, -2.5)
    assert raw["usage"]["prompt_tokens"] == raw["usage"]["total_tokens"] > 0
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 6 * raw["usage"]["prompt_tokens"] // 2
    _wait_all_blocks_free(running)


def test_paraphrases_are_nearest(client):
    vectors = torch.tensor([d.embedding for d in client.embeddings.create(model=MODEL, input=SENTENCES).data])
    sim = vectors @ vectors.T
    sim.fill_diagonal_(-1)
    partner = [i ^ 1 for i in range(len(SENTENCES))]   # 0<->1, 2<->3, 4<->5
    assert sim.argmax(dim=1).tolist() == partner


def test_equals_offline_and_transformers(client, hf_default_model, default_model_path):
    """The same vectors as LLM.embed, and as transformers' mean of the final hidden states
    of the same GGUF (token ids in, so both see the same tokens)."""
    from pagoda.engine.llm import LLM

    llm = LLM(**ENGINE)
    ids = [llm.get_tokenizer().encode(s) for s in SENTENCES[:3]] + [list(range(100, 100 + 70))]
    served = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    served = torch.tensor([d.embedding for d in served.data])
    offline = torch.tensor([o.outputs.embedding for o in llm.embed([{"prompt_token_ids": i} for i in ids],
                                                                    use_tqdm=False)])
    torch.testing.assert_close(served, offline, atol=1e-5, rtol=0)
    with torch.inference_mode():
        for row, token_ids in zip(served, ids):
            hidden = hf_default_model.model(torch.tensor([token_ids])).last_hidden_state[0]
            want = torch.nn.functional.normalize(hidden.mean(dim=0), dim=-1)
            torch.testing.assert_close(row, want, atol=2e-4, rtol=0)


def _error(running, body: dict, path: str = "/v1/embeddings") -> tuple[int, dict]:
    r = httpx.post(f"{running.base_url}{path}", json=body, timeout=60)
    return r.status_code, r.json()["error"]


def test_bad_input_is_a_clear_400(real_server, client):
    _, running = real_server
    for body, needle in [
        ({"input": ""}, "empty string"),
        ({"input": []}, "must not be empty"),
        ({"input": ["fine", ""]}, "empty strings"),
        ({"input": [[1, 2], []]}, "empty lists"),
        ({"input": "x", "dimensions": 64}, "does not support Matryoshka"),
        ({"input": "x", "dimensions": 0}, "dimensions must be a positive integer"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "normalize": False}, "Unrecognized request argument"),
        ({"input": [1, 49152]}, "out of vocabulary"),
        ({"input": ["ok", [1, 2]]}, "must be a string, a list of strings"),  # no mixing, as OpenAI
        ({"input": [[1, 2], [7] * (MAX_MODEL_LEN + 1)]},
         f"input[1]: This model's maximum context length (max_model_len) is {MAX_MODEL_LEN} tokens"),
        ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ]:
        status, err = _error(running, body)
        assert status == 400, (body, err)
        assert needle in err["message"], (body, err)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="x")
    # Too long, but truncated to the context length: it fits.
    ok = httpx.post(f"{running.base_url}/v1/embeddings", timeout=60,
                    json={"input": [7] * (MAX_MODEL_LEN + 50), "truncate_prompt_tokens": -1}).json()
    assert ok["usage"]["prompt_tokens"] == MAX_MODEL_LEN
    # Generation routes refuse on an embedding server.
    status, err = _error(running, {"messages": [{"role": "user", "content": "hi"}]}, "/v1/chat/completions")
    assert status == 400 and err["code"] == "wrong_task"
    status, err = _error(running, {"prompt": "hi", "max_tokens": 2}, "/v1/completions")
    assert status == 400 and err["code"] == "wrong_task"
    _wait_all_blocks_free(running)


def test_disconnect_aborts_every_input(real_server):
    """A batch far too long for the client's patience: once it hangs up, every input is
    aborted in the engine and every KV block comes back, long before the batch would end."""
    _, running = real_server
    before = httpx.get(f"{running.base_url}/metrics", timeout=10).text
    inputs = [[(i * 7 + j) % 4000 + 10 for j in range(200)] for i in range(64)]  # 64 x 200 tokens, 32 per step
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{running.base_url}/v1/embeddings", json={"input": inputs}, timeout=httpx.Timeout(30, read=1.0))
    start = time.monotonic()
    _wait_all_blocks_free(running, timeout=10)
    assert time.monotonic() - start < 10
    after = httpx.get(f"{running.base_url}/metrics", timeout=10).text
    assert _aborted(after) - _aborted(before) >= 60  # (a few may have finished before the hang-up)


def _aborted(metrics: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("pagoda:request_aborted_total"))


def test_generate_server_refuses_embeddings():
    """vLLM's behaviour: /v1/embeddings on a server that generates is a 400, not a 404."""
    from tests.e2e.fake_engine import FakeEngine

    with running_server(FakeEngine()) as running, \
            openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="x", max_retries=0) as c:
        with pytest.raises(openai.BadRequestError) as e:
            c.embeddings.create(model="pagoda-test", input="hello")
        assert e.value.code == "wrong_task"
        assert "does not serve embeddings" in e.value.message


def test_ollama_embed_routes_give_the_same_vectors(real_server, client):
    """Ollama's /api/embed (and the older /api/embeddings) through the official ollama client:
    the vectors of /v1/embeddings, token counts, and a clear error for options."""
    import ollama

    _, running = real_server
    reference = [d.embedding for d in client.embeddings.create(model=MODEL, input=SENTENCES[:3],
                                                                encoding_format="float").data]  # fmt: skip
    oc = ollama.Client(host=running.base_url, timeout=120)
    out = oc.embed(model=f"{MODEL}:latest", input=SENTENCES[:3])
    assert len(out.embeddings) == 3
    for got, want in zip(out.embeddings, reference):
        assert got == pytest.approx(want, abs=1e-6, rel=0)
    num_tokens = client.embeddings.create(model=MODEL, input=SENTENCES[:3]).usage.prompt_tokens
    assert out.prompt_eval_count == num_tokens and out.total_duration > 0
    one = oc.embed(model=MODEL, input=SENTENCES[0])
    assert one.embeddings[0] == pytest.approx(reference[0], abs=1e-6, rel=0)
    legacy = oc.embeddings(model=MODEL, prompt=SENTENCES[1])
    assert list(legacy.embedding) == pytest.approx(reference[1], abs=1e-6, rel=0)
    # truncate (Ollama's default true) keeps an over-long input's last tokens; false refuses it.
    long_text = "word " * (MAX_MODEL_LEN + 50)
    assert len(oc.embed(model=MODEL, input=long_text).embeddings[0]) == 576
    with pytest.raises(ollama.ResponseError) as err:
        oc.embed(model=MODEL, input=long_text, truncate=False)
    assert err.value.status_code == 400 and "maximum context length" in str(err.value)
    with pytest.raises(ollama.ResponseError) as err:
        oc.embed(model=MODEL, input="x", options={"temperature": 0.5})
    assert err.value.status_code == 400 and "temperature" in str(err.value)
    with pytest.raises(ollama.ResponseError) as err:
        oc.embed(model="nope", input="x")
    assert err.value.status_code == 404
    _wait_all_blocks_free(running)


def test_score_and_rerank_are_the_embeddings_cosines(real_server, client):
    """/v1/score (vLLM's shape) and /rerank (Jina's / Cohere's): each pair's cosine of the
    vectors /v1/embeddings gives, a paraphrase ranked first, top_n and return_documents
    honoured; a generating server answers them with a 400, and /classify (a classifier's) is a 400
    here (cross-encoders: tests/e2e/test_cross_encoders.py)."""
    _, running = real_server
    vectors = torch.tensor([d.embedding for d in client.embeddings.create(model=MODEL, input=SENTENCES).data])
    vectors = vectors / vectors.norm(dim=1, keepdim=True)
    r = httpx.post(f"{running.base_url}/v1/score", json={"model": MODEL, "text_1": SENTENCES[0],
                                                         "text_2": SENTENCES[1:]}, timeout=60).json()
    got = [d["score"] for d in r["data"]]
    want = (vectors[1:] @ vectors[0]).tolist()
    assert [d["index"] for d in r["data"]] == list(range(5)) and r["usage"]["prompt_tokens"] > 0
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
    for path in ("/rerank", "/v1/rerank"):
        r = httpx.post(f"{running.base_url}{path}", json={"model": MODEL, "query": SENTENCES[2],
                                                         "documents": SENTENCES[3:] + SENTENCES[:2], "top_n": 2},
                       timeout=60).json()
        assert [x["index"] for x in r["results"]][0] == 0   # its paraphrase, SENTENCES[3]
        assert len(r["results"]) == 2 and r["results"][0]["document"]["text"] == SENTENCES[3]
        assert r["results"][0]["relevance_score"] >= r["results"][1]["relevance_score"]
    r = httpx.post(f"{running.base_url}/rerank", json={"query": "q", "documents": ["a"], "return_documents": False},
                   timeout=60).json()
    assert "document" not in r["results"][0]
    status, err = _error(running, {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "/v1/score")
    assert status == 400 and err["param"] == "text_1"
    status, err = _error(running, {"input": "a sentence"}, "/classify")
    assert status == 400 and err["code"] == "wrong_task" and "this server embeds" in err["message"]
    from tests.e2e.fake_engine import FakeEngine

    with running_server(FakeEngine()) as generating:
        status, err = _error(generating, {"text_1": "a", "text_2": "b"}, "/v1/score")
        assert status == 400 and err["code"] == "wrong_task"
