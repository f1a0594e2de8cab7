"""BERT cross-encoders (``BertForSequenceClassification``: ms-marco-MiniLM and its kin): an
encoder whose tokens attend to every token of their own prompt, learned absolute positions
and token types, LayerNorms after each sublayer, a two-layer MLP; the classifier reads the
first ([CLS]) token's state through BERT's pooler (dense, then tanh).

The engine serves it as a pooling model (task classify, CLS pooling): the scheduler computes
each prompt whole in one step (``SchedulerConfig.whole_prompts``: a later chunk's keys are
ones an earlier chunk's queries must see), so a step's tokens are whole prompts one after
another, each from position 0. Attention runs here, over each prompt's own tokens padded
into one batch; nothing goes through the KV cache (a prompt is never continued: its pool
blocks only bound how many prompts run at once, and are never written or read).

Token types come as input embeddings (``embed(ids, token_type_ids)``, which the runner calls
for a cross-encoder pair's prompt, PoolingParams.pair_start); without them every token is
type 0, as transformers' default.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.model.arch import ModelArchConfig, hf_num_labels
from pagoda.model.layers.decoder import CausalLM, KVSpec
from pagoda.model.models import UnsupportedModelError

_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}

# A checkpoint's names -> ours (first match wins): the encoder's layers under model.layers,
# their sublayers renamed flat; older checkpoints' LayerNorm gamma / beta are weight / bias.
_RENAMES = (
    (re.compile(r"^bert\.encoder\.layer\.(\d+)\.attention\.self\."), r"model.layers.\1.attn."),
    (re.compile(r"^bert\.encoder\.layer\.(\d+)\.attention\.output\.dense\."), r"model.layers.\1.attn.out."),
    (re.compile(r"^bert\.encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\."), r"model.layers.\1.attn_norm."),
    (re.compile(r"^bert\.encoder\.layer\.(\d+)\.intermediate\.dense\."), r"model.layers.\1.mlp_in."),
    (re.compile(r"^bert\.encoder\.layer\.(\d+)\.output\.dense\."), r"model.layers.\1.mlp_out."),
    (re.compile(r"^bert\.encoder\.layer\.(\d+)\.output\.LayerNorm\."), r"model.layers.\1.mlp_norm."),
    (re.compile(r"^bert\."), "model."),
)


class BertEmbeddings(nn.Module):
    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        e, h = config.encoder or {}, config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, h)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, h)
        self.token_type_embeddings = nn.Embedding(e["type_vocab_size"], h)
        self.LayerNorm = nn.LayerNorm(h, eps=e["layer_norm_eps"])


class BertAttention(nn.Module):
    """Bidirectional self-attention with biases (query, key, value, out)."""

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.query, self.key, self.value = (nn.Linear(h, self.num_heads * self.head_dim) for _ in range(3))
        self.out = nn.Linear(self.num_heads * self.head_dim, h)

    def forward(self, x: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``batch``: (gather [B, L] rows of x per prompt, padded; valid [B, L])."""
        gather, valid = batch
        b, n = gather.shape
        q, k, v = (p(x)[gather].view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
                   for p in (self.query, self.key, self.value))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :])
        # Back to the step's rows: the valid rows of the batch in row-major order are the
        # prompts' tokens in the step's order (each prompt's rows are consecutive).
        return self.out(out.transpose(1, 2).reshape(b, n, -1)[valid])


class BertLayer(nn.Module):
    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        e, h = config.encoder or {}, config.hidden_size
        self.attn = BertAttention(config)
        self.attn_norm = nn.LayerNorm(h, eps=e["layer_norm_eps"])
        self.mlp_in = nn.Linear(h, config.intermediate_size)
        self.mlp_out = nn.Linear(config.intermediate_size, h)
        self.mlp_norm = nn.LayerNorm(h, eps=e["layer_norm_eps"])
        self.act = _ACTIVATIONS[e["hidden_act"]]

    def forward(self, x: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = self.attn_norm(x + self.attn(x, batch))
        return self.mlp_norm(x + self.mlp_out(self.act(self.mlp_in(x))))


class BertPooler(nn.Module):
    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)


class BertModel(nn.Module):
    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        self.embeddings = BertEmbeddings(config)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))
        self.pooler = BertPooler(config)


def prompt_batch(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's prompts as a padded batch: (gather [B, L], valid [B, L]), each prompt the
    rows from one position 0 to the next. E.g. positions [0, 1, 2, 0, 1] -> gather [[0, 1, 2],
    [3, 4, 0]], valid [[T, T, T], [T, T, F]]. RuntimeError for a prompt that does not start at
    position 0 or skips one (a chunk: the scheduler runs an encoder's prompts whole)."""
    pos = positions.tolist()
    starts = [i for i, p in enumerate(pos) if p == 0]
    if not pos or starts[:1] != [0] or any(p != q + 1 for q, p in zip(pos, pos[1:]) if p != 0):
        raise RuntimeError(f"an encoder computes each prompt whole in one step, from position 0; this step's "
                           f"positions are {pos[:8]}{'...' if len(pos) > 8 else ''}")
    lengths = [e - s for s, e in zip(starts, starts[1:] + [len(pos)])]
    width = max(lengths)
    offsets = torch.arange(width)
    first = torch.tensor(starts)[:, None]
    valid = offsets[None, :] < torch.tensor(lengths)[:, None]
    gather = torch.where(valid, first + offsets[None, :], 0)
    return gather.to(positions.device), valid.to(positions.device)


class BertForSequenceClassification(CausalLM):
    packed_modules_mapping = {}   # query, key and value stay three layers, as the checkpoint holds them
    tensor_parallel = False
    lora = False

    def __init__(self, config: ModelArchConfig) -> None:
        nn.Module.__init__(self)   # not a decoder: none of CausalLM's layers
        self.config = config
        self.model = BertModel(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.stage = None          # no pipeline stages
        self.decode_stack = None   # never a decode step to stack

    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise UnsupportedModelError(f"BERT position embeddings {config['position_embedding_type']!r} are not "
                                        f"supported (absolute only)")
        act = config.get("hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise UnsupportedModelError(f"BERT hidden_act {act!r} is not supported ({', '.join(_ACTIVATIONS)})")
        heads, hidden = config["num_attention_heads"], config["hidden_size"]
        eps = float(config.get("layer_norm_eps", 1e-12))
        return ModelArchConfig(
            architecture=architecture, vocab_size=config["vocab_size"], hidden_size=hidden,
            intermediate_size=config["intermediate_size"], num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=heads, head_dim=hidden // heads, rms_norm_eps=eps,
            rope_theta=10000.0,   # (no rotary: learned positions)
            max_position_embeddings=config.get("max_position_embeddings", 512), tie_word_embeddings=True,
            attention_bias=True, has_lm_head=False, num_labels=hf_num_labels(config),
            encoder={"type_vocab_size": config.get("type_vocab_size", 2), "layer_norm_eps": eps, "hidden_act": act},
        )

    @classmethod
    def arch_from_gguf(cls, md: dict[str, Any], tensor_names: set[str], architecture: str) -> ModelArchConfig:
        raise UnsupportedModelError("BERT cross-encoders are served from HF folders, not GGUF files")

    @classmethod
    def hf_name(cls, name: str) -> str | None:
        if name.endswith("position_ids"):   # a buffer older checkpoints saved: positions come from the step
            return None
        name = re.sub(r"\.gamma$", ".weight", re.sub(r"\.beta$", ".bias", name))
        for pattern, ours in _RENAMES:
            if pattern.match(name):
                return pattern.sub(ours, name, count=1)
        return name

    def init_rope(self, device: torch.device) -> None:
        pass   # learned positions: no rotary tables

    def kv_specs(self) -> list[KVSpec | None]:
        # The pool's pages are sized as a decoder's of this shape would be (the scheduler counts
        # blocks); nothing is written to them, and on the CPU untouched pages cost no memory.
        c = self.config
        return [KVSpec(c.num_attention_heads, c.head_dim) for _ in range(c.num_hidden_layers)]

    @property
    def activation_dtype(self) -> torch.dtype:
        return self.model.embeddings.LayerNorm.weight.dtype

    def shard_rows(self, module_path: str, shard: int) -> tuple[int, int]:
        raise KeyError(f"{type(self).__name__} has no stacked projections")

    def tie_weights(self) -> None:
        pass   # no LM head

    def embed(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Word and token-type embeddings (type 0 where ``token_type_ids`` is None); the
        forward adds the positions' and normalises."""
        e = self.model.embeddings
        types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        return e.word_embeddings(input_ids) + e.token_type_embeddings(types)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta: Any,
                num_layers: int | None = None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        e = self.model.embeddings
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        x = e.LayerNorm(x + e.position_embeddings(positions))
        batch = prompt_batch(positions)
        for layer in self.model.layers[:num_layers]:
            x = layer(x, batch)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"{type(self).__name__} has no LM head: it classifies (task classify)")

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """[n, hidden] first-token states -> [n, num_labels] float32 logits (pooler, classifier)."""
        return self.classifier(torch.tanh(self.model.pooler.dense(pooled))).float()
