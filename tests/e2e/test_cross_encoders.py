"""Cross-encoders and classifiers on the real server (task classify), against transformers on
tiny random checkpoints written here, each with a tokenizer of its own:

- a BertForSequenceClassification cross-encoder (one label, BERT's pair template and token
  types): /v1/score, /score and /rerank, /v1/rerank, /v2/rerank give sigmoid(transformers'
  logit) of each (query, document) pair, ranked by it; served with a step budget of one
  context, so the prompts of a request run a few a step, never split;
- a Qwen3ForSequenceClassification with three labels: /classify gives softmax(transformers'
  logits) and the likeliest label's name from id2label;
- a Qwen3ForCausalLM served with --classifier-from-token no,yes (Qwen3-Reranker's way): a
  pair's score is softmax over the LM head's "no" / "yes" logits at the last position, of
  "yes".

And the refusals: bad input, the wrong kind of model for a route, options that do not fit.
"""

from __future__ import annotations

import os

import httpx
import pytest
import torch

from pagoda.config import EngineConfig
from pagoda.engine.llm import LLM
from tests.e2e.server_utils import real_engine_server, running_server

WORDS = ("the a cat dog sat on mat rug what is where are you how do i bake bread at home recipe simple stock market "
         "fell shares dropped street today no yes paris capital of france city river cooking weather sunny rain"
         ).split()
QUERY = "what is the capital of france"
DOCUMENTS = ["paris is the capital of france", "the cat sat on the mat", "how do i bake bread at home",
             "the river city is sunny today", "stock market shares dropped", "a dog", "rain", "where are you"]
MAX_LEN = 64


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory) -> str:
    """A tiny BERT cross-encoder with a WordPiece vocabulary of WORDS (BERT's own tokenizer)."""
    transformers = pytest.importorskip("transformers")
    path = str(tmp_path_factory.mktemp("tiny-bert-cross-encoder"))
    with open(os.path.join(path, "vocab.txt"), "w") as f:
        f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]))
    transformers.BertTokenizerFast(os.path.join(path, "vocab.txt")).save_pretrained(path)
    config = transformers.BertConfig(vocab_size=len(WORDS) + 5, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64, max_position_embeddings=MAX_LEN,
                                     num_labels=1, initializer_range=0.2)
    torch.manual_seed(0)
    transformers.BertForSequenceClassification(config).save_pretrained(path)
    return path


def _qwen3(tmp_path_factory, name: str, cls: str, **fields) -> str:
    """A tiny Qwen3 checkpoint with a word-level tokenizer of WORDS (no pair template: a pair
    is its two texts' tokens joined, as transformers' Qwen tokenizers make it)."""
    transformers = pytest.importorskip("transformers")
    import tokenizers
    from tokenizers import models, pre_tokenizers

    path = str(tmp_path_factory.mktemp(name))
    tok = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", *WORDS])}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(path, "tokenizer.json"))
    config = transformers.Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=128, head_dim=32,
                                      num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                                      max_position_embeddings=256, initializer_range=0.3, rope_theta=1e6, **fields)
    torch.manual_seed(0)
    getattr(transformers, cls)(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def qwen3_classifier_dir(tmp_path_factory) -> str:
    return _qwen3(tmp_path_factory, "tiny-qwen3-seq-cls", "Qwen3ForSequenceClassification",
                  id2label={0: "negative", 1: "neutral", 2: "positive"}, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def qwen3_lm_dir(tmp_path_factory) -> str:
    return _qwen3(tmp_path_factory, "tiny-qwen3-lm", "Qwen3ForCausalLM", tie_word_embeddings=True)


def _engine(path: str, **fields) -> EngineConfig:
    return EngineConfig(model=path, show_progress=False, num_kv_blocks=64, block_size=16, **fields)


def _post(running, path: str, body: dict) -> tuple[int, dict]:
    r = httpx.post(f"{running.base_url}{path}", json=body, timeout=60)
    return r.status_code, r.json()


def _error(running, path: str, body: dict) -> tuple[int, dict]:
    status, body = _post(running, path, body)
    return status, body.get("error", body)


def _word_ids(path: str, *texts: str) -> list[int]:
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    return tok.encode(*texts).ids


# ---- BERT ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bert_server(bert_dir):
    # One context a step: a request's pairs run a few a step, each whole.
    with real_engine_server(_engine(bert_dir, max_model_len=MAX_LEN, max_num_batched_tokens=MAX_LEN),
                            served_model_name="bert-ce") as (_, running):
        yield running


@pytest.fixture(scope="module")
def bert_reference(bert_dir):
    """transformers' score of (query, document): sigmoid of its logit (sentence-transformers'
    CrossEncoder default for one label), from its own tokenizer's pair encoding."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(bert_dir)
    model = transformers.BertForSequenceClassification.from_pretrained(bert_dir, dtype=torch.float32).eval()

    @torch.inference_mode()
    def score(query: str, document: str) -> tuple[float, int]:
        enc = tok(query, document, return_tensors="pt")
        return torch.sigmoid(model(**enc).logits[0, 0]).item(), enc["input_ids"].shape[1]

    return score


def test_bert_scores_equal_transformers(bert_server, bert_reference):
    want = [bert_reference(QUERY, d) for d in DOCUMENTS]
    assert len({round(s, 4) for s, _ in want}) == len(DOCUMENTS)   # distinct: the order below means something
    status, r = _post(bert_server, "/v1/score", {"model": "bert-ce", "text_1": QUERY, "text_2": DOCUMENTS})
    assert status == 200, r
    assert r["object"] == "list" and r["model"] == "bert-ce" and r["id"].startswith("score-")
    assert [d["index"] for d in r["data"]] == list(range(len(DOCUMENTS)))
    assert [d["score"] for d in r["data"]] == pytest.approx([s for s, _ in want], abs=1e-5)
    assert r["usage"]["prompt_tokens"] == r["usage"]["total_tokens"] == sum(n for _, n in want)
    # Pairs of equal lists, on the other path.
    status, r = _post(bert_server, "/score", {"text_1": [QUERY, "a dog"], "text_2": DOCUMENTS[:2]})
    assert status == 200
    pair = [bert_reference(QUERY, DOCUMENTS[0])[0], bert_reference("a dog", DOCUMENTS[1])[0]]
    assert [d["score"] for d in r["data"]] == pytest.approx(pair, abs=1e-5)


def test_bert_rerank_order_and_top_n(bert_server, bert_reference):
    scores = [bert_reference(QUERY, d)[0] for d in DOCUMENTS]
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -scores[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        status, r = _post(bert_server, path, {"query": QUERY, "documents": DOCUMENTS, "top_n": 3})
        assert status == 200, r
        assert [x["index"] for x in r["results"]] == order[:3]
        assert [x["relevance_score"] for x in r["results"]] == pytest.approx([scores[i] for i in order[:3]], abs=1e-5)
        assert [x["document"]["text"] for x in r["results"]] == [DOCUMENTS[i] for i in order[:3]]
    status, r = _post(bert_server, "/rerank", {"query": QUERY, "documents": DOCUMENTS, "return_documents": False})
    assert [x["index"] for x in r["results"]] == order and all("document" not in x for x in r["results"])


def test_bert_refusals(bert_server):
    long_doc = " ".join(["bread"] * MAX_LEN)
    for path, body, status, needle in [
        ("/rerank", {"query": QUERY, "documents": []}, 400, "documents"),
        ("/rerank", {"query": "", "documents": ["a"]}, 400, "query"),
        ("/rerank", {"query": QUERY, "documents": ["a"], "top_n": 0}, 400, "top_n"),
        ("/rerank", {"query": QUERY, "documents": ["a", long_doc]}, 400,
         f"documents[1]: This model's maximum context length (max_model_len) is {MAX_LEN} tokens"),
        ("/rerank", {"query": QUERY, "documents": ["a"], "truncate_prompt_tokens": 8}, 400, "truncate_prompt_tokens"),
        ("/v1/score", {"text_1": [], "text_2": "a"}, 400, "must not be empty"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, 400, "give one text_1"),
        ("/v1/score", {"text_1": "a", "text_2": "b", "temperature": 0.5}, 400, "temperature"),
        ("/classify", {"input": "a dog", "truncate_prompt_tokens": 4}, 400, "[CLS]"),
        ("/v1/embeddings", {"input": "a dog"}, 400, "it is a classifier"),
        ("/v1/completions", {"prompt": "a dog", "max_tokens": 2}, 400, "classifier"),
    ]:
        got, err = _error(bert_server, path, body)
        assert got == status and needle in err["message"], (path, body, err)
    got, err = _error(bert_server, "/v1/embeddings", {"input": "a dog"})
    assert err["code"] == "wrong_task"
    got, err = _error(bert_server, "/rerank", {"model": "nope", "query": QUERY, "documents": ["a"]})
    assert got == 404
    # A one-label model classifies too: its sigmoid, named by its one label.
    status, r = _post(bert_server, "/classify", {"input": ["a dog"]})
    assert status == 200 and r["data"][0]["label"] == "LABEL_0" and r["data"][0]["num_classes"] == 1


# ---- decoders ------------------------------------------------------------------------------


def test_qwen3_classify_equals_transformers(qwen3_classifier_dir):
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(qwen3_classifier_dir,
                                                                            dtype=torch.float32).eval()
    texts = ["the cat sat on the mat", "stock market fell today", "yes", "how do i bake bread at home"]
    with torch.inference_mode():
        want = [torch.softmax(model(torch.tensor([_word_ids(qwen3_classifier_dir, t)])).logits[0], -1) for t in texts]
    with real_engine_server(_engine(qwen3_classifier_dir), served_model_name="qwen3-cls") as (engine, running):
        assert engine.pooler_config.classifier.labels == ("negative", "neutral", "positive")
        status, r = _post(running, "/classify", {"model": "qwen3-cls", "input": texts})
        assert status == 200, r
        assert r["object"] == "list" and r["model"] == "qwen3-cls" and r["id"].startswith("classify-")
        names = ["negative", "neutral", "positive"]
        for i, (d, w) in enumerate(zip(r["data"], want)):
            assert d["index"] == i and d["num_classes"] == 3
            assert d["probs"] == pytest.approx(w.tolist(), abs=1e-5)
            assert d["label"] == names[int(w.argmax())]
        assert r["usage"]["prompt_tokens"] == sum(len(_word_ids(qwen3_classifier_dir, t)) for t in texts)
        ids = _word_ids(qwen3_classifier_dir, texts[1])
        status, one = _post(running, "/classify", {"input": ids})   # token ids in
        assert one["data"][0]["probs"] == pytest.approx(want[1].tolist(), abs=1e-5)
        for path, body, needle in [
            ("/classify", {"input": ""}, "empty string"),
            ("/classify", {"input": [1, 64]}, "out of vocabulary"),
            ("/v1/score", {"text_1": "a", "text_2": "b"}, "3 labels"),
            ("/rerank", {"query": "a", "documents": ["b"]}, "3 labels"),
        ]:
            got, err = _error(running, path, body)
            assert got == 400 and needle in err["message"], (path, err)


def test_qwen3_reranker_from_tokens(qwen3_lm_dir):
    """vLLM's hf_overrides {"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker":
    true} as --classifier-from-token no,yes: a pair's score is P("yes") of the two at the last
    position of the pair's tokens joined."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(qwen3_lm_dir, dtype=torch.float32).eval()
    no, yes = _word_ids(qwen3_lm_dir, "no")[0], _word_ids(qwen3_lm_dir, "yes")[0]
    with torch.inference_mode():
        want = [torch.softmax(model(torch.tensor([_word_ids(qwen3_lm_dir, QUERY, d)])).logits[0, -1, [no, yes]],
                              -1)[1].item() for d in DOCUMENTS]  # fmt: skip
    config = _engine(qwen3_lm_dir, classifier_from_token="no,yes")
    with real_engine_server(config, served_model_name="qwen3-reranker") as (engine, running):
        assert engine.pooler_config.classifier.labels == ("yes",)
        status, r = _post(running, "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS})
        assert status == 200, r
        assert [d["score"] for d in r["data"]] == pytest.approx(want, abs=1e-5)
        status, r = _post(running, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 2})
        assert [x["index"] for x in r["results"]] == sorted(range(len(want)), key=lambda i: -want[i])[:2]
        status, r = _post(running, "/classify", {"input": f"{QUERY} {DOCUMENTS[0]}"})
        assert r["data"][0]["label"] == "yes" and r["data"][0]["probs"] == pytest.approx([want[0]], abs=1e-5)


def test_llama_sequence_classification_offline(tmp_path):
    """Any family pagoda serves as *ForCausalLM, as *ForSequenceClassification: Llama's, token
    ids in (LLM.embed with a classify request), against transformers' logits."""
    import transformers

    from pagoda.pooling import PoolingParams

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3,
                                      num_labels=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForSequenceClassification(config).eval()
    model.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, show_progress=False, num_kv_blocks=16, block_size=16,
              max_num_batched_tokens=16)   # the longer prompt in chunks: only its last position is pooled
    prompts = [[5, 9, 17, 33, 2], list(range(3, 40))]
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], PoolingParams(task="classify"), use_tqdm=False)
    with torch.inference_mode():
        for ids, out in zip(prompts, outs):
            want = model(torch.tensor([ids])).logits[0]
            torch.testing.assert_close(torch.tensor(out.outputs.embedding), want, atol=1e-4, rtol=0)


# ---- the wrong model, the wrong options ------------------------------------------------------


def test_generating_server_refuses_classify():
    from tests.e2e.fake_engine import FakeEngine

    with running_server(FakeEngine()) as running:
        got, err = _error(running, "/classify", {"input": "hello"})
        assert got == 400 and err["code"] == "wrong_task" and "generates text" in err["message"]


def test_options_that_do_not_fit(bert_dir, qwen3_classifier_dir, qwen3_lm_dir):
    def llm(path, **kwargs):
        return LLM(path, show_progress=False, num_kv_blocks=16, block_size=16, **kwargs)

    with pytest.raises(ValueError, match="has none"):
        llm(qwen3_classifier_dir, classifier_from_token="no,yes")
    with pytest.raises(ValueError, match="not tokens of the model's vocabulary"):
        llm(qwen3_lm_dir, classifier_from_token="no,maybe")
    with pytest.raises(ValueError, match="applies to --task classify"):
        llm(qwen3_lm_dir, task="embed", classifier_from_token="no,yes")
    with pytest.raises(ValueError, match="no classification head"):
        llm(qwen3_lm_dir, task="classify")
    with pytest.raises(ValueError, match="cannot generate"):
        llm(qwen3_classifier_dir, task="generate")
    with pytest.raises(ValueError, match="classifier only"):
        llm(bert_dir, task="embed")
    with pytest.raises(ValueError, match="must be at least max_model_len"):
        llm(bert_dir, max_num_batched_tokens=32)
    # "score" is vLLM's older name of the task.
    assert llm(bert_dir, task="score").engine.pooler_config.task == "classify"
