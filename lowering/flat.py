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
from spmd.kernels.layout import SUPPORTED_DTYPES, BucketTables

__all__ = ["pack", "pack_planned", "unpack", "views"]


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


def views(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like each of ``tensors``, in the layout :func:`pack`
    writes (what a communication hook's ``bucket.gradients()`` returns)."""
    out, at = [], 0
    for t in tensors:
        out.append(flat[at:at + t.numel()].view(t.shape))
        at += t.numel()
    return out


def pack_planned(tensors: list[torch.Tensor], scale: float, dtype: torch.dtype,
                 out: torch.Tensor | None = None,
                 tables: BucketTables | None = None) -> torch.Tensor:
    """:func:`pack` for a bucket a planned graph describes (one device, one dtype, shapes
    fixed when it was planned), without checking each tensor on every step: the kernel
    straight away on CUDA; on CPU one ``torch.cat`` of their flat views (``kernels.pack``'s
    checks and reshapes cost ~3 µs a tensor here, more than the copy of a small one).
    ``out``: a buffer of the right size and dtype to write into (last step's, reused), or
    None for a new one; never a view of one of ``tensors``. ``tables``: the bucket's kept
    launch plan (its spec's), so that a step's host work on CUDA is one address per
    tensor.

    Numerics are ``kernels.pack``'s: values converted to float32 when scaled or cast,
    multiplied by ``scale``, rounded once to ``dtype``.
    """
    device = tensors[0].device
    if kernels.implementation(device) == "triton" and _kernels_take(tensors, dtype):
        from spmd.kernels import packing_triton

        if out is None:
            out = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=device)
        packing_triton.copy(tensors, out, scale, to_flat=True, accumulate=False, tables=tables)
        return out
    # torch.flatten is a view of a contiguous tensor; measured here, one cat of them is as
    # fast as a plain torch.cat for 51 tensors of 192 KiB (flatten_dense_tensors took twice
    # as long) and 1.3x slower than flatten_dense_tensors for 120 tensors of 16 KiB
    pieces = list(map(torch.flatten, tensors))
    source = tensors[0].dtype
    if source == dtype and (scale == 1.0 or dtype == torch.float32):
        flat = torch.cat(pieces, out=out) if out is not None else torch.cat(pieces)
        return flat.mul_(scale) if scale != 1.0 else flat
    flat = torch.cat(pieces)
    if flat.dtype != torch.float32 and flat.dtype in SUPPORTED_DTYPES:
        flat = flat.float()
    if scale != 1.0:
        flat.mul_(scale)
    if out is not None:
        return out.copy_(flat)
    return flat if flat.dtype == dtype else flat.to(dtype)


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
