"""`pagoda bench serve`'s tokenizer: --tokenizer, else --model where it names local files
(as vLLM's benchmark takes it; it used the bundled model's whatever --model said), else
the bundled model's."""

from __future__ import annotations

from pagoda.bench.serve import load_client_tokenizer, tokenizer_source
from pagoda.entrypoints.cli import build_parser


def _args(*extra: str):
    return build_parser().parse_args(["bench", "serve", "--base-url", "http://127.0.0.1:9", *extra])


def test_tokenizer_comes_from_tokenizer_then_a_local_model_then_the_bundled_model(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    model = tmp_path / "model.gguf"
    model.write_bytes(b"")
    assert tokenizer_source(_args()) is None
    assert tokenizer_source(_args("--model", "llama-1b")) is None          # a served name, not a path
    assert tokenizer_source(_args("--model", str(model))) == str(model)
    assert tokenizer_source(_args("--model", str(model), "--tokenizer", str(other))) == str(other)


def test_a_local_model_folder_gives_its_own_tokenizer(tmp_path):
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"unk_token": "[UNK]"}))
    tok = load_client_tokenizer(tokenizer_source(_args("--model", str(tmp_path))))
    assert tok.vocab_size == 3 and tok.encode("hello world", add_special_tokens=False) == [1, 2]
