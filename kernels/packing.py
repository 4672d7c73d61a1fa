"""Bucket packing: many tensors into one flat buffer and back, scaled and cast on the way.

Every bucketed collective starts with ``pack`` (the gradients of a bucket, divided by the
world size and perhaps cast to bf16, into the buffer the all-reduce sends) and ends with
``unpack`` (the reduced buffer back into the gradients). On CUDA each is one Triton launch
per distinct dtype of the tensors (one for a normal bucket) instead of one copy per tensor;
on CPU, and wherever ``SPMD_KERNELS=torch``, the torch reference below does the same work.

Numerics, on both paths: every element is converted to float32, multiplied by ``scale``
(itself rounded to float32), added to the target when accumulating, and rounded once
(to nearest even) to the destination dtype. With ``scale=1`` a copy is exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spmd.kernels import checks
from spmd.kernels.dispatch import implementation
from spmd.kernels.layout import offsets

__all__ = ["pack", "unpack", "pack_reference", "unpack_reference"]


@torch.no_grad()
def pack(tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None, *,
         scale: float = 1.0, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Copy ``tensors`` into one flat 1-D buffer, each multiplied by ``scale`` and cast.

    The layout is the tensors' elements concatenated in order, each in logical (row-major)
    order, with no padding: tensor ``i`` starts at the sum of the element counts before it,
    exactly like ``torch.cat([t.reshape(-1) for t in tensors])``. Tensors may have any
    shape and strides (up to 4 dimensions after merging those that walk memory together).

    Args:
        tensors: float32, bfloat16 or float16 tensors, all on one device.
        out: a 1-D contiguous buffer on the same device with at least the total number of
            elements; written from index 0 and returned. New when None.
        scale: every element is multiplied by it (e.g. ``1 / world_size``).
        dtype: the buffer's dtype (e.g. ``torch.bfloat16`` to compress fp32 gradients).
            None: ``out``'s dtype when ``out`` is given, else the tensors' common dtype
            (mixed dtypes then raise).

    Returns:
        ``out``, or the new buffer.

    Raises:
        TypeError for non-tensors or an unsupported dtype; ValueError for mixed devices,
        mixed dtypes without ``dtype``, an ``out`` too small or not flat.

    Example::

        >>> grads = [torch.ones(2, 3), torch.full((4,), 2.0)]
        >>> pack(grads, scale=0.5, dtype=torch.bfloat16)
        tensor([0.5000, 0.5000, 0.5000, 0.5000, 0.5000, 0.5000, 1.0000, 1.0000, 1.0000,
                1.0000], dtype=torch.bfloat16)
    """
    tensors = checks.tensor_list("pack", "tensors", tensors)
    scale = checks.scalar("pack", "scale", scale)
    if out is not None and not isinstance(out, torch.Tensor):
        raise TypeError(f"pack: out must be a tensor or None, got {type(out).__name__}")
    if not tensors and out is None:
        raise ValueError("pack: no tensors and no out; nothing tells the device and dtype")
    device = tensors[0].device if out is None else out.device
    for i, t in enumerate(tensors):
        name = f"tensors[{i}]"
        checks.same_device("pack", device, name, t)
        checks.dtype("pack", name, t)
        checks.strided("pack", name, t, written=False)
    if dtype is not None:
        checks.dtype_arg("pack", dtype)
    total = sum(t.numel() for t in tensors)
    if out is not None:
        checks.flat("pack", "out", out, total)
        checks.same_device("pack", device, "out", out)
        if dtype is not None and dtype != out.dtype:
            raise ValueError(f"pack: dtype={dtype} but out is {out.dtype}")
    else:
        kinds = {t.dtype for t in tensors}
        if dtype is None and len(kinds) > 1:
            raise ValueError(f"pack: the tensors mix dtypes {sorted(map(str, kinds))}; pass "
                             f"dtype= to choose the buffer's")
        out = torch.empty(total, dtype=dtype or tensors[0].dtype, device=device)
    if total == 0:
        return out
    if implementation(device) == "triton":
        from spmd.kernels import packing_triton

        packing_triton.copy(tensors, out, scale, to_flat=True, accumulate=False)
    else:
        pack_reference(tensors, out, scale)
    return out


@torch.no_grad()
def unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor], *, scale: float = 1.0,
           accumulate: bool = False) -> None:
    """Copy a flat buffer back into ``tensors`` (the reverse of ``pack``), in place.

    Each tensor receives its slice of ``flat`` (same layout as ``pack(tensors)``),
    multiplied by ``scale`` and cast to the tensor's own dtype; with ``accumulate`` the
    slice is added to the tensor's values instead of replacing them (both in float32,
    rounded once). Targets may be strided but must not overlap themselves (an expanded
    view) or, elsewhere than at their own slice, ``flat``.

    Args:
        flat: 1-D contiguous buffer with at least the tensors' total number of elements.
        tensors: float32, bfloat16 or float16 tensors on ``flat``'s device.
        scale: multiplies every element of ``flat`` as it is read (e.g. ``1 / world_size``).
        accumulate: add into the tensors instead of overwriting them.

    Example::

        >>> grads = [torch.zeros(2, 3), torch.zeros(4)]
        >>> unpack(torch.arange(10.0), grads, scale=2.0)
        >>> grads[1]
        tensor([12., 14., 16., 18.])
    """
    tensors = checks.tensor_list("unpack", "tensors", tensors)
    scale = checks.scalar("unpack", "scale", scale)
    if not isinstance(accumulate, bool):
        raise TypeError(f"unpack: accumulate must be a bool, got {type(accumulate).__name__}")
    total = sum(t.numel() for t in tensors)
    checks.flat("unpack", "flat", flat, total)
    for i, t in enumerate(tensors):
        name = f"tensors[{i}]"
        checks.same_device("unpack", flat.device, name, t)
        checks.dtype("unpack", name, t)
        checks.strided("unpack", name, t, written=True)
    if total == 0:
        return
    if implementation(flat.device) == "triton":
        from spmd.kernels import packing_triton

        packing_triton.copy(tensors, flat, scale, to_flat=False, accumulate=accumulate)
    else:
        unpack_reference(flat, tensors, scale, accumulate)


def pack_reference(tensors: list[torch.Tensor], out: torch.Tensor, scale: float) -> None:
    """Plain torch ``pack``: what the CPU path runs and the tests compare against."""
    total = sum(t.numel() for t in tensors)
    pieces = [t.reshape(-1) for t in tensors]
    if scale == 1.0:
        torch.cat(pieces, out=out[:total])  # casts, rounding to nearest even
    elif out.dtype == torch.float32:
        torch.cat(pieces, out=out[:total]).mul_(scale)  # casting to float32 first is exact
    else:
        out[:total].copy_(torch.cat([p.float() for p in pieces]).mul_(scale))


def unpack_reference(flat: torch.Tensor, tensors: list[torch.Tensor], scale: float,
                     accumulate: bool) -> None:
    """Plain torch ``unpack``: what the CPU path runs and the tests compare against."""
    for t, start in zip(tensors, offsets([t.numel() for t in tensors])):
        if t.numel() == 0:
            continue
        piece = flat[start:start + t.numel()].view(t.shape)
        if scale != 1.0:
            piece = piece.float() * scale
        if not accumulate:
            t.copy_(piece)
        elif t.dtype == torch.float32:
            t.add_(piece)
        else:
            t.copy_(t.float() + piece.float())
