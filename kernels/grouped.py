"""A mixture of experts' products: one matrix per expert over rows laid out expert by
expert (``spmd.lowering.experts``' ``grouped_mm``, after the dispatch).

- ``grouped_mm(x, weight, offs, bias)``: ``x`` ``(R, K)`` holds expert ``e``'s rows at
  ``offs[e - 1]:offs[e]`` (``offs``: cumulative row counts, int64; the rows after
  ``offs[-1]`` are padding, zero in the result); ``weight`` ``(E, K, N)`` in any
  strides (a transposed view of ``(E, N, K)`` weights too); ``bias`` ``(E, N)`` or None.
  Returns ``(R, N)``: ``x[rows_e] @ weight[e] + bias[e]`` on each expert's rows.
- ``grouped_mm_weight(a, b, offs, scale)``: ``a`` ``(K, R)``, ``b`` ``(R, N)``: expert
  ``e``'s ``scale * a[:, rows_e] @ b[rows_e]``, ``(E, K, N)`` (zeros for an expert with
  no rows): the weight gradient.

Where ``spmd.kernels.implementation`` says Triton (CUDA; CPU under ``SPMD_KERNELS=triton``,
interpreted, which is how the tests check it) and the dtype is float32, bfloat16 or
float16, each is one launch (``spmd.kernels.grouped_triton``) that reads the offsets on
the device; otherwise, and in float64, the reference: a loop of ``torch.mm`` (``addmm``
with a bias) over the experts, written in place, which reads the offsets on the host.
On CUDA the compiler prefers ``torch._grouped_mm`` where it takes the operands
(``spmd.lowering.experts.grouped_kernel``: bfloat16, aligned).
"""

from __future__ import annotations

import torch

from spmd.kernels.dispatch import implementation

__all__ = ["grouped_mm", "grouped_mm_weight", "expert_rows", "TRITON_DTYPES"]

TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check(offs: torch.Tensor, where: str, *mats: torch.Tensor) -> None:
    if offs.dim() != 1 or offs.dtype != torch.int64:
        raise ValueError(f"{where}: offs must be 1-D int64 cumulative row counts, got "
                         f"{tuple(offs.shape)} {offs.dtype}")
    devices = {m.device for m in (offs, *mats)}
    if len(devices) != 1:
        raise ValueError(f"{where}: the operands are on several devices: {devices}")
    if len({m.dtype for m in mats}) != 1:
        raise ValueError(f"{where}: the matrices' dtypes differ: "
                         f"{[m.dtype for m in mats]}")


def _triton(t: torch.Tensor) -> bool:
    return t.dtype in TRITON_DTYPES and implementation(t.device) == "triton"


def expert_rows(offs: torch.Tensor) -> list[tuple[int, int, int]]:
    """(expert, first row, end row) of each expert, from the offsets (on the host)."""
    ends = offs.tolist()
    return [(e, start, end) for e, (start, end) in enumerate(zip([0, *ends[:-1]], ends))]


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """Each expert's rows of ``x`` times its ``weight`` (module doc); padding rows zero."""
    if x.dim() != 2 or weight.dim() != 3 or weight.shape[1] != x.shape[1] \
            or weight.shape[0] != offs.shape[0]:
        raise ValueError(f"grouped_mm: x (R, K), weight (E, K, N) and offs (E,) expected, "
                         f"got {tuple(x.shape)}, {tuple(weight.shape)}, {tuple(offs.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0], weight.shape[2]):
        raise ValueError(f"grouped_mm: bias must be (E, N) = {tuple(weight.shape[::2])}, "
                         f"got {tuple(bias.shape)}")
    _check(offs, "grouped_mm", x, weight,
           *(() if bias is None else (bias,)))
    out = x.new_empty((x.shape[0], weight.shape[2]))
    if _triton(x):
        from spmd.kernels import grouped_triton

        grouped_triton.grouped_mm(x, weight, offs, bias, out)
        return out
    for e, start, end in expert_rows(offs):
        if end > start:  # written in place: no temporary per expert
            if bias is None:
                torch.mm(x[start:end], weight[e], out=out[start:end])
            else:
                torch.addmm(bias[e], x[start:end], weight[e], out=out[start:end])
    out[int(offs[-1]) if offs.numel() else 0:].zero_()  # the padding rows
    return out


def grouped_mm_weight(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor,
                      scale: float = 1.0) -> torch.Tensor:
    """Each expert's ``scale * a[:, rows_e] @ b[rows_e]`` (module doc), ``(E, K, N)``."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"grouped_mm_weight: a (K, R) and b (R, N) expected, got "
                         f"{tuple(a.shape)}, {tuple(b.shape)}")
    _check(offs, "grouped_mm_weight", a, b)
    out = a.new_empty((offs.shape[0], a.shape[0], b.shape[1]))
    if _triton(a):
        from spmd.kernels import grouped_triton

        grouped_triton.grouped_mm_weight(a, b, offs, scale, out)
        return out
    for e, start, end in expert_rows(offs):
        if end > start:
            torch.mm(a[:, start:end], b[start:end], out=out[e])
            if scale != 1.0:
                out[e].mul_(scale)
        else:
            out[e].zero_()  # an expert that received no row
    return out
