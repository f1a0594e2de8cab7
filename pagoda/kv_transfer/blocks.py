"""A KV cache's blocks as rows of bytes: what a transfer moves, and its layout check.

The model runner keeps one cache per buffer (``ModelRunner.kv_buffers``; layers of
different KV groups share buffers, pagoda/core/kv_layout.py). A buffer is a tensor
``[2, num_blocks, block_size, kv_heads, head_dim]``, or an 8-bit ``QuantizedKVCache``
whose ``data`` and ``scales`` tensors are indexed the same way. Each such tensor is a
*part*; a block is its slice ``[:, b]`` of every part. A transfer of n blocks is, per
part, ``part.index_select(1, block_ids)``: a ``[2, n, ...]`` tensor, moved as bytes.

E.g. the bundled SmolLM2-135M in float32 with blocks of 64: 30 buffers of one part
``[2, B, 64, 3, 64]``; a block is 30 x 2 x 64 x 3 x 64 x 4 B = 2.8 MiB over all layers.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch

from pagoda.attention.kv_quant import QuantizedKVCache

LayerCache = Any  # torch.Tensor | QuantizedKVCache


def cache_parts(buffers: Sequence[LayerCache]) -> list[torch.Tensor]:
    """Every tensor of the cache buffers, each indexed by block on dim 1."""
    parts: list[torch.Tensor] = []
    for buf in buffers:
        if isinstance(buf, QuantizedKVCache):
            parts.extend((buf.data, buf.scales))
        else:
            parts.append(buf)
    return parts


def layout_of(buffers: Sequence[LayerCache]) -> list[list]:
    """What two instances must agree on to exchange blocks: per part its dtype and its shape
    without the block count, e.g. [["torch.float32", [2, 64, 3, 64]], ...]."""
    return [[str(p.dtype), [p.shape[0], *p.shape[2:]]] for p in cache_parts(buffers)]


def row_bytes(part: torch.Tensor, num_rows: int) -> int:
    """Bytes of ``num_rows`` blocks of one part."""
    return part.shape[0] * num_rows * part[0, 0].numel() * part.element_size()


def gather_into(parts: Sequence[torch.Tensor], block_ids: Sequence[int],
                views: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:  # fmt: skip
    """Blocks ``block_ids`` of each part, in that order: per part a contiguous
    ``[2, n, ...]`` tensor on the CPU, written into ``views`` (same shapes) when given."""
    out = []
    for j, part in enumerate(parts):
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=part.device)
        if views is not None and part.device.type == "cpu":
            torch.index_select(part, 1, idx, out=views[j])
            out.append(views[j])
            continue
        rows = part.index_select(1, idx).cpu()
        if views is not None:
            views[j].copy_(rows)
            rows = views[j]
        out.append(rows.contiguous())
    return out


def part_views(parts: Sequence[torch.Tensor], num_rows: int, buffer: Any,
               offset: int = 0) -> list[torch.Tensor]:  # fmt: skip
    """Tensors over ``buffer`` (bytes-like; read-only is fine) for ``num_rows`` blocks of each
    part, packed one after another from ``offset``, shaped like ``gather_into``'s output."""
    views = []
    for part in parts:
        n = row_bytes(part, num_rows)
        views.append(tensor_over(buffer, part.dtype, [part.shape[0], num_rows, *part.shape[2:]], offset))
        offset += n
    return views


def tensor_over(buffer: Any, dtype: torch.dtype, shape: Sequence[int], offset: int = 0) -> torch.Tensor:
    """A tensor viewing ``buffer`` at byte ``offset`` (no copy)."""
    count = 1
    for d in shape:
        count *= d
    nbytes = count * torch.empty(0, dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(list(shape), dtype=dtype)
    with warnings.catch_warnings():
        # A read-only buffer (a received frame) is only ever read from.
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=offset)
    return raw.view(dtype).view(list(shape))


def install(parts: Sequence[torch.Tensor], rows: Sequence[torch.Tensor], row_idx: Sequence[int],
            block_ids: Sequence[int]) -> None:  # fmt: skip
    """Copy rows ``row_idx`` of received ``rows`` (one tensor per part) into blocks ``block_ids``."""
    for part, src in zip(parts, rows, strict=True):
        dev = part.device
        src_idx = torch.tensor(list(row_idx), dtype=torch.long)
        dst_idx = torch.tensor(list(block_ids), dtype=torch.long, device=dev)
        part.index_copy_(1, dst_idx, src.index_select(1, src_idx).to(dev))
