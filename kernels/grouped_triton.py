"""The Triton kernels behind ``grouped_mm`` and ``grouped_mm_weight``: a mixture of experts'
products, one matrix per expert, over rows laid out expert by expert, in one launch each.

``grouped_mm(x, weight, offs)``: ``x`` ``(R, K)`` holds expert ``e``'s rows at
``offs[e - 1]:offs[e]`` (``offs`` the cumulative row counts, ``offs[-1] <= R``; the rows
after it are padding), ``weight`` ``(E, K, N)`` in any strides, an optional ``bias`` ``(E, N)``. Each program computes a
``BLOCK_M x BLOCK_N`` tile of one expert's rows: the grid is an upper bound on the tiles
(``cdiv(R, BLOCK_M) + E + 1``: each expert's last tile may be partial, and the padding is
one more group), and each program finds its expert by walking the offsets, on the GPU:
nothing reads the offsets on the host. Programs of the padding group store zeros; those
past the last tile store nothing. Accumulation in float32, one store per tile.

``grouped_mm_weight(a, b, offs)``: ``a`` ``(K, R)``, ``b`` ``(R, N)``; expert ``e``'s
``a[:, rows_e] @ b[rows_e, :]`` ``(K, N)`` (the weight gradient), times ``scale``: a
``(E, cdiv(K, BLOCK_K), cdiv(N, BLOCK_N))`` grid, each program looping over its expert's
rows (none: zeros).

float32 runs ``tl.dot`` at IEEE precision (what ``torch.mm`` gives by default, not TF32);
bfloat16 and float16 multiply in their own precision with float32 sums, as cuBLAS does.
Imported only when a Triton kernel is launched (``spmd.kernels.dispatch``). Block sizes
are the Triton matmul tutorial's starting point, not tuned on a GPU yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spmd.kernels.dispatch import launchable, on_device
from spmd.kernels.packing_triton import cast


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, WIDEN: tl.constexpr):
    if WIDEN:  # (interpreted: Triton 3.9's interpreter multiplies bfloat16 wrongly; widened
        # to float32 first, the products are the same exact ones a GPU's dot sums)
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def grouped_kernel(x, w, offs, bias, out, R, K, N, E,
                   sxr, sxk, swe, swk, swn, sbe, sbn, sor, son, HAS_BIAS: tl.constexpr,
                   IEEE: tl.constexpr, WIDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    # which group (expert, or E: the padding) and which of its tiles: walk the groups,
    # counting their tiles, and keep the one this program falls in
    start = 0
    before = 0
    group = -1
    first = 0
    end_row = 0
    for e in range(0, E + 1):
        end = tl.where(e < E, tl.load(offs + tl.minimum(e, E - 1)).to(tl.int32), R)
        tiles = (end - start + BLOCK_M - 1) // BLOCK_M
        hit = (pid >= before) & (pid < before + tiles)
        group = tl.where(hit, e, group)
        first = tl.where(hit, start + (pid - before) * BLOCK_M, first)
        end_row = tl.where(hit, end, end_row)
        before += tiles
        start = end
    expert = group < E  # (False for the padding group and past the last tile)
    rows = first + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_in = cols < N
    # the padding group reads nothing and stores zeros (bounds, not a vector & a scalar:
    # Triton 3.9's interpreter makes that an int32 mask, which it then refuses)
    row_read = rows < tl.where(expert, end_row, 0)
    col_read = cols < tl.where(expert, N, 0)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)  # (tl.zeros: a jit helper of
    # triton.language, which an interpreted copy of this module cannot call)
    wbase = w + tl.maximum(group, 0).to(tl.int64) * swe
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_in = ks < K
        a = tl.load(x + rows[:, None].to(tl.int64) * sxr + ks[None, :] * sxk,
                    mask=row_read[:, None] & k_in[None, :], other=0.0)
        b = tl.load(wbase + ks[:, None] * swk + cols[None, :] * swn,
                    mask=k_in[:, None] & col_read[None, :], other=0.0)
        acc += _dot(a, b, IEEE, WIDEN)
    if HAS_BIAS:  # the expert's bias on its rows (the padding stays zero)
        acc += tl.load(bias + tl.maximum(group, 0).to(tl.int64) * sbe + cols * sbn,
                       mask=col_read, other=0.0).to(tl.float32)[None, :]
    stored = (rows < tl.where(group >= 0, end_row, 0))[:, None] & col_in[None, :]
    tl.store(out + rows[:, None].to(tl.int64) * sor + cols[None, :] * son,
             cast(acc, out.dtype.element_ty), mask=stored)


@triton.jit
def weight_kernel(a, b, offs, out, K, N, scale,
                  sak, sar, sbr, sbn, soe, sok, son,
                  IEEE: tl.constexpr, WIDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    e = tl.program_id(0)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_in = ks < K
    col_in = cols < N
    start = tl.where(e > 0, tl.load(offs + tl.maximum(e - 1, 0)).to(tl.int32), 0)
    end = tl.load(offs + e).to(tl.int32)
    acc = tl.full((BLOCK_K, BLOCK_N), 0.0, tl.float32)
    for r0 in range(start, end, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        row_in = rows < end
        lhs = tl.load(a + ks[:, None] * sak + rows[None, :].to(tl.int64) * sar,
                      mask=k_in[:, None] & row_in[None, :], other=0.0)
        rhs = tl.load(b + rows[:, None].to(tl.int64) * sbr + cols[None, :] * sbn,
                      mask=row_in[:, None] & col_in[None, :], other=0.0)
        acc += _dot(lhs, rhs, IEEE, WIDEN)
    tl.store(out + e.to(tl.int64) * soe + ks[:, None] * sok + cols[None, :] * son,
             cast(acc * scale, out.dtype.element_ty), mask=k_in[:, None] & col_in[None, :])


def _blocks(m: int, n: int, k: int) -> tuple[int, int, int]:
    """Tile sizes: the tutorial's 64 x 64 x 32, smaller where a dimension is (``tl.dot``
    needs 16 at least)."""
    fit = lambda size, most: max(16, min(most, triton.next_power_of_2(max(size, 1))))  # noqa: E731
    return fit(m, 64), fit(n, 64), fit(k, 32)


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
               bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """Launch ``grouped_kernel`` over ``out`` ``(R, N)``. Arguments are already checked."""
    rows, k = x.shape
    experts, _, n = weight.shape
    bm, bn, bk = _blocks(rows, n, k)
    kernel = launchable(grouped_kernel, out.device)
    grid = (triton.cdiv(rows, bm) + experts + 1, triton.cdiv(n, bn))
    with on_device(out.device):
        kernel[grid](x, weight, offs, bias if bias is not None else x, out, rows, k, n,
                     experts, *x.stride(), *weight.stride(),
                     *(bias.stride() if bias is not None else (0, 0)), *out.stride(),
                     HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
                     WIDEN=out.device.type == "cpu", BLOCK_M=bm,
                     BLOCK_N=bn, BLOCK_K=bk)


def grouped_mm_weight(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, scale: float,
                      out: torch.Tensor) -> None:
    """Launch ``weight_kernel`` over ``out`` ``(E, K, N)``. Arguments are already checked."""
    k, rows = a.shape
    n = b.shape[1]
    experts = offs.shape[0]
    bm, bn, bk = _blocks(rows, n, k)
    kernel = launchable(weight_kernel, out.device)
    grid = (experts, triton.cdiv(k, bk), triton.cdiv(n, bn))
    with on_device(out.device):
        kernel[grid](a, b, offs, out, k, n, scale, *a.stride(), *b.stride(), *out.stride(),
                     IEEE=a.dtype == torch.float32, WIDEN=out.device.type == "cpu",
                     BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
