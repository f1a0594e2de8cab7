"""The model runner: turns a SchedulerOutput into one forward and sampled tokens.

It keeps its own copy of each running request (token ids, block table,
sampler state), updated from the scheduler's diffs, so that the same runner
could live in another process or on another rank.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from pagoda.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagoda.lora.manager import LoRAManager
from pagoda.model.attention import AttentionMetadata
from pagoda.model.models.llama import LlamaForCausalLM
from pagoda.sample.sampler import Sampler, SamplingMetadata, SamplingRow
from pagoda.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_ids: frozenset[int]
    lora_int_id: int = 0
    all_token_ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.all_token_ids = self.prompt_token_ids + self.output_token_ids


def kv_cache_bytes_per_block(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    c = model.config
    elem = torch.empty(0, dtype=dtype).element_size()
    return 2 * c.num_hidden_layers * block_size * c.num_key_value_heads * c.head_dim * elem


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        kv_dtype: torch.dtype,
        seed: int = 0,
        lora: LoRAManager | None = None,
    ) -> None:
        """``lora``: the adapters, when LoRA is enabled (it has wrapped the model's projections)."""
        self.model = model
        self.lora = lora
        self.block_size = block_size
        self.device = device
        c = model.config
        self.kv_caches = [
            # empty, not zeros: a fresh large allocation is zero pages from the OS
            # already, and untouched pages cost no RSS until blocks are used.
            torch.empty(2, num_blocks, block_size, c.num_key_value_heads, c.head_dim, dtype=kv_dtype, device=device)
            for _ in range(c.num_hidden_layers)
        ]
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}
        # Generators outlive preemption, so a seeded request draws the same
        # numbers whether or not it was preempted and recomputed.
        self.generators: dict[str, torch.Generator] = {}
        self._rng = random.Random(seed)

    def _generator_for(self, req_id: str, params: SamplingParams) -> torch.Generator | None:
        if params.temperature < 1e-5:
            return None
        gen = self.generators.get(req_id)
        if gen is None:
            seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self.generators[req_id] = gen
        return gen

    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            self.generators.pop(rid, None)
        for rid in so.preempted_req_ids:
            self.requests.pop(rid, None)
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = CachedRequestState(
                new.req_id, list(new.prompt_token_ids), list(new.output_token_ids),
                new.sampling_params, list(new.block_ids), new.num_computed_tokens, new.eos_token_ids,
                new.lora_int_id,
            )
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    @torch.inference_mode()
    def execute_model(
        self, so: SchedulerOutput, grammar_masks: dict[str, torch.Tensor] | None = None
    ) -> ModelRunnerOutput:
        """One forward + sampling. ``grammar_masks``: req id -> [vocab] bool
        (True = allowed) for requests under a grammar."""
        self._update_states(so)
        if so.is_empty:
            return ModelRunnerOutput([], [])
        # Decodes first: the attention path batches them together.
        order = sorted(so.num_scheduled_tokens, key=lambda rid: so.num_scheduled_tokens[rid] != 1)
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []       # index into `order` of requests that sample
        logits_indices: list[int] = []
        offset = 0
        for i, rid in enumerate(order):
            state = self.requests[rid]
            n = so.num_scheduled_tokens[rid]
            start = state.num_computed_tokens
            end = start + n
            input_ids.extend(state.all_token_ids[start:end])
            positions.extend(range(start, end))
            query_lens.append(n)
            context_lens.append(start)
            tables.append(state.block_ids)
            offset += n
            # Only a request whose last known token is in this step samples.
            if end == len(state.all_token_ids):
                sample_rows.append(i)
                logits_indices.append(offset - 1)

        meta = AttentionMetadata.build(query_lens, context_lens, tables, self.block_size, self.device)
        if self.lora is not None:
            token_loras: list[int] = []
            for rid, n in zip(order, query_lens):
                token_loras.extend([self.requests[rid].lora_int_id] * n)
            self.lora.prepare(token_loras, pinned={s.lora_int_id for s in self.requests.values()})
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            self.kv_caches,
            meta,
        )
        sampled: list[list[int]] = [[] for _ in order]
        logprobs: list = [None for _ in order]
        if sample_rows:
            logits = self.model.compute_logits(hidden[torch.tensor(logits_indices, device=self.device)])
            if grammar_masks:
                rows = [j for j, i in enumerate(sample_rows) if order[i] in grammar_masks]
                if rows:
                    allowed = torch.stack([grammar_masks[order[sample_rows[j]]] for j in rows]).to(self.device)
                    vocab = min(allowed.shape[1], logits.shape[1])
                    banned = torch.ones(len(rows), logits.shape[1], dtype=torch.bool, device=self.device)
                    banned[:, :vocab] = ~allowed[:, :vocab]
                    idx = torch.tensor(rows, device=self.device)
                    logits[idx] = logits[idx].masked_fill(banned, float("-inf"))
            rows = []
            for i in sample_rows:
                state = self.requests[order[i]]
                rows.append(
                    SamplingRow(
                        params=state.sampling_params,
                        prompt_token_ids=state.prompt_token_ids,
                        output_token_ids=state.output_token_ids,
                        generator=self._generator_for(state.req_id, state.sampling_params),
                        eos_token_ids=state.eos_token_ids,
                    )
                )
            md = SamplingMetadata.from_rows(rows, logits.shape[-1], self.device)
            out = self.sampler(logits, md)
            token_ids = out.sampled_token_ids.tolist()
            lp = out.logprobs.tolist() if out.logprobs is not None else None
            top_ids = out.topk_token_ids.tolist() if out.topk_token_ids is not None else None
            top_lps = out.topk_logprobs.tolist() if out.topk_logprobs is not None else None
            for j, i in enumerate(sample_rows):
                sampled[i] = [token_ids[j]]
                k = rows[j].params.logprobs
                if k is not None and lp is not None:
                    logprobs[i] = [(lp[j], top_ids[j][:k], top_lps[j][:k])]
        for i, rid in enumerate(order):
            state = self.requests[rid]
            state.num_computed_tokens += so.num_scheduled_tokens[rid]
            if sampled[i]:
                state.output_token_ids.extend(sampled[i])
                state.all_token_ids.extend(sampled[i])
        return ModelRunnerOutput(order, sampled, logprobs)
