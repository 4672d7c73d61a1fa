"""Flat buffers of many tensors, for every dtype a model may hold.

``spmd.kernels.pack``/``unpack`` do the work (one launch on CUDA, scaled and cast in the
same pass) for the dtypes they take: float32, bfloat16, float16. Anything else — float64
parameters, integer buffers being broadcast — goes through plain torch ops here, with the
same layout (tensors concatenated in order, no padding), so callers never branch.
"""

from __future__ import annotations

from typing import Sequence

import torch

import spmd.kernels as kernels
from spmd.kernels.layout import SUPPORTED_DTYPES

__all__ = ["pack", "unpack"]


def _kernels_take(tensors: Sequence[torch.Tensor], dtype: torch.dtype | None) -> bool:
    return (dtype is None or dtype in SUPPORTED_DTYPES) and all(
        t.dtype in SUPPORTED_DTYPES for t in tensors)


def pack(tensors: Sequence[torch.Tensor], *, scale: float = 1.0,
         dtype: torch.dtype | None = None) -> torch.Tensor:
    """``tensors`` concatenated into one 1-D buffer, times ``scale``, as ``dtype``."""
    if _kernels_take(tensors, dtype):
        return kernels.pack(list(tensors), scale=scale, dtype=dtype)
    target = dtype or tensors[0].dtype
    flat = torch.cat([t.reshape(-1).to(target) for t in tensors])
    return flat.mul_(scale) if scale != 1.0 else flat


def unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor], *,
           accumulate: bool = False) -> None:
    """Write (or add) the pieces of ``flat`` back into ``tensors``, cast to their dtypes."""
    if _kernels_take(tensors, flat.dtype):
        kernels.unpack(flat, list(tensors), accumulate=accumulate)
        return
    pieces = flat.split([t.numel() for t in tensors])
    with torch.no_grad():
        for t, piece in zip(tensors, pieces):
            value = piece.view(t.shape).to(t.dtype)
            t.add_(value) if accumulate else t.copy_(value)
