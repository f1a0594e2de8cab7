"""The Triton backend: the paged KV cache read in place by Triton kernels
(``pagoda/ops/triton_attention.py``), the GPU's default.

Per layer: one launch stores the step's K/V into their slots (slot -1, a padded row, is
skipped), one paged decode launch covers every decode (split-KV over long contexts, a
second small launch combining the splits), and one variable-length launch covers every
prompt chunk of the step over its cached prefix. 8-bit caches are read in the kernels
through their per-token scales.

The metadata's tensors are slices of persistent device buffers, filled once per step
from host staging buffers (pinned on CUDA) with non-blocking copies: no host sync, no
allocation per step, and fixed addresses a CUDA graph can replay over. Each KV group has
two sets, used in turn, so a step's host writes never race the previous step's copies
(with overlapped steps, the previous step may still be in flight).

E.g. two decodes (contexts 5, 9) and one chunk of 3 tokens after 16 cached, block size 4:
seq_lens [6, 10, 19], query_start_loc [0, 3] (over the prompt tokens only), block tables
padded with 0 to the widest row; slot_mapping per token as the torch backend's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagoda.attention.backend import AttentionBackend
from pagoda.attention.kv_quant import QuantizedKVCache
from pagoda.attention.metadata import AttentionMetadata
from pagoda.ops import triton_attention as kernels
from pagoda.ops.staging import StagingBuffers

# Cache element types the kernels read (8-bit ones through their per-token scales; fp8 e4m3
# is held as its bytes and decoded in the kernels).
CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.float8_e4m3fn)

# Split-KV: a decode's keys are split so that about this many programs run per SM (decodes x
# KV heads x splits), in chunks of at least _MIN_SPLIT_KEYS keys.
_MIN_SPLIT_KEYS = 256
# The metadata's device inputs (pagoda/ops/staging.py), per KV group.
_INPUT_DTYPES = {"slots": torch.int64, "tables": torch.int32, "lens": torch.int32, "qsl": torch.int32}
_MAX_SPLITS = 16


@dataclass
class TritonMetadata(AttentionMetadata):
    block_tables: torch.Tensor | None = None     # [N, max_blocks] int32, decodes first
    seq_lens: torch.Tensor | None = None         # [N] int32: context + query tokens
    query_start_loc: torch.Tensor | None = None  # [P + 1] int32 over the prompt chunks' tokens
    num_prefills: int = 0
    max_query_len: int = 0                       # the longest prompt chunk
    max_decode_len: int = 0                      # the longest decode's seq_len
    num_splits: int | None = None                # split-KV count; None: chosen per layer
    workspace: torch.Tensor | None = None        # flat float32 split-KV scratch; None: the backend's own


def num_splits(num_decodes: int, num_kv_heads: int, max_len: int, num_sms: int) -> int:
    """Split-KV count for a decode launch: enough programs to fill the device twice over,
    never a split shorter than _MIN_SPLIT_KEYS keys. E.g. 1 decode, 8 KV heads, 4096 keys,
    132 SMs: 264 programs wanted / 8 = 33, capped by 4096 / 256 = 16 -> 16."""
    programs = max(1, num_decodes * num_kv_heads)
    wanted = -(-2 * num_sms // programs)
    return max(1, min(wanted, max_len // _MIN_SPLIT_KEYS, _MAX_SPLITS))


class TritonBackend(AttentionBackend):
    name = "triton"
    rope_writes_kv = False   # the store kernel writes K/V itself

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.num_sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                        if self.device.type == "cuda" else 4)
        self._inputs: dict[int, StagingBuffers] = {}   # per KV group
        self._workspace = torch.empty(0, dtype=torch.float32, device=self.device)

    def describe(self) -> str:
        interp = " (interpreter)" if self.device.type == "cpu" else ""
        return f"triton{interp}: paged decode with split-KV, one varlen prefill launch, in-kernel KV store"

    def build(self, query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
              block_size: int, device: torch.device, group: int = 0) -> TritonMetadata:  # fmt: skip
        n = len(query_lens)
        num_decodes = 0
        while num_decodes < n and query_lens[num_decodes] == 1:
            num_decodes += 1
        num_tokens = sum(query_lens)
        nb = max((len(t) for t in block_tables), default=1)
        num_qsl = n - num_decodes + 1   # query_start_loc's length
        if group not in self._inputs:
            self._inputs[group] = StagingBuffers(self.device, _INPUT_DTYPES)
        shapes = {"slots": (num_tokens,), "tables": (n, nb), "lens": (n,), "qsl": (num_qsl,)}
        bufs = self._inputs[group].next(shapes)
        host = {name: pair[0].numpy() for name, pair in bufs.items()}
        q_lens = np.asarray(query_lens, dtype=np.int64)
        ctx = np.asarray(context_lens, dtype=np.int64)
        tables = host["tables"]
        for i, t in enumerate(block_tables):
            tables[i, :len(t)] = t
        # Each token's position: [2, 1] tokens with contexts [5, 0] -> [5, 6, 0].
        owner = np.repeat(np.arange(n), q_lens)
        first = np.cumsum(q_lens) - q_lens
        pos = np.arange(num_tokens) - first[owner] + ctx[owner]
        host["slots"][:num_tokens] = tables[owner, pos // block_size].astype(np.int64) * block_size + pos % block_size
        seq = q_lens + ctx
        host["lens"][:n] = seq
        prompt_lens = q_lens[num_decodes:]
        host["qsl"][0] = 0
        host["qsl"][1:num_qsl] = np.cumsum(prompt_lens)
        used = {"slots": (slice(num_tokens),), "tables": (slice(n), slice(nb)), "lens": (slice(n),),
                "qsl": (slice(num_qsl),)}
        dev = {}
        for name, index in used.items():
            h, d = bufs[name]
            d[index].copy_(h[index], non_blocking=True)
            dev[name] = d[index]
        return TritonMetadata(
            slot_mapping=dev["slots"], num_decodes=num_decodes, decode_gather_slots=None,
            decode_mask=None, prefills=[], backend=self,
            block_tables=dev["tables"], seq_lens=dev["lens"],
            query_start_loc=dev["qsl"], num_prefills=n - num_decodes,
            max_query_len=int(prompt_lens.max()) if n > num_decodes else 0,
            max_decode_len=int(seq[:num_decodes].max()) if num_decodes else 0,
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor | QuantizedKVCache, meta: TritonMetadata, scale: float,
                kv_written: bool = False, window: int | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        if isinstance(kv_cache, QuantizedKVCache):
            cache, scales = kv_cache.data, kv_cache.scales
        else:
            cache, scales = kv_cache, None
        if not kv_written:
            kernels.store_kv(k, v, cache, meta.slot_mapping, scales)
        sinks = None if sinks is None else sinks.float()
        nd = meta.num_decodes
        out = torch.empty_like(q)
        if nd:
            splits = meta.num_splits or num_splits(nd, k.shape[1], meta.max_decode_len, self.num_sms)
            kernels.paged_decode(q[:nd], cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale,
                                 window=window or 0, softcap=softcap or 0.0, sinks=sinks, scales=scales,
                                 num_splits=splits, out=out[:nd], workspace=self.workspace(meta, q, nd, splits))
        if meta.num_prefills:
            kernels.paged_extend(q[nd:], cache, meta.block_tables[nd:], meta.query_start_loc, meta.seq_lens[nd:],
                                 scale, max_query_len=meta.max_query_len, window=window or 0,
                                 softcap=softcap or 0.0, sinks=sinks, scales=scales, out=out[nd:])
        return out

    def workspace(self, meta: TritonMetadata, q: torch.Tensor, nd: int, splits: int) -> torch.Tensor | None:
        """The split-KV scratch [nd, H, splits, D + 2] float32: a view of the metadata's own
        buffer (a CUDA graph's, fixed at capture: never reallocated) or of the backend's,
        grown when a step needs more."""
        if splits == 1:
            return None
        _, heads, dim = q.shape
        need = nd * heads * splits * (dim + 2)
        flat = meta.workspace
        if flat is None:
            if self._workspace.numel() < need:
                size = max(need, 1 << 16, 2 * self._workspace.numel())
                self._workspace = torch.empty(size, dtype=torch.float32, device=self.device)
            flat = self._workspace
        elif flat.numel() < need:
            raise RuntimeError(f"a captured step's split-KV workspace holds {flat.numel()} floats, {need} needed")
        return flat[:need].view(nd, heads, splits, dim + 2)
