"""The multi-tensor launch layout: one launch over thousands of tensors of mixed sizes.

A launch gets two small int64 tables instead of one argument per tensor:

- ``rows``: one row per tensor, ``width`` int64 each. The first three columns are the same
  for every kernel (address of the tensor's first element, its element count, its offset in
  the flat buffer); kernels append what else they need (the addresses of optimizer state,
  the sizes and strides of a strided tensor).
- ``chunks``: one ``(row, first element)`` pair per program. Every tensor is cut into
  chunks of ``chunk`` elements, so a 100M-element weight spreads over many programs and a
  1-element bias takes one; each program walks its chunk ``block`` elements at a time.
  On the flat buffer's grid (``on_flat_grid``, for packing tensors at unaligned offsets)
  the chunks are instead the multiples of ``chunk`` of the flat buffer that a tensor's
  slice touches: the first may start before the tensor (a negative first element) and
  the last run past its end, and the kernel masks what is not the tensor's. Every
  whole chunk then stores whole, aligned blocks of the flat buffer, whatever the
  tensor's offset.

The flat buffer has no padding: tensor ``i`` occupies ``[offset_i, offset_i + numel_i)``
with ``offset_i`` the sum of the element counts before it, in logical (row-major) order.

Tables live on the device and are cached by their content (addresses, sizes, offsets), so
a training loop that packs the same gradients every step builds and copies them once. A
cache hit is always right: the table depends on nothing but its key. Building that key
still costs a row per tensor on every launch (~0.65 µs a tensor here, 35 ms for 10,000
tensors); a caller that launches over the same bucket every step keeps a
:class:`BucketTables` instead, whose key is the tensors' addresses alone.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SUPPORTED_DTYPES", "MAX_DIMS", "Launch", "BucketTables", "offsets", "collapse",
           "overlaps_itself", "aligned", "launch_layout"]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Dimensions a strided tensor may keep after merging; 4 covers conv weights and any
# transpose of them. More raises (a call to .contiguous() first fixes it).
MAX_DIMS = 4
# Elements per program step, and steps per chunk. Chosen like Triton's vector-add tutorial
# (1024-wide blocks); not yet tuned on a GPU.
MAX_BLOCK = 1024
MAX_STEPS = 4
MIN_BLOCK = 16


@dataclass(frozen=True, kw_only=True, slots=True)
class Launch:
    """Everything a multi-tensor kernel launch needs besides its scalar arguments."""

    rows: torch.Tensor    # int64 [n_tensors, width], on the device
    chunks: torch.Tensor  # int64 [grid, 2]: (row, first element), on the device
    width: int            # int64 columns per row
    grid: int             # programs to launch; 0 when every tensor is empty
    block: int            # elements a program handles per step (a power of two)
    chunk: int            # elements per program (a multiple of block)


class BucketTables:
    """The launch plan of one bucket, kept by the caller that launches over it every step
    (a planned graph's gradient bucket): reused while the tensors' addresses are those it
    was built for, rebuilt when one moved. A step's host work is then one ``data_ptr()``
    per tensor (~50 ns here) instead of a table row and a lookup hashing every row
    (~0.65 µs a tensor): launch cost all but flat in the number of tensors.

    The addresses are the whole key, so only a caller whose tensors keep their shapes,
    strides and dtypes from call to call may keep one (a graph planned for fixed shapes);
    anything else calls the kernels without it.

    Example::

        >>> tables = BucketTables()
        >>> tables.get([64, 128], lambda: "plan for 64, 128")
        'plan for 64, 128'
        >>> tables.get([64, 128], lambda: "rebuilt"), tables.builds  # same addresses: kept
        ('plan for 64, 128', 1)
    """

    __slots__ = ("addresses", "plan", "builds")

    def __init__(self) -> None:
        self.addresses: list[int] | None = None
        self.plan: Any = None
        self.builds = 0  # how many times the plan was (re)built: for tests and profiles

    def get(self, addresses: list[int], build: Callable[[], Any]) -> Any:
        """The plan for ``addresses``: the kept one when they are unchanged, else
        ``build()``'s, kept in its place."""
        if addresses != self.addresses:
            self.plan = build()
            self.addresses = addresses
            self.builds += 1
        return self.plan


def offsets(numels: Sequence[int]) -> list[int]:
    """Where each tensor starts in the flat buffer: ``offsets([3, 0, 2]) == [0, 3, 3]``."""
    out, total = [], 0
    for n in numels:
        out.append(total)
        total += n
    return out


def collapse(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Sizes and strides of ``t`` with size-1 dimensions dropped and dimensions that walk
    memory as one merged, keeping logical (row-major) order. A contiguous tensor collapses
    to ``((numel,), (1,))``; ``x.t()`` of a contiguous matrix keeps two dimensions."""
    sizes: list[int] = []
    strides: list[int] = []
    for size, stride in zip(t.shape, t.stride()):
        if size == 1:
            continue
        if sizes and strides[-1] == stride * size:
            sizes[-1] *= size
            strides[-1] = stride
        else:
            sizes.append(size)
            strides.append(stride)
    return tuple(sizes), tuple(strides)


def overlaps_itself(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    """True when two elements may share memory (an expanded view): writing such a tensor
    element by element is ill-defined. Conservative, like torch's own check."""
    dims = sorted((abs(st), sz) for sz, st in zip(sizes, strides) if sz > 1)
    reach = 0  # one past the furthest element reachable with the smaller strides
    for stride, size in dims:
        if stride < max(reach, 1):
            return True
        reach = stride * (size - 1) + max(reach, 1)
    return False


def aligned(addresses: Sequence[int], numel: int, offset: int) -> bool:
    """Whether a row may take the kernels' aligned path: every address 16-byte aligned and
    the element count and flat offset multiples of 8, so that with a 16-byte aligned flat
    buffer every 8-element group (16 bytes of bf16, 32 of fp32) is aligned on both sides."""
    return numel % 8 == 0 and offset % 8 == 0 and all(a % 16 == 0 for a in addresses)


def launch_layout(rows: Sequence[Sequence[int]], device: torch.device,
                  on_flat_grid: bool = False) -> Launch:
    """The device tables for ``rows`` (column 1 of each row is its tensor's element count,
    column 2 its offset in the flat buffer), cached by content; ``on_flat_grid``: chunks
    on the flat buffer's multiples of ``chunk`` (see the module docstring). Example::

        >>> a, b = torch.ones(5000), torch.ones(3)
        >>> launch = launch_layout([(a.data_ptr(), 5000, 0), (b.data_ptr(), 3, 5000)], a.device)
        >>> launch.block, launch.chunk, launch.grid
        (1024, 4096, 3)
    """
    return _cached(tuple(map(tuple, rows)), torch.device(device), on_flat_grid)


@functools.lru_cache(maxsize=256)
def _cached(rows: tuple[tuple[int, ...], ...], device: torch.device,
            on_flat_grid: bool) -> Launch:
    width = len(rows[0]) if rows else 3
    numels = torch.tensor([row[1] for row in rows], dtype=torch.int64)
    biggest = int(numels.max()) if rows else 0
    block = min(MAX_BLOCK, max(MIN_BLOCK, 1 << max(0, biggest - 1).bit_length()))
    chunk = block * max(1, min(MAX_STEPS, math.ceil(biggest / block)))
    if on_flat_grid:  # the flat buffer's chunks [lo, hi) that the slice touches
        offsets = torch.tensor([row[2] for row in rows], dtype=torch.int64)
        lo = offsets // chunk
        counts = torch.where(numels > 0, (offsets + numels + chunk - 1) // chunk - lo, 0)
    else:
        counts = (numels + chunk - 1) // chunk
    row_of = torch.repeat_interleave(torch.arange(len(rows)), counts)
    first_chunk = torch.cumsum(counts, 0) - counts
    start = (torch.arange(len(row_of)) - first_chunk[row_of]) * chunk
    if on_flat_grid:
        start += lo[row_of] * chunk - offsets[row_of]
    chunks = torch.stack([row_of, start], 1)
    table = torch.cat([torch.tensor(rows, dtype=torch.int64).reshape(-1), chunks.reshape(-1)])
    table = table.to(device)  # one host-to-device copy for both tables
    n = len(rows) * width
    return Launch(rows=table[:n], chunks=table[n:], width=width, grid=len(row_of), block=block,
                  chunk=chunk)
