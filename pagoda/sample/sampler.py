"""Turn one step's logits into tokens, vectorised over the batch.

One row of ``logits`` is one request that samples this step. ``Sampler.forward``
processes every row in this order:

0. Structured output: a row under a grammar gets -inf at every token its grammar
   does not allow this step (``SamplingRow.allowed_tokens``; a mask narrower than
   the logits also bans the columns past its end); a row with ``allowed_token_ids``
   at every token not listed.
1. ``logit_bias`` is added.
2. ``min_tokens``: while a row has fewer than ``min_tokens`` outputs, its
   ``stop_token_ids`` and (unless ``ignore_eos``) the model's EOS ids get -inf; so does
   the last token of each of its bad words whose other tokens end the output.
2b. Logits processors (plug-ins, pagoda/sample/logits_processor.py) that may change the
   argmax, in the order loaded, over the whole batch in their own row order (vLLM's place
   for them: after min_tokens and logit_bias, before penalties); then the masks and bans of
   steps 0 and 2 again, so that no plug-in lets through a token a grammar,
   ``allowed_token_ids``, a bad word or ``min_tokens`` bans.
3. Penalties, as vLLM/OpenAI define them:
   repetition (over prompt + output tokens): ``l / rp if l > 0 else l * rp``;
   then ``l -= frequency_penalty * count_in_output``;
   then ``l -= presence_penalty * (count_in_output > 0)``.
   Greedy rows take the argmax here.
4. Temperature divides the logits of random rows.
5. Logprobs are ``log_softmax`` of these logits: "processed logprobs", after
   bias, penalties and temperature but before any truncation, so a token cut
   by top-k/top-p/min-p still has a finite logprob. With them come the rank of
   the sampled token and the logprobs (and ranks) of the row's ``logprob_token_ids``.
   They include the plug-ins of step 2b, not those of step 5b.
5b. Argmax-invariant logits processors (vLLM's place for them: after temperature, beside
   min-p), skipped in a step whose rows are all greedy (they could not change its tokens);
   the masks and bans again.
6. Truncation of random rows: min-p, then top-k, then top-p (each on what the
   previous one left).
7. Random rows sample with an exponential race: ``argmax(probs / q)`` with
   ``q ~ Exp(1)`` drawn from the row's own generator, which picks token ``i``
   with probability ``probs[i]``. Each random row draws exactly ``V`` numbers
   per step, so a seeded request gets the same tokens whatever else is in the
   batch and in whatever order. On a GPU the draws of every row come from one
   counter-based hash instead (``counter_exponentials``): a pure function of the
   row's seed (its generator's), its output position and the token, for the whole
   batch in a few kernels with no per-row launch; the same properties hold, and a
   preempted request redraws exactly what it drew.

Work no row needs is skipped: a batch of greedy rows without a grammar, bias,
penalties, logprobs or logits processors is a bare argmax. ``forward`` never modifies the logits it is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagoda.ops import cpu_kernels
from pagoda.sampling_params import SamplingParams


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on ``device`` without waiting for the device: on CUDA through pinned
    memory and a non-blocking copy (a plain copy from pageable memory waits until the
    stream has run everything queued before it: with overlapped steps, the step in flight)."""
    if torch.device(device).type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def device_tensor(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)`` through ``to_device``."""
    return to_device(torch.tensor(values, dtype=dtype), device)


@dataclass
class SamplingRow:
    """What the model runner knows about one request that samples this step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far, before this step's token
    # The row's own generator (random rows): seeded with params.seed when given,
    # else from the engine's RNG. None falls back to torch's global RNG.
    generator: torch.Generator | None
    eos_token_ids: frozenset[int]  # the model's end tokens, for min_tokens
    # Under a grammar (structured output): [V'] bool, True = allowed this step, from
    # the structured-output manager's bitmask. None: unconstrained.
    allowed_tokens: torch.Tensor | None = None
    # Overlapped steps: tokens sampled by the step in flight, not in output_token_ids yet
    # (the counter-based draws are keyed by the true output position).
    num_pending: int = 0


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    # The three below are all None when no row asked for logprobs. Otherwise
    # they cover every row; a row reads its first ``params.logprobs`` columns.
    logprobs: torch.Tensor | None  # [B] logprob of the sampled token
    topk_token_ids: torch.Tensor | None  # [B, K] int64, K = max logprobs asked (may be 0)
    topk_logprobs: torch.Tensor | None  # [B, K] float32, sorted descending
    sampled_ranks: torch.Tensor | None = None  # [B] int64: 1 + tokens more likely than the sampled one
    # logprob_token_ids, flattened in the order of SamplingMetadata.tracked_rows/tokens:
    tracked_logprobs: torch.Tensor | None = None  # [N] float32
    tracked_ranks: torch.Tensor | None = None     # [N] int64


@dataclass
class SamplingMetadata:
    """Per-step tensors built from the rows. Optional fields are None when no row needs them."""

    num_rows: int
    all_greedy: bool
    all_random: bool
    is_greedy: torch.Tensor  # [B] bool
    # [B] float32; 1.0 for greedy rows so dividing leaves them unchanged.
    # None when every random row has temperature 1.
    temperature: torch.Tensor | None
    # Truncation, only over random rows; disabled rows hold a no-op value.
    min_p: torch.Tensor | None  # [B] float32, 0.0 = off
    top_k: torch.Tensor | None  # [B] int64, V = off
    top_p: torch.Tensor | None  # [B] float32, 1.0 = off
    # Penalties: [B] float32 factors and [B, V] statistics of the token history.
    repetition_penalty: torch.Tensor | None
    repeated_mask: torch.Tensor | None  # [B, V] bool: in prompt or output
    frequency_penalty: torch.Tensor | None
    presence_penalty: torch.Tensor | None
    output_counts: torch.Tensor | None  # [B, V] float32: occurrences in the output
    # Rows under a grammar [G] int64, and what each may not emit [G, V] bool (True =
    # banned: what its grammar disallows, and any column past the end of its mask).
    grammar_rows: torch.Tensor | None
    grammar_banned: torch.Tensor | None
    # Sparse (row, token, value) triples for logit_bias.
    bias_rows: torch.Tensor | None
    bias_tokens: torch.Tensor | None
    bias_values: torch.Tensor | None
    # (row, token) pairs banned by min_tokens this step.
    ban_rows: torch.Tensor | None
    ban_tokens: torch.Tensor | None
    generators: list[torch.Generator | None]  # per row; unused for greedy rows
    random_row_indices: list[int]  # kept as a list so drawing never syncs a device
    max_num_logprobs: int | None  # None: no row asked for logprobs (-1, the whole vocabulary, is V here)
    # logprob_token_ids of every row, as (row, token) pairs; None when no row tracks any.
    tracked_rows: torch.Tensor | None = None
    tracked_tokens: torch.Tensor | None = None
    # The counter-based draws (GPU): per random row, its seed and output position; None:
    # each row draws from its generator.
    random_rows: torch.Tensor | None = None     # [R] int64, indices of the random rows
    random_seeds: torch.Tensor | None = None    # [R] int64
    random_offsets: torch.Tensor | None = None  # [R] int64
    # Plug-in logits processors and their view of the batch (pagoda/sample/processor_batch.py),
    # set by the model runner; None: none loaded.
    logits_processors: Any = None   # a ProcessorStep (not imported here: it imports this module)

    @classmethod
    def from_rows(
        cls, rows: list[SamplingRow], vocab_size: int, device: torch.device, counter_rng: bool | None = None
    ) -> SamplingMetadata:
        """``counter_rng``: draw with ``counter_exponentials`` (default: on CUDA, where every
        random row has a generator to take its seed from)."""
        params = [row.params for row in rows]
        greedy = [p.is_greedy for p in params]
        random_rows = [p for p, g in zip(params, greedy) if not g]

        def floats(values: list[float]) -> torch.Tensor:
            return device_tensor(values, torch.float32, device)

        temperature = None
        if any(p.temperature != 1.0 for p in random_rows):
            temperature = floats([1.0 if g else p.temperature for p, g in zip(params, greedy)])
        min_p = top_k = top_p = None
        if any(p.min_p > 0 for p in random_rows):
            min_p = floats([0.0 if g else p.min_p for p, g in zip(params, greedy)])
        if any(0 < p.top_k < vocab_size for p in random_rows):
            ks = [vocab_size if g or p.top_k <= 0 else min(p.top_k, vocab_size)
                  for p, g in zip(params, greedy)]
            top_k = device_tensor(ks, torch.int64, device)
        if any(p.top_p < 1.0 for p in random_rows):
            top_p = floats([1.0 if g else p.top_p for p, g in zip(params, greedy)])

        repetition_penalty = repeated_mask = None
        if any(p.repetition_penalty != 1.0 for p in params):
            repetition_penalty = floats([p.repetition_penalty for p in params])
            # Only rows that use the penalty pay for listing their history.
            histories = [
                r.prompt_token_ids + r.output_token_ids if r.params.repetition_penalty != 1.0 else []
                for r in rows
            ]
            repeated_mask = _token_counts(histories, vocab_size, device) > 0
        frequency_penalty = presence_penalty = output_counts = None
        if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
            frequency_penalty = floats([p.frequency_penalty for p in params])
            presence_penalty = floats([p.presence_penalty for p in params])
            outputs = [
                r.output_token_ids
                if r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0
                else []
                for r in rows
            ]
            output_counts = _token_counts(outputs, vocab_size, device)

        bias_rows, bias_tokens, bias_values = [], [], []
        ban_rows, ban_tokens = [], []
        for i, row in enumerate(rows):
            p = row.params
            for token_id, value in (p.logit_bias or {}).items():
                if token_id < vocab_size:
                    bias_rows.append(i)
                    bias_tokens.append(token_id)
                    bias_values.append(value)
            banned = set()
            if len(row.output_token_ids) < p.min_tokens:
                banned = set(p.stop_token_ids or ())
                if not p.ignore_eos:
                    banned |= row.eos_token_ids
            for seq in p.bad_words_token_ids or ():
                # A bad word's last token, wherever the output ends with the tokens before it.
                before = len(seq) - 1
                if before == 0 or (len(row.output_token_ids) >= before and row.output_token_ids[-before:] == seq[:-1]):
                    banned.add(seq[-1])
            for token_id in sorted(banned):
                if token_id < vocab_size:
                    ban_rows.append(i)
                    ban_tokens.append(token_id)

        def index(values: list[int]) -> torch.Tensor:
            return device_tensor(values, torch.int64, device)

        # Rows that may emit only some tokens: under a grammar, or with allowed_token_ids (or both).
        grammar_rows = [i for i, row in enumerate(rows) if row.allowed_tokens is not None]
        listed = [i for i, p in enumerate(params) if p.allowed_token_ids]
        grammar_banned = None
        if grammar_rows:
            allowed = to_device(torch.stack([rows[i].allowed_tokens for i in grammar_rows]), device)
            width = min(allowed.shape[1], vocab_size)
            grammar_banned = torch.ones(len(grammar_rows), vocab_size, dtype=torch.bool, device=device)
            grammar_banned[:, :width] = ~allowed[:, :width]
        if listed:
            masked = sorted(set(grammar_rows) | set(listed))
            banned_rows = torch.zeros(len(masked), vocab_size, dtype=torch.bool, device=device)
            if grammar_rows:
                banned_rows[device_tensor([masked.index(i) for i in grammar_rows], torch.int64, device)] = grammar_banned
            for i in listed:
                keep = torch.ones(vocab_size, dtype=torch.bool)
                keep[[t for t in params[i].allowed_token_ids if t < vocab_size]] = False
                banned_rows[masked.index(i)] |= to_device(keep, device)
            grammar_rows, grammar_banned = masked, banned_rows

        random_idx = [i for i, g in enumerate(greedy) if not g]
        if counter_rng is None:
            counter_rng = torch.device(device).type == "cuda"
        counter = counter_rng and bool(random_idx) and all(rows[i].generator is not None for i in random_idx)
        asked = [vocab_size if p.logprobs == -1 else p.logprobs for p in params if p.logprobs is not None]
        # In range: validate_for_vocab checked them at admission.
        tracked = [(i, t) for i, p in enumerate(params) for t in p.logprob_token_ids or ()]
        return cls(
            num_rows=len(rows),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            is_greedy=device_tensor(greedy, torch.bool, device),
            temperature=temperature,
            min_p=min_p,
            top_k=top_k,
            top_p=top_p,
            repetition_penalty=repetition_penalty,
            repeated_mask=repeated_mask,
            frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty,
            output_counts=output_counts,
            grammar_rows=index(grammar_rows) if grammar_rows else None,
            grammar_banned=grammar_banned,
            bias_rows=index(bias_rows) if bias_rows else None,
            bias_tokens=index(bias_tokens) if bias_rows else None,
            bias_values=floats(bias_values) if bias_rows else None,
            ban_rows=index(ban_rows) if ban_rows else None,
            ban_tokens=index(ban_tokens) if ban_rows else None,
            generators=[row.generator for row in rows],
            random_row_indices=random_idx,
            random_rows=index(random_idx) if counter else None,
            # (a seed is any 64-bit integer: kept as its two's-complement int64)
            random_seeds=index([_int64(rows[i].generator.initial_seed()) for i in random_idx]) if counter else None,
            random_offsets=index([len(rows[i].output_token_ids) + rows[i].num_pending for i in random_idx])
            if counter else None,
            max_num_logprobs=max(asked) if asked else None,
            tracked_rows=index([i for i, _ in tracked]) if tracked else None,
            tracked_tokens=index([t for _, t in tracked]) if tracked else None,
        )


def _token_counts(
    token_lists: list[list[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """[B, V] float32 occurrence counts. Ids >= V (padding, say) are dropped."""
    num_rows = len(token_lists)
    width = max((len(t) for t in token_lists), default=0)
    # Pad with V and scatter into an extra column that is then cut off, which
    # also swallows any id the logits have no column for.
    padded = torch.full((num_rows, width), vocab_size, dtype=torch.int64)
    for i, tokens in enumerate(token_lists):
        if tokens:
            padded[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64).clamp_(max=vocab_size)
    padded = to_device(padded, device)
    counts = torch.zeros((num_rows, vocab_size + 1), dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab_size]


class Sampler(torch.nn.Module):
    """Stateless; see the module docstring for the processing order."""

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()  # a no-op for float32 input; never written in place
        logits = _apply_grammar_bias_and_bans(logits, metadata)
        if metadata.logits_processors is not None:
            logits = _apply_processors(logits, metadata, metadata.logits_processors.non_argmax_invariant)
        logits = _apply_penalties(logits, metadata)

        greedy_ids = None if metadata.all_random else _argmax_rows(logits)
        if metadata.temperature is not None:
            logits = logits / metadata.temperature.unsqueeze(1)

        logprobs = topk_ids = topk_logprobs = None
        if metadata.max_num_logprobs is not None:
            all_logprobs = torch.log_softmax(logits, dim=-1)
            k = min(metadata.max_num_logprobs, logits.shape[-1])
            topk_logprobs, topk_ids = all_logprobs.topk(k, dim=-1)  # sorted descending

        if metadata.all_greedy:
            assert greedy_ids is not None
            sampled = greedy_ids
        else:
            if metadata.logits_processors is not None:
                logits = _apply_processors(logits, metadata, metadata.logits_processors.argmax_invariant)
            probs = torch.softmax(_truncate(logits, metadata), dim=-1)
            sampled = _exponential_race(probs, metadata)
            if greedy_ids is not None:
                sampled = torch.where(metadata.is_greedy, greedy_ids, sampled)

        ranks = tracked = tracked_ranks = None
        if metadata.max_num_logprobs is not None:
            logprobs = all_logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1)
            ranks = (all_logprobs > logprobs.unsqueeze(1)).sum(dim=1) + 1
            if metadata.tracked_rows is not None:
                rows = all_logprobs[metadata.tracked_rows]
                tracked = rows.gather(1, metadata.tracked_tokens.unsqueeze(1)).squeeze(1)
                tracked_ranks = (rows > tracked.unsqueeze(1)).sum(dim=1) + 1
        return SamplerOutput(
            sampled_token_ids=sampled,
            logprobs=logprobs,
            topk_token_ids=topk_ids,
            topk_logprobs=topk_logprobs,
            sampled_ranks=ranks,
            tracked_logprobs=tracked,
            tracked_ranks=tracked_ranks,
        )


    def target_distribution(
        self, logits: torch.Tensor, metadata: SamplingMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What ``forward`` would sample from, without sampling: (argmax after the grammar
        masks, bias, bans and penalties [B]; the final distribution of random rows after
        temperature and truncation [B, V], None when every row is greedy). Speculative
        decoding verifies drafts against these."""
        if metadata.logits_processors is not None:
            # (The engine refuses plug-ins with speculative decoding: see EngineConfig's RULES.)
            raise RuntimeError("logits processors do not verify speculative drafts")
        logits = _apply_penalties(_apply_grammar_bias_and_bans(logits.float(), metadata), metadata)
        greedy_ids = _argmax_rows(logits)
        if metadata.all_greedy:
            return greedy_ids, None
        if metadata.temperature is not None:
            logits = logits / metadata.temperature.unsqueeze(1)
        return greedy_ids, torch.softmax(_truncate(logits, metadata), dim=-1)


def _argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of [B, V] scores; on CPU float32, pagoda's kernel (the same
    indices, ties and NaN included, in about a tenth of the time)."""
    if x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu" and x.shape[1] > 0:
        ops = cpu_kernels.kernels()
        if ops is not None:
            return ops.argmax_rows(x)
    return x.argmax(dim=-1)


def _apply_grammar_bias_and_bans(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Steps 0-2 of the module docstring, on one copy of the logits (none when no row needs them)."""
    if md.grammar_rows is None and md.bias_rows is None and md.ban_rows is None:
        return logits
    logits = logits.clone()
    if md.grammar_rows is not None:
        logits[md.grammar_rows] = logits[md.grammar_rows].masked_fill(md.grammar_banned, float("-inf"))
    if md.bias_rows is not None:
        # (row, token) pairs are unique (dict keys), so accumulate only adds once.
        logits.index_put_((md.bias_rows, md.bias_tokens), md.bias_values, accumulate=True)
    if md.ban_rows is not None:
        logits[md.ban_rows, md.ban_tokens] = float("-inf")
    return logits


def _apply_processors(logits: torch.Tensor, md: SamplingMetadata, processors: list) -> torch.Tensor:
    """Steps 2b and 5b: ``processors`` over the batch, then what steps 0 and 2 banned banned again."""
    if not processors:
        return logits
    assert md.logits_processors is not None
    logits = md.logits_processors.run(processors, logits)
    if md.grammar_rows is not None:
        logits[md.grammar_rows] = logits[md.grammar_rows].masked_fill(md.grammar_banned, float("-inf"))
    if md.ban_rows is not None:
        logits[md.ban_rows, md.ban_tokens] = float("-inf")
    return logits


def _apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    if md.repetition_penalty is not None:
        assert md.repeated_mask is not None
        rp = torch.where(md.repeated_mask, md.repetition_penalty.unsqueeze(1), 1.0)
        logits = torch.where(logits > 0, logits / rp, logits * rp)
    if md.output_counts is not None:
        assert md.frequency_penalty is not None and md.presence_penalty is not None
        logits = logits - md.frequency_penalty.unsqueeze(1) * md.output_counts
        logits = logits - md.presence_penalty.unsqueeze(1) * (md.output_counts > 0)
    return logits


def _truncate(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """min-p, then top-k, then top-p; cut tokens get -inf. Greedy rows hold no-op values."""
    neg_inf = float("-inf")
    if md.min_p is not None:
        probs = torch.softmax(logits, dim=-1)
        threshold = md.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < threshold, neg_inf)
    if md.top_k is None and md.top_p is None:
        return logits

    # Both work on the row sorted by logit. Cutting by rank rather than by
    # value keeps exactly k tokens even when several tie at the boundary.
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if md.top_k is not None:
        ranks = torch.arange(logits.shape[-1], device=logits.device)
        sorted_logits = sorted_logits.masked_fill(ranks >= md.top_k.unsqueeze(1), neg_inf)
    if md.top_p is not None:
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep a token while the mass strictly before it is still short of
        # top_p: the smallest prefix whose mass reaches top_p. The first token
        # has nothing before it, so it always stays.
        mass_before = probs.cumsum(dim=-1) - probs
        cut = mass_before >= md.top_p.unsqueeze(1)
        cut[:, 0] = False  # guard against rounding in the subtraction
        # top_p == 1 means off; rounding must not cut the tail there either.
        cut &= (md.top_p < 1.0).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(cut, neg_inf)
    return torch.full_like(logits, neg_inf).scatter(1, order, sorted_logits)


def _int64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _wrapped(constant: int) -> int:
    """A 64-bit constant as the int64 with its bits (torch's int64 arithmetic wraps)."""
    return _int64(constant & ((1 << 64) - 1))


_GOLDEN, _MIX1, _MIX2 = _wrapped(0x9E3779B97F4A7C15), _wrapped(0xBF58476D1CE4E5B9), _wrapped(0x94D049BB133111EB)
_TOKEN = _wrapped(0xD6E8FEB86659FD93)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def counter_exponentials(seeds: torch.Tensor, offsets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, V] Exp(1) draws, each a pure function of (seed, offset, token): splitmix64's
    finaliser over seed + offset x golden ratio + token x another odd constant (all mod
    2^64), its top 24 bits as a uniform u in (0, 1), then -log(u). No state, no per-row
    call: one set of elementwise kernels for the whole batch."""
    tokens = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)
    z = (seeds + offsets * _GOLDEN)[:, None] + tokens[None, :] * _TOKEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    z = z ^ _shr(z, 31)
    u = (_shr(z, 40).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return -torch.log(u)


def _exponential_race(probs: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Sample each row from ``probs``: argmax of probs / q with q ~ Exp(1) per token.

    Each random row draws its V numbers from its own generator (rows without
    one share torch's global RNG), or all rows at once from the counter-based hash
    (``md.random_seeds``); greedy rows draw nothing.
    """
    q = torch.ones_like(probs)
    if md.random_seeds is not None:
        q[md.random_rows] = counter_exponentials(md.random_seeds, md.random_offsets, probs.shape[1])
    else:
        for i in md.random_row_indices:
            q[i].exponential_(generator=md.generators[i])
    # Exp(1) can round to exactly 0; 0/0 would be NaN and argmax picks NaN.
    # With q > 0 a cut token (prob exactly 0) scores 0 and can never beat the
    # row's most likely token, whose score is positive.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return _argmax_rows(probs / q)
