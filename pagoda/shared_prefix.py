"""Operator-declared shared prefixes: the cache blocks that stay shared across cache salts.

A request's ``cache_salt`` (per tenant, say) is mixed into its block hashes, so one
tenant never gets a prefix-cache hit on another's prompt: a hit is visible as a
shorter time to first token, and a tenant who could probe the cache could learn what
others recently asked (a timing side channel). Salting everything would also make
every tenant recompute the same system prompt, so the operator may declare texts that
are not secret (``--shared-prefix-file``). The full blocks of a prompt that consist
of a declared text's leading tokens are hashed without the salt; the salt goes into
the first block after them, and the hash chain carries it on from there.

The file is a JSON array of strings, or plain text holding one prefix, or several
separated by lines that hold only ``---``. Each text is matched as the tokenizer
writes it at the start of a completion prompt (with and without special tokens) and
as the chat template renders it as the system message.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Sequence

logger = logging.getLogger(__name__)


def read_shared_prefix_file(path: str) -> list[str]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"shared prefix file not found: {path}")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".json"):
        try:
            texts = json.loads(text)
        except ValueError as e:
            raise ValueError(f"{path}: not valid JSON: {e}") from None
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise ValueError(f"{path}: expected a JSON array of strings")
    else:
        texts = [part.strip("\n") for part in text.split("\n---\n")]
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise ValueError(f"{path}: no shared prefix text in it")
    return texts


class SharedPrefixes:
    """Token sequences of the declared texts; ``shared_len`` matches a prompt against them."""

    def __init__(self, sequences: Sequence[Sequence[int]], block_size: int) -> None:
        self.block_size = block_size
        # Distinct, longest first; at least one full block each or they can never count.
        unique = {tuple(s) for s in sequences if len(s) >= block_size}
        self.sequences = sorted(unique, key=len, reverse=True)

    @classmethod
    def from_texts(cls, texts: Sequence[str], tokenizer, block_size: int) -> SharedPrefixes:
        sequences: list[list[int]] = []
        for text in texts:
            sequences.append(tokenizer.encode(text, add_special_tokens=True))
            sequences.append(tokenizer.encode(text, add_special_tokens=False))
            try:
                rendered = tokenizer.apply_chat_template([{"role": "system", "content": text}],
                                                         add_generation_prompt=False)  # fmt: skip
            except Exception as e:  # no template, or one that refuses a lone system message
                logger.info("shared prefix: chat rendering skipped (%s)", e)
            else:
                sequences.append(tokenizer.encode(rendered, add_special_tokens=False))
        return cls(sequences, block_size)

    def shared_len(self, prompt_token_ids: Sequence[int]) -> int:
        """The longest run of leading prompt tokens that is also the start of a declared
        sequence, rounded down to whole blocks (only whole blocks are hashed).

        E.g. block_size 4, declared [1, 2, 3, 4, 5, 6], prompt [1, 2, 3, 4, 5, 9, ...]
        -> 5 common tokens -> 4.
        """
        best = 0
        for seq in self.sequences:
            if len(seq) < best + self.block_size or not prompt_token_ids or seq[0] != prompt_token_ids[0]:
                continue
            n = 0
            for a, b in zip(seq, prompt_token_ids):
                if a != b:
                    break
                n += 1
            best = max(best, n - n % self.block_size)
        return best
