"""A tensor- or pipeline-parallel worker (rank > 0): load this rank's part of the model (its
stage's layers, its shard of them), then follow rank 0's steps.

    python -m pagoda.executor.worker --rank 1 --init-method tcp://host:port --config-json '{...}'

Started by the engine core on its node, by `pagoda serve --node-rank N` on the
others, or by torchrun (RANK / WORLD_SIZE / LOCAL_RANK in the environment).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time

from pagoda.config import EngineConfig

# What a worker gives to the minimum over the ranks through which rank 0 passes a number.
STATE_PLAN_ANY = 1 << 62

logger = logging.getLogger(__name__)


def run_worker(config: EngineConfig, rank: int, local_rank: int, init_method: str) -> int:
    from pagoda.distributed.group import DistributedError, RankGroups, rendezvous_store
    from pagoda.executor.multiproc import configure_threads, gather_weight_bytes, rank_device
    from pagoda.model.loader import load_model, parse_dtype
    from pagoda.worker.kv_sizing import kv_blocks_for
    from pagoda.worker.model_runner import ModelRunner, kv_cache_bytes_per_block, kv_cache_storage

    configure_threads(config)
    world = config.world_size
    device = rank_device(config, local_rank)
    dtype = parse_dtype(config.dtype)
    store = rendezvous_store(init_method, rank, world, config.distributed_timeout)
    group = RankGroups(store, rank, config.tensor_parallel_size, config.pipeline_parallel_size, device,
                       config.distributed_timeout)
    loaded = load_model(config.model, dtype, device, show_progress=False, quantization=config.quantization,
                        tp_group=group.tp, tp_rank=group.tp_rank, expert_parallel=config.enable_expert_parallel,
                        pipe=group.pipe)
    gather_weight_bytes(group, loaded.model)
    # The KV cache as rank 0 keeps it (float16 in the quantized modes), sized by the same rule.
    kv_dtype, kv_quant = kv_cache_storage(config.resolved_kv_cache_dtype, dtype)
    per_block = kv_cache_bytes_per_block(loaded.model, config.block_size, kv_dtype, kv_quant)
    num_blocks = group.all_reduce_min(kv_blocks_for(config, loaded.model, device, dtype, per_block))
    # A hybrid model's state slots and saved states: rank 0's plan (EngineCore._plan_kv).
    slots, saved = (group.all_reduce_min(STATE_PLAN_ANY) for _ in range(2)) if loaded.arch.is_hybrid else (0, 0)
    runner = ModelRunner(loaded.model, num_blocks, config.block_size, device, kv_dtype, config.seed, samples=False,
                         kv_cache_dtype=kv_quant, attention_backend=config.attention_backend,
                         num_state_slots=slots, num_state_checkpoints=saved)
    logger.info("rank %d/%d ready: %d KV blocks", rank, world, num_blocks)
    try:
        while True:
            msg = group.recv_step()
            if msg is None:
                return 0
            if msg.sched_out is not None:
                runner.apply_sampled(msg.sampled)
                runner.execute_model(msg.sched_out)
            if msg.expert_load and group.pipe is not None and group.tp_rank == 0:
                # This stage's MoE counts, once for the stage (its TP ranks route alike).
                group.pipe.send_expert_counts(runner.model.expert_counts())
    except DistributedError as e:
        logger.error("rank %d: %s; exiting", rank, e)
        return 1


def _exit_with_parent() -> None:
    """A worker started by a local engine core ends when that process is gone."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    from pagoda.host import torchrun_rank

    p = argparse.ArgumentParser(prog="python -m pagoda.executor.worker")
    p.add_argument("--rank", type=int, default=None)
    p.add_argument("--local-rank", type=int, default=None)
    p.add_argument("--init-method", default=None)
    p.add_argument("--config-json", required=True)
    args = p.parse_args(argv)
    config = EngineConfig(**json.loads(args.config_json))
    rank, local_rank, init = args.rank, args.local_rank, args.init_method
    launched = torchrun_rank()
    if rank is None:
        if launched is None:
            p.error("--rank is required outside torchrun")
        rank, _, local_rank = launched
        init = init or config.distributed_init_method or "env://"
    logging.basicConfig(level=os.environ.get("PAGODA_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s rank-{rank} %(levelname)s %(message)s")
    _exit_with_parent()
    code = run_worker(config, rank, local_rank if local_rank is not None else rank, init)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: gloo's threads may still hold sockets of dead peers.
    os._exit(code)


if __name__ == "__main__":
    main()
