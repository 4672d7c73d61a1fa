"""Reducing received chunks: low precision on the wire, float32 in the sum.

A gradient all-reduce that sends bfloat16 or float8 loses accuracy where it adds, not
where it sends: summing ``p`` bfloat16 chunks in bfloat16 rounds ``p - 1`` times. So each
rank receives its segment of the bucket as ``p`` chunks in the wire dtype (what an
all-to-all delivers), and ``reduce_chunks`` sums them in float32 and rounds once, to the
output dtype. The sender's side is ``quantize_chunks``: a plain cast for float32, bfloat16
and float16, and for float8 a scale per chunk that maps the chunk's largest magnitude to
float8's largest value.

On CUDA ``reduce_chunks`` is one Triton launch (``spmd.kernels.reduce_triton``); on CPU,
and wherever ``SPMD_KERNELS=torch``, the torch reference below does the same arithmetic
(also for float8_e4m3fn chunks on GPUs older than sm_89, which Triton cannot load).

Numerics, on both paths: ``out[j] = cast(scale * ((c[0, j] * s[0] + c[1, j] * s[1]) + ...))``,
every operation in float32 (no fused multiply-add), chunks added in order ``0 .. p-1`` (so
the result does not depend on the implementation or the launch), ``scale`` itself rounded
to float32, one rounding to nearest even at the end. Without ``scales`` there is no
multiplication by them, so one chunk with ``scale=1`` is copied exactly (-0.0 included).
"""

from __future__ import annotations

from typing import Any

import torch

from spmd.kernels import checks
from spmd.kernels.dispatch import implementation
from spmd.kernels.layout import SUPPORTED_DTYPES
from spmd.runtime.compressed import FLOAT8_DTYPES

__all__ = ["WIRE_DTYPES", "FLOAT8_DTYPES", "reduce_chunks", "quantize_chunks",
           "reduce_chunks_reference"]

WIRE_DTYPES = SUPPORTED_DTYPES + FLOAT8_DTYPES
_WIRE_NAMES = ", ".join(str(d).removeprefix("torch.") for d in WIRE_DTYPES)


@torch.no_grad()
def reduce_chunks(chunks: torch.Tensor, out: torch.Tensor | None = None, *,
                  scales: torch.Tensor | None = None, scale: float = 1.0,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """Sum ``p`` received chunks element by element in float32, scale, and cast once.

    ``out[j] = cast(scale * sum_i(chunks[i, j].float() * scales[i]))``, summed in the order
    ``i = 0 .. p-1``; see the module docstring for the exact arithmetic.

    Args:
        chunks: contiguous ``(p, n)`` tensor, float32, bfloat16, float16, float8_e4m3fn or
            float8_e5m2: row ``i`` is the chunk received from rank ``i``.
        out: contiguous 1-D tensor of ``n`` elements (float32, bfloat16 or float16) on
            ``chunks``' device, written and returned. It may be a row of ``chunks`` of the
            same dtype (reducing in place into the receive buffer); no other overlap.
            New when None.
        scales: float32 tensor of shape ``(p,)`` on the same device: chunk ``i`` stands
            for ``chunks[i].float() * scales[i]`` (as ``quantize_chunks`` makes float8
            chunks). None: no per-chunk scale.
        scale: multiplies the sum (e.g. ``1 / p`` for a mean).
        dtype: the result's dtype when ``out`` is None (default float32); when given
            with ``out`` it must be ``out``'s.

    Returns:
        ``out``, or the new ``(n,)`` tensor.

    Raises:
        TypeError for a non-tensor or an unsupported dtype (of ``chunks``, ``scales``,
        ``out`` or ``dtype``); ValueError for a wrong shape, a non-contiguous tensor,
        another device, ``out`` of the wrong size or overlapping ``chunks``, or ``dtype``
        disagreeing with ``out``.

    Example::

        >>> x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 7.0]])
        >>> reduce_chunks(x.to(torch.bfloat16), scale=1 / 3, dtype=torch.bfloat16)
        tensor([3.0000, 4.3438], dtype=torch.bfloat16)
        >>> q, s = quantize_chunks(x, torch.float8_e4m3fn)
        >>> reduce_chunks(q, scales=s)  # 9 and 13 exactly, but float8 keeps 3 bits: 3 -> 2.86
        tensor([ 8.8571, 13.0000])
    """
    fn = "reduce_chunks"
    _tensor(fn, "chunks", chunks)
    if chunks.dtype not in WIRE_DTYPES:
        raise TypeError(f"{fn}: chunks is {chunks.dtype}; the wire dtypes are {_WIRE_NAMES}")
    if chunks.dim() != 2:
        raise ValueError(f"{fn}: chunks must be 2-D (p chunks, n elements), got shape "
                         f"{tuple(chunks.shape)}")
    if not chunks.is_contiguous():
        raise ValueError(f"{fn}: chunks (shape {tuple(chunks.shape)}, stride "
                         f"{chunks.stride()}) is not contiguous")
    p, n = chunks.shape
    device = chunks.device
    scale = checks.scalar(fn, "scale", scale)
    if scales is not None:
        _tensor(fn, "scales", scales)
        if scales.dtype != torch.float32:
            raise TypeError(f"{fn}: scales is {scales.dtype}, expected torch.float32")
        if scales.shape != (p,):
            raise ValueError(f"{fn}: scales has shape {tuple(scales.shape)}, expected ({p},): "
                             f"one per chunk")
        checks.same_device(fn, device, "scales", scales)
        if not scales.is_contiguous():
            raise ValueError(f"{fn}: scales (stride {scales.stride()}) is not contiguous")
    if dtype is not None:
        checks.dtype_arg(fn, dtype)
    if out is None:
        out = torch.empty(n, dtype=dtype or torch.float32, device=device)
    else:
        _tensor(fn, "out", out)
        checks.dtype(fn, "out", out)
        if dtype is not None and dtype != out.dtype:
            raise ValueError(f"{fn}: dtype={dtype} but out is {out.dtype}")
        if out.shape != (n,) or not out.is_contiguous():
            raise ValueError(f"{fn}: out must be a contiguous 1-D tensor of the chunks' {n} "
                             f"elements, got shape {tuple(out.shape)} with stride "
                             f"{out.stride()}")
        checks.same_device(fn, device, "out", out)
        _check_overlap(fn, chunks, out)
    if n == 0:
        return out
    if p == 0:
        return out.zero_()  # an empty sum
    if implementation(device) == "triton" and _triton_reads(chunks.dtype, device):
        from spmd.kernels import reduce_triton

        reduce_triton.reduce(chunks, scales, scale, out)
    else:
        reduce_chunks_reference(chunks, scales, scale, out)
    return out


def reduce_chunks_reference(chunks: torch.Tensor, scales: torch.Tensor | None, scale: float,
                            out: torch.Tensor) -> None:
    """Plain torch ``reduce_chunks``: what the CPU path runs and the tests compare against.
    Arguments are already checked. Row by row, a multiply then an add (no fused
    multiply-add), in the kernel's order."""
    acc = None
    for i in range(chunks.shape[0]):
        term = chunks[i].float()
        if scales is not None:
            term = term * scales[i]  # a 0-d float32 tensor: a float32 multiply
        acc = term.clone() if acc is None else acc.add_(term)  # a copy: out may be a row
    acc *= float(torch.tensor(scale, dtype=torch.float32))  # rounded to float32 first
    out.copy_(acc)  # rounds to nearest even


@torch.no_grad()
def quantize_chunks(x: torch.Tensor, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What a sender puts on the wire for ``reduce_chunks``: ``x`` cast to ``dtype``, with
    a float32 scale per row for the float8 dtypes.

    For float8, row ``i`` gets ``scales[i] = amax(|x[i]|) / finfo(dtype).max`` (1 for a
    row of zeros; at least float32's smallest normal, so tiny rows do not divide by zero)
    and is sent as ``(x[i] / scales[i])`` clamped to ``±finfo(dtype).max`` (so rounding
    cannot overflow) and rounded to nearest even; ``q[i].float() * scales[i]`` is then
    within 2**-4 (e4m3; 2**-3 for e5m2) of ``x[i]`` relatively, for elements not too far
    below the row's largest. A row holding inf or NaN reduces to NaN everywhere (its scale is
    inf or NaN), as a gradient overflow should. For float32, bfloat16
    and float16 it is a plain cast and ``scales`` is None.

    Args:
        x: float32, bfloat16 or float16, ``(p, n)`` (a scale per row) or ``(n,)`` (one
            chunk: ``q`` is ``(n,)`` and ``scales`` ``(1,)``).
        dtype: float32, bfloat16, float16, float8_e4m3fn or float8_e5m2.

    Returns:
        ``(q, scales)``: ``q`` of ``x``'s shape in ``dtype``, ``scales`` float32 of shape
        ``(p,)`` (or ``(1,)``), or None when ``dtype`` is not a float8 dtype.

    Example::

        >>> q, s = quantize_chunks(torch.tensor([[0.5, -1.0], [0.0, 0.0]]),
        ...                        torch.float8_e4m3fn)
        >>> q.float(), s
        (tensor([[ 224., -448.],
                [   0.,    0.]]), tensor([0.0022, 1.0000]))
    """
    fn = "quantize_chunks"
    _tensor(fn, "x", x)
    checks.dtype(fn, "x", x)
    if x.dim() not in (1, 2):
        raise ValueError(f"{fn}: x must be 1-D (one chunk) or 2-D (p chunks), got shape "
                         f"{tuple(x.shape)}")
    if dtype not in WIRE_DTYPES:
        raise TypeError(f"{fn}: dtype={dtype} is not a wire dtype; they are {_WIRE_NAMES}")
    if dtype not in FLOAT8_DTYPES:
        return x.to(dtype), None
    from spmd.runtime.compressed import quantize_rows  # the one quantiser: runtime's

    q, scales = quantize_rows(x.reshape(1, -1) if x.dim() == 1 else x, dtype)
    return q.view(x.shape), scales


def _triton_reads(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the Triton kernel can load ``dtype`` there: Triton 3.9 compiles
    float8_e4m3fn only for sm_89 and later (an A100 takes the torch path for it)."""
    return not (dtype == torch.float8_e4m3fn and device.type == "cuda"
                and torch.cuda.get_device_capability(device) < (8, 9))


def _tensor(fn: str, name: str, value: Any) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a tensor, got {type(value).__name__}")


def _check_overlap(fn: str, chunks: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` may be exactly a row of ``chunks`` (each element of it is read, in every
    chunk, by the program that writes it, before it writes it), or apart from it."""
    start, itemsize = chunks.data_ptr(), chunks.element_size()
    end = start + chunks.numel() * itemsize
    o_start = out.data_ptr()
    if out.numel() == 0 or o_start + out.numel() * out.element_size() <= start or end <= o_start:
        return
    row_bytes = chunks.shape[1] * itemsize
    if out.dtype == chunks.dtype and (o_start - start) % row_bytes == 0:
        return
    raise ValueError(f"{fn}: out overlaps chunks without being one of its rows (of the "
                     f"same dtype); reduce into a separate buffer")
