"""The Triton kernel behind ``pack`` and ``unpack``: many tensors to or from one flat buffer
in one launch, scaled and cast on the way.

Tensors reach the kernel through the pointer table of ``spmd.kernels.layout``; each program
copies one chunk of one tensor. The flat side is always contiguous; the tensor side is
either contiguous (the fast path) or walked through up to four merged dimensions
(``STRIDED``), so transposed or sliced gradients need no staging copy.

Where a tensor and its slice of the bucket are both 16-byte aligned (``ALIGNED``), loads
and stores move 16 bytes at a time. Where they are not, an unpack's stores still start at
the tensor's aligned first element, but a pack's would straddle every 16-byte boundary of
the bucket. On an H200 such a pack reached 68% of a copy's bandwidth, against 93% for
the unaligned unpack (BENCHMARKS.md), and the stores are the likely difference. So a
pack of such tensors is chunked on the bucket's own grid (``FLAT_GRID``): each chunk is
an aligned stretch of the flat buffer, stored whole, 16 bytes at a time, with only the
tensor's first and last chunk masked; the tensor side is read an element at a time.

Imported only when a Triton kernel is launched (``spmd.kernels.dispatch``); the torch
reference is in ``spmd.kernels.packing`` and the benchmark in ``benchmarks/kernels.py``.

Bytes moved: ``numel * (itemsize(tensor) + itemsize(flat))``, plus ``numel *
itemsize(tensor)`` more when unpacking with ``accumulate``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spmd.kernels.dispatch import launchable, on_device
from spmd.kernels.layout import (MAX_DIMS, BucketTables, aligned, collapse, launch_layout,
                                 offsets)

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def cast(x, DTYPE: tl.constexpr):
    """float32 ``x`` rounded to ``DTYPE``, to nearest even. bfloat16 is rounded by hand,
    as torch does it, because Triton 3.9's interpreter truncates (and its "rtne" mode
    rounds ties away from zero); on a GPU the few integer operations cost nothing next to
    the memory traffic, and the CPU tests then check the very code the GPU runs."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        bits = tl.where(x != x, 0x7FC0, bits)  # NaN stays NaN, as in torch
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


@triton.jit
def chunk_of(rows, chunks, WIDTH: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """This program's chunk, as every multi-tensor kernel starts: a pointer to its tensor's
    row of the table, its first element, and the tensor's element count and flat offset."""
    pid = tl.program_id(0)
    row = rows + tl.load(chunks + 2 * pid) * WIDTH
    first = tl.load(chunks + 2 * pid + 1)
    numel = tl.load(row + 1)
    offset = tl.load(row + 2)
    if ALIGNED:  # checked on the host; lets the compiler use 16-byte loads and stores
        numel = tl.multiple_of(numel, 8)
        offset = tl.multiple_of(offset, 8)
        first = tl.multiple_of(first, BLOCK)
    return row, first, numel, offset


@triton.jit
def where_of(row, idx, STRIDED: tl.constexpr):
    """Element offsets in memory of logical elements ``idx`` of the row's tensor."""
    if STRIDED:
        # row[3:6]: sizes of merged dims 1..3; row[6:10]: strides of dims 0..3
        # (padded at the front with size 1, stride 0).
        rest = idx
        where = (rest % tl.load(row + 5)) * tl.load(row + 9)
        rest = rest // tl.load(row + 5)
        where += (rest % tl.load(row + 4)) * tl.load(row + 8)
        rest = rest // tl.load(row + 4)
        where += (rest % tl.load(row + 3)) * tl.load(row + 7)
        where += (rest // tl.load(row + 3)) * tl.load(row + 6)
        return where
    else:
        return idx


@triton.jit
def move(tensor, where, flat, at, mask, scale, DTYPE: tl.constexpr, TO_FLAT: tl.constexpr,
         ACCUMULATE: tl.constexpr):
    """One block: ``tensor + where`` to ``flat + at`` (or back), scaled and cast."""
    if TO_FLAT:
        x = tl.load(tensor + where, mask=mask).to(tl.float32) * scale
        tl.store(flat + at, cast(x, flat.dtype.element_ty), mask=mask)
    else:
        x = tl.load(flat + at, mask=mask).to(tl.float32) * scale
        if ACCUMULATE:
            x = tl.load(tensor + where, mask=mask).to(tl.float32) + x
        tl.store(tensor + where, cast(x, DTYPE), mask=mask)


@triton.jit
def copy_kernel(rows, chunks, flat, scale,
                WIDTH: tl.constexpr, DTYPE: tl.constexpr, STRIDED: tl.constexpr,
                ALIGNED: tl.constexpr, FLAT_GRID: tl.constexpr, TO_FLAT: tl.constexpr,
                ACCUMULATE: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    # Which tensor (a row of the table) and which of its chunks this program copies.
    row, first, numel, offset = chunk_of(rows, chunks, WIDTH, ALIGNED, BLOCK)
    tensor = tl.load(row).to(tl.pointer_type(DTYPE))
    if ALIGNED:
        tensor = tl.multiple_of(tensor, 16)
    if FLAT_GRID:
        # The chunk is the flat buffer's [base, base + CHUNK), base a multiple of CHUNK
        # (``launch_layout(on_flat_grid=True)``): a whole chunk stores aligned blocks with
        # no mask, so 16 bytes at a time; the tensor's first and last chunk are masked.
        base = tl.multiple_of(offset + first, BLOCK)
        whole = (first >= 0) & (first + CHUNK <= numel)
        for step in range(0, CHUNK, BLOCK):
            idx = first + step + tl.arange(0, BLOCK)  # logical index within the tensor
            at = base + step + tl.arange(0, BLOCK)
            if whole:
                move(tensor, where_of(row, idx, STRIDED), flat, at, None, scale, DTYPE,
                     TO_FLAT, ACCUMULATE)
            else:
                move(tensor, where_of(row, idx, STRIDED), flat, at, (idx >= 0) & (idx < numel),
                     scale, DTYPE, TO_FLAT, ACCUMULATE)
    else:
        for step in range(0, CHUNK, BLOCK):
            idx = first + step + tl.arange(0, BLOCK)  # logical index within the tensor
            move(tensor, where_of(row, idx, STRIDED), flat + offset, idx, idx < numel, scale,
                 DTYPE, TO_FLAT, ACCUMULATE)


def plan(tensors: list[torch.Tensor], flat: torch.Tensor, to_flat: bool) -> tuple[tuple, ...]:
    """The launches that copy ``tensors`` to (``to_flat``) or from ``flat``: one ``(Launch,
    dtype, strided, aligned, flat grid)`` per group of tensors that share a dtype and a way
    of being walked (strided, aligned or neither), its device tables cached by content.
    Packing a group that is not aligned lays its chunks on the flat buffer's grid, so that
    the stores, at least, are whole and aligned."""
    groups: dict[tuple[torch.dtype, bool, bool], list[list[int]]] = {}
    flat_aligned = flat.data_ptr() % 16 == 0
    for t, start in zip(tensors, offsets([t.numel() for t in tensors])):
        if t.numel() == 0:
            continue
        row = [t.data_ptr(), t.numel(), start]
        is_strided = not t.is_contiguous()  # contiguous is what collapses to one stride-1 dim
        if is_strided:
            sizes, strides = collapse(t)
            pad = MAX_DIMS - len(sizes)
            row += [*((1,) * pad + sizes)[1:], *((0,) * pad + strides)]
        is_aligned = flat_aligned and not is_strided and aligned(row[:1], row[1], row[2])
        groups.setdefault((t.dtype, is_strided, is_aligned), []).append(row)
    launches = []
    for (dtype, is_strided, is_aligned), rows in groups.items():
        flat_grid = to_flat and not is_aligned
        launches.append((launch_layout(rows, flat.device, flat_grid), dtype, is_strided,
                         is_aligned, flat_grid))
    return tuple(launches)


def host_plan(tensors: list[torch.Tensor], flat: torch.Tensor, to_flat: bool = True,
              tables: BucketTables | None = None) -> tuple[tuple, ...]:
    """A launch's host work before the kernels start: :func:`plan`, or with the bucket's
    ``tables`` its kept plan when no address moved (``benchmarks/kernels.py --host`` times
    both)."""
    if tables is None:
        return plan(tensors, flat, to_flat)
    addresses = [t.data_ptr() for t in tensors]
    addresses.append(flat.data_ptr())
    addresses.append(-1 if to_flat else -2)  # the direction is part of the plan
    return tables.get(addresses, lambda: plan(tensors, flat, to_flat))


def copy(tensors: list[torch.Tensor], flat: torch.Tensor, scale: float, *, to_flat: bool,
         accumulate: bool, tables: BucketTables | None = None) -> None:
    """Launch ``copy_kernel`` once per group of ``tensors`` (see :func:`plan`): pack when
    ``to_flat``, unpack otherwise. Arguments are already checked. ``tables``: the bucket's
    kept plan, for a caller whose tensors keep their shapes, strides and dtypes from call
    to call (then only their addresses are looked at)."""
    kernel = launchable(copy_kernel, flat.device)
    with on_device(flat.device):
        for launch, dtype, is_strided, is_aligned, flat_grid in host_plan(tensors, flat, to_flat,
                                                                          tables):
            kernel[(launch.grid,)](
                launch.rows, launch.chunks, flat, scale,
                WIDTH=launch.width, DTYPE=TL_DTYPES[dtype], STRIDED=is_strided,
                ALIGNED=is_aligned, FLAT_GRID=flat_grid, TO_FLAT=to_flat, ACCUMULATE=accumulate,
                CHUNK=launch.chunk, BLOCK=launch.block, enable_fp_fusion=False)
