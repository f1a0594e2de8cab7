"""Process settings for an engine (or a rank) on CUDA."""

from __future__ import annotations

import logging

import torch

from pagoda.config import EngineConfig

logger = logging.getLogger(__name__)


def cuda_defaults(config: EngineConfig) -> None:
    """Process settings for a CUDA engine. Torch threads: --num-threads, else 1 (the host side
    of a GPU step is small tensors from Python lists and the sampler's bookkeeping; a pool of
    spinning threads only takes cores from the API server; the first GPU run served c=16 at
    168 tok/s with 16 threads, 263 with 1). SDPA, where it remains (the torch backend, and
    attention of models the Triton kernels do not take), never the cuDNN backend: it plans
    each new (batch, length, mask) shape, and a served engine's shapes change every step."""
    torch.set_num_threads(config.num_threads or 1)
    torch.backends.cuda.enable_cudnn_sdp(False)
    logger.info("CUDA: %d torch thread(s); SDPA backends flash, memory-efficient and math (cuDNN off)",
                torch.get_num_threads())
