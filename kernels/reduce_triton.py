"""The Triton kernel behind ``reduce_chunks``: ``p`` received chunks summed in float32 and
written once, in one launch.

A 1-D grid over blocks of the ``n`` output elements; each program walks the ``p >= 1``
chunks in order (``chunks + i * n`` for chunk ``i``), converts each to float32, multiplies
by the chunk's scale, adds it to a float32 accumulator held in registers, and stores
``accumulator * scale`` once in the output dtype. Imported only when a Triton kernel is
launched (``spmd.kernels.dispatch``); the torch reference is in ``spmd.kernels.reduce``.

Bytes moved: ``p * n * itemsize(chunks) + n * itemsize(out)`` (plus ``4 * p`` for the
scales, once per program, from cache). When ``n * itemsize(chunks)`` is a multiple of 16 the
JIT learns that every chunk starts 16-byte aligned and loads 16 bytes at a time; other
sizes still work, with narrower loads.

float8 chunks are converted by Triton's own ``.to(tl.float32)`` (one ``cvt`` per two
elements on sm_89 and later). Triton 3.9's interpreter decodes float8's NaN (and
float8_e5m2's infinities) as large finite numbers; finite values exactly. The compiled
kernel is right for every bit pattern (``tests/gpu/test_kernels_gpu.py`` checks all 256).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spmd.kernels.dispatch import launchable, on_device
from spmd.kernels.packing_triton import cast

# Output elements per program: Triton's vector-add tutorial's 1024, which at four warps is
# 8 elements per thread and chunk: 16-byte loads of bfloat16, 8-byte ones of float8 (PTX
# for sm_90, 2026-11). Not yet tuned on a GPU; 2048 for float8 is the first thing to try.
MAX_BLOCK = 1024
MIN_BLOCK = 16


@triton.jit
def reduce_kernel(chunks, scales, out, p, n, scale,
                  HAS_SCALES: tl.constexpr, BLOCK: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # p * n may pass 2**31
    mask = idx < n
    at = chunks + idx
    # The first chunk starts the sum (not 0 + it: one chunk is then copied exactly, -0.0
    # included), the others are added in order, so the sum does not depend on the launch.
    acc = tl.load(at, mask=mask).to(tl.float32)
    if HAS_SCALES:
        acc = acc * tl.load(scales)
    for i in range(1, p):
        at += n
        x = tl.load(at, mask=mask).to(tl.float32)
        if HAS_SCALES:
            x = x * tl.load(scales + i)
        acc += x
    tl.store(out + idx, cast(acc * scale, out.dtype.element_ty), mask=mask)


def reduce(chunks: torch.Tensor, scales: torch.Tensor | None, scale: float,
           out: torch.Tensor) -> None:
    """Launch ``reduce_kernel`` once over ``out``. Arguments are already checked."""
    p, n = chunks.shape
    block = max(MIN_BLOCK, min(MAX_BLOCK, triton.next_power_of_2(n)))
    kernel = launchable(reduce_kernel, out.device)
    with on_device(out.device):
        kernel[(triton.cdiv(n, block),)](
            chunks, scales if scales is not None else chunks, out, p, n, scale,
            HAS_SCALES=scales is not None, BLOCK=block, enable_fp_fusion=False)
