"""The model runner: turns a SchedulerOutput into one forward and sampled tokens.

It keeps its own copy of each running request (token ids, block table,
sampler state), updated from the scheduler's diffs, so that the same runner
could live in another process or on another rank.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pagoda.attention import AttentionMetadata, select_backend
from pagoda.attention.cpu import CpuBackend
from pagoda.attention.kv_quant import QuantizedKVCache, storage_dtype
from pagoda.attention.metadata import chunk_requests
from pagoda.attention.state import StateCache, StepStates
from pagoda.core.kv_layout import KVLayout
from pagoda.core.outputs import TokenLogprobs
from pagoda.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagoda.lora.manager import LoRAManager
from pagoda.model.layers import decode_stack
from pagoda.model.layers.decoder import CausalLM
from pagoda.multimodal.encoder_cache import EncoderCache
from pagoda.pooling import PoolerConfig, PoolingParams
from pagoda.sample.processor_batch import ProcessorBatch, ProcessorRow
from pagoda.sample.rejection_sampler import rejection_sample, verify_greedy
from pagoda.sample.sampler import Sampler, SamplerOutput, SamplingMetadata, SamplingRow, device_tensor
from pagoda.sampling_params import SamplingParams
from pagoda.spec_decode.proposer import DraftRequest, Proposer
from pagoda.worker.pooler import Pooler, pair_token_types
from pagoda.worker.step_inputs import StepInputs

if TYPE_CHECKING:   # (imported when graphs are captured: it imports triton)
    from pagoda.worker.cuda_graphs import DecodeGraphs, GraphCapture

logger = logging.getLogger(__name__)


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[list[int]]      # per KV group, its block table
    num_computed_tokens: int
    eos_token_ids: frozenset[int]
    lora_int_id: int = 0
    pooling_params: PoolingParams | None = None   # an embedding request: pooled, not sampled
    mm_inputs: list = field(default_factory=list)  # its images (pagoda.multimodal.ImageInput)
    all_token_ids: list[int] = field(init=False)
    # M-RoPE with images: the prompt's positions [3, P], and the shift of every later one.
    mrope: np.ndarray | None = None
    mrope_delta: int = 0

    def __post_init__(self) -> None:
        self.all_token_ids = self.prompt_token_ids + self.output_token_ids


@dataclass
class _Batch:
    """A step between ``ModelRunner.start_batch`` and ``finish_batch``: the requests'
    states (captured: a later step may forget them first), the forward's hidden states and
    the rows that need logits."""

    so: SchedulerOutput
    order: list[str]
    states: list[CachedRequestState]
    num_tokens: dict[str, int]
    drafts: dict[str, list[int]]
    hidden: torch.Tensor | None = None
    query_lens: list[int] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)       # index into `order` of requests that sample
    logits_indices: list[int] = field(default_factory=list)
    sampling_rows: list[SamplingRow] = field(default_factory=list)   # theirs, where this runner samples
    spec_rows: list[int] = field(default_factory=list)         # ... of requests verifying drafts
    spec_indices: list[int] = field(default_factory=list)      # their logits: last known token and every draft
    # prompt_logprobs: per request, (first prompt token scored, hidden rows that score it and on).
    prompt_spans: list[tuple[str, int, range]] = field(default_factory=list)
    pool_rows: list[tuple[int, int]] = field(default_factory=list)   # (index into `order`, first hidden row)
    # Overlapped steps: (index into input_ids, row of the step before's sampled ids) of each
    # input token still on the device, and per request how many of its tokens are.
    fills: list[tuple[int, int]] = field(default_factory=list)
    missing: dict[str, int] = field(default_factory=dict)
    sampler_out: SamplerOutput | None = None   # sampled already (sample_batch), not read back yet
    ready: torch.cuda.Event | None = None      # on CUDA: sampler_out's copies to the host are done


def kv_layout(model: CausalLM) -> KVLayout:
    """How the model's layers share block tables and cache buffers (by their windows); the
    same for every pipeline stage (each allocates only its layers' buffers, ``held_buffers``)."""
    c, n = model.config, len(model.model.layers)
    return KVLayout.plan([c.sliding_window_of(i) for i in range(n)], [c.chunk_of(i) for i in range(n)],
                         [(c.kv_heads_of(i), c.head_dim_of(i)) for i in range(n)],
                         c.kv_source if c.kv_source is not None else None)


def held_buffers(model: CausalLM) -> list[int]:
    """The cache buffers this process allocates: those of the layers it holds (all of them
    but on a pipeline stage)."""
    layer_buffer = kv_layout(model).layer_buffer
    return sorted({layer_buffer[i] for i, spec in enumerate(model.kv_specs()) if spec is not None})


def buffer_shapes(model: CausalLM) -> dict[int, tuple[int, int]]:
    """Per cache buffer this process holds: (KV heads, head size) of its layers (a
    tensor-parallel rank's share of the heads; the layers of one buffer cache alike)."""
    layer_buffer = kv_layout(model).layer_buffer
    shapes: dict[int, tuple[int, int]] = {}
    for i, spec in enumerate(model.kv_specs()):
        if spec is not None:
            shape = shapes.setdefault(layer_buffer[i], (spec.num_kv_heads, spec.head_dim))
            if shape != (spec.num_kv_heads, spec.head_dim):
                raise ValueError(f"layer {i} caches {spec.num_kv_heads} x {spec.head_dim} in a buffer of {shape}")
    return shapes


def state_bytes(model: CausalLM) -> int:
    """A hybrid model's state, every state layer's, for one request (0 for other models)."""
    shapes = getattr(model, "state_shapes", list)()
    return sum(math.prod(shape) for shape in shapes if shape is not None) * model.activation_dtype.itemsize


def kv_cache_bytes_per_block(model: CausalLM, block_size: int, dtype: torch.dtype,
                             kv_cache_dtype: str = "auto", state_checkpoints: bool = False) -> int:  # fmt: skip
    """A block is a page of every cache buffer (one per layer, unless layers of different
    KV groups share buffers); with ``state_checkpoints``, also a hybrid model's state at the
    block's end (prefix caching)."""
    shapes = buffer_shapes(model).values()
    states = state_bytes(model) if state_checkpoints else 0
    if storage_dtype(kv_cache_dtype) is not None:
        return sum(QuantizedKVCache.bytes_per_block(block_size, kvh, hd) for kvh, hd in shapes) + states
    elem = torch.empty(0, dtype=dtype).element_size()
    return sum(2 * block_size * kvh * hd * elem for kvh, hd in shapes) + states


def kv_cache_storage(kv_cache_dtype: str, model_dtype: torch.dtype) -> tuple[torch.dtype, str]:
    """(float dtype of a plain cache, 8-bit kind or "auto") for a resolved --kv-cache-dtype
    (``EngineConfig.resolved_kv_cache_dtype``)."""
    kv_dtype = torch.float16 if kv_cache_dtype == "float16" else model_dtype
    return kv_dtype, kv_cache_dtype if kv_cache_dtype in ("int8", "fp8") else "auto"


def allocate_kv_cache(model: CausalLM, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                      kv_cache_dtype: str, device: torch.device | str, pin: bool = False,
                      buffer: int | None = None) -> torch.Tensor | QuantizedKVCache:  # fmt: skip
    """One cache buffer (``buffer``; None: the first held), shared by its layers: [2, blocks,
    block_size, kv_heads, head_dim] of kv_dtype, or an 8-bit QuantizedKVCache with its
    scales. Uninitialised: a fresh large allocation is zero pages from the OS already, and
    untouched pages cost no RSS until blocks are used."""
    shapes = buffer_shapes(model)
    kvh, hd = shapes[min(shapes) if buffer is None else buffer]
    quantized = storage_dtype(kv_cache_dtype)
    if quantized is not None:
        return QuantizedKVCache(num_blocks, block_size, kvh, hd, quantized, device, pin)
    return torch.empty(2, num_blocks, block_size, kvh, hd, dtype=kv_dtype, device=device, pin_memory=pin)


def _copy_blocks(src, dst, src_idx: torch.Tensor, dst_idx: torch.Tensor) -> None:
    """Blocks src_idx of one layer's cache -> blocks dst_idx of another (device <-> host)."""
    if isinstance(src, QuantizedKVCache):
        src.copy_blocks_to(dst, src_idx, dst_idx)
    else:
        dst.index_copy_(1, dst_idx, src.index_select(1, src_idx).to(dst.device))


def _prompt_span(state: CachedRequestState, start: int, end: int, offset: int) -> tuple[str, int, range] | None:
    """Where a request's prompt logprobs come from this step, if it asked for them: the
    logits at position p score prompt token p + 1, so a chunk computing positions
    [start, end) scores prompt tokens start + 1 .. min(end, P - 1) (the last position's
    logits sample the first output instead). E.g. P = 5 in chunks [0, 3) and [3, 5): the
    first scores tokens 1, 2, 3 from hidden rows offset + 0..2, the second token 4 from row
    offset + 0. None for a request that did not ask, or a step past its prompt."""
    if state.pooling_params is not None or state.sampling_params.prompt_logprobs is None:
        return None  # (an embedding request's chunks are pooled, not scored)
    last = min(end, len(state.prompt_token_ids) - 1)
    if last <= start:
        return None
    return state.req_id, start + 1, range(offset, offset + last - start)


def _logprob_entries(lps: torch.Tensor, targets: torch.Tensor, k: int) -> list[TokenLogprobs]:
    """One TokenLogprobs per row of [N, V] logprobs: the target token's logprob and rank, and the top k."""
    target_lps = lps.gather(1, targets.unsqueeze(1)).squeeze(1)
    ranks = ((lps > target_lps.unsqueeze(1)).sum(dim=1) + 1).tolist()
    top_lps, top_ids = lps.topk(k, dim=-1) if k else (lps[:, :0], targets[:, None][:, :0])
    return [TokenLogprobs(lp, ids, tlps, rank)
            for lp, ids, tlps, rank in zip(target_lps.tolist(), top_ids.tolist(), top_lps.tolist(), ranks)]


def _to_host(out: SamplerOutput) -> tuple[SamplerOutput, torch.cuda.Event]:
    """``out``'s tensors copied to pinned host memory without waiting (CUDA), and the event
    after which they are there."""
    copies = {}
    for f in dataclasses.fields(out):
        value = getattr(out, f.name)
        if isinstance(value, torch.Tensor):
            host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            host.copy_(value, non_blocking=True)
            copies[f.name] = host
    event = torch.cuda.Event()
    event.record()
    return dataclasses.replace(out, **copies), event


def _sampled_logprobs(out: SamplerOutput, params: list[SamplingParams]) -> list[TokenLogprobs | None]:
    """Per sampled row, its logprobs entry (None where the request asked for none): each row
    reads its own top-k of the batch's widest, and its tracked tokens in order."""
    if out.logprobs is None:
        return [None] * len(params)
    lp = out.logprobs.tolist()
    top_ids = out.topk_token_ids.tolist() if out.topk_token_ids is not None else [[] for _ in params]
    top_lps = out.topk_logprobs.tolist() if out.topk_logprobs is not None else [[] for _ in params]
    ranks = out.sampled_ranks.tolist() if out.sampled_ranks is not None else [None] * len(params)
    tracked = out.tracked_logprobs.tolist() if out.tracked_logprobs is not None else []
    tracked_ranks = out.tracked_ranks.tolist() if out.tracked_ranks is not None else []
    entries: list[TokenLogprobs | None] = []
    at = 0
    for j, p in enumerate(params):
        if p.logprobs is None:
            entries.append(None)
            continue
        k = len(top_ids[j]) if p.logprobs == -1 else p.logprobs
        entry = TokenLogprobs(lp[j], top_ids[j][:k], top_lps[j][:k], ranks[j])
        ids = list(p.logprob_token_ids or ())
        if ids:  # in range: validate_for_vocab checked them at admission
            entry.tracked_token_ids = ids
            entry.tracked_logprobs = tracked[at:at + len(ids)]
            entry.tracked_ranks = tracked_ranks[at:at + len(ids)]
            at += len(ids)
        entries.append(entry)
    return entries


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        kv_dtype: torch.dtype,
        seed: int = 0,
        samples: bool = True,
        num_host_blocks: int = 0,
        kv_cache_dtype: str = "auto",
        lora: LoRAManager | None = None,
        pooler_config: PoolerConfig | None = None,
        attention_backend: str = "auto",
        num_state_slots: int = 0,
        num_state_checkpoints: int = 0,
        num_host_state_slots: int = 0,
        num_spec_state_rows: int = 0,
        encoder_cache_budget: int = 16384,
    ) -> None:
        """``samples``: False on tensor-parallel workers (rank > 0): they run the
        forward (its collectives) but rank 0 samples (and pools), and they learn the sampled
        tokens from it (``apply_sampled``) before the next step. ``lora``: the
        adapters, when LoRA is enabled (it has wrapped the model's projections).
        ``pooler_config``: an embedding engine's pooling (pagoda/worker/pooler.py).
        ``attention_backend``: auto, cpu, torch or triton (pagoda/attention/selector.py).
        ``encoder_cache_budget``: a vision-language model's encoder cache, in embeddings."""
        self.samples = samples
        self.model = model
        self.lora = lora
        # Speculative decoding: set by the engine (pagoda/spec_decode/) when enabled.
        self.proposer: Proposer | None = None
        self.block_size = block_size
        self.device = device
        quantized = storage_dtype(kv_cache_dtype)

        def cache(n: int, on: torch.device | str, pin: bool = False, buffer: int | None = None):
            return allocate_kv_cache(model, n, block_size, kv_dtype, kv_cache_dtype, on, pin, buffer)

        self.layout = kv_layout(model)
        for chunk in self.layout.group_chunks:
            if chunk is not None and chunk % block_size:
                raise ValueError(f"the model's attention chunk ({chunk}) must be a multiple of the KV block size "
                                 f"({block_size}): pass a block_size (--block-size) that divides it")
        held = set(held_buffers(model))
        self.kv_buffers = [cache(num_blocks, device, buffer=b) if b in held else None
                           for b in range(self.layout.num_buffers)]
        # Per layer, its buffer (layers of different KV groups share one).
        self.kv_caches = [self.kv_buffers[b] for b in self.layout.layer_buffer]
        # A hybrid model's state layers: one state per slot of the scheduler's state pool
        # (pagoda/core/state_pool.py), passed where attention layers get their KV cache.
        # With prefix caching, also the states saved at block ends, in the entries of the
        # scheduler's StateCheckpoints (pagoda/core/state_pool.py).
        self.state_slots: dict[str, int] = {}   # the slots of the requests this runner knows
        self._restore: dict[str, int] = {}      # new requests' prefix hits: the saved state to start from
        shapes = model.state_shapes()
        # Speculative decoding: after the saved states, k rows per slot where a verifying
        # step saves its request's state after each token but the last (``_keep_accepted``).
        self._spec_base = num_state_checkpoints
        self._spec_k = num_spec_state_rows // num_state_slots if num_state_slots else 0
        saved_rows = num_state_checkpoints + num_spec_state_rows
        if any(shape is not None for shape in shapes):
            if num_state_slots < 1:
                raise ValueError("a hybrid model needs state slots (num_state_slots)")
            dtype = model.activation_dtype
            for i, shape in enumerate(shapes):
                if shape is not None:
                    # Uninitialised (no memory is touched before use, as the KV cache): a slot
                    # is zeroed when a request takes it, a saved state written before it is read.
                    self.kv_caches[i] = StateCache(
                        torch.empty(num_state_slots, *shape, dtype=dtype, device=device),
                        torch.empty(saved_rows, *shape, dtype=dtype, device=device) if saved_rows else None,
                        self.kv_caches[i],   # a layer with a KV cache too keeps it (Falcon-H1)
                        # Swap preemption: swapped-out requests' states, in (pinned) host memory.
                        torch.empty(num_host_state_slots, *shape, dtype=dtype, pin_memory=device.type == "cuda")
                        if num_host_state_slots else None)
        self._state_caches: list[StateCache] = [c for c, sh in zip(self.kv_caches, shapes) if sh is not None]
        # Swap preemption's host pool: the same layout, in (pinned, on CUDA) host memory.
        # (None for a buffer this process does not hold: a hybrid model's state layers.)
        self.host_kv_buffers = [cache(num_host_blocks, "cpu", device.type == "cuda", b) if kv is not None else None
                                for b, kv in enumerate(self.kv_buffers)] if num_host_blocks else []  # fmt: skip
        # The attention backend (pagoda/attention): on the CPU its C++ kernels, decode attention
        # in place through the block tables (float32 queries, float32/float16/int8 KV).
        self.attn_backend, why = select_backend(attention_backend, device,
                                                quantized if quantized is not None else kv_dtype,
                                                model.activation_dtype)
        logger.info("attention backend: %s (%s)", self.attn_backend.describe(), why)
        self.decode_kernel = isinstance(self.attn_backend, CpuBackend)
        # Decode-only steps' layers in one C++ call, where the model's layers allow it.
        if self.decode_kernel and lora is None:
            model.decode_stack, why = decode_stack.build(model)
            logger.info("decode steps: %s", "the layers in one C++ call (DecodeStack)" if model.decode_stack
                        else f"the layers from Python ({why})")
        # A backend with device-side metadata (Triton) gets its token ids and positions the
        # same way: persistent buffers, non-blocking copies (pagoda/worker/step_inputs.py).
        self.step_inputs = StepInputs(device) if self.attn_backend.name == "triton" else None
        self.graphs: DecodeGraphs | None = None   # decode steps from captured graphs (capture_graphs)
        self.sampler = Sampler()
        # Plug-in logits processors (--logits-processors), set by the engine where this runner
        # samples; their stable view of the batch (pagoda/sample/processor_batch.py).
        self.logits_processors: ProcessorBatch | None = None
        self.pooler = Pooler.for_model(pooler_config, model) if pooler_config is not None and samples else None
        self.requests: dict[str, CachedRequestState] = {}
        # Generators outlive preemption, so a seeded request draws the same
        # numbers whether or not it was preempted and recomputed.
        self.generators: dict[str, torch.Generator] = {}
        self._rng = random.Random(seed)
        # Overlapped steps: the last sampled batch's (request -> row, sampled ids on the device).
        self._previous: tuple[dict[str, int], torch.Tensor] | None = None
        # A vision-language model: each image's embeddings, encoded once (pagoda/multimodal).
        self.image_token_id = (model.config.vision or {}).get("image_token_id")
        self.encoder_cache = EncoderCache(encoder_cache_budget) if self.image_token_id is not None else None
        # Images attended in both directions (Gemma 3): the torch path's masks open over them.
        self.open_images = bool((model.config.vision or {}).get("bidirectional"))
        # Positions of three rows (temporal, height, width) for image tokens (Qwen2-VL's M-RoPE).
        self.mrope = model.config.mrope_section is not None and self.image_token_id is not None
        chunked = any(self.layout.chunk_of(g) is not None for g in range(self.layout.num_groups))
        if self.open_images and (self.attn_backend.name not in ("torch", "cpu") or chunked):
            where = "chunked-attention layers" if chunked else f"the {self.attn_backend.name} attention backend"
            raise ValueError(f"{type(model).__name__}'s images attend in both directions, which {where} "
                             "do not do yet (the cpu and torch backends do)")

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

    def capture_graphs(self, capture: GraphCapture, max_batch: int, max_model_len: int) -> str | None:
        """Capture decode steps of up to ``max_batch`` sequences of up to ``max_model_len``
        tokens as graphs (pagoda/worker/cuda_graphs.py); None when done, else why not (the
        steps then stay eager)."""
        from pagoda.worker.cuda_graphs import DecodeGraphs

        if self.attn_backend.name != "triton":
            return f"the {self.attn_backend.name} attention backend is not captured"
        if self.lora is not None or self.model.stage is not None or self.proposer is not None:
            return "LoRA, pipeline stages and speculative decoding run eagerly"
        if self.model.config.num_experts > 0:
            return "MoE layers route tokens to experts on the host (a sync a graph cannot hold)"
        if self.layout.group_chunks:
            return "chunked attention splits requests per step (metadata a graph cannot hold)"
        attn = self.model.model.layers[0].self_attn
        if not hasattr(attn, "num_heads") or not hasattr(attn, "head_dim"):
            return f"{type(attn).__name__} layers are not captured"
        graphs = DecodeGraphs(self.model, self.kv_caches, self.attn_backend, self.layout.layer_group,
                              self.layout.num_groups, max_batch, -(-max_model_len // self.block_size),
                              self.block_size, attn.num_heads, attn.num_kv_heads, attn.head_dim, self.device,
                              capture)  # fmt: skip
        try:
            with torch.inference_mode():
                graphs.capture_all()
        except Exception as e:  # a forward that cannot be captured (data-dependent shapes, a sync)
            logger.warning("decode graphs not captured (%s: %s): decode steps run eagerly", type(e).__name__, e)
            return f"capture failed: {e}"
        self.graphs = graphs
        return None

    def apply_sampled(self, sampled: list[tuple[str, list[int]]]) -> None:
        """Append the tokens rank 0 sampled last step (tensor-parallel workers)."""
        for rid, tokens in sampled:
            state = self.requests.get(rid)
            if state is not None:
                state.output_token_ids.extend(tokens)
                state.all_token_ids.extend(tokens)

    def _update_states(self, so: SchedulerOutput) -> None:
        # Swapped-out requests' states first: their slots may be new requests' this step.
        for slot, host in so.state_swap_out:
            for cache in self._state_caches:
                cache.host[host].copy_(cache.slots[slot])
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            self.generators.pop(rid, None)
            self.state_slots.pop(rid, None)
            if self.pooler is not None:
                self.pooler.forget(rid)
        for rid in so.preempted_req_ids:
            self.requests.pop(rid, None)
            self.state_slots.pop(rid, None)
        for new in so.scheduled_new_reqs:
            if self._state_caches:
                if new.state_slot < 0:
                    raise RuntimeError(f"{new.req_id} was scheduled without a state slot on a hybrid model")
                self.state_slots[new.req_id] = new.state_slot
                for cache in self._state_caches:
                    if new.state_swap_in >= 0:   # swapped in: its state as it left
                        cache.slots[new.state_slot].copy_(cache.host[new.state_swap_in], non_blocking=True)
                    else:
                        cache.slots[new.state_slot].zero_()   # its first token meets zeros (the causal padding)
                if new.num_computed_tokens and new.state_swap_in < 0:
                    # A prefix hit, whole blocks: from the state saved at its end.
                    if self._state_caches[0].blocks is None or new.state_restore < 0:
                        raise RuntimeError(f"{new.req_id}: a prefix hit on a hybrid model without a saved state")
                    self._restore[new.req_id] = new.state_restore
            self.requests[new.req_id] = CachedRequestState(
                new.req_id, list(new.prompt_token_ids), list(new.output_token_ids),
                new.sampling_params, [list(t) for t in new.block_ids], new.num_computed_tokens, new.eos_token_ids,
                new.lora_int_id, new.pooling_params, list(new.mm_inputs),
            )
            if self.mrope and new.mm_inputs:
                state = self.requests[new.req_id]
                state.mrope, state.mrope_delta = self.model.mrope_positions(state.prompt_token_ids, state.mm_inputs)
            if new.pooling_params is not None and self.pooler is not None:
                self.pooler.start(new.req_id, new.num_computed_tokens)
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            for table, ids in zip(state.block_ids, cached.new_block_ids):
                table.extend(ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _step_states(self, order: list[str], query_lens: list[int], writes: dict[str, list[tuple[int, int]]],
                     meta: AttentionMetadata, drafts: dict[str, list[int]]) -> StepStates:
        """The step's plan for the state layers, in the metadata's order (decodes, one token
        each and first, then the prompt chunks by their first token): each sequence's slot,
        the saved state a prefix hit starts from, and the states its tokens save (the
        scheduler's ``state_writes``; a request verifying drafts also after each of its
        tokens but the last, in its slot's speculative rows)."""
        by_offset = {offset: i for i, offset in enumerate(itertools.accumulate([0, *query_lens[:-1]]))}
        rows = [by_offset[t] for t in range(meta.num_decodes)] + [by_offset[c.token_start] for c in meta.prefills]
        plan = StepStates([], [], [])
        for i in rows:
            rid = order[i]
            slot = self.state_slots[rid]
            plan.slots.append(slot)
            plan.restore.append(self._restore.pop(rid, -1))
            saves = list(writes.get(rid, ()))
            draft = drafts.get(rid)
            if draft:
                saves.extend((j, self._spec_row(slot, j)) for j in range(1, len(draft) + 1))
                saves.sort()
            plan.checkpoints.append(saves)
        return plan

    def _spec_row(self, slot: int, tokens: int) -> int:
        """The saved-state row holding a verifying request's state after its first ``tokens``
        tokens of the step (1 <= tokens <= k)."""
        if not 1 <= tokens <= self._spec_k:
            raise RuntimeError(f"a verifying step of {tokens} tokens past the {self._spec_k} speculative rows")
        return self._spec_base + slot * self._spec_k + tokens - 1

    def _keep_accepted(self, rid: str, num_drafts: int, num_emitted: int) -> None:
        """A hybrid model's request after verifying ``num_drafts`` drafts, ``num_emitted``
        tokens emitted (the accepted drafts and one more): its slot holds the state after
        every draft; where some were rejected, the state after the last token it keeps
        computed (its last known token and the accepted drafts) replaces it."""
        if not self._state_caches or num_emitted > num_drafts:
            return
        slot = self.state_slots[rid]
        row = self._spec_row(slot, num_emitted)
        for cache in self._state_caches:
            cache.slots[slot].copy_(cache.blocks[row])

    def _swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Copy preempted requests' blocks to the host pool, then resumed ones' back (out
        first: a device block freed by a swap-out may be the target of a swap-in)."""
        if swap_out:
            dev = torch.tensor([d for d, _ in swap_out], device=self.device)
            host = torch.tensor([h for _, h in swap_out])
            for kv, host_kv in zip(self.kv_buffers, self.host_kv_buffers):
                if kv is not None:
                    _copy_blocks(kv, host_kv, dev, host)
        if swap_in:
            host = torch.tensor([h for h, _ in swap_in])
            dev = torch.tensor([d for _, d in swap_in], device=self.device)
            for kv, host_kv in zip(self.kv_buffers, self.host_kv_buffers):
                if kv is not None:
                    _copy_blocks(host_kv, kv, host, dev)

    def execute_model(
        self, so: SchedulerOutput, grammar_masks: dict[str, torch.Tensor] | None = None
    ) -> ModelRunnerOutput:
        """One forward + sampling. ``grammar_masks``: req id -> [vocab] bool
        (True = allowed) for requests under a grammar; the sampler applies them
        (``SamplingRow.allowed_tokens``). Requests under a grammar never verify drafts
        (the scheduler gives them no draft slots)."""
        return self.finish_batch(self.start_batch(so, grammar_masks))

    @torch.inference_mode()
    def start_batch(self, so: SchedulerOutput,
                    grammar_masks: dict[str, torch.Tensor] | None = None) -> _Batch | None:  # fmt: skip
        """The first half of ``execute_model``: the batch's states, its inputs and the forward
        (on a pipeline's first stage, the stage's layers; the logits come later). None for
        an empty step. Everything the second half needs is captured here, so that under
        pipeline parallelism later steps may start (and forget finished requests) before
        ``finish_batch``."""
        self._update_states(so)
        if so.swap_out or so.swap_in:
            self._swap(so.swap_out, so.swap_in)
        if so.is_empty:
            return None
        drafts = self._propose(so)
        # Tokens computed per request: the scheduler's count, less draft slots left unfilled.
        num_tokens = {
            rid: n - so.num_spec_tokens.get(rid, 0) + len(drafts.get(rid, ()))
            for rid, n in so.num_scheduled_tokens.items()
        }
        # Decodes first: the attention path batches them together.
        order = sorted(num_tokens, key=lambda rid: num_tokens[rid] != 1)
        b = _Batch(so, order, [self.requests[rid] for rid in order], num_tokens, drafts)
        input_ids: list[int] = []
        positions: list[int] = []
        context_lens: list[int] = []
        tables: list[list[list[int]]] = []   # per request, per KV group
        # Images whose placeholders this step computes: (first row, start, end, state, image).
        splices: list[tuple[int, int, int, CachedRequestState, Any]] = []
        open_spans: dict[int, list[tuple[int, int]]] = {}   # request -> its images' spans, if open
        image_positions: list[tuple[int, np.ndarray]] = []   # M-RoPE: (first row, [3, n]) of image tokens
        pairs: list[tuple[int, int, int, int]] = []   # cross-encoder pairs with token types (pair_token_types)
        offset = 0
        for i, (rid, state) in enumerate(zip(order, b.states)):
            n = num_tokens[rid]
            draft = drafts.get(rid, [])
            start = state.num_computed_tokens
            end = start + n - len(draft)
            known = state.all_token_ids[start:end]
            input_ids.extend(known)
            if len(known) < end - start:
                # Overlapped steps: the last position's token is being sampled by the step
                # before (Request.num_pending); it is taken from that step's ids on the device.
                self._fill_from_previous(b, rid, len(input_ids), end - start - len(known))
                input_ids.append(0)
            input_ids.extend(draft)
            if state.mrope is None:
                positions.extend(range(start, start + n))
            else:
                positions.extend(self._mrope_rows(state, start, n, offset, image_positions))
            b.query_lens.append(n)
            context_lens.append(start)
            tables.append(state.block_ids)
            span = _prompt_span(state, start, end, offset)
            if span is not None:
                b.prompt_spans.append(span)
            for image in state.mm_inputs:
                if image.offset < end and image.end > start:
                    splices.append((offset, start, end, state, image))
                    if self.open_images:
                        open_spans.setdefault(i, []).append((image.offset, image.end))
            offset += n
            # Only a request whose last known token is in this step samples; an embedding
            # request pools every chunk of its prompt instead.
            if state.pooling_params is not None:
                b.pool_rows.append((i, offset - n))
                if state.pooling_params.pair_start is not None:
                    pairs.append((offset - n, start, n, state.pooling_params.pair_start))
            elif draft:
                b.spec_rows.append(i)
                b.spec_indices.extend(range(offset - len(draft) - 1, offset))
            elif end >= len(state.all_token_ids):
                b.sample_rows.append(i)
                b.logits_indices.append(offset - 1)
        if self.samples:
            grammar_masks = grammar_masks or {}
            b.sampling_rows = [
                SamplingRow(
                    params=state.sampling_params,
                    prompt_token_ids=state.prompt_token_ids,
                    output_token_ids=state.output_token_ids,
                    generator=self._generator_for(state.req_id, state.sampling_params),
                    eos_token_ids=state.eos_token_ids,
                    allowed_tokens=grammar_masks.get(state.req_id),
                    num_pending=b.missing.get(state.req_id, 0),
                )
                for state in (b.states[i] for i in b.sample_rows)
            ]

        # One metadata per KV group; each layer reads its group's (a chunked-attention group's
        # over its requests split at chunk boundaries: pagoda/core/kv_layout.py).
        metas = []
        for g in range(self.layout.num_groups):
            lens, group_tables = (b.query_lens, context_lens), [t[g] for t in tables]
            chunk = self.layout.chunk_of(g)
            if chunk is not None:
                *lens, group_tables = chunk_requests(*lens, group_tables, chunk, self.block_size)
            metas.append(self.attn_backend.build(*lens, group_tables, self.block_size, self.device, group=g))
            if open_spans:
                metas[-1].open_spans(open_spans)
        if self._state_caches:
            states = self._step_states(order, b.query_lens, so.state_writes, metas[0], drafts)
            for m in metas:
                m.states = states
        meta = metas[0] if len(metas) == 1 else [metas[g] for g in self.layout.layer_group]
        if self.lora is not None:
            token_loras: list[int] = []
            for rid, n in zip(order, b.query_lens):
                token_loras.extend([self.requests[rid].lora_int_id] * n)
            self.lora.prepare(token_loras, pinned={s.lora_int_id for s in self.requests.values()})
        if self.step_inputs is not None:
            ids_t, pos_t = self.step_inputs.fill(input_ids, positions)
        else:
            ids_t = torch.tensor(input_ids, dtype=torch.long, device=self.device)
            pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        if image_positions:   # three rows where image tokens have a height and a width
            pos_t = pos_t[None].repeat(3, 1)
            for row, rows in image_positions:
                pos_t[:, row:row + rows.shape[1]] = torch.from_numpy(rows).to(self.device)
        if b.fills:
            at, rows = zip(*b.fills)
            at_t, rows_t = device_tensor([at, rows], torch.long, self.device)
            ids_t[at_t] = self._previous[1][rows_t]
        embeds = self._image_embeds(ids_t, splices) if splices else None
        if pairs:   # a BERT-style cross-encoder's pairs: their second texts' tokens are of type 1
            embeds = self.model.embed(ids_t, pair_token_types(len(input_ids), pairs, self.device))
        if self.graphs is not None and not drafts and embeds is None and len(input_ids) == len(order):
            b.hidden = self.graphs.run(ids_t, pos_t, metas)   # None: not a step a graph runs
        if b.hidden is None:
            b.hidden = (self.model(ids_t, pos_t, self.kv_caches, meta) if embeds is None else
                        self.model(ids_t, pos_t, self.kv_caches, meta, inputs_embeds=embeds))
        if self.proposer is not None and self.proposer.needs_sync:
            if hasattr(self.proposer, "sync_step"):   # MTP: the target's hidden states too
                self.proposer.sync_step(order, b.query_lens, ids_t, pos_t, metas, b.hidden)
            else:
                self.proposer.sync(ids_t, pos_t, metas)
        return b

    @staticmethod
    def _mrope_rows(state: CachedRequestState, start: int, n: int, row: int,
                    image_positions: list[tuple[int, np.ndarray]]) -> list[int]:  # fmt: skip
        """M-RoPE: the positions of a request's tokens [start, start + n) (its prompt's from
        its table, later ones shifted by its delta), one a token; where image tokens among
        them have three that differ, their [3, k] go to ``image_positions`` at ``row``."""
        table = state.mrope
        assert table is not None
        length = table.shape[1]
        inside = table[:, start:min(start + n, length)]
        if inside.shape[1] and not ((inside[1] == inside[0]).all() and (inside[2] == inside[0]).all()):
            image_positions.append((row, inside))
        later = range(max(start, length) + state.mrope_delta, start + n + state.mrope_delta)
        return inside[0].tolist() + list(later)

    def _image_embeds(self, ids: torch.Tensor,
                      splices: list[tuple[int, int, int, CachedRequestState, Any]]) -> torch.Tensor:  # fmt: skip
        """The step's input embeddings: the tokens', with each image's embeddings at the
        placeholder positions the step computes (the image encoded now, or from the cache)."""
        if self.encoder_cache is None:
            raise RuntimeError("a request with images on a model that takes text only")
        embeds = self.model.embed(ids)
        encoded = [self.encoder_cache.get(image, self.model.embed_images, self.device) for *_, image in splices]
        width = max(e.shape[-1] for e in encoded)
        if width > embeds.shape[-1]:   # features beside the embeddings (Qwen3-VL's deepstack): zero on text rows
            embeds = torch.cat([embeds, embeds.new_zeros(embeds.shape[0], width - embeds.shape[-1])], dim=-1)
        for (row, start, end, state, image), emb in zip(splices, encoded):
            span = torch.tensor(state.all_token_ids[image.offset:image.end])
            is_embed = span == self.image_token_id
            if int(is_embed.sum()) != emb.shape[0]:
                raise RuntimeError(f"request {state.req_id}: {int(is_embed.sum())} image tokens for "
                                   f"{emb.shape[0]} embeddings")
            lo, hi = max(start, image.offset), min(end, image.end)
            which = (torch.cumsum(is_embed, 0) - 1)[lo - image.offset:hi - image.offset]
            take = is_embed[lo - image.offset:hi - image.offset]
            rows = torch.arange(row + lo - start, row + hi - start)[take]
            embeds[rows.to(embeds.device)] = emb[which[take].to(emb.device)].to(embeds.dtype)
        return embeds

    def _fill_from_previous(self, b: _Batch, rid: str, at: int, missing: int) -> None:
        previous = self._previous
        if missing != 1 or previous is None or rid not in previous[0]:
            raise RuntimeError(f"request {rid}: {missing} input token(s) unknown, and not sampled by the step "
                               "before: only the token of the step in flight may be pending")
        b.fills.append((at, previous[0][rid]))
        b.missing[rid] = missing

    @torch.inference_mode()
    def sample_batch(self, b: _Batch | None) -> None:
        """Overlapped steps: the batch's logits and sampled ids, left on the device (the next
        step may take its input tokens from them before ``finish_batch`` reads them back)."""
        if b is None or not b.sample_rows or not self.samples or b.sampler_out is not None:
            return
        if b.spec_rows or b.prompt_spans or b.pool_rows:
            raise RuntimeError("a step with drafts, prompt logprobs or pooling is not sampled ahead")
        logits = self.model.compute_logits(self._rows(b.hidden, b.logits_indices))
        out = self.sampler(logits, self._sampling_metadata(b, logits.shape[-1]))
        self._previous = ({b.order[i]: j for j, i in enumerate(b.sample_rows)}, out.sampled_token_ids)
        if self.device.type == "cuda":
            # Back to the host now, behind this step's kernels but ahead of the next step's:
            # reading them (finish_batch) then waits for this step only, not for the next.
            b.sampler_out, b.ready = _to_host(out)
        else:
            b.sampler_out = out

    @torch.inference_mode()
    def finish_batch(self, b: _Batch | None) -> ModelRunnerOutput:
        """The second half of ``execute_model``: logits, sampling, the requests' progress."""
        if b is None:
            return ModelRunnerOutput([], [])
        so, order, hidden = b.so, b.order, b.hidden
        sampled: list[list[int]] = [[] for _ in order]
        logprobs: list = [None for _ in order]
        pooled = self._pool(order, b.query_lens, b.pool_rows, hidden) if b.pool_rows and self.pooler is not None else {}
        if b.spec_rows:
            spec_logits = self.model.compute_logits(hidden[torch.tensor(b.spec_indices, device=self.device)])
            self._verify([order[i] for i in b.spec_rows], b.drafts, spec_logits, sampled, b.spec_rows)
            for i in b.spec_rows:
                self._keep_accepted(order[i], len(b.drafts[order[i]]), len(sampled[i]))
        prompt_logprobs = self._prompt_logprobs(hidden, b.prompt_spans, dict(zip(order, b.states)))
        if b.sample_rows and b.sampler_out is None:
            logits = self.model.compute_logits(self._rows(hidden, b.logits_indices))
        if b.ready is not None:
            b.ready.synchronize()
        if b.sample_rows and self.samples:
            out = b.sampler_out
            if out is None:
                out = self.sampler(logits, self._sampling_metadata(b, logits.shape[-1]))
            token_ids = out.sampled_token_ids.tolist()
            entries = _sampled_logprobs(out, [r.params for r in b.sampling_rows])
            for j, i in enumerate(b.sample_rows):
                sampled[i] = [token_ids[j]]
                logprobs[i] = [entries[j]] if entries[j] is not None else None
        if not self.samples:
            for rid, state in zip(order, b.states):
                state.num_computed_tokens += so.num_scheduled_tokens[rid]
            return ModelRunnerOutput(order, sampled, logprobs)
        for i, (rid, state) in enumerate(zip(order, b.states)):
            if self.requests.get(rid) is not state:
                # Forgotten since its step started (it finished, was aborted or preempted while
                # the step was in flight: pipeline parallelism): it gets nothing from the step.
                sampled[i], logprobs[i] = [], None
                prompt_logprobs.pop(rid, None)
                continue
            state.num_computed_tokens += b.num_tokens[rid]
            if sampled[i]:
                state.output_token_ids.extend(sampled[i])
                state.all_token_ids.extend(sampled[i])
            if rid in so.num_spec_tokens:
                # Roll back as the scheduler does: the last emitted token is not
                # computed yet, and blocks past the computed tokens are freed.
                state.num_computed_tokens = len(state.all_token_ids) - 1
                num_kept = (state.num_computed_tokens + self.block_size - 1) // self.block_size
                for table in state.block_ids:
                    del table[num_kept:]
        return ModelRunnerOutput(
            order, sampled, logprobs, num_draft_tokens={rid: len(d) for rid, d in b.drafts.items() if d},
            prompt_logprobs=prompt_logprobs,
            pooled=pooled,
        )

    def _sampling_metadata(self, b: _Batch, vocab_size: int) -> SamplingMetadata:
        """The sampler's metadata for the batch's sampling rows; with logits processors, their
        state brought up to these rows (once per sampling step, just before it samples)."""
        md = SamplingMetadata.from_rows(b.sampling_rows, vocab_size, self.device)
        if self.logits_processors is not None:
            md.logits_processors = self.logits_processors.step([
                ProcessorRow(b.order[i], b.states[i].sampling_params, b.states[i].prompt_token_ids,
                             b.states[i].output_token_ids)
                for i in b.sample_rows])
        return md

    def _rows(self, hidden: torch.Tensor, indices: list[int]) -> torch.Tensor:
        """hidden[indices] (strictly increasing rows): a slice where they are the first n rows
        (a decode step in which every request samples: no index tensor to copy to the device)."""
        n = len(indices)
        if indices[-1] == n - 1:
            return hidden[:n]
        return hidden[torch.tensor(indices, device=self.device)]

    def _pool(self, order: list[str], query_lens: list[int], pool_rows: list[tuple[int, int]],
              hidden: torch.Tensor) -> dict[str, list[float]]:  # fmt: skip
        """Feed each embedding request's chunk of hidden states to the pooler; the vectors of
        those whose prompt ended in this step."""
        assert self.pooler is not None
        pooled = {}
        for i, first in pool_rows:
            state = self.requests[order[i]]
            rows = hidden[first:first + query_lens[i]]
            vector = self.pooler.add(state.req_id, rows, state.num_computed_tokens, len(state.prompt_token_ids),
                                     state.pooling_params)
            if vector is not None:
                pooled[state.req_id] = vector
        return pooled


    def _prompt_logprobs(self, hidden: torch.Tensor, spans: list[tuple[str, int, range]],
                         states: dict[str, CachedRequestState]) -> dict[str, tuple[int, list[TokenLogprobs]]]:  # fmt: skip
        """prompt_logprobs of this step's prompt chunks: the raw logprobs (log-softmax of the
        logits, no sampling settings applied, as vLLM) of each next prompt token. Every rank
        computes the logits (a collective under tensor parallelism); rank 0 reads them."""
        if not spans:
            return {}
        rows = torch.tensor([r for _, _, span in spans for r in span], device=self.device)
        logits = self.model.compute_logits(hidden[rows])
        if not self.samples:
            return {}
        all_lps = torch.log_softmax(logits.float(), dim=-1)
        out: dict[str, tuple[int, list[TokenLogprobs]]] = {}
        first = 0
        for rid, first_token, span in spans:
            state = states[rid]
            lps = all_lps[first:first + len(span)]
            first += len(span)
            targets = torch.tensor(state.prompt_token_ids[first_token:first_token + len(span)], device=self.device)
            k = state.sampling_params.prompt_logprobs
            k = lps.shape[-1] if k == -1 else min(k, lps.shape[-1])
            out[rid] = (first_token, _logprob_entries(lps, targets, k))
        return out
    # ---- speculative decoding ---------------------------------------------------------

    def _propose(self, so: SchedulerOutput) -> dict[str, list[int]]:
        if self.proposer is None or not so.num_spec_tokens:
            return {}
        rids = list(so.num_spec_tokens)
        asks = [
            DraftRequest(self.requests[rid].all_token_ids, so.num_spec_tokens[rid], self.requests[rid].block_ids, rid)
            for rid in rids
        ]
        return {rid: d[: so.num_spec_tokens[rid]] for rid, d in zip(rids, self.proposer.propose(asks))}

    def _verify(
        self,
        rids: list[str],
        drafts: dict[str, list[int]],
        logits: torch.Tensor,
        sampled: list[list[int]],
        rows_in_order: list[int],
    ) -> None:
        """Accept or reject each request's drafts against the target's logits (one row
        per draft plus one). Row j of a request sees its output so far plus drafts d[:j],
        so penalties, logit bias and min_tokens apply exactly as plain decoding would."""
        rows: list[SamplingRow] = []
        for rid in rids:
            state = self.requests[rid]
            gen = self._generator_for(rid, state.sampling_params)
            draft = drafts[rid]
            for j in range(len(draft) + 1):
                rows.append(SamplingRow(
                    params=state.sampling_params,
                    prompt_token_ids=state.prompt_token_ids,
                    output_token_ids=state.output_token_ids + draft[:j],
                    generator=gen,
                    eos_token_ids=state.eos_token_ids,
                ))
        md = SamplingMetadata.from_rows(rows, logits.shape[-1], self.device)
        greedy_ids, probs = self.sampler.target_distribution(logits, md)
        greedy = greedy_ids.tolist()
        first = 0
        for rid, i in zip(rids, rows_in_order):
            draft = drafts[rid]
            last = first + len(draft) + 1
            params = self.requests[rid].sampling_params
            if params.is_greedy:
                sampled[i] = verify_greedy(greedy[first:last], draft)
            else:
                assert probs is not None
                sampled[i] = rejection_sample(probs[first:last], draft, None, self._generator_for(rid, params))
            first = last
