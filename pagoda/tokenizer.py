"""Tokenizer: a thin layer over a `tokenizers.Tokenizer`, built from an HF folder or GGUF metadata.

GGUF files carry no tokenizer.json, only llama.cpp's description of the vocabulary
(`tokenizer.ggml.*`). We rebuild an equivalent `tokenizers` pipeline from it, following
llama.cpp's choices (pre-tokenizer regexes per `tokenizer.ggml.pre`, which tokens are special,
which end generation) so that prompts tokenize the way the model saw them in llama.cpp.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Sequence
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Protocol

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers

if TYPE_CHECKING:
    from pagoda.config import EngineConfig

__all__ = ["Tokenizer", "ChatTemplateError"]

logger = logging.getLogger(__name__)

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Token texts llama.cpp treats as end-of-generation (and forces to control type) whatever the file says.
_EOG_TEXTS = frozenset(
    {
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
        "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
    }
)  # fmt: skip

# --- pre-tokenizer regexes, as llama.cpp's llm_tokenizer_bpe uses them per tokenizer.ggml.pre ---
# llama.cpp's GPT-2 pattern lacks the trailing `|\s+`, but its splitter keeps unmatched text as its own
# piece, which is what the extra alternative does here.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# pre name -> (regexes applied one after another, each splitting the pieces of the previous one;
#              ignore_merges: a piece that is already a whole vocabulary token is taken as is)
_PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {}
for _group, _spec in [
    # 'default' marks files converted without a known pre-tokenizer. llama.cpp then guesses with extra
    # punctuation/number splits; we use the plain GPT-2 pattern, as transformers does for such files.
    (("default", "gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4", "trillion", "granite-docling",
      "gigachat", "mellum", "a.x-4.0", "roberta-bpe"), ((_GPT2,), False)),
    # These vocabularies were trained with every digit a token of its own.
    (("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "minerva"),
     ((r"\p{N}", _GPT2), False)),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
     ((_LLAMA3,), True)),
    (("dbrx", "smaug-bpe"), ((_LLAMA3,), False)),
    (("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez", "hunyuan", "kormo"), ((_QWEN2,), False)),
    (("gpt-4o", "llama4", "minimax-m2"), ((_GPT4O,), False)),
    (("tekken",), ((_TEKKEN,), True)),
]:  # fmt: skip
    for _name in _group:
        _PRE_TOKENIZERS[_name] = _spec

# tokenizer.ggml.pre values for which llama.cpp adds BOS unless the file says otherwise.
_PRE_ADDS_BOS = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                           "tekken", "chameleon"})  # fmt: skip


class ChatTemplateError(ValueError):
    """A chat template called raise_exception(), e.g. because the roles do not alternate."""


class Tokenizer:
    backend: tokenizers.Tokenizer
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    unk_token_id: int | None
    eos_token_ids: frozenset[int]
    add_bos_token: bool
    chat_template: str | None
    vocab_size: int
    all_special_ids: frozenset[int]

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        unk_token_id: int | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        add_bos_token: bool = False,
        chat_template: str | None = None,
        named_chat_templates: dict[str, str] | None = None,
        min_vocab_size: int = 0,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        self.eos_token_ids = frozenset(extra_eos_token_ids) | ({eos_token_id} if eos_token_id is not None else set())
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        self._named_chat_templates = dict(named_chat_templates or {})
        # A GGUF vocabulary may repeat a token text, which the backend then stores once.
        self.vocab_size = max(backend.get_vocab_size(with_added_tokens=True), min_vocab_size)
        specials = {i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
        known = (bos_token_id, eos_token_id, pad_token_id, unk_token_id)
        self.all_special_ids = frozenset(specials | {i for i in known if i is not None})
        # An HF tokenizer.json may add BOS itself through its post-processor; then we must not add another.
        probe = backend.encode("", add_special_tokens=True).ids
        self._backend_adds_bos = bos_token_id is not None and bos_token_id in probe[:1]
        if self._backend_adds_bos:
            self.add_bos_token = True

    # ------------------------------------------------------------------ special token strings
    def _token_text(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)

    @property
    def bos_token(self) -> str | None:
        return self._token_text(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self._token_text(self.eos_token_id)

    def __len__(self) -> int:
        return self.vocab_size

    # ------------------------------------------------------------------ encode / decode
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and not self._backend_adds_bos and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def encode_pair(self, text: str, pair: str) -> tuple[list[int], int | None]:
        """A cross-encoder's (query, document) as transformers' ``tokenizer(text, pair)`` makes
        it: the tokenizer's pair template (BERT: [CLS] text [SEP] pair [SEP]; without one the
        two are joined), and where the second part begins, its first token of type 1 (BERT's
        token type ids; None where the template makes none)."""
        enc = self.backend.encode(text, pair, add_special_tokens=True)
        ids: list[int] = enc.ids
        types: list[int] = enc.type_ids
        if self.add_bos_token and not self._backend_adds_bos and self.bos_token_id is not None:
            ids, types = [self.bos_token_id, *ids], [0, *types]
        return ids, types.index(1) if 1 in types else None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    # ------------------------------------------------------------------ chat template
    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[Any] | None = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        template = chat_template
        if template is None and tools and "tool_use" in self._named_chat_templates:
            template = self._named_chat_templates["tool_use"]
        if template is None:
            template = self.chat_template
        if template is None:
            raise ValueError(
                "this model has no chat template; pass one with --chat-template (a Jinja template file or string)"
            )
        # Like transformers: keys set to None (e.g. OpenAI's content=None with tool calls) are dropped,
        # since templates test for presence rather than for None.
        cleaned = [{k: v for k, v in m.items() if v is not None} for m in messages]
        variables: dict[str, Any] = {
            name: text
            for name, text in (
                ("bos_token", self.bos_token),
                ("eos_token", self.eos_token),
                ("unk_token", self._token_text(self.unk_token_id)),
                ("pad_token", self._token_text(self.pad_token_id)),
            )
            if text is not None
        }
        variables.update(kwargs)  # explicit arguments win over the special-token defaults
        variables.setdefault("documents", None)
        return _compile_template(template).render(
            messages=cleaned, tools=tools, add_generation_prompt=add_generation_prompt, **variables
        )

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_pretrained_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load tokenizer.json plus tokenizer_config.json / generation_config.json from an HF model folder."""
        folder = os.fspath(path)
        tokenizer_file = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            raise FileNotFoundError(f"{folder}: no tokenizer.json (only fast-tokenizer folders are supported)")
        backend = tokenizers.Tokenizer.from_file(tokenizer_file)
        config = _read_json(os.path.join(folder, "tokenizer_config.json"))
        special_map = _read_json(os.path.join(folder, "special_tokens_map.json"))
        generation = _read_json(os.path.join(folder, "generation_config.json"))

        def special_id(name: str) -> int | None:
            value = config.get(name) or special_map.get(name)
            if isinstance(value, dict):  # older files serialize AddedToken objects
                value = value.get("content")
            return backend.token_to_id(value) if isinstance(value, str) else None

        eos_id = special_id("eos_token")
        extra_eos = generation.get("eos_token_id")
        extra_eos_ids = extra_eos if isinstance(extra_eos, list) else [extra_eos] if isinstance(extra_eos, int) else []

        default_template, named = _templates_from_config(config.get("chat_template"))
        jinja_file = os.path.join(folder, "chat_template.jinja")
        if os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                default_template = f.read()

        return cls(
            backend,
            bos_token_id=special_id("bos_token"),
            eos_token_id=eos_id,
            pad_token_id=special_id("pad_token"),
            unk_token_id=special_id("unk_token"),
            extra_eos_token_ids=[i for i in extra_eos_ids if isinstance(i, int)],
            add_bos_token=bool(config.get("add_bos_token", False)),
            chat_template=default_template,
            named_chat_templates=named,
        )

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, Any]) -> Tokenizer:
        """Rebuild the tokenizer a GGUF file describes in its `tokenizer.ggml.*` metadata."""
        model = metadata.get("tokenizer.ggml.model")
        tokens: list[str] | None = metadata.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ValueError("GGUF metadata has no tokenizer.ggml.tokens; pass a tokenizer folder instead")
        types: list[int] = metadata.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
        if len(types) != len(tokens):
            raise ValueError("GGUF tokenizer.ggml.token_type and tokenizer.ggml.tokens differ in length")

        pre = metadata.get("tokenizer.ggml.pre") or "default"
        if model == "gpt2":
            backend = _byte_level_bpe(tokens, metadata.get("tokenizer.ggml.merges") or [], pre)
            default_add_bos = pre in _PRE_ADDS_BOS
        elif model == "llama":
            add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
            scores = metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
            unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
            backend = _sentencepiece_bpe(tokens, types, scores, unk_id, add_space_prefix)
            default_add_bos = True  # llama.cpp's default for SentencePiece vocabularies
        else:
            raise ValueError(
                f"unsupported GGUF tokenizer model {model!r} (supported: 'gpt2' byte-level BPE, "
                "'llama' SentencePiece BPE); pass a tokenizer folder instead"
            )

        def meta_id(key: str) -> int | None:
            value = metadata.get(f"tokenizer.ggml.{key}")
            return value if isinstance(value, int) and 0 <= value < len(tokens) else None

        bos_id, eos_id = meta_id("bos_token_id"), meta_id("eos_token_id")
        eog_ids = {i for i in (meta_id("eot_token_id"), meta_id("eom_token_id")) if i is not None}
        eog_ids |= {i for i, text in enumerate(tokens) if text in _EOG_TEXTS}

        special_ids = {i for i, t in enumerate(types) if t == _CONTROL} | eog_ids
        special_ids |= {i for i in (bos_id, eos_id) if i is not None}
        if "<|return|>" in tokens and "<|call|>" in tokens:
            # GPT-OSS's Harmony vocabulary: <|end|> ends one message of an output, <|return|> and <|call|>
            # end the output (llama.cpp's rule too). It stays a special token.
            eog_ids -= {i for i, text in enumerate(tokens) if text == "<|end|>"}
        # Control tokens are special (matched whole in text, dropped by decode(skip_special_tokens=True));
        # user-defined ones are matched whole but, as in llama.cpp, always rendered by decode.
        backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in sorted(special_ids)])
        user_defined = [i for i, t in enumerate(types) if t == _USER_DEFINED and i not in special_ids]
        backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user_defined])

        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_id=eos_id,
            pad_token_id=meta_id("padding_token_id"),
            unk_token_id=meta_id("unknown_token_id"),
            extra_eos_token_ids=sorted(eog_ids),
            add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", default_add_bos)),
            chat_template=metadata.get("tokenizer.chat_template"),
            min_vocab_size=len(tokens),
        )


# ---------------------------------------------------------------------- GGUF vocabularies
def _bpe_backend(vocab: dict[str, int], merges: list[Any], **options: Any) -> tokenizers.Tokenizer:
    # Going through JSON is faster than models.BPE(vocab, merges) for ~50k-entry vocabularies.
    model = {
        "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
        "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
        "vocab": vocab, "merges": merges,
    }  # fmt: skip
    model.update(options)
    return tokenizers.Tokenizer.from_str(json.dumps({"version": "1.0", "model": model}))


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str) -> tokenizers.Tokenizer:
    """GPT-2 style BPE: tokens are spelled in the byte-to-unicode alphabet, e.g. 'Ġt' for ' t'."""
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(
            f"unsupported GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre); supported: {sorted(_PRE_TOKENIZERS)}"
        )
    regexes, ignore_merges = _PRE_TOKENIZERS[pre]
    # Later duplicates win, as in llama.cpp's token_to_id map.
    vocab = {text: i for i, text in enumerate(tokens)}
    pairs = [m.split(" ", 1) for m in merges]
    backend = _bpe_backend(vocab, pairs, ignore_merges=ignore_merges)
    # Each regex splits the pieces produced by the previous one, as llama.cpp's unicode_regex_split does;
    # ByteLevel then maps the raw bytes of each piece to the token alphabet.
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(
    tokens: list[str], types: list[int], scores: list[float], unk_id: int | None, add_space_prefix: bool
) -> tokenizers.Tokenizer:
    """llama.cpp's SPM tokenizer: greedily merge the adjacent pair forming the best-scoring vocabulary
    token, falling back to <0xXX> byte tokens. Equivalent to BPE whose merge ranks follow the score
    of the merged token, which is how we express it for the `tokenizers` library."""
    vocab = {text: i for i, text in enumerate(tokens)}
    mergeable = {text: i for text, i in vocab.items() if types[i] in (_NORMAL, _USER_DEFINED)}
    candidates: list[tuple[float, int, int, str, str]] = []
    for text, i in mergeable.items():
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            if left in mergeable and right in mergeable:
                candidates.append((-scores[i], mergeable[left], mergeable[right], left, right))
    candidates.sort()
    merges = [[left, right] for *_, left, right in candidates]
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    backend = _bpe_backend(vocab, merges, byte_fallback=True, unk_token=unk, fuse_unk=True)
    # Spaces become '▁', and llama.cpp puts one in front of every run of text, including after a special
    # token and before text that already starts with a space (as the original Llama-2 tokenizer.json does;
    # transformers' GGUF conversion prepends only at the very start, and only when there is no space).
    steps_in = [normalizers.Replace(" ", "▁")]
    if add_space_prefix:
        steps_in.insert(0, normalizers.Prepend("▁"))
    backend.normalizer = normalizers.Sequence(steps_in)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    return backend


# ---------------------------------------------------------------------- HF folders
def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _templates_from_config(value: Any) -> tuple[str | None, dict[str, str]]:
    """tokenizer_config's chat_template is a string or a list of {"name", "template"} entries."""
    if isinstance(value, str):
        return value, {}
    if isinstance(value, list):
        named = {e["name"]: e["template"] for e in value if isinstance(e, dict) and "name" in e and "template" in e}
        return named.get("default"), named
    return None, {}


# ---------------------------------------------------------------------- Jinja chat templates
class _GenerationTag(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` marks assistant text for training masks;
    for inference it renders its body unchanged, but templates using it must still parse."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return list(parser.parse_statements(("name:endgeneration",), drop_needle=True))


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None,
    separators: tuple[str, str] | None = None, sort_keys: bool = False,
) -> str:  # fmt: skip
    # Jinja's own tojson escapes HTML characters (<, >, &, '), which would change what the model sees.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    # The same environment as transformers, so templates written for HF render identically.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def model_tokenizer(path: str, gguf_metadata: dict[str, Any] | None = None) -> Tokenizer:
    """The tokenizer of the model at ``path``: an HF folder's files, or a GGUF file's
    metadata (``gguf_metadata`` when the caller has read it already)."""
    if gguf_metadata is None and os.path.isdir(path):
        return Tokenizer.from_pretrained_dir(path)
    if gguf_metadata is None:
        from pagoda.hub.gguf_file import GGUFFile

        gguf_metadata = GGUFFile(path).metadata
    return Tokenizer.from_gguf_metadata(gguf_metadata)


def load_tokenizer(config: EngineConfig) -> Tokenizer:
    """The tokenizer alone, without the weights (the API server process needs only this)."""
    from pagoda.hub.stores import resolve_model

    resolved = resolve_model(config.model)
    return with_chat_template(model_tokenizer(resolved.path), config.chat_template, resolved.defaults.template)


class ModelFiles(Protocol):
    """Where a loaded model came from (``pagoda.model.loader.LoadedModel`` is one)."""

    path: str
    gguf_metadata: dict[str, Any] | None


def build_tokenizer(loaded: ModelFiles, chat_template: str | None, ollama_template: str | None = None) -> Tokenizer:
    """The tokenizer of a model already loaded (reusing the GGUF metadata it read)."""
    return with_chat_template(model_tokenizer(loaded.path, loaded.gguf_metadata), chat_template, ollama_template)


def with_chat_template(tokenizer: Tokenizer, chat_template: str | None, ollama_template: str | None = None) -> Tokenizer:
    """Set the chat template: ``chat_template`` (a string or a file) if given; else the
    model's own; else ``ollama_template`` (an Ollama model's Go template, translated by
    pagoda/hub/ollama_template.py; an untranslatable one is an error only when the model
    has no template of its own to use instead)."""
    if chat_template is not None:
        if os.path.isfile(chat_template):
            with open(chat_template) as f:
                chat_template = f.read()
        tokenizer.chat_template = chat_template
    elif ollama_template is not None:
        from pagoda.hub.ollama_template import OllamaTemplateError, translate_ollama_template

        if tokenizer.chat_template is not None:
            try:
                translate_ollama_template(ollama_template)
                logger.info("chat template: the GGUF file's own (Jinja), not the Ollama template layer")
            except OllamaTemplateError as e:
                logger.warning("chat template: the GGUF file's own; the Ollama template layer cannot be "
                               "translated (%s)", e)
        else:
            try:
                tokenizer.chat_template = translate_ollama_template(ollama_template)
            except OllamaTemplateError as e:
                raise OllamaTemplateError(f"the model has no chat template of its own and its Ollama template "
                                          f"cannot be translated: {e}; pass one with --chat-template") from None
            logger.info("chat template: the Ollama template layer, translated to Jinja")
    return tokenizer
