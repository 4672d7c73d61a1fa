"""An all-reduce that sends a low-precision dtype but adds in float32.

A backend's all-reduce adds in the dtype it is given: sent in bfloat16, a ring or tree
all-reduce rounds every partial sum to bfloat16, ``p - 1`` roundings on ``p`` ranks, so
the error grows with the number of ranks (torch's ``bf16_compress_hook`` does exactly
that). Here the backend only moves bytes:

1. each rank cuts its tensor into ``p`` chunks, converts them to the wire dtype (float8
   with a scale per chunk, so each fits the format's range) and sends chunk ``j`` to rank
   ``j`` (one all-to-all: every rank receives the ``p`` pieces of its own chunk);
2. each rank adds the pieces it received in float32, scaled once (by ``1/p`` for an
   average), and rounds the result to the wire dtype once;
3. the reduced chunks are all-gathered (in the wire dtype) and converted back.

Bytes sent per rank are those of a ring all-reduce in the wire dtype (``2 (p-1)/p`` of
the tensor), and the result is the float32 sum rounded once to the wire dtype, at any
number of ranks. The float32 addition is ``combine``: plain torch here, the Triton
``spmd.kernels.reduce_chunks`` where the compiler calls it.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from spmd.runtime import checks
from spmd.runtime.collectives import all_gather_into_tensor, all_to_all_single
from spmd.runtime.groups import resolve_group
from spmd.runtime.reduction import ReduceOp

__all__ = ["all_reduce_compressed", "WIRE_DTYPES", "FLOAT8_DTYPES", "quantize_rows",
           "dequantize_rows", "combine_rows"]

FLOAT8_DTYPES = tuple(d for d in (getattr(torch, "float8_e4m3fn", None),
                                  getattr(torch, "float8_e5m2", None)) if d is not None)
WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, *FLOAT8_DTYPES)

Combine = Callable[[torch.Tensor, "torch.Tensor | None", float], torch.Tensor]


def quantize_rows(rows: torch.Tensor, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``rows`` (``(p, m)``) in ``dtype``, with a float32 scale per row for float8
    (``row / scale`` fits the format: ``scale = max |row| / finfo.max``, 1 for a row of
    zeros, at least float32's smallest normal so a tiny row does not divide by zero;
    values clamped so rounding cannot overflow; a row holding inf or NaN gets a non-finite
    scale, so it reduces to NaN, as an overflowed gradient should); None for the other
    dtypes."""
    if dtype not in FLOAT8_DTYPES:
        return rows.to(dtype), None
    top = torch.finfo(dtype).max
    amax = (rows.abs().amax(dim=1).float() if rows.shape[1]
            else rows.new_zeros(rows.shape[0], dtype=torch.float32))
    scales = torch.where(amax == 0, 1.0,
                         (amax / top).clamp_min(torch.finfo(torch.float32).tiny))
    q = (rows.float() / scales[:, None]).clamp_(-top, top).to(dtype)
    return q, scales


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """float32 values of quantized rows (``scales``: one per row, or None)."""
    out = q.float()
    return out if scales is None else out.mul_(scales[:, None])


def combine_rows(chunks: torch.Tensor, scales: torch.Tensor | None, scale: float
                 ) -> torch.Tensor:
    """The float32 sum of ``chunks`` (``(p, m)``, each row times its scale) times
    ``scale``, added row by row in order."""
    total = torch.zeros(chunks.shape[1], dtype=torch.float32, device=chunks.device)
    for i in range(chunks.shape[0]):
        row = chunks[i].float()
        total.add_(row if scales is None else row * scales[i])
    return total.mul_(scale) if scale != 1.0 else total


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory as bytes (the backend moves them whatever the dtype)."""
    return t.contiguous().view(torch.uint8)


class CompressedWork:
    """A compressed all-reduce in flight: the all-to-all is running; ``wait()`` adds what
    arrived and all-gathers the result (so the second half runs where it is waited
    on, in the same order on every rank)."""

    def __init__(self, first: Any, finish: Callable[[], None]) -> None:
        self._first, self._finish, self._done = first, finish, False

    def wait(self, timeout: Any = None) -> bool:
        if not self._done:
            self._first.wait(timeout)
            self._finish()
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done

    def exception(self) -> None:
        return None

    def get_future(self) -> Any:
        raise RuntimeError("all_reduce_compressed: its work has no future (the second half "
                           "runs in wait())")

    def __repr__(self) -> str:
        return f"CompressedWork({'done' if self._done else 'pending'})"


def all_reduce_compressed(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
                          group: Any = None, async_op: bool = False, *,
                          wire_dtype: torch.dtype = torch.bfloat16,
                          combine: Combine | None = None) -> CompressedWork | None:
    """All-reduce a floating ``tensor`` in place, sent as ``wire_dtype`` and added in
    float32 (see the module doc): the result is the float32 sum (``ReduceOp.SUM``) or
    average (``ReduceOp.AVG``) rounded once to ``wire_dtype``, whatever the number of
    ranks.

    Args:
        tensor: the tensor to reduce (floating; any shape; written in place).
        op: ``ReduceOp.SUM`` or ``ReduceOp.AVG``.
        group: the process group (default: the world).
        async_op: return a work whose ``wait()`` completes it.
        wire_dtype: float32, bfloat16, float16, float8_e4m3fn or float8_e5m2 (float8
            with a scale per chunk).
        combine: ``combine(chunks, scales, scale) -> float32`` adds the received chunks
            (default: torch, row by row); the compiler passes its Triton kernel.

    Example::

        grad = torch.randn(1 << 20)
        all_reduce_compressed(grad, ReduceOp.AVG, wire_dtype=torch.bfloat16)
    """
    name = "all_reduce_compressed"
    pg = resolve_group(group, name)
    checks.tensor(tensor, name, pg)
    if not tensor.is_floating_point():
        raise TypeError(f"{name}: tensor must be floating (it is added in float32), got "
                        f"{tensor.dtype}")
    if wire_dtype not in WIRE_DTYPES:
        raise ValueError(f"{name}: wire_dtype must be one of "
                         f"{', '.join(str(d) for d in WIRE_DTYPES)}, got {wire_dtype}")
    rop = ReduceOp.of(op)
    if rop not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"{name}: op must be ReduceOp.SUM or ReduceOp.AVG, got {rop.name}")
    combine = combine or combine_rows
    p, n = pg.size(), tensor.numel()
    m = max(1, math.ceil(n / p))
    if wire_dtype in FLOAT8_DTYPES:  # a scale per chunk: from the float32 values
        flat = torch.zeros(p * m, dtype=torch.float32, device=tensor.device)
        flat[:n] = tensor.reshape(-1)
        q, scales = quantize_rows(flat.view(p, m), wire_dtype)
    else:  # a plain cast: into the send buffer in the same pass as the copy
        q, scales = torch.empty((p, m), dtype=wire_dtype, device=tensor.device), None
        q.view(-1)[:n].view(tensor.shape).copy_(tensor)
        q.view(-1)[n:].zero_()
    recv_scales = None
    if scales is not None:  # the scale of every piece this rank receives
        recv_scales = torch.empty_like(scales)
        all_to_all_single(recv_scales, scales, group=pg)
    recv = torch.empty_like(q)
    first = all_to_all_single(_bytes(recv).view(p, -1), _bytes(q).view(p, -1), group=pg,
                              async_op=True)
    scale = 1.0 / p if rop is ReduceOp.AVG else 1.0

    def finish() -> None:
        reduced = combine(recv, recv_scales, scale).view(1, m)
        mine, mine_scale = quantize_rows(reduced, wire_dtype)
        gathered = torch.empty((p, m), dtype=wire_dtype, device=tensor.device)
        all_gather_into_tensor(_bytes(gathered).view(-1), _bytes(mine).view(-1), group=pg)
        if mine_scale is None:  # cast back in the same pass as the copy into the result
            tensor.copy_(gathered.view(-1)[:n].view(tensor.shape))
            return
        every_scale = torch.empty(p, dtype=torch.float32, device=tensor.device)
        all_gather_into_tensor(every_scale, mine_scale, group=pg)
        whole = dequantize_rows(gathered, every_scale).view(-1)[:n]
        tensor.copy_(whole.view(tensor.shape))

    work = CompressedWork(first, finish)
    if async_op:
        return work
    work.wait()
    return None
