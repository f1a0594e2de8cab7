"""A GGUF file's tensors as torch tensors, for the loader (pagoda.hub.gguf_file reads the
file without torch: the API process reads its metadata only)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the file is opened where it is read (gguf is a slow import)
    from pagoda.hub.gguf_file import GGUFFile


def tensor_rows(gf: GGUFFile, name: str) -> torch.Tensor:
    """The tensor's stored bytes as a uint8 tensor [rows, bytes per row], without copying
    (``GGUFFile.mapped_rows``: a view into a copy-on-write map of the file)."""
    return torch.from_numpy(gf.mapped_rows(name))


def copy_rows(gf: GGUFFile, name: str) -> torch.Tensor:
    """Like ``tensor_rows``, but a private copy read with pread (for a tensor whose rows the
    loader reorders; no page of the file's maps becomes resident)."""
    return torch.from_numpy(gf.read_rows(name))


def load_tensor(gf: GGUFFile, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Dequantize a tensor into a new contiguous tensor (float32 unless ``dtype`` says
    otherwise) in PyTorch dimension order."""
    return torch.from_numpy(gf.dequantize(name)).to(torch.float32 if dtype is None else dtype).contiguous()
