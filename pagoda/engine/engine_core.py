"""EngineCore: the scheduler and the model runner, stepped together.

It speaks only token ids (EngineCoreRequest in, EngineCoreOutputs out), so the
same object runs inside the caller's process (offline LLM, tests) or in an
engine-core process behind ZMQ (the server).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import time
from collections import deque
from dataclasses import dataclass

import torch

from pagoda.config import EngineConfig
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.kv_layout import KVLayout
from pagoda.core.outputs import EngineCoreOutput
from pagoda.core.request import Request, RequestStatus
from pagoda.core.scheduler import Scheduler, SchedulerConfig
from pagoda.engine.cpu_threads import governed_threads
from pagoda.engine.cpu_threads import ThreadGovernor
from pagoda.engine.messages import EngineCoreOutputs, EngineCoreRequest, Heartbeat
from pagoda.host import cpu_threads_policy, keep_freed_memory
from pagoda.hub.stores import model_defaults, resolve_model_path
from pagoda.lora.errors import LoRAInUseError
from pagoda.lora.manager import LoRAManager
from pagoda.lora.request import LoRARequest
from pagoda.metrics.step import StepStatsCollector
from pagoda.model.auto_mode import resolve_quantization
from pagoda.model.loader import LoadedModel, load_model, parameter_bytes, parse_dtype
from pagoda.model.models import model_class
from pagoda.pooling import (
    PoolerConfig,
    classifier_from_config,
    read_hf_config,
    resolve_classifier_pooler,
    resolve_pooler_config,
    resolve_task,
)
from pagoda.validation import InvalidRequestError, WrongTaskError
from pagoda.worker.cuda_setup import cuda_defaults
from pagoda.worker.kv_sizing import kv_blocks_for
from pagoda.worker.model_runner import ModelRunner, kv_cache_bytes_per_block, kv_cache_storage, kv_layout, state_bytes

logger = logging.getLogger(__name__)
EXPERT_LOAD_INTERVAL_S = 1.0   # how often a MoE model's expert load goes to the API process
# A float32 KV cache (the exact mode) for contexts this long gets a start-up hint about float16 KV.
LONG_CONTEXT_HINT = 4096


def _tenant_specs(config: EngineConfig) -> tuple:
    if config.api_keys_file is None:
        return ()
    from pagoda.tenants import load_api_keys_file, tenants_of

    return tuple(tenants_of(load_api_keys_file(config.api_keys_file)).values())


ALLOW_LONG_ENV = ("PAGODA_ALLOW_LONG_MAX_MODEL_LEN", "VLLM_ALLOW_LONG_MAX_MODEL_LEN")


def check_trained_context(max_model_len: int, arch) -> None:
    """A --max-model-len past the context the checkpoint was trained for is refused, as vLLM
    refuses it (positions past it were never seen and the outputs can turn to noise), unless
    PAGODA_ALLOW_LONG_MAX_MODEL_LEN=1 (or vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN=1) says to
    serve it anyway: then a warning."""
    trained = arch.trained_context
    if max_model_len <= trained:
        return
    what = (f"max_model_len {max_model_len} is past {trained}, the context {arch.architecture} was trained for "
            f"(max_position_embeddings, a GGUF file's context_length, with its RoPE scaling)")
    for name in ALLOW_LONG_ENV:
        if os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on"):
            logger.warning("%s: serving it as %s=1 asks; positions past it may give wrong outputs", what, name)
            return
    raise ValueError(f"{what}; positions past it may give wrong outputs. Set {ALLOW_LONG_ENV[0]}=1 to serve "
                     f"it anyway")


@dataclass(frozen=True)
class _KVPlan:
    """The KV cache an engine holds (EngineCore._plan_kv)."""

    num_blocks: int
    num_host_blocks: int
    max_model_len: int
    kv_dtype: torch.dtype
    kv_quant: str
    layout: KVLayout


def _check_hybrid(config: EngineConfig) -> None:
    """What a hybrid model (state layers beside attention: pagoda/model/models/lfm2.py) does
    not combine with yet, each named: the runner's state slots hold one state per running
    request, which a draft running the target's own first layers, transferred KV blocks and
    pipeline stages would not. (Tensor parallelism: the family says whether its state
    layers split, ``CausalLM.tensor_parallel``.)"""
    spec = config.speculative_config
    refused = [(spec is not None and spec.method == "layer_skip", "--speculative-config method layer_skip"),
               (config.kv_role is not None, "--kv-role"),
               (config.pipeline_parallel_size > 1, "--pipeline-parallel-size > 1"),
               (config.dp_expert_parallel, "--enable-expert-parallel"),
               (config.enable_lora, "--enable-lora")]
    names = [name for bad, name in refused if bad]
    if names:
        raise ValueError(f"a hybrid model (recurrent state layers) cannot be combined with {', '.join(names)} yet")


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, collect_stats: bool = True) -> None:
        """``collect_stats``: attach a StepRecord (batch, FLOPs/bytes estimate) to each step's
        outputs and now and then a KV pool picture, for metrics and the dashboard."""
        config, why = resolve_quantization(config, resolve_model_path(config.model))
        if why is not None:
            logger.info(why)
        self.config = config
        device = torch.device(config.device)
        parallel = config.world_size > 1 or config.data_parallel_size > 1
        if device.type == "cpu" and not parallel:  # parallel ranks: configure_threads (threads_per_rank)
            threads = cpu_threads_policy(config.num_threads)
            if threads is not None:
                torch.set_num_threads(threads)
            logger.info("CPU threads: %d", torch.get_num_threads())
        if device.type == "cpu":
            keep_freed_memory()
        if device.type == "cuda":
            cuda_defaults(config)
        dtype = parse_dtype(config.dtype)
        self.tp_driver = None
        self.ep_group = None   # expert parallelism across data-parallel replicas (_join_expert_parallel)
        # Pipeline parallelism: steps started, not finished yet (_step_pipelined), at most this many.
        self.pipeline_depth = config.pipeline_parallel_size
        self._in_flight: deque = deque()
        self.threads: ThreadGovernor | None = None  # the thread count's governor, where it moves
        if config.world_size > 1:
            # Rank 0 of a tensor- and/or pipeline-parallel group (pagoda/executor/multiproc.py).
            from pagoda.executor.multiproc import configure_threads, start_driver

            if loaded is not None:
                raise ValueError("a parallel engine loads its own part of the model; do not pass `loaded`")
            configure_threads(config)
            ray_launcher = None
            if config.distributed_executor_backend == "ray":
                from pagoda.executor.ray_executor import start_ray_workers as ray_launcher
            self.tp_driver, device = start_driver(config, ray_launcher)
            try:
                group = self.tp_driver.group
                loaded = load_model(config.model, dtype, device, show_progress=config.show_progress,
                                    quantization=config.quantization, tp_group=group.tp, tp_rank=0,
                                    expert_parallel=config.enable_expert_parallel, pipe=group.pipe,
                                    mmproj=config.mmproj)
                self._init_rest(config, loaded, device, dtype, collect_stats)
            except BaseException:
                # The workers may be waiting in a collective: stop them, do not talk to them.
                self.tp_driver.kill()
                raise
            return
        if loaded is None:
            loaded = load_model(config.model, dtype, device, show_progress=config.show_progress,
                                quantization=config.quantization, mmproj=config.mmproj)
        self.ep_group = None
        if config.dp_expert_parallel:
            self._join_expert_parallel(config, loaded, device)
        if device.type == "cpu" and not parallel:
            span = governed_threads(config.num_threads)
            if span is not None:
                self.threads = ThreadGovernor(*span, set_threads=torch.set_num_threads)
                logger.info("CPU threads: %d, down to %d while other processes want a core", *reversed(span))
            else:
                weight_bytes = parameter_bytes(loaded.model)
                threads = cpu_threads_policy(config.num_threads, weight_bytes)
                if threads is not None and threads != torch.get_num_threads():
                    torch.set_num_threads(threads)
                    logger.info("CPU threads: %d (for %.2f GiB of weights)", threads, weight_bytes / 2**30)
        self._init_rest(config, loaded, device, dtype, collect_stats)

    def _join_expert_parallel(self, config: EngineConfig, loaded: LoadedModel, device: torch.device) -> None:
        """Join the replicas' expert-parallel group and keep only this replica's share of every
        MoE layer's experts (pagoda/model/layers/expert_parallel.py). The checkpoint is read
        whole first, then the other replicas' experts are dropped."""
        from pagoda.distributed.group import EPGroup
        from pagoda.model.layers.expert_parallel import moe_blocks, shard_experts

        if config.expert_parallel_init_method is None:
            raise ValueError("--data-parallel-size > 1 with --enable-expert-parallel runs its replicas through "
                             "DataParallelLLM (`pagoda serve`), which gives them their group's rendezvous; "
                             "a single engine (LLM, EngineCore) cannot form it")
        if not moe_blocks(loaded.model):
            raise ValueError(f"--enable-expert-parallel: {loaded.path} has no mixture-of-experts layers")
        self.ep_group = EPGroup(config.expert_parallel_init_method, config.data_parallel_rank,
                                config.data_parallel_size, device, config.distributed_timeout)
        before = parameter_bytes(loaded.model)
        e0, e1 = shard_experts(loaded.model, self.ep_group)
        self._ep_layers = len(moe_blocks(loaded.model))
        logger.info("expert parallelism across %d data-parallel replicas: replica %d holds experts [%d, %d) of %d "
                    "in each of %d MoE layers (%d per replica); weights %.1f -> %.1f MiB",
                    config.data_parallel_size, config.data_parallel_rank, e0, e1, loaded.arch.num_experts,
                    self._ep_layers, e1 - e0, before / 2**20, parameter_bytes(loaded.model) / 2**20)

    def _init_rest(self, config: EngineConfig, loaded: LoadedModel, device: torch.device, dtype: torch.dtype,
                   collect_stats: bool) -> None:
        """Everything after the model is loaded: the KV plan, the scheduler, the runner
        (LoRA, speculative decoding), shared prefixes and step statistics."""
        self.loaded = loaded
        arch = loaded.arch
        self._moe = arch.num_experts > 0
        self._last_expert_load = float("-inf")
        self.vocab_size = arch.vocab_size
        if self.tp_driver is not None:
            self.tp_driver.gather_weight_bytes(loaded.model)
        self.pooler_config = self._pooler_config(config, loaded)
        if arch.is_hybrid:
            _check_hybrid(config)
        draft = self._load_draft(config, loaded, device, dtype)
        plan = self._plan_kv(config, loaded, device, dtype, draft)
        self._build_scheduler(config, plan)
        self._build_runner(config, loaded, device, dtype, plan, draft)
        self.kv_transfer = None   # prefill-decode disaggregation (pagoda/kv_transfer/engine.py)
        if config.kv_role is not None:
            from pagoda.kv_transfer.engine import PDTransfer

            if self.pooler_config is not None:
                raise ValueError("--kv-role applies to an engine that generates, not to an embedding engine")
            self.kv_transfer = PDTransfer(config.kv_transfer_config, self.scheduler, self.runner.kv_buffers)
        self.shared_prefixes = self._shared_prefixes(config, loaded)
        self.overlap = self._overlap_steps(config, device)
        self._structured = None
        self.step_stats: StepStatsCollector | None = None
        if collect_stats:
            weight_elem = next(loaded.model.parameters()).element_size()
            elem = torch.empty(0, dtype=dtype).element_size()
            kv_elem = torch.empty(0, dtype=plan.kv_dtype).element_size() if plan.kv_quant == "auto" else 1
            self.step_stats = StepStatsCollector(arch, weight_bytes=weight_elem, act_bytes=elem, kv_bytes=kv_elem)

    def _overlap_steps(self, config: EngineConfig, device: torch.device) -> bool:
        """Whether steps overlap (--async-scheduling; default on CUDA): the next step is
        scheduled and launched while the one before runs (``_step_overlapped``). One
        process's engine only; the start-up log says why not."""
        wanted = config.async_scheduling if config.async_scheduling is not None else device.type == "cuda"
        if not wanted:
            return False
        why = ("tensor or pipeline parallelism" if self.tp_driver is not None else
               "speculative decoding" if config.speculative_config is not None else
               "prefill-decode disaggregation" if self.kv_transfer is not None else
               "expert parallelism across replicas" if self.ep_group is not None else
               "an embedding engine" if self.pooler_config is not None else
               "logits processors (they read each request's output tokens on the host, before the step "
               "samples)" if config.logits_processors else None)
        if why is not None:
            if config.async_scheduling:
                raise ValueError(f"--async-scheduling does not combine with {why}")
            logger.info("steps run one after another (%s)", why)
            return False
        logger.info("steps overlap: the next is scheduled while the one before runs")
        return True

    @staticmethod
    def _pooler_config(config: EngineConfig, loaded: LoadedModel) -> PoolerConfig | None:
        """An embedding or classifying engine's pooling (pagoda/pooling.py); None for a
        generating one."""
        arch, from_tokens = loaded.arch, config.classifier_from_token
        if from_tokens is not None and (arch.num_labels or not arch.has_lm_head):
            raise ValueError(f"--classifier-from-token reads a causal LM's LM head; {loaded.path} has none "
                             f"({'a score head of its own' if arch.num_labels else 'no LM head'})")
        task = resolve_task(config.task, loaded.path, arch.has_lm_head,
                            classifier=bool(arch.num_labels) or from_tokens is not None)
        overrides = config.override_pooler_config
        if task in ("embed", "classify") and config.pipeline_parallel_size > 1:
            raise ValueError(f"{loaded.path} is served with --task {task}, which is not supported with "
                             f"--pipeline-parallel-size > 1 yet")
        if from_tokens is not None and task != "classify":
            raise ValueError(f"--classifier-from-token applies to --task classify, not {task}")
        if arch.encoder is not None and task != "classify":
            raise ValueError(f"{arch.architecture} is served as a classifier only (--task classify), not {task}")
        if task == "classify":
            return EngineCore._classifier_pooler(config, loaded)
        if task != "embed":
            if overrides is not None and not overrides.is_empty:
                raise ValueError("pooler options (--pooling-type, --no-normalize, --matryoshka-dimensions) apply "
                                 "to an embedding engine; this one generates (start it with --task embed)")
            return None
        if config.speculative_config is not None:
            raise ValueError("--speculative-config does not apply to an embedding engine (--task embed)")
        pooler = resolve_pooler_config(loaded.path, loaded.arch.hidden_size, overrides)
        logger.info("task embed: %s pooling, %snormalized, %d dimensions", pooler.pooling_type,
                    "" if pooler.normalize else "not ", pooler.hidden_size)
        return pooler

    @staticmethod
    def _classifier_pooler(config: EngineConfig, loaded: LoadedModel) -> PoolerConfig:
        """A classifying engine's pooling and head (pagoda/pooling.py ClassifierConfig):
        LAST for a decoder, CLS for an encoder, the labels and activations from config.json."""
        arch, from_tokens = loaded.arch, config.classifier_from_token
        for setting, on in (("--speculative-config", config.speculative_config is not None),
                            ("tensor parallelism", config.world_size > 1),
                            ("LoRA", config.enable_lora and arch.encoder is not None)):
            if on:
                raise ValueError(f"{setting} is not supported with --task classify ({loaded.path}) yet")
        token_ids = None
        if from_tokens is not None:
            from pagoda.tokenizer import build_tokenizer

            tokenizer = build_tokenizer(loaded, config.chat_template)
            token_ids = tuple(tokenizer.token_to_id(t) for t in from_tokens)
            missing = [t for t, i in zip(from_tokens, token_ids) if i is None]
            if missing or any(i >= arch.vocab_size for i in token_ids if i is not None):
                raise ValueError(f"--classifier-from-token: {missing or list(from_tokens)} are not tokens of the "
                                 f"model's vocabulary (give them as the vocabulary spells them)")
        classifier = classifier_from_config(read_hf_config(loaded.path), arch.num_labels, from_tokens, token_ids,
                                            token_types=arch.encoder is not None)
        pooler = resolve_classifier_pooler(arch.hidden_size, classifier, "LAST" if arch.encoder is None else "CLS",
                                           config.override_pooler_config)
        logger.info("task classify: %s pooling, labels %s%s; /classify applies %s, /score and /rerank %s",
                    pooler.pooling_type, list(classifier.labels),
                    f" (the LM head's logits of {list(from_tokens)})" if from_tokens else "",
                    classifier.classify_activation, classifier.score_activation)
        return pooler

    def _load_draft(self, config: EngineConfig, loaded: LoadedModel, device: torch.device,
                    dtype: torch.dtype) -> LoadedModel | None:
        """The draft model of a draft_model speculative config (None otherwise), checked
        against the target with any speculative config."""
        spec = config.speculative_config
        draft = None
        if spec is not None and spec.method == "mtp":
            if self.tp_driver is not None:
                raise ValueError("an mtp speculative config is not supported with --tensor-parallel-size > 1")
            from pagoda.spec_decode.mtp import load_mtp

            return load_mtp(loaded.path, loaded, dtype, device, config.quantization)
        if spec is not None and spec.method == "draft_model":
            if self.tp_driver is not None:
                raise ValueError("a draft_model speculative config is not supported with --tensor-parallel-size > 1")
            from pagoda.spec_decode.gemma4_assistant import assistant_config, load_assistant

            assistant = assistant_config(spec.model)
            if assistant is not None:   # a Gemma 4 assistant: queries over the target's KV cache
                return load_assistant(spec.model, assistant, loaded, dtype, device, config.quantization)
            draft = load_model(spec.model, dtype, device, show_progress=config.show_progress,
                               quantization=config.quantization)
        if spec is not None:
            from pagoda.spec_decode import check_draft_model

            check_draft_model(spec, loaded, draft)
        return draft

    def _plan_kv(self, config: EngineConfig, loaded: LoadedModel, device: torch.device, dtype: torch.dtype,
                 draft: LoadedModel | None) -> _KVPlan:
        """How many KV blocks (device and host) this engine holds, and the longest request
        they fit; sets max_model_len, num_blocks, num_host_blocks and logs the memory plan."""
        # An Ollama model's num_ctx is its default context length (pagoda/hub/stores.py).
        default_len = model_defaults(config.model).max_model_len
        max_model_len = config.max_model_len or min(default_len or loaded.arch.max_position_embeddings,
                                                    loaded.arch.max_position_embeddings)
        if config.max_model_len:
            check_trained_context(config.max_model_len, loaded.arch)
        limit = loaded.arch.context_limit
        if limit is not None and max_model_len > limit:
            if config.max_model_len:
                raise ValueError(f"max_model_len {max_model_len} is past {limit}, the longest context "
                                 f"{loaded.arch.architecture} is served at (its attention is exact up to there)")
            max_model_len = limit
        kv_dtype, kv_quant = kv_cache_storage(config.resolved_kv_cache_dtype, dtype)  # kv_quant: 8-bit with scales
        per_block = kv_cache_bytes_per_block(loaded.model, config.block_size, kv_dtype, kv_quant)
        if draft is not None and not getattr(draft.model, "reads_target_kv", False):
            # The draft model's own cache has as many blocks, over the same block ids.
            per_block += kv_cache_bytes_per_block(draft.model, config.block_size, dtype)
        self.num_state_slots, self.num_state_checkpoints, self.state_checkpoint_interval = 0, 0, 1
        self.num_spec_state_rows = 0
        beside_blocks = 0
        if loaded.arch.is_hybrid:
            beside_blocks = self._plan_checkpoints(config, loaded, per_block)
        num_blocks = kv_blocks_for(config, loaded.model, device, dtype, per_block + beside_blocks)
        if loaded.arch.is_hybrid:
            num_blocks = self._size_states(config, loaded, num_blocks, per_block, beside_blocks)
        if self.tp_driver is not None:
            # Every rank sizes its own pool (its own heads, its own memory); the smallest wins.
            num_blocks = self.tp_driver.group.all_reduce_min(num_blocks)
            if loaded.arch.is_hybrid:
                # The workers hold as many state slots and saved states (their heads' states):
                # rank 0's plan, passed as a minimum over the ranks (the workers give STATE_PLAN_ANY).
                self.num_state_slots, self.num_state_checkpoints = (
                    self.tp_driver.group.all_reduce_min(n) for n in (self.num_state_slots, self.num_state_checkpoints))
                if self.state_checkpoint_interval == 1 and self.num_state_checkpoints:
                    self.num_state_checkpoints = num_blocks   # one beside each block
        # Layers of different attention types (windows) keep separate block tables (KV
        # groups) over one pool: the longest request the pool holds counts each group's blocks.
        layout = kv_layout(loaded.model)
        step_tokens = min(config.max_num_batched_tokens, max_model_len)
        capacity = num_blocks * config.block_size
        longest = layout.max_tokens(num_blocks, config.block_size, step_tokens)
        if longest < max_model_len:
            if config.max_model_len is not None or num_blocks < 1:
                raise ValueError(
                    f"the KV cache holds {capacity} tokens ({num_blocks} blocks of "
                    f"{config.block_size}), fewer than max_model_len={max_model_len} needs"
                    f"{f' in {layout.num_groups} KV groups' if layout.num_groups > 1 else ''}; "
                    f"raise --kv-cache-memory or lower --max-model-len"
                )
            max_model_len = longest
        logger.info("memory plan: weights %.2f GiB, KV cache %.2f GiB (%d blocks of %d tokens in %d KV group(s) "
                    "of %d layers: %d block-tokens, %d per request)", parameter_bytes(loaded.model) / 2**30,
                    num_blocks * per_block / 2**30, num_blocks, config.block_size, layout.num_groups,
                    layout.num_buffers, capacity, max_model_len)
        if kv_dtype == torch.float32 and config.kv_cache_dtype == "auto" and max_model_len >= LONG_CONTEXT_HINT:
            # The exact mode keeps transformers' numbers (float32 KV) by default; say what the
            # faster trade is, since a long context's decode step reads all of it.
            logger.info("KV cache in float32 (the exact mode's default: transformers' numbers); a long context's "
                        "decode reads all of it every step: --kv-cache-dtype float16 halves that (docs/benchmarks.md: "
                        "1.34x decode tok/s at a 4k context, logprobs within 7e-3 of transformers instead of 1e-4)")
        swap_space = config.swap_space if config.preemption_mode != "recompute" else 0
        self.num_host_state_slots = 0
        if swap_space and self.num_state_slots:
            # A hybrid model's swapped-out requests take their states along: up to half the
            # swap space holds states (at most one per state slot), the rest KV blocks.
            slot = state_bytes(loaded.model)
            self.num_host_state_slots = min(self.num_state_slots, swap_space // 2 // slot)
            if self.num_host_state_slots < 1:
                raise ValueError(f"--swap-space {config.swap_space} bytes holds no request's state: a hybrid model "
                                 f"swaps {slot} bytes of state per request beside its KV; give it at least "
                                 f"{2 * slot} bytes")
            swap_space -= self.num_host_state_slots * slot
            logger.info("swap space: %d host state slots (%.1f MiB), %.1f MiB for KV blocks", self.num_host_state_slots,
                        self.num_host_state_slots * slot / 2**20, swap_space / 2**20)
        num_host_blocks = swap_space // per_block
        if config.preemption_mode != "recompute" and num_host_blocks < 1:
            raise ValueError(f"--swap-space {config.swap_space} bytes holds no KV block ({per_block} bytes each)")
        self.max_model_len = max_model_len
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        return _KVPlan(num_blocks, num_host_blocks, max_model_len, kv_dtype, kv_quant, layout)

    def _plan_checkpoints(self, config: EngineConfig, loaded: LoadedModel, per_block: int) -> int:
        """How a hybrid model's prefix cache saves states: one beside every block where a
        state costs at most the block's own KV (LFM2's convolutions: returns its bytes, added
        to a block's), else (a Gated DeltaNet's or Mamba layer's state is megabytes) in a pool
        of their own, one every ``ceil(state / block KV)`` blocks of a long prompt and at each
        chunk's last block end (``state_checkpoint_interval``; returns 0). No saved states
        without prefix caching."""
        if not config.enable_prefix_caching or (self.pooler_config and self.pooler_config.needs_every_position):
            self.state_checkpoint_interval = 0
            return 0
        slot = state_bytes(loaded.model)
        if slot <= per_block:
            return slot
        self.state_checkpoint_interval = -(-slot // per_block)
        return 0

    def _size_states(self, config: EngineConfig, loaded: LoadedModel, num_blocks: int, per_block: int,
                     beside_blocks: int) -> int:
        """A hybrid model's state slots (at most one per seat, at most half the cache budget)
        and saved states (one per block, or a quarter of the budget in a pool of their own:
        at least two), out of the budget the blocks were sized for; returns the blocks left."""
        slot = state_bytes(loaded.model)
        budget = num_blocks * (per_block + beside_blocks)
        # Speculative decoding: each slot's request saves its state after each of its k
        # tokens but the last in a verifying step (the state of its accepted tokens is one).
        spec = config.speculative_config
        k = spec.num_speculative_tokens if spec is not None else 0
        self.num_state_slots = max(1, min(config.max_num_seqs, budget // 2 // (slot * (1 + k))))
        self.num_spec_state_rows = self.num_state_slots * k
        pooled = self.state_checkpoint_interval > 1
        if pooled:
            self.num_state_checkpoints = max(2, budget // 4 // slot)
        if config.num_kv_blocks is None:
            spent = (self.num_state_slots + self.num_spec_state_rows +
                     (self.num_state_checkpoints if pooled else 0)) * slot
            num_blocks = (budget - spent) // (per_block + beside_blocks)
        if self.state_checkpoint_interval == 1:
            self.num_state_checkpoints = num_blocks   # one beside each block
        self.state_checkpoint_interval = max(1, self.state_checkpoint_interval)
        logger.info("state slots: %d of %.1f MiB (%s)%s", self.num_state_slots, slot / 2**20,
                    "one per seat" if self.num_state_slots == config.max_num_seqs else
                    f"half the cache budget: at most {self.num_state_slots} requests run at once",
                    f", and {k} states a slot for speculative decoding's verifying steps" if k else "")
        if self.num_state_checkpoints:
            logger.info("prefix caching: %d saved states (%.1f MiB), %s", self.num_state_checkpoints,
                        self.num_state_checkpoints * slot / 2**20,
                        "one at each block's end" if not pooled else
                        f"at every {self.state_checkpoint_interval}th block end of a long prompt and each "
                        f"chunk's last (a state costs {slot / per_block:.1f} blocks' KV)")
        return num_blocks

    def _build_scheduler(self, config: EngineConfig, plan: _KVPlan) -> None:
        spec = config.speculative_config
        # Windowed groups give back the blocks that slide out of their window. MEAN and CLS
        # pooling read every position's hidden state, which a prefix-cache hit would skip:
        # an embedding engine with them never looks prefixes up (LAST pooling does: a hit
        # always leaves the last position to compute).
        caching = config.enable_prefix_caching and not (self.pooler_config and self.pooler_config.needs_every_position)
        encoder = self.loaded.arch.encoder is not None
        if encoder:
            # An encoder's prompt runs whole in one step (its tokens attend both ways): none is
            # continued from cached blocks, and each must fit a step's budget.
            caching = False
            if config.max_num_batched_tokens < plan.max_model_len:
                raise ValueError(f"{self.loaded.arch.architecture} computes each prompt in one step: "
                                 f"--max-num-batched-tokens ({config.max_num_batched_tokens}) must be at least "
                                 f"max_model_len ({plan.max_model_len}); raise it or lower --max-model-len")
        if self.loaded.arch.is_hybrid:
            caching = self.num_state_checkpoints > 0
        self.kv_manager = KVCacheManager(plan.num_blocks, config.block_size, caching,
                                         group_windows=plan.layout.group_windows)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_num_seqs=min(config.max_num_seqs, self.num_state_slots or config.max_num_seqs),
                max_model_len=plan.max_model_len,
                num_speculative_tokens=spec.num_speculative_tokens if spec is not None else 0,
                policy=config.scheduling_policy,
                max_long_partial_prefills=config.max_long_partial_prefills,
                long_prefill_token_threshold=config.long_prefill_token_threshold,
                tenants=_tenant_specs(config),
                preemption_mode=config.preemption_mode,
                num_host_blocks=plan.num_host_blocks,
                max_loras=config.max_loras if config.enable_lora else 0,
                vocab_size=self.vocab_size,
                num_state_slots=self.num_state_slots,
                num_host_state_slots=self.num_host_state_slots,
                num_state_checkpoints=self.num_state_checkpoints,
                state_checkpoint_interval=self.state_checkpoint_interval,
                whole_images=bool((self.loaded.arch.vision or {}).get("bidirectional")),
                whole_prompts=encoder,
            ),
            self.kv_manager,
        )

    def _build_runner(self, config: EngineConfig, loaded: LoadedModel, device: torch.device, dtype: torch.dtype,
                      plan: _KVPlan, draft: LoadedModel | None) -> None:
        """The model runner (with its LoRA layers and speculative proposer) and what a step
        calls: the runner itself, or rank 0 driving a tensor-parallel group."""
        self.lora: LoRAManager | None = None
        if config.enable_lora:
            # Wraps the projections in LoRA layers (the model code has no LoRA branch).
            self.lora = LoRAManager(loaded.model, loaded.arch, config.max_loras, config.max_lora_rank)
        self.runner = ModelRunner(loaded.model, plan.num_blocks, config.block_size, device, plan.kv_dtype, config.seed,
                                  num_host_blocks=plan.num_host_blocks, kv_cache_dtype=plan.kv_quant,
                                  lora=self.lora, pooler_config=self.pooler_config,
                                  attention_backend=config.attention_backend, num_state_slots=self.num_state_slots,
                                  num_state_checkpoints=self.num_state_checkpoints,
                                  num_host_state_slots=self.num_host_state_slots,
                                  num_spec_state_rows=self.num_spec_state_rows,
                                  encoder_cache_budget=config.encoder_cache_budget)
        if config.logits_processors:   # (rank 0 samples: tensor-parallel workers load none)
            from pagoda.sample.processor_batch import ProcessorBatch

            if self.pooler_config is not None:
                raise ValueError("--logits-processors applies to an engine that generates text, not to one that "
                                 "embeds or classifies (--task)")
            self.runner.logits_processors = ProcessorBatch.build(config, device)
        if config.enforce_eager:
            logger.info("decode steps run eagerly (--enforce-eager%s)",
                        "" if device.type == "cuda" else ": on the CPU they always do")
        elif device.type == "cuda" and self.tp_driver is None and config.speculative_config is None \
                and not loaded.arch.is_hybrid and loaded.arch.encoder is None:
            from pagoda.worker.cuda_graphs import CudaGraphCapture

            why = self.runner.capture_graphs(CudaGraphCapture(), min(config.max_num_seqs, 256), plan.max_model_len)
            if why is not None:
                logger.info("decode steps run eagerly: %s", why)
        self.executor = self.runner
        if self.tp_driver is not None:
            self.tp_driver.runner = self.runner
            self.executor = self.tp_driver
        spec = config.speculative_config
        if spec is not None:
            from pagoda.spec_decode import build_proposer, draft_kv_caches

            caches = None if draft is None or getattr(draft.model, "reads_target_kv", False) else draft_kv_caches(
                draft, plan.num_blocks, config.block_size, dtype, device)
            self.runner.proposer = build_proposer(spec, loaded.model, self.runner.kv_caches, config.block_size,
                                                  device, draft, caches, self.runner.layout.layer_group,
                                                  self.runner.layout.group_chunks)

    @staticmethod
    def _shared_prefixes(config: EngineConfig, loaded: LoadedModel):
        if config.shared_prefix_file is None:
            return None
        from pagoda.shared_prefix import SharedPrefixes, read_shared_prefix_file
        from pagoda.tokenizer import build_tokenizer

        return SharedPrefixes.from_texts(
            read_shared_prefix_file(config.shared_prefix_file),
            build_tokenizer(loaded, config.chat_template), config.block_size,
        )  # fmt: skip

    @property
    def structured(self):
        """The grammar manager, built on first use (it needs the tokenizer)."""
        if self._structured is None:
            from pagoda.structured_output.manager import StructuredOutputManager

            self._structured = StructuredOutputManager(self._make_grammar_backend)
        return self._structured

    def _make_grammar_backend(self):
        from pagoda.structured_output.backend import LLGuidanceBackend
        from pagoda.tokenizer import build_tokenizer

        tokenizer = build_tokenizer(self.loaded, self.config.chat_template)
        return LLGuidanceBackend(tokenizer.backend.to_str(), self.vocab_size, tokenizer.eos_token_ids)

    # ---- requests ----------------------------------------------------------------

    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a request. The front ends validated it (pagoda/validation.py); the scheduler
        re-checks what would break its invariants or the model's (InvalidRequestError)."""
        params = req.sampling_params
        if (req.pooling_params is None) != (self.pooler_config is None) or (
                req.pooling_params is not None and req.pooling_params.task != self.pooler_config.task):
            wants = "text generation" if req.pooling_params is None else f"task {req.pooling_params.task}"
            raise WrongTaskError(f"request {req.request_id!r} wants {wants}, but this engine runs task "
                                 f"{self.pooler_config.task if self.pooler_config else 'generate'} (--task)")
        if req.lora_request is not None:
            self.add_lora(req.lora_request)
        if req.mm_inputs:
            self._check_images(req)
        request = Request(
            req.request_id,
            req.prompt_token_ids,
            params,
            eos_token_ids=frozenset(req.eos_token_ids),
            max_model_len=self.max_model_len,
            arrival_time=req.arrival_time or None,
            priority=req.priority,
            cache_salt=req.cache_salt,
            tenant=req.tenant,
            lora_request=req.lora_request,
            pooling_params=req.pooling_params,
            mm_inputs=req.mm_inputs,
            background=req.background,
        )
        if req.cache_salt and self.shared_prefixes is not None:
            request.num_shared_prefix_tokens = self.shared_prefixes.shared_len(req.prompt_token_ids)
        if params.structured_outputs is not None:
            # Compiled off the step loop; the scheduler waits for it.
            request.grammar = self.structured.submit(params.structured_outputs)
        if self.kv_transfer is not None and self.kv_transfer.add_request(request):
            return  # its KV is on its way from a prefill instance
        if self.kv_transfer is None and params.kv_transfer_params is not None:
            raise ValueError("kv_transfer_params: this instance takes no part in prefill-decode disaggregation "
                             "(start it with --kv-role prefill|decode)")
        self.scheduler.add_request(request)

    def _check_images(self, req: EngineCoreRequest) -> None:
        """A request's images fit the model and its prompt: InvalidRequestError if not (the
        API process checked them; a request that bypassed it must not crash the step)."""
        arch = self.loaded.arch
        if arch.vision is None:
            raise InvalidRequestError(f"request {req.request_id!r} has images, but this model takes text only")
        image_token = arch.vision["image_token_id"]
        end = 0
        for k, image in enumerate(req.mm_inputs):
            try:
                want = model_class(arch.architecture).num_image_embeds(arch.vision, tuple(image.shape))
            except ValueError as e:
                raise InvalidRequestError(f"request {req.request_id!r}, image {k}: {e}") from None
            if len(image.pixels) != image.itemsize * math.prod(image.shape):
                raise InvalidRequestError(f"request {req.request_id!r}, image {k}: {len(image.pixels)} bytes of "
                                          f"pixels for shape {tuple(image.shape)}")
            if image.offset < end or image.length < 1 or image.end > len(req.prompt_token_ids):
                raise InvalidRequestError(f"request {req.request_id!r}, image {k}: its span "
                                          f"[{image.offset}, {image.end}) is outside the prompt "
                                          "or overlaps another image's")
            end = image.end
            if self.scheduler.config.whole_images and image.length > self.scheduler.config.max_num_batched_tokens:
                raise InvalidRequestError(
                    f"request {req.request_id!r}, image {k}: its {image.length} tokens attend to each other in both "
                    "directions and so are computed in one step, but a step computes at most "
                    f"{self.scheduler.config.max_num_batched_tokens} tokens (--max-num-batched-tokens)")
            got = req.prompt_token_ids[image.offset:end].count(image_token)
            if got != want:
                raise InvalidRequestError(f"request {req.request_id!r}, image {k}: {got} image tokens in its span "
                                          f"for {want} embeddings")

    # ---- LoRA adapters -------------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load an adapter (a no-op if its id is loaded); LoRAAdapterError names what is wrong."""
        if self.lora is None:
            raise ValueError(
                f"LoRA adapter {lora_request.lora_name!r} requested, but LoRA is not enabled "
                f"(start the engine with enable_lora=True / --enable-lora)"
            )
        self.lora.add(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter; refused (LoRAInUseError) while a request uses it. False if unknown."""
        if self.lora is None:
            return False
        users = [r.request_id for r in self.scheduler.requests.values() if r.lora_int_id == lora_int_id]
        if users:
            name = self.lora.adapters[lora_int_id].request.lora_name if lora_int_id in self.lora.adapters else lora_int_id
            raise LoRAInUseError(
                f"LoRA adapter {name!r} is in use by {len(users)} running or waiting request(s); "
                f"unload it after they finish"
            )
        return self.lora.remove(lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        return self.lora.list() if self.lora is not None else []

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        ended = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        outputs = [
            EngineCoreOutput(r.request_id, [], finish_reason="abort",
                             num_cached_tokens=max(r.num_cached_tokens, 0))
            for r in ended
        ]
        if self.kv_transfer is not None:
            outputs += self.kv_transfer.abort(request_ids)
        return outputs

    def finish_stopped(self, request_ids: list[str]) -> None:
        """End requests that the front end stopped (a stop string matched)."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        """Requests waiting or running, steps still in flight (pipeline parallelism, overlapped steps), or KV
        transfers under way (a prefill or decode instance)."""
        return (self.scheduler.has_unfinished_requests() or bool(self._in_flight)
                or (self.kv_transfer is not None and self.kv_transfer.has_work()))

    def has_pending_transfers(self) -> bool:
        """KV is on its way to this (decode) instance: nothing to step, but soon."""
        return self.kv_transfer is not None and self.kv_transfer.has_pending()

    # ---- one step ----------------------------------------------------------------

    def step(self) -> EngineCoreOutputs:
        if self.pipeline_depth > 1:
            return self._step_pipelined()
        if self.overlap:
            return self._step_overlapped()
        start = time.monotonic()
        arrived = self.kv_transfer.poll() if self.kv_transfer is not None else []
        sched_out, record, masks = self._schedule(start)
        runner_out = self.executor.execute_model(sched_out, masks)
        return self._finish_step(sched_out, runner_out, record, start, arrived=arrived)

    def step_expert_parallel(self) -> EngineCoreOutputs | None:
        """One lockstep step of a replica in an expert-parallel group (pagoda/engine/core_proc.py
        runs the waves): its own step when it has requests, and when that ran no forward pass
        (nothing scheduled) a dummy pass that takes part in every MoE layer's exchanges with
        no tokens. Returns the step's outputs, None after a dummy pass alone. Every replica
        of the group must call it the same number of times."""
        from pagoda.distributed.group import DistributedError
        from pagoda.model.layers.expert_parallel import dummy_pass

        before = self.ep_group.rounds
        out = self.step() if self.has_unfinished_requests() else None
        done = self.ep_group.rounds - before
        if done == 0:
            dummy_pass(self.runner.model)
        elif done != self._ep_layers:
            raise DistributedError(f"a step ran {done} MoE exchanges, not one forward pass's {self._ep_layers}: "
                                   "expert parallelism across replicas runs one forward pass per step")
        return out

    def _step_pipelined(self) -> EngineCoreOutputs:
        """Pipeline parallelism: keep up to ``pipeline_depth`` steps (micro-batches) in flight
        so that the stages do not wait for each other (vLLM V1's batch queue), then finish the
        oldest. The steps cover disjoint requests: the scheduler gives a request no tokens
        while its sampled token is pending, but may send a prompt's next chunk behind the one
        before, since every stage runs the steps in the order sent (so K/V written by one step
        are in place for the next, and blocks freed and reused meanwhile are written in order).
        E.g. depth 2: start A, start B, finish A (B runs on stage 1 meanwhile), start C, ..."""
        outputs: list[EngineCoreOutput] = []
        while len(self._in_flight) < self.pipeline_depth:
            start = time.monotonic()
            # The work not in flight, shared out over the free slots: else one step would take
            # every decode and the next find none (E.g. 16 decodes, depth 2: 8 and 8).
            sched = self.scheduler
            pending = sum(r.num_tokens - r.num_computed_tokens for r in itertools.chain(sched.running, sched.waiting))
            budget = -(-pending // (self.pipeline_depth - len(self._in_flight)))
            sched_out, record, masks = self._schedule(start, budget)
            if sched_out.is_empty:
                # Nothing to start (or all in flight); the ranks still forget ended requests.
                if sched_out.finished_req_ids or not self._in_flight:
                    outputs += self.scheduler.update_from_output(sched_out, self.executor.execute_model(sched_out))
                break
            self._in_flight.append((sched_out, record, start, self.executor.submit(sched_out, masks)))
        if not self._in_flight:
            return self._stats_out(outputs, None, time.monotonic())
        sched_out, record, start, batch = self._in_flight.popleft()
        return self._finish_step(sched_out, self.executor.collect(batch), record, start, outputs)

    def _step_overlapped(self) -> EngineCoreOutputs:
        """Overlapped steps (vLLM's async scheduling): schedule step N+1 and launch it, its
        sampled ids left on the device, while step N runs; then read N's tokens back and
        update the scheduler with them. A request whose token N samples is scheduled in N+1
        at the next position (``Request.num_pending``), its input token taken from N's ids
        on the device; a request that N's token ends (a stop, max_tokens) wastes that one
        position, which nothing reads. Steps run one after another again, the step in flight
        finished first, while any request needs its output history on the host to sample
        (penalties, min_tokens, a grammar) or wants prompt logprobs.

        E.g. call 1: launch A (nothing to return yet); call 2: launch B, return A's tokens;
        call 3: launch C, return B's; ..."""
        start = time.monotonic()
        previous = self._in_flight.popleft() if self._in_flight else None
        outputs: list[EngineCoreOutput] = []
        sched = self.scheduler
        if all(r.overlappable() for r in itertools.chain(sched.running, sched.waiting)):
            sched_out, record, masks = self._schedule(start, overlap=True)
            if not sched_out.is_empty:
                batch = self.runner.start_batch(sched_out, masks)
                self.runner.sample_batch(batch)
                self._in_flight.append((sched_out, record, start, batch))
            elif previous is None:
                return self._finish_step(sched_out, self.executor.execute_model(sched_out), record, start)
            else:   # nothing to launch: the runner still forgets ended requests
                outputs = sched.update_from_output(sched_out, self.executor.execute_model(sched_out))
        elif previous is None:   # a step that samples from the output history: not overlapped
            sched_out, record, masks = self._schedule(start)
            return self._finish_step(sched_out, self.executor.execute_model(sched_out, masks), record, start)
        if previous is None:
            return self._stats_out(outputs, None, time.monotonic())
        sched_out, record, started, batch = previous
        return self._finish_step(sched_out, self.runner.finish_batch(batch), record, started, outputs)

    def _schedule(self, start: float, token_budget: int | None = None, overlap: bool = False):
        """This step's SchedulerOutput, its stats record and its requests' grammar masks."""
        sched_out = self.scheduler.schedule(token_budget, overlap)
        if sched_out.kv_in:
            self.kv_transfer.install(sched_out)
        collector = self.step_stats
        record = None
        if collector is not None:
            # Before update_from_output, which forgets the requests that finish.
            record = collector.record_step(sched_out, self.scheduler.requests, start)
        masks = None
        if sched_out.structured_req_ids:
            reqs = self.scheduler.requests
            rows = self.structured.bitmask_for(
                [reqs[rid].matcher for rid in sched_out.structured_req_ids], self.vocab_size
            )
            masks = dict(zip(sched_out.structured_req_ids, rows))
        return sched_out, record, masks

    def _finish_step(self, sched_out, runner_out, record, start: float,
                     outputs: list[EngineCoreOutput] | None = None, arrived=()) -> EngineCoreOutputs:
        """``outputs``: earlier outputs of this call (pipelined steps); ``arrived``: KV
        transfers that came in before the step (a decode instance)."""
        if self.threads is not None:
            self.threads.step_done()
        outputs = (outputs or []) + self.scheduler.update_from_output(sched_out, runner_out)
        if self.kv_transfer is not None:
            self.kv_transfer.after_update(outputs)
            outputs = self.kv_transfer.merge(arrived, outputs)
        end = time.monotonic()
        if record is not None:
            record.duration = end - start
        return self._stats_out(outputs, record, end)

    def _stats_out(self, outputs: list[EngineCoreOutput], record, end: float) -> EngineCoreOutputs:
        out = EngineCoreOutputs(outputs=outputs, scheduler_stats=self._make_stats(), timestamp=end)
        if self.step_stats is not None:
            out.step = record
            out.kv_block_map = self.step_stats.maybe_block_map(self.kv_manager.pool, end)
        out.expert_load = self._maybe_expert_load(end)
        return out

    def _make_stats(self):
        stats = self.scheduler.make_stats()
        cache = getattr(self.runner, "encoder_cache", None)
        if cache is not None:
            stats.encoder_cache_hits, stats.encoder_cache_misses = cache.hits, cache.misses
            stats.encoder_seconds = cache.encoder_seconds
        return stats

    def _maybe_expert_load(self, now: float) -> list[list[int]] | None:
        """The experts' load for /metrics, at most once a second (MoE models only). Under
        pipeline parallelism rank 0 holds only its stage's layers: the other stages' counts
        come with a step, or at once when none is in flight (TensorParallelDriver.expert_load)."""
        if not self._moe or now - self._last_expert_load < EXPERT_LOAD_INTERVAL_S:
            return None
        if self.config.pipeline_parallel_size > 1:
            load = self.tp_driver.expert_load(idle=not self._in_flight)
            if load is None:
                return None
        else:
            load = self.runner.model.expert_load()
        self._last_expert_load = now
        return load

    def idle_stats(self) -> Heartbeat:
        """Stats alone (no step), for the heartbeat the core sends while idle."""
        now = time.monotonic()
        out = Heartbeat(scheduler_stats=self._make_stats(), timestamp=now)
        if self.step_stats is not None:
            out.kv_block_map = self.step_stats.maybe_block_map(self.kv_manager.pool, now)
        out.expert_load = self._maybe_expert_load(now)
        return out

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def check_health(self) -> None:
        """Raise if a part of the engine outside this process is gone (a tensor-parallel worker)."""
        if self.tp_driver is not None:
            self.tp_driver.check_workers()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any, and the KV connector (idempotent)."""
        if self.tp_driver is not None:
            self.tp_driver.shutdown()
        if self.kv_transfer is not None:
            self.kv_transfer.close()
            self.kv_transfer = None
