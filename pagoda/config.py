"""Engine configuration: one frozen, validated object built from user options."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from pagoda.kv_transfer.params import KVTransferConfig
from pagoda.pooling import TASKS, PoolerOverrides
from pagoda.spec_decode.config import SpeculativeConfig


def _positive(name: str, value: object, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


# The quantization modes pipeline stages run: the exact mode and the gguf mode (each stage
# keeps its layers' blocks as the file stores them; the converting modes are not staged yet).
PIPELINE_MODES = ("none", "gguf")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None              # HF folder or .gguf file; None = bundled default
    served_model_name: str | None = None
    dtype: str = "auto"                   # auto = float32 on CPU
    quantization: str = "none"            # none (exact) | int8 (dynamic int8 GEMMs) | q4 (4-bit groups) | gguf | bf16; CPU
    device: str = "cpu"
    max_model_len: int | None = None      # None = the model's own context length
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # tokens per step; None = 512 on CPU, 8192 on GPU
    block_size: int | None = None         # tokens per KV block; None = 64 on CPU, 16 on GPU
    kv_cache_memory: int | None = None    # bytes for the KV pool; None = a share of free memory
    num_kv_blocks: int | None = None      # explicit pool size, overrides kv_cache_memory
    enable_prefix_caching: bool = True
    seed: int = 0
    skip_tokenizer_init: bool = False
    chat_template: str | None = None      # a template string or a path to one
    show_progress: bool = True
    num_threads: int | None = None        # torch threads of the engine; None = the thread governor (engine/cpu_threads.py)
    # Parallel runtime (docs/parallel.md).
    tensor_parallel_size: int = 1
    # Decoder layers split into this many stages (processes), each a TP group (world = TP x PP).
    pipeline_parallel_size: int = 1
    # MoE models under tensor parallelism: each rank holds a share of every layer's experts
    # (whole experts; their outputs summed over ranks).
    enable_expert_parallel: bool = False
    data_parallel_size: int = 1
    # Set by DataParallelLLM on each replica's config, not by users: the replica's index and,
    # with --enable-expert-parallel, the expert-parallel group's rendezvous (tcp://127.0.0.1:port).
    data_parallel_rank: int = 0
    expert_parallel_init_method: str | None = None
    distributed_init_method: str | None = None  # tcp://host:port or env://; None = local, automatic
    nnodes: int = 1                       # nodes the tensor/pipeline-parallel group spans
    node_rank: int = 0                    # 0 = the node running the engine core (rank 0)
    distributed_timeout: float = 120.0    # seconds a collective may wait for a peer
    threads_per_rank: int | None = None   # torch threads per rank; None = 1 when parallel on CPU
    # Who starts the processes (docs/parallel.md): mp = subprocesses (torch.distributed's launch), or
    # ray = Ray actors (pip install pagoda[ray]): tensor-parallel workers / data-parallel engine cores.
    distributed_executor_backend: str = "mp"
    data_parallel_backend: str = "mp"
    ray_address: str | None = None        # a Ray cluster; None = RAY_ADDRESS, a `ray start` here, else a new one
    # Speculative decoding: a SpeculativeConfig, or a dict / JSON string of one (vLLM's shape).
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None
    # Scheduling (docs/scheduling.md).
    scheduling_policy: str = "fcfs"       # fcfs | priority | fair
    max_long_partial_prefills: int | None = None
    long_prefill_token_threshold: int | None = None
    shared_prefix_file: str | None = None  # texts whose prefix blocks stay shared across cache salts
    api_keys_file: str | None = None       # API key -> tenant, weight, limits (JSON or TOML)
    kv_cache_dtype: str = "auto"           # auto | float16 | int8 | fp8 (8-bit KV with per-token scales)
    attention_backend: str = "auto"        # auto | cpu | torch | triton (pagoda/attention/selector.py)
    enforce_eager: bool = False            # no CUDA graphs for decode steps (vLLM's flag)
    async_scheduling: bool | None = None   # overlapped steps (vLLM's flag); None = on CUDA
    preemption_mode: str = "recompute"     # recompute | swap | auto
    swap_space: int = 0                    # bytes of host memory for swapped-out KV blocks
    enable_lora: bool = False             # serve LoRA adapters (pagoda/lora)
    max_loras: int = 1                    # adapters resident at once (one batch mixes up to this many)
    max_lora_rank: int = 16               # largest adapter rank accepted
    max_logprobs: int = 20                # vLLM's --max-logprobs: the most logprobs / prompt_logprobs a
                                          # request may ask (-1: no bound; a request's -1 = whole vocabulary)
    # auto | generate | embed (pagoda/pooling.py): auto embeds with an embedding checkpoint.
    task: str = "auto"
    # An embedding engine's pooling over the checkpoint's: a PoolerOverrides, or a dict / JSON
    # string of its fields (pooling_type, normalize, is_matryoshka, matryoshka_dimensions).
    override_pooler_config: PoolerOverrides | dict[str, Any] | str | None = None
    # Prefill-decode disaggregation (pagoda/kv_transfer, docs/parallel.md): prefill | decode | None
    # (colocated), and the instance's KV endpoint settings: a KVTransferConfig, or a dict / JSON string.
    kv_role: str | None = None
    kv_transfer_config: KVTransferConfig | dict[str, Any] | str | None = None

    def __post_init__(self) -> None:
        _positive("max_model_len", self.max_model_len, allow_none=True)
        _positive("max_num_seqs", self.max_num_seqs)
        if self.max_num_batched_tokens is None:
            # A step's budget: on the CPU a step of 512 tokens already keeps both cores busy (and
            # bounds the decodes' wait behind a prompt); a GPU needs thousands (vLLM's serving
            # default on large GPUs: 8192).
            object.__setattr__(self, "max_num_batched_tokens", 512 if self.device.split(":")[0] == "cpu" else 8192)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (no bound) or an integer >= 0, got {self.max_logprobs!r}")
        if self.block_size is None:
            # CPU: a sequence's K/V for a layer is read block by block, and this machine reads
            # scattered 6 KiB runs (16 tokens of the default model, float16) at a third of its
            # streaming bandwidth, 24 KiB runs (64 tokens) at half (docs/benchmarks.md). vLLM's
            # CPU backend picks 128 for the same reason; 64 keeps prefix hits finer.
            object.__setattr__(self, "block_size", 64 if self.device.split(":")[0] == "cpu" else 16)
        _positive("block_size", self.block_size)
        _positive("kv_cache_memory", self.kv_cache_memory, allow_none=True)
        _positive("num_kv_blocks", self.num_kv_blocks, allow_none=True)
        _positive("num_threads", self.num_threads, allow_none=True)
        if self.num_threads is not None and (self.world_size > 1 or self.data_parallel_size > 1):
            raise ValueError("--num-threads sets the threads of a single engine; with tensor, pipeline or "
                             "data parallelism use --threads-per-rank")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}")
        if self.quantization == "int4":
            object.__setattr__(self, "quantization", "q4")  # the issue's / vLLM-style name
        if self.quantization not in ("none", "int8", "q4", "gguf", "bf16"):
            raise ValueError(f"quantization must be none, int8, q4, gguf or bf16, got {self.quantization!r}")
        if self.device == "cpu" and self.dtype in ("bfloat16", "bf16"):
            # The CPU's bf16 mode: bfloat16 GEMMs on oneDNN, float32 norms, residuals and
            # attention (pagoda/model/layers/quantization.py, Bf16Linear).
            if self.quantization not in ("none", "bf16"):
                raise ValueError(f"--dtype bfloat16 on the CPU is a mode of its own (bfloat16 GEMMs); it does "
                                 f"not combine with --quantization {self.quantization}")
            object.__setattr__(self, "quantization", "bf16")
            object.__setattr__(self, "dtype", "float32")
        elif self.quantization == "bf16" and (self.device != "cpu" or self.dtype not in ("auto", "float32", "fp32", "float")):
            raise ValueError("--quantization bf16 is the CPU's bf16 mode (float32 model, bfloat16 GEMMs); on a GPU "
                             "use --dtype bfloat16")
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        _positive("pipeline_parallel_size", self.pipeline_parallel_size)
        _positive("data_parallel_size", self.data_parallel_size)
        _positive("nnodes", self.nnodes)
        _positive("threads_per_rank", self.threads_per_rank, allow_none=True)
        if isinstance(self.node_rank, bool) or not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank!r}")
        if self.world_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} x pipeline_parallel_size="
                             f"{self.pipeline_parallel_size} must be a multiple of nnodes={self.nnodes} "
                             f"(the same number of ranks on every node)")
        if not self.distributed_timeout > 0:
            raise ValueError(f"distributed_timeout must be > 0 seconds, got {self.distributed_timeout!r}")
        if self.enable_expert_parallel and self.tensor_parallel_size < 2 and self.data_parallel_size < 2:
            raise ValueError("--enable-expert-parallel splits experts over tensor-parallel ranks or data-parallel "
                             "replicas: it needs --tensor-parallel-size > 1 or --data-parallel-size > 1")
        if isinstance(self.data_parallel_rank, bool) or not isinstance(self.data_parallel_rank, int) \
                or not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(f"data_parallel_rank must be in [0, data_parallel_size={self.data_parallel_size}), "
                             f"got {self.data_parallel_rank!r}")
        if self.nnodes > 1 and self.distributed_init_method is None:
            raise ValueError("a multi-node group needs a rendezvous: --master-addr/--master-port "
                             "or --distributed-init-method tcp://host:port")
        if self.data_parallel_size > 1 and (self.nnodes > 1 or self.distributed_init_method is not None):
            raise ValueError("--data-parallel-size > 1 runs its replicas on this node; it cannot be "
                             "combined with a multi-node or explicit tensor-parallel rendezvous")
        if self.dp_expert_parallel:   # before the backends' and pipeline's checks: name this mode
            self._check_dp_expert_parallel()
        self._check_backends()
        if self.scheduling_policy not in ("fcfs", "priority", "fair"):
            raise ValueError(f"scheduling_policy must be fcfs, priority or fair, got {self.scheduling_policy!r}")
        _positive("max_long_partial_prefills", self.max_long_partial_prefills, allow_none=True)
        _positive("long_prefill_token_threshold", self.long_prefill_token_threshold, allow_none=True)
        if self.attention_backend not in ("auto", "cpu", "torch", "triton"):
            raise ValueError(f"attention_backend must be auto, cpu, torch or triton, got {self.attention_backend!r}")
        if self.kv_cache_dtype not in ("auto", "float16", "int8", "fp8"):
            raise ValueError(f"kv_cache_dtype must be auto, float16, int8 or fp8, got {self.kv_cache_dtype!r}")
        if self.preemption_mode not in ("recompute", "swap", "auto"):
            raise ValueError(f"preemption_mode must be recompute, swap or auto, got {self.preemption_mode!r}")
        if isinstance(self.swap_space, bool) or not isinstance(self.swap_space, int) or self.swap_space < 0:
            raise ValueError(f"swap_space must be a number of bytes >= 0, got {self.swap_space!r}")
        if self.preemption_mode != "recompute" and self.swap_space == 0:
            raise ValueError(f"preemption_mode={self.preemption_mode} needs --swap-space (host memory for KV)")
        if self.api_keys_file is not None:
            from pagoda.tenants import load_api_keys_file

            load_api_keys_file(self.api_keys_file)  # raises on a malformed file
        if self.shared_prefix_file is not None:
            from pagoda.shared_prefix import read_shared_prefix_file

            read_shared_prefix_file(self.shared_prefix_file)
        if self.tensor_parallel_size > 1 and (self.kv_cache_dtype != "auto" or self.preemption_mode != "recompute"):
            raise ValueError("--kv-cache-dtype int8|fp8 and --preemption-mode swap|auto are not supported with "
                             "--tensor-parallel-size > 1 yet")
        _positive("max_loras", self.max_loras)
        _positive("max_lora_rank", self.max_lora_rank)
        if self.enable_lora and (self.tensor_parallel_size > 1 or self.data_parallel_size > 1):
            raise ValueError("--enable-lora is not supported with tensor or data parallelism yet")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        object.__setattr__(self, "override_pooler_config", PoolerOverrides.parse(self.override_pooler_config))
        if self.speculative_config is not None and self.tensor_parallel_size > 1:
            raise ValueError("--speculative-config is not supported with --tensor-parallel-size > 1 yet")
        if self.pipeline_parallel_size > 1:
            self._check_pipeline_parallel()
        if self.speculative_config is not None and self.enable_lora:
            raise ValueError("--speculative-config is not supported with --enable-lora yet")
        if self.speculative_config is not None and (self.kv_cache_dtype != "auto" or self.preemption_mode != "recompute"):
            raise ValueError("--speculative-config is not supported with --kv-cache-dtype int8|fp8 or "
                             "--preemption-mode swap|auto yet")
        object.__setattr__(self, "kv_transfer_config", KVTransferConfig.parse(self.kv_role, self.kv_transfer_config))
        if self.kv_role is not None:
            self._check_kv_role()

    def _check_kv_role(self) -> None:
        """What a prefill or decode instance cannot be combined with (yet)."""
        clashes = {
            "--tensor-parallel-size > 1": self.tensor_parallel_size > 1,
            "--pipeline-parallel-size > 1": self.pipeline_parallel_size > 1,
            "--data-parallel-size > 1": self.data_parallel_size > 1,
            "--speculative-config": self.speculative_config is not None,
            "--enable-lora": self.enable_lora,
            "--task embed": self.task == "embed",
        }
        for what, clash in clashes.items():
            if clash:
                raise ValueError(f"--kv-role {self.kv_role} cannot be combined with {what} yet: one engine core "
                                 "per instance, its whole KV cache in one process, one sequence per request")

    def _check_backends(self) -> None:
        """--distributed-executor-backend / --data-parallel-backend / --ray-address."""
        for name in ("distributed_executor_backend", "data_parallel_backend"):
            if getattr(self, name) not in ("mp", "ray"):
                raise ValueError(f"{name} must be mp or ray, got {getattr(self, name)!r}")
        tp_ray = self.distributed_executor_backend == "ray"
        dp_ray = self.data_parallel_backend == "ray"
        if tp_ray and self.tensor_parallel_size < 2:
            raise ValueError("--distributed-executor-backend ray runs the tensor-parallel workers as Ray "
                             "actors: it needs --tensor-parallel-size > 1")
        if dp_ray and self.data_parallel_size < 2:
            raise ValueError("--data-parallel-backend ray runs the data-parallel replicas as Ray actors: "
                             "it needs --data-parallel-size > 1")
        if self.ray_address is not None and not (tp_ray or dp_ray):
            raise ValueError("--ray-address needs --distributed-executor-backend ray or --data-parallel-backend ray")
        if not (tp_ray or dp_ray):
            return
        if (self.ray_address or "").startswith("ray://"):
            raise ValueError("--ray-address ray://... (Ray Client) is not supported: run pagoda on a node of the "
                             "cluster (rank 0's node hosts the rendezvous, the API server's node the replicas' "
                             "sockets) and give the head's host:port")
        if tp_ray and (self.nnodes > 1 or self.distributed_init_method is not None or torchrun_rank() is not None):
            raise ValueError("--distributed-executor-backend ray: Ray places the ranks on its nodes; --nnodes, "
                             "--node-rank, --master-addr/--master-port, --distributed-init-method and torchrun "
                             "belong to the mp launch")
        if self.device != "cpu":
            raise ValueError("the Ray backends run on CPU only (Ray's GPU assignment is not wired to the ranks' "
                             f"devices yet); got --device {self.device}")
        require_ray()

    def _check_pipeline_parallel(self) -> None:
        """What pipeline parallelism does not combine with (yet), each named."""
        refused = [
            (self.quantization not in PIPELINE_MODES, f"--quantization {self.quantization}"
                                          + (" (the CPU's --dtype bfloat16 mode)" if self.quantization == "bf16" else "")),
            (self.speculative_config is not None, "--speculative-config"),
            (self.enable_lora, "--enable-lora"),
            (self.kv_cache_dtype != "auto", f"--kv-cache-dtype {self.kv_cache_dtype}"),
            (self.preemption_mode != "recompute", f"--preemption-mode {self.preemption_mode}"),
            (self.data_parallel_size > 1, "--data-parallel-size > 1"),
            (self.task == "embed", "--task embed"),
            (self.distributed_executor_backend == "ray", "--distributed-executor-backend ray"),
        ]
        names = [name for bad, name in refused if bad]
        if names:
            raise ValueError(f"{', '.join(names)} {'is' if len(names) == 1 else 'are'} not supported with "
                             f"--pipeline-parallel-size > 1 yet")

    @property
    def dp_expert_parallel(self) -> bool:
        """Expert parallelism across the data-parallel replicas (docs/parallel.md): each replica
        holds a share of every MoE layer's experts and the replicas exchange tokens."""
        return self.enable_expert_parallel and self.data_parallel_size > 1

    def _check_dp_expert_parallel(self) -> None:
        """What expert parallelism across data-parallel replicas does not combine with (yet), each named."""
        refused = [
            (self.tensor_parallel_size > 1, "--tensor-parallel-size > 1"),
            (self.pipeline_parallel_size > 1, "--pipeline-parallel-size > 1"),
            (self.speculative_config is not None, "--speculative-config"),
            (self.data_parallel_backend == "ray", "--data-parallel-backend ray"),
            (self.distributed_executor_backend == "ray", "--distributed-executor-backend ray"),
        ]
        names = [name for bad, name in refused if bad]
        if names:
            raise ValueError(f"--data-parallel-size > 1 with --enable-expert-parallel (experts split over the "
                             f"replicas) does not combine with {', '.join(names)} yet")

    @property
    def world_size(self) -> int:
        """Ranks of one engine's parallel group: tensor x pipeline parallel."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def resolved_kv_cache_dtype(self) -> str:
        """``auto`` made concrete: the model's dtype ("auto") in the exact mode, float16 with
        --quantization int8|q4|gguf|bf16 (as llama.cpp's default; decode attention reads half the
        bytes, and those modes are approximate already)."""
        if self.kv_cache_dtype == "auto" and self.quantization != "none":
            return "float16"
        return self.kv_cache_dtype

# Models whose weights a step reads take long enough per op that two threads pay off
# on a 2-core machine (see cpu_threads_policy).
BIG_MODEL_BYTES = 256 << 20


def cpu_threads_policy(requested: int | None, weight_bytes: int | None = None) -> int | None:
    """A fixed thread count: while the engine loads, where ``governed_threads`` gives no
    range (off Linux), and for the roofline bench. ``requested`` if given; else
    ``OMP_NUM_THREADS`` if set (None: leave torch's choice); else one per core less
    one for the API process and its clients, and on machines with 2 cores or fewer
    exactly one, unless the model's weights (``weight_bytes``) are at least
    BIG_MODEL_BYTES: then both cores.

    Why not all cores for small models: torch's threads meet at a barrier after every
    op, so when another process takes one of the cores, every op waits a whole
    scheduler slice for the descheduled thread. Measured on this project's 2-core
    machines under load: a batch-1 decode step of the 135M model took 724 ms with 2
    threads against 53 ms with 1 (docs/benchmarks.md). A real-size model's ops each
    take milliseconds (a 1B decode step reads ~700 MB), so a slice lost now and then
    costs little against using the second core for every op (docs/benchmarks.md,
    real-size models)."""
    if requested is not None:
        return requested
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    if cores <= 2:
        return cores if weight_bytes is not None and weight_bytes >= BIG_MODEL_BYTES else 1
    return cores - 1


def governed_threads(requested: int | None) -> tuple[int, int] | None:
    """(low, high): the range the engine's ``ThreadGovernor`` moves its torch threads in
    (pagoda/engine/cpu_threads.py), or None for a fixed count (``cpu_threads_policy``):
    when ``--num-threads`` or ``OMP_NUM_THREADS`` says how many, on one core and off
    Linux. Else every core while the machine is otherwise idle, and one less (at least
    one) while other processes want a core."""
    from pagoda.engine import cpu_threads

    if requested is not None or os.environ.get("OMP_NUM_THREADS"):
        return None
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return None
    if cores < 2 or not cpu_threads.available():
        return None
    return max(1, cores - 1), cores


# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def keep_freed_memory() -> bool:
    """Let glibc's malloc keep freed memory for the next step instead of handing it
    back to the kernel: a step's large activations (a batch's logits, int8 products,
    prompt chunks) are then reused pages, not fresh mmaps that fault in page by page
    on every step. Allocations up to 32 MiB (glibc's limit) come from the heap, and
    up to 256 MiB of free heap is kept (1 GiB was no faster). Measured here (one
    thread): an int8 decode step of 64 sequences 126-145 -> 121-131 ms (its time
    without varies with the page faults), prompts and steps of 16 unchanged; the
    price is a higher RSS. Returns whether it applied (glibc only; elsewhere a no-op)."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return all(mallopt(param, value) == 1 for param, value in
               ((_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 256 << 20), (_M_TOP_PAD, 64 << 20)))


def release_freed_memory() -> bool:
    """Hand malloc's free heap back to the kernel (glibc's malloc_trim), after a one-off
    burst of allocations such as converting a model's weights at load. Returns whether
    it ran (glibc only)."""
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
    return True


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux); a conservative 2 GiB elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 2 << 30


def torchrun_rank() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when launched by torchrun (or alike), else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        return rank, world, int(os.environ.get("LOCAL_RANK", rank))
    return None


RAY_MISSING = ("the Ray backends (--distributed-executor-backend ray, --data-parallel-backend ray) need Ray, "
               "an optional extra: pip install 'pagoda[ray]'")


def require_ray() -> None:
    """Raise ImportError naming the extra when Ray is not installed (without importing it)."""
    import importlib.util
    import sys

    if "ray" in sys.modules:
        missing = sys.modules["ray"] is None
    else:
        missing = importlib.util.find_spec("ray") is None
    if missing:
        raise ImportError(RAY_MISSING)
