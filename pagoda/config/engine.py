"""The engine's options: typed groups, each field defined once with its help (see
pagoda/config/options.py), and ``EngineConfig``, one frozen object holding every group.

Each group checks its own fields. What two groups say together is checked in one place,
``RULES`` at the end: pairs of settings that do not combine (yet), and settings that need
another, each with one message shape.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagoda.config.kv_transfer import KV_ROLES, KVTransferConfig
from pagoda.config.options import OptionGroup, option
from pagoda.config.pooling import TASKS, PoolerOverrides, parse_token_list
from pagoda.config.speculative import SpeculativeConfig
from pagoda.config.units import parse_size, positive_float
from pagoda.host import require_ray, torchrun_rank

# The weight modes of the model runner (pagoda/model/layers/quantization.py), and those
# pipeline stages run (each stage keeps its layers' blocks as the file stores them; the
# converting modes are not staged yet).
QUANTIZATION_MODES = ("none", "int8", "q4", "gguf", "bf16")
PIPELINE_MODES = ("auto", "none", "gguf")
SCHEDULING_POLICIES = ("fcfs", "priority", "fair")   # pagoda/core/sched_policy.py
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")
KV_CACHE_DTYPES = ("auto", "float16", "int8", "fp8")
PREEMPTION_MODES = ("recompute", "swap", "auto")
EXECUTOR_BACKENDS = ("mp", "ray")


def _positive(name: str, value: object, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _one_of(name: str, value: object, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be {', '.join(map(str, choices[:-1]))} or {choices[-1]}, got {value!r}")


def _set(obj: object, name: str, value: object) -> None:
    object.__setattr__(obj, name, value)


# Tokens per KV block on the CPU unless --block-size says otherwise (why: EngineConfig's defaults).
CPU_BLOCK_SIZE = 64


@dataclass(frozen=True)
class ModelOptions(OptionGroup):
    TITLE = "model"
    DESCRIPTION = "Which model, in which arithmetic, for which task (docs/models.md)."

    model: str | None = option(
        None, "HF model folder or .gguf file, or a name in $PAGODA_MODELS, the Hugging Face cache "
              "(org/name[:QUANT]) or Ollama's store (name[:tag]), as `pagoda list` shows them",
        default_text="the bundled SmolLM2-135M-Instruct")
    served_model_name: str | None = option(None, "the model's name in the API (default: the model's)",
                                           commands=("serve", "run-batch"))
    dtype: str = option(
        "auto", "auto|float32|bfloat16|float16 (auto = float32 on CPU); bfloat16 on the CPU is the bf16 mode "
                "(same as --quantization bf16): bfloat16 weights and GEMM inputs on oneDNN (AMX / AVX512_BF16 "
                "where the CPU has them), float32 sums, norms and attention")
    quantization: str = option(
        "auto", "auto: a GGUF file of 256 MiB or more on the CPU in float32 most of whose quantized bytes "
                "are of the types the gguf mode has kernels of its own for (Q4_K, Q6_K, MXFP4; on AVX-512 VNNI "
                "CPUs every integer block type) runs in the gguf mode, anything else in none (the start-up "
                "log says which and why); none: exact (reference-equal output; on CPU in float32 a GGUF file's weights stay in its "
                "blocks, memory-mapped, and are dequantized in cache to the same values; elsewhere dequantized "
                "to --dtype at load); gguf: a GGUF file's blocks (any type) times activations in int8 per group "
                "of 32, llama.cpp's arithmetic; int8: int8 weights per channel, activations int8 per token (16 "
                "outlier channels per layer kept in float), perplexity within ~1.5% of fp32; q4 (alias int4): "
                "4-bit groups of 32 (GGUF Q4_1 scheme) with activations int8 per group of 32, the smallest "
                "weights; bf16: see --dtype bfloat16. int8, q4, gguf and bf16 use a float16 KV cache by default",
        choices=("auto",) + QUANTIZATION_MODES + ("int4",))
    max_model_len: int | None = option(
        None, "the longest sequence (prompt + output) in tokens; past the context the model was trained for "
              "(its max_position_embeddings or GGUF context_length, with its RoPE scaling) it is refused unless "
              "PAGODA_ALLOW_LONG_MAX_MODEL_LEN=1 (vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN) is set",
        default_text="the model's context length")
    max_logprobs: int = option(
        20, "the most logprobs / prompt_logprobs a request may ask for (vLLM's flag); -1: no bound, so that "
            "a request may ask for the whole vocabulary with -1")
    seed: int = option(0, "the engine's base seed for sampling without a request seed")
    chat_template: str | None = option(None, "a Jinja chat template string or file",
                                       default_text="the model's own")
    skip_tokenizer_init: bool = option(False, "load no tokenizer (requests give token ids)", cli=False)
    task: str = option(
        "auto", "generate text, embed (POST /v1/embeddings: the final hidden states pooled), or classify (a "
                "sequence-classification head: /classify, and /score and /rerank as a cross-encoder; score is "
                "vLLM's older name for it); auto: classify for a *ForSequenceClassification checkpoint or with "
                "--classifier-from-token, embed for an embedding checkpoint (no LM head, or a "
                "sentence-transformers layout), else generate",
        choices=TASKS)
    classifier_from_token: tuple[str, ...] | str | None = option(
        None, "serve a causal LM as a classifier whose logits are its LM head's logits of these tokens at the "
              "last position (vLLM's hf_overrides key): two tokens (no,yes: Qwen3-Reranker, mxbai-rerank-v2) "
              "give one score, the second token's probability of the two (vLLM's from_2_way_softmax); other "
              "counts give one label per token", metavar="TOKENS")
    # An embedding engine's pooling over the checkpoint's: a PoolerOverrides, or a dict / JSON
    # string of its fields (pooling_type, normalize, is_matryoshka, matryoshka_dimensions).
    override_pooler_config: PoolerOverrides | dict[str, Any] | str | None = option(
        None, "--task embed, vLLM's spelling: JSON of pooling_type, normalize, is_matryoshka, "
              "matryoshka_dimensions (--pooling-type, --normalize and --matryoshka-dimensions win over it)",
        metavar="JSON")

    def check(self) -> None:
        _positive("max_model_len", self.max_model_len, allow_none=True)
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (no bound) or an integer >= 0, got {self.max_logprobs!r}")
        if self.quantization == "int4":
            _set(self, "quantization", "q4")  # vLLM-style name
        _one_of("quantization", self.quantization, ("auto",) + QUANTIZATION_MODES)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        _one_of("task", self.task, TASKS)
        if self.task == "score":
            _set(self, "task", "classify")
        _set(self, "classifier_from_token", parse_token_list("classifier_from_token", self.classifier_from_token))
        _set(self, "override_pooler_config", PoolerOverrides.parse(self.override_pooler_config))


@dataclass(frozen=True)
class LoadOptions(OptionGroup):
    TITLE = "loading"
    DESCRIPTION = ("Where weights come from: a model named ORG/NAME that no store holds is fetched from the Hugging "
                   "Face Hub (HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE), only the files the engine reads.")

    show_progress: bool = option(True, "show progress bars while weights load", cli=False)
    revision: str | None = option(
        None, "the Hub revision (branch, tag or commit) of a model named ORG/NAME, fetched when the cache lacks "
              "it (vLLM's flag)", default_text="main")
    hf_file: str | None = option(
        None, "the GGUF file of a Hub repository to fetch and serve (llama.cpp's --hf-file; or ORG/NAME:QUANT)")


@dataclass(frozen=True)
class DeviceOptions(OptionGroup):
    TITLE = "device"
    DESCRIPTION = "Where the model runs, on how many threads, with which kernels."

    device: str = option("cpu", "cpu or cuda[:N]")
    num_threads: int | None = option(
        None, "a fixed number of torch threads for the engine (default: every core while the machine is "
              "otherwise idle, one less while other processes want one; OMP_NUM_THREADS if set)")
    attention_backend: str = option(
        "auto", "the attention kernels (vLLM's flag): auto = cpu (pagoda's C++ kernels) on the CPU, triton on "
                "CUDA where triton is installed; torch = the reference (gathered contexts and SDPA) on any "
                "device. The start-up log names the one chosen and why",
        choices=ATTENTION_BACKENDS)
    enforce_eager: bool = option(
        False, "on CUDA, run decode steps eagerly instead of replaying the CUDA graphs captured at start-up "
               "(vLLM's flag; graphs need the triton attention backend)")
    async_scheduling: bool | None = option(
        None, "overlapped steps (vLLM's flag): schedule and launch the next step while the one before runs, "
              "its sampled tokens passed on the device (default: on with --device cuda, off on the CPU, where a "
              "step's work is all on the host)")

    def check(self) -> None:
        if not isinstance(self.device, str) or (self.device not in ("cpu", "cuda")
                                                and not self.device.startswith("cuda:")):
            raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}")
        _positive("num_threads", self.num_threads, allow_none=True)
        _one_of("attention_backend", self.attention_backend, ATTENTION_BACKENDS)

    @property
    def on_cpu(self) -> bool:
        return self.device.split(":")[0] == "cpu"


@dataclass(frozen=True)
class CacheOptions(OptionGroup):
    TITLE = "KV cache"
    DESCRIPTION = "The paged KV cache: its blocks, their dtype, prefix caching and preemption (docs/scheduling.md)."

    block_size: int | None = option(None, "tokens per KV block (prefix caching reuses whole blocks)",
                                    default_text="64 on CPU, 16 on GPU")
    kv_cache_memory: int | None = option(None, "KV cache budget, e.g. 2GiB", parse=parse_size, metavar="SIZE",
                                         default_text="a quarter of free RAM, at most 4 GiB")
    num_kv_blocks: int | None = option(None, "explicit KV pool size in blocks (overrides --kv-cache-memory)")
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of prompt prefixes seen before")
    kv_cache_dtype: str = option(
        "auto", "auto: the model's dtype, or float16 with --quantization int8|q4|gguf|bf16; float16: half the "
                "bytes of float32 KV (decode attention reads K/V in place, converting on load); int8 / fp8 "
                "(e4m3): 8-bit K/V with a float32 scale per token and head, about 4x the blocks of float32 KV in "
                "the same memory (2x of bf16)",
        choices=KV_CACHE_DTYPES)
    preemption_mode: str = option(
        "recompute", "how a preempted request gives its KV blocks back: recompute them later, swap them to "
                     "host memory (--swap-space) and back, or auto: swap long ones, recompute short ones",
        choices=PREEMPTION_MODES)
    swap_space: int = option(0, "host memory for swapped-out KV blocks, e.g. 4GiB (needed by --preemption-mode "
                                "swap|auto)", parse=parse_size, metavar="SIZE")
    shared_prefix_file: str | None = option(
        None, "system prompts / texts whose prefix cache blocks stay shared across cache_salt values (JSON "
              "array of strings, or text with '---' lines between entries)")

    def check(self) -> None:
        _positive("block_size", self.block_size, allow_none=True)
        _positive("kv_cache_memory", self.kv_cache_memory, allow_none=True)
        _positive("num_kv_blocks", self.num_kv_blocks, allow_none=True)
        _one_of("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _one_of("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        if isinstance(self.swap_space, bool) or not isinstance(self.swap_space, int) or self.swap_space < 0:
            raise ValueError(f"swap_space must be a number of bytes >= 0, got {self.swap_space!r}")
        if self.shared_prefix_file is not None:
            from pagoda.shared_prefix import read_shared_prefix_file

            read_shared_prefix_file(self.shared_prefix_file)


@dataclass(frozen=True)
class SchedulerOptions(OptionGroup):
    TITLE = "scheduler"
    DESCRIPTION = "Continuous batching under one token budget per step, and who goes first (docs/scheduling.md)."

    max_num_seqs: int = option(256, "requests running at once")
    max_num_batched_tokens: int | None = option(None, "the token budget of one step",
                                                default_text="512 on the CPU, 8192 on a GPU")
    scheduling_policy: str = option(
        "fcfs", "fcfs: arrival order; priority: lower request priority first, may preempt lower priorities; "
                "fair: share each step's tokens across tenants by weight",
        choices=SCHEDULING_POLICIES)
    max_long_partial_prefills: int | None = option(
        None, "at most this many prompts longer than --long-prefill-token-threshold are chunk-prefilled at "
              "once (short prompts pass the others)")
    long_prefill_token_threshold: int | None = option(
        None, "a prompt with more tokens than this to compute is a long prefill; its chunk per step is capped "
              "at this while others want the budget (default with --max-long-partial-prefills: 4% of the "
              "context length)")
    api_keys_file: str | None = option(
        None, "JSON or TOML: API key -> {tenant, weight, max_running, max_queued}; any key is accepted and "
              "names the request's tenant (without it, an X-Tenant header does)", commands=("serve",))

    def check(self) -> None:
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens, allow_none=True)
        _one_of("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        _positive("max_long_partial_prefills", self.max_long_partial_prefills, allow_none=True)
        _positive("long_prefill_token_threshold", self.long_prefill_token_threshold, allow_none=True)
        if self.api_keys_file is not None:
            from pagoda.tenants import load_api_keys_file

            load_api_keys_file(self.api_keys_file)  # raises on a malformed file


@dataclass(frozen=True)
class ParallelOptions(OptionGroup):
    TITLE = "parallelism"
    DESCRIPTION = "Tensor, pipeline, data and expert parallelism, on one node or several (docs/parallel.md)."

    tensor_parallel_size: int = option(
        1, "ranks that split each layer (torch.distributed: gloo on CPU, nccl on CUDA)", aliases=("-tp",))
    pipeline_parallel_size: int = option(
        1, "stages that split the layers, each a process (or a TP group); world = TP x PP ranks",
        aliases=("-pp",))
    enable_expert_parallel: bool = option(
        False, "MoE models: each tensor-parallel rank holds whole experts (default: every expert split by "
               "rows); with --data-parallel-size N (TP=1), the N replicas share the experts and exchange tokens")
    data_parallel_size: int = option(
        1, "engine replicas behind one server, with prefix-aware routing (serve only)", aliases=("-dp",))
    # Set by DataParallelLLM on each replica's config, not by users: the replica's index and,
    # with --enable-expert-parallel, the expert-parallel group's rendezvous.
    data_parallel_rank: int = option(0, "a data-parallel replica's index (set by the server)", cli=False)
    expert_parallel_init_method: str | None = option(
        None, "the expert-parallel group's rendezvous, tcp://127.0.0.1:port (set by the server)", cli=False)
    distributed_init_method: str | None = option(
        None, "tcp://host:port or env:// (MASTER_ADDR/MASTER_PORT, as torchrun sets them); alternative to "
              "--master-addr/--master-port", default_text="local, automatic")
    nnodes: int = option(1, "nodes the tensor/pipeline-parallel group spans")
    node_rank: int = option(0, "this node's index; 0 runs the server and engine core, others only workers")
    distributed_timeout: float = option(120.0, "seconds a collective waits for a peer before the engine "
                                               "reports it failed", parse=positive_float)
    threads_per_rank: int | None = option(
        None, "torch threads per rank or replica on CPU", default_text="1 when parallel, else all")
    distributed_executor_backend: str = option(
        "mp", "who starts the tensor-parallel workers: mp = subprocesses, ray = Ray actors in a placement group "
              "(pip install 'pagoda[ray]')", choices=EXECUTOR_BACKENDS)
    data_parallel_backend: str = option(
        "mp", "who starts the data-parallel engine cores: mp = subprocesses, ray = Ray actors on this node",
        choices=EXECUTOR_BACKENDS)
    ray_address: str | None = option(
        None, "the Ray cluster to use (host:port of `ray start --head`)",
        default_text="RAY_ADDRESS, else a cluster started on this machine, else a new local one")

    def check(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "nnodes"):
            _positive(name, getattr(self, name))
        _positive("threads_per_rank", self.threads_per_rank, allow_none=True)
        if isinstance(self.node_rank, bool) or not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank!r}")
        if self.world_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} x pipeline_parallel_size="
                             f"{self.pipeline_parallel_size} must be a multiple of nnodes={self.nnodes} "
                             f"(the same number of ranks on every node)")
        if isinstance(self.distributed_timeout, bool) or not isinstance(self.distributed_timeout, (int, float)) \
                or not self.distributed_timeout > 0:
            raise ValueError(f"distributed_timeout must be > 0 seconds, got {self.distributed_timeout!r}")
        if isinstance(self.data_parallel_rank, bool) or not isinstance(self.data_parallel_rank, int) \
                or not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(f"data_parallel_rank must be in [0, data_parallel_size={self.data_parallel_size}), "
                             f"got {self.data_parallel_rank!r}")
        _one_of("distributed_executor_backend", self.distributed_executor_backend, EXECUTOR_BACKENDS)
        _one_of("data_parallel_backend", self.data_parallel_backend, EXECUTOR_BACKENDS)
        if (self.ray_address or "").startswith("ray://"):
            raise ValueError("--ray-address ray://... (Ray Client) is not supported: run pagoda on a node of the "
                             "cluster (rank 0's node hosts the rendezvous, the API server's node the replicas' "
                             "sockets) and give the head's host:port")

    @property
    def world_size(self) -> int:
        """Ranks of one engine's parallel group: tensor x pipeline parallel."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def dp_expert_parallel(self) -> bool:
        """Expert parallelism across the data-parallel replicas (docs/parallel.md): each replica
        holds a share of every MoE layer's experts and the replicas exchange tokens."""
        return self.enable_expert_parallel and self.data_parallel_size > 1


@dataclass(frozen=True)
class SpeculativeOptions(OptionGroup):
    TITLE = "speculative decoding"
    DESCRIPTION = "Draft tokens verified in one target forward (docs/speculative_decoding.md)."

    # A SpeculativeConfig, or a dict / JSON string of one (vLLM's shape).
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = option(
        None, 'speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
              "(methods: ngram [prompt_lookup_min/max], layer_skip [num_layers], draft_model [model], mtp)",
        metavar="JSON")

    def check(self) -> None:
        _set(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))


@dataclass(frozen=True)
class LoRAOptions(OptionGroup):
    TITLE = "LoRA"
    DESCRIPTION = "Adapters served on top of the model (PEFT format)."

    enable_lora: bool = option(False, "serve LoRA adapters (PEFT format) on top of the model")
    max_loras: int = option(1, "LoRA adapters resident at once; one batch mixes requests of up to this many")
    max_lora_rank: int = option(16, "largest LoRA rank accepted")

    def check(self) -> None:
        _positive("max_loras", self.max_loras)
        _positive("max_lora_rank", self.max_lora_rank)


@dataclass(frozen=True)
class DisaggregationOptions(OptionGroup):
    TITLE = "prefill-decode disaggregation"
    DESCRIPTION = "Prompts on one instance, decoding on another, KV blocks passed between (docs/parallel.md)."

    kv_role: str | None = option(
        None, "prefill: compute prompts and their first token, and keep their KV blocks for a decode instance; "
              "decode: fetch those blocks and decode on (`pagoda router` pairs them); default: neither (prefill "
              "and decode here)", choices=KV_ROLES, commands=("serve",))
    # The instance's KV endpoint settings: a KVTransferConfig, or a dict / JSON string.
    kv_transfer_config: KVTransferConfig | dict[str, Any] | str | None = option(
        None, 'the KV endpoint: on a prefill instance {"host", "port", "advertise_host", "timeout_s"} (default '
              '127.0.0.1, a free port, 30 s to fetch parked blocks), on a decode instance {"transport": '
              '"auto|shm|tcp", "timeout_s"} (auto: shared memory on one host, else tcp)',
        metavar="JSON", commands=("serve",))

    def check(self) -> None:
        _set(self, "kv_transfer_config", KVTransferConfig.parse(self.kv_role, self.kv_transfer_config))


def parse_mm_limits(value: dict[str, Any] | str | None) -> dict[str, int]:
    """vLLM's ``--limit-mm-per-prompt``: ``{"image": N}`` as a dict or JSON; {} for the default."""
    from pagoda.json_options import json_object

    if value is None:
        return {}
    value = json_object("limit_mm_per_prompt", value, ("image",))   # the one modality this server takes
    for key, n in value.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"limit_mm_per_prompt: the limit for {key!r} must be an integer >= 0, got {n!r}")
    return dict(value)


@dataclass(frozen=True)
class MultiModalOptions(OptionGroup):
    TITLE = "images in"
    DESCRIPTION = "What vision-language models accept and how their image encoder's outputs are kept (docs/vision.md)."

    mmproj: str | None = option(
        None, "llama.cpp's multimodal projector file (a vision tower in GGUF, convert_hf_to_gguf.py --mmproj) "
              "beside a GGUF language model: served as the vision-language model it makes (llama-server's flag)",
        metavar="FILE")
    limit_mm_per_prompt: dict[str, int] | str | None = option(
        None, 'images a prompt may hold, as JSON: \'{"image": N}\' (0: none)', metavar="JSON",
        default_text='{"image": 8}')
    encoder_cache_budget: int = option(
        16384, "embeddings the encoder cache keeps (each image's, by content hash), least recently used "
               "dropped first")
    allowed_media_domains: list[str] | None = option(
        None, "hosts whose http(s) image URLs are fetched (redirects checked too); without it no URL is "
              "fetched, only data URLs are read (vLLM fetches every host then)", nargs="+", metavar="HOST",
        commands=("serve",))
    allowed_local_media_path: str | None = option(
        None, "a folder whose files file:// image URLs may read (links resolved); without it none",
        commands=("serve",))
    media_fetch_timeout: float = option(10.0, "seconds one image URL may take to fetch, body included",
                                        parse=positive_float, commands=("serve",))

    def check(self) -> None:
        import os

        _set(self, "limit_mm_per_prompt", parse_mm_limits(self.limit_mm_per_prompt))
        if self.mmproj is not None and not os.path.isfile(self.mmproj):
            raise ValueError(f"mmproj: {self.mmproj!r} is not a file")
        _positive("encoder_cache_budget", self.encoder_cache_budget)
        if isinstance(self.allowed_media_domains, str):
            _set(self, "allowed_media_domains", self.allowed_media_domains.replace(",", " ").split())
        if self.allowed_local_media_path is not None and not os.path.isdir(self.allowed_local_media_path):
            raise ValueError(f"allowed_local_media_path: {self.allowed_local_media_path!r} is not a folder")

    @property
    def max_images(self) -> int:
        return self.limit_mm_per_prompt.get("image", 8)


@dataclass(frozen=True)
class SamplingOptions(OptionGroup):
    TITLE = "sampling"
    DESCRIPTION = "Plug-ins in the sampler (docs/serving.md#logits-processors)."

    # Class names, or (from Python) LogitsProcessor subclasses; kept as names ("module:Class"),
    # each loaded once here to check it: the engine core loads them again in its own process.
    logits_processors: tuple[str, ...] | list[Any] | None = option(
        None, "logits processor classes (vLLM's flag), module:Class or module.Class, each a subclass of "
              "pagoda.sample.logits_processor.LogitsProcessor built with (EngineConfig, device, is_pin_memory); "
              "per-request arguments in SamplingParams.extra_args (vllm_xargs on the OpenAI routes)",
        nargs="+", metavar="CLASS")

    def check(self) -> None:
        from pagoda.config.plugins import resolve_processor_names

        _set(self, "logits_processors", resolve_processor_names(self.logits_processors) or None)


GROUPS: tuple[type[OptionGroup], ...] = (
    ModelOptions, LoadOptions, DeviceOptions, CacheOptions, SchedulerOptions, ParallelOptions,
    SpeculativeOptions, LoRAOptions, DisaggregationOptions, MultiModalOptions, SamplingOptions)


@dataclass(frozen=True)
class EngineConfig(SamplingOptions, MultiModalOptions, DisaggregationOptions, LoRAOptions, SpeculativeOptions,
                   ParallelOptions, SchedulerOptions, CacheOptions, DeviceOptions, LoadOptions, ModelOptions):
    """Every engine option, flat (``config.max_num_seqs``), each group checked by itself, then
    ``RULES`` over them. ``config.group(CacheOptions)`` is one group's view."""

    def __post_init__(self) -> None:
        self._resolve()
        for group in GROUPS:
            group.check(self)
        broken = [rule.message(self) for rule in RULES if rule.broken(self)]
        if broken:
            raise ValueError("; ".join(broken))
        if self.distributed_executor_backend == "ray" or self.data_parallel_backend == "ray":
            require_ray()

    def _resolve(self) -> None:
        """Defaults that depend on other options, made concrete before the checks."""
        on_cpu = isinstance(self.device, str) and self.device.split(":")[0] == "cpu"
        if self.max_num_batched_tokens is None:
            # A step's budget: on the CPU a step of 512 tokens already keeps both cores busy (and
            # bounds the decodes' wait behind a prompt); a GPU needs thousands (vLLM's serving
            # default on large GPUs: 8192).
            _set(self, "max_num_batched_tokens", 512 if on_cpu else 8192)
        if self.block_size is None:
            # CPU: a sequence's K/V for a layer is read block by block, and this machine reads
            # scattered 6 KiB runs (16 tokens of the default model, float16) at a third of its
            # streaming bandwidth, 24 KiB runs (64 tokens) at half (docs/benchmarks.md). vLLM's
            # CPU backend picks 128 for the same reason; 64 keeps prefix hits finer.
            _set(self, "block_size", CPU_BLOCK_SIZE if on_cpu else 16)
        if on_cpu and self.dtype in ("bfloat16", "bf16") and self.quantization in ("auto", "none", "bf16"):
            # The CPU's bf16 mode: bfloat16 GEMMs on oneDNN, float32 norms, residuals and
            # attention (pagoda/model/layers/quantization.py, Bf16Linear).
            _set(self, "quantization", "bf16")
            _set(self, "dtype", "float32")

    def group(self, group: type[OptionGroup]) -> OptionGroup:
        """One group's options as an object of their own."""
        from pagoda.config.options import options_of

        return group(**{o.name: getattr(self, o.name) for o in options_of(group)})

    @property
    def resolved_kv_cache_dtype(self) -> str:
        """``auto`` made concrete: the model's dtype ("auto") in the exact mode, float16 with
        --quantization int8|q4|gguf|bf16 (as llama.cpp's default; decode attention reads half the
        bytes, and those modes are approximate already).

        Why not float16 in the exact mode too (measured, docs/benchmarks.md "KV dtype of the
        exact mode"): the exact mode's promise is transformers' numbers. Bundled model, 11 prompts
        of 35-7,037 tokens, 64 greedy tokens: float32 KV stays within 1.3e-4 of transformers'
        logprobs, float16 KV within 7.0e-3 (the same tokens); float16 decodes 1.34x faster at a
        4k context. The faster trade is one flag away (--kv-cache-dtype float16), and the start-up
        log says so for long contexts."""
        if self.kv_cache_dtype == "auto" and self.quantization not in ("none", "auto"):
            return "float16"
        return self.kv_cache_dtype


# --- what two options say together -----------------------------------------------------------

@dataclass(frozen=True)
class Setting:
    """A setting as a message names it (``label``: text, or made from the config), and when it is on."""

    label: str | Callable[[EngineConfig], str]
    on: Callable[[EngineConfig], bool]

    def name(self, c: EngineConfig) -> str:
        return self.label if isinstance(self.label, str) else self.label(c)


@dataclass(frozen=True)
class Incompatible:
    """``a`` and ``b`` do not combine: "{a} cannot be combined with {b}: {why}"."""

    a: Setting
    b: Setting
    why: str = "not supported yet"

    def broken(self, c: EngineConfig) -> bool:
        return self.a.on(c) and self.b.on(c)

    def message(self, c: EngineConfig) -> str:
        return f"{self.a.name(c)} cannot be combined with {self.b.name(c)}: {self.why}"


@dataclass(frozen=True)
class Requires:
    """``a`` needs ``b``: "{a} needs {b}: {why}"."""

    a: Setting
    b: Setting
    why: str

    def broken(self, c: EngineConfig) -> bool:
        return self.a.on(c) and not self.b.on(c)

    def message(self, c: EngineConfig) -> str:
        return f"{self.a.name(c)} needs {self.b.name(c)}: {self.why}"


TP = Setting("--tensor-parallel-size > 1", lambda c: c.tensor_parallel_size > 1)
PP = Setting("--pipeline-parallel-size > 1", lambda c: c.pipeline_parallel_size > 1)
DP = Setting("--data-parallel-size > 1", lambda c: c.data_parallel_size > 1)
TP_OR_DP = Setting("--tensor-parallel-size > 1 or --data-parallel-size > 1",
                   lambda c: c.tensor_parallel_size > 1 or c.data_parallel_size > 1)
PARALLEL = Setting("tensor, pipeline or data parallelism", lambda c: c.world_size > 1 or c.data_parallel_size > 1)
EP = Setting("--enable-expert-parallel", lambda c: c.enable_expert_parallel)
DP_EP = Setting("--data-parallel-size > 1 with --enable-expert-parallel (experts split over the replicas)",
                lambda c: c.dp_expert_parallel)
MULTINODE = Setting("--nnodes > 1", lambda c: c.nnodes > 1)
RENDEZVOUS = Setting("a rendezvous (--master-addr/--master-port or --distributed-init-method tcp://host:port)",
                     lambda c: c.distributed_init_method is not None)
MULTINODE_OR_RENDEZVOUS = Setting("a multi-node or explicit tensor-parallel rendezvous (--nnodes, "
                                  "--distributed-init-method, --master-addr/--master-port)",
                                  lambda c: c.nnodes > 1 or c.distributed_init_method is not None)
TP_RAY = Setting("--distributed-executor-backend ray", lambda c: c.distributed_executor_backend == "ray")
DP_RAY = Setting("--data-parallel-backend ray", lambda c: c.data_parallel_backend == "ray")
ANY_RAY = Setting("the Ray backends", lambda c: "ray" in (c.distributed_executor_backend, c.data_parallel_backend))
RAY_ADDRESS = Setting("--ray-address", lambda c: c.ray_address is not None)
MP_LAUNCH = Setting("--nnodes, --node-rank, --master-addr/--master-port, --distributed-init-method or torchrun",
                    lambda c: c.nnodes > 1 or c.distributed_init_method is not None or torchrun_rank() is not None)
CUDA = Setting(lambda c: f"--device {c.device}", lambda c: not c.device.startswith("cpu"))
NUM_THREADS = Setting("--num-threads", lambda c: c.num_threads is not None)
CPU_BF16 = Setting("--dtype bfloat16 on the CPU (the bf16 mode: bfloat16 GEMMs)",
                   lambda c: c.on_cpu and c.dtype in ("bfloat16", "bf16"))
QUANTIZED = Setting(lambda c: f"--quantization {c.quantization}",
                    lambda c: c.quantization not in ("auto", "none", "bf16"))
BF16_MODE = Setting("--quantization bf16 (the CPU's bf16 mode: float32 model, bfloat16 GEMMs)",
                    lambda c: c.quantization == "bf16")
GPU_OR_HALF = Setting(lambda c: f"--device {c.device}" if not c.on_cpu else f"--dtype {c.dtype}",
                      lambda c: not c.on_cpu or c.dtype not in ("auto", "float32", "fp32", "float"))
UNSTAGED_MODE = Setting(lambda c: f"--quantization {c.quantization}"
                        + (" (the CPU's --dtype bfloat16 mode)" if c.quantization == "bf16" else ""),
                        lambda c: c.quantization not in PIPELINE_MODES)
SPEC = Setting("--speculative-config", lambda c: c.speculative_config is not None)
LORA = Setting("--enable-lora", lambda c: c.enable_lora)
KV_8BIT = Setting(lambda c: f"--kv-cache-dtype {c.kv_cache_dtype}", lambda c: c.kv_cache_dtype in ("int8", "fp8"))
SWAP = Setting(lambda c: f"--preemption-mode {c.preemption_mode}", lambda c: c.preemption_mode != "recompute")
SWAP_SPACE = Setting("--swap-space (host memory for KV)", lambda c: c.swap_space > 0)
EMBED = Setting("--task embed", lambda c: c.task == "embed")
LOGITS_PROCESSORS = Setting("--logits-processors", lambda c: bool(c.logits_processors))
KV_ROLE = Setting(lambda c: f"--kv-role {c.kv_role}", lambda c: c.kv_role is not None)

_ONE_CORE = "one engine core per instance, its whole KV cache in one process, one sequence per request (not yet)"

RULES: tuple[Incompatible | Requires, ...] = (
    # Parallel runtime.
    Incompatible(NUM_THREADS, PARALLEL, "--num-threads sets the threads of a single engine; use --threads-per-rank"),
    Requires(EP, TP_OR_DP, "it splits experts over tensor-parallel ranks or data-parallel replicas"),
    Requires(MULTINODE, RENDEZVOUS, "a multi-node group meets at node 0"),
    Incompatible(DP, MULTINODE_OR_RENDEZVOUS, "--data-parallel-size > 1 runs its replicas on this node"),
    Incompatible(DP_EP, TP), Incompatible(DP_EP, PP), Incompatible(DP_EP, SPEC),
    Incompatible(DP_EP, DP_RAY), Incompatible(DP_EP, TP_RAY),
    Requires(TP_RAY, TP, "it runs the tensor-parallel workers as Ray actors"),
    Requires(DP_RAY, DP, "it runs the data-parallel replicas as Ray actors"),
    Requires(RAY_ADDRESS, Setting("--distributed-executor-backend ray or --data-parallel-backend ray",
                                  ANY_RAY.on), "the address is a Ray cluster's"),
    Incompatible(TP_RAY, MP_LAUNCH, "Ray places the ranks on its nodes; those belong to the mp launch"),
    Incompatible(ANY_RAY, CUDA, "the Ray backends run on CPU only (Ray's GPU assignment is not wired to the "
                                "ranks' devices yet)"),
    # Modes.
    Incompatible(CPU_BF16, QUANTIZED, "the bf16 mode is a mode of its own and does not combine with "
                                      "another --quantization"),
    Incompatible(BF16_MODE, GPU_OR_HALF, "on a GPU use --dtype bfloat16"),
    Requires(SWAP, SWAP_SPACE, "swapped-out blocks need host memory"),
    # What tensor parallelism, pipeline parallelism, LoRA and speculative decoding do not take yet.
    Incompatible(TP, KV_8BIT), Incompatible(TP, SWAP), Incompatible(TP, SPEC),
    Incompatible(LORA, TP), Incompatible(LORA, DP),
    Incompatible(PP, UNSTAGED_MODE, "pipeline stages run the exact and gguf modes only (yet)"),
    Incompatible(PP, SPEC), Incompatible(PP, LORA), Incompatible(PP, KV_8BIT), Incompatible(PP, SWAP),
    Incompatible(PP, DP), Incompatible(PP, EMBED), Incompatible(PP, TP_RAY),
    Incompatible(SPEC, LORA), Incompatible(SPEC, KV_8BIT), Incompatible(SPEC, SWAP),
    # Logits processors (pagoda/sample/logits_processor.py).
    Incompatible(LOGITS_PROCESSORS, SPEC, "a verifying step scores each draft position, which plug-ins written "
                                          "for one row per request cannot follow (vLLM refuses it too)"),
    Incompatible(LOGITS_PROCESSORS, EMBED, "an embedding engine samples nothing"),
    # Prefill-decode disaggregation.
    Incompatible(KV_ROLE, TP, _ONE_CORE), Incompatible(KV_ROLE, PP, _ONE_CORE), Incompatible(KV_ROLE, DP, _ONE_CORE),
    Incompatible(KV_ROLE, SPEC, _ONE_CORE), Incompatible(KV_ROLE, LORA, _ONE_CORE),
    Incompatible(KV_ROLE, EMBED, _ONE_CORE),
)
