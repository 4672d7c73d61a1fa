"""Triton kernels behind ``sgd_step`` and ``adamw_step``: the optimizer applied to many
parameters in one launch, reading gradients straight from the flat bucket.

Parameters and state reach the kernel through the pointer table of ``spmd.kernels.layout``
(one row per parameter: its address, element count and offset in the bucket, then the
addresses of its state); each program updates one chunk of one parameter. Everything is
computed in float32, in ``torch.optim``'s order, with ``tl.fma`` exactly where torch's
kernels fuse (``add(alpha=)``, ``lerp``, ``addcmul``), IEEE division and square root, and
no other contraction (``enable_fp_fusion=False``), so the interpreter on CPU and the GPU
compute the same thing. The torch reference is in ``spmd.kernels.optim``; the benchmark
in ``benchmarks/kernels.py``.

Bytes moved per element: SGD ``grad + 2 param (+ 2 buffer)``; AdamW ``grad + 2 param +
2 exp_avg + 2 exp_avg_sq (+ 2 max_exp_avg_sq)``, each times its itemsize.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spmd.kernels.dispatch import launchable, on_device
from spmd.kernels.layout import aligned, launch_layout, offsets
from spmd.kernels.packing_triton import TL_DTYPES, cast, chunk_of


@triton.jit
def sgd_kernel(rows, chunks, grad, grad_scale, lr, weight_decay, momentum, one_minus_dampening,
               P: tl.constexpr, B: tl.constexpr, WEIGHT_DECAY: tl.constexpr,
               MOMENTUM: tl.constexpr, FIRST: tl.constexpr, NESTEROV: tl.constexpr,
               MAXIMIZE: tl.constexpr, ALIGNED: tl.constexpr, CHUNK: tl.constexpr,
               BLOCK: tl.constexpr):
    # row: param, numel, offset in the bucket, momentum buffer
    row, first, numel, offset = chunk_of(rows, chunks, 4, ALIGNED, BLOCK)
    param = tl.load(row).to(tl.pointer_type(P))
    buffer = tl.load(row + 3).to(tl.pointer_type(B))
    if ALIGNED:  # checked on the host; lets the compiler use 16-byte loads and stores
        param = tl.multiple_of(param, 16)
        buffer = tl.multiple_of(buffer, 16)
    grad += offset
    for step in range(0, CHUNK, BLOCK):
        idx = first + step + tl.arange(0, BLOCK)
        mask = idx < numel
        g = tl.load(grad + idx, mask=mask).to(tl.float32) * grad_scale
        if MAXIMIZE:
            g = -g
        p = tl.load(param + idx, mask=mask).to(tl.float32)
        if WEIGHT_DECAY:
            g = tl.fma(weight_decay, p, g)  # grad.add(param, alpha=weight_decay)
        if MOMENTUM:
            if FIRST:
                buf = g  # torch.optim.SGD: the buffer starts as a copy of the gradient
            else:
                buf = tl.load(buffer + idx, mask=mask).to(tl.float32) * momentum
                buf = tl.fma(one_minus_dampening, g, buf)  # .add_(grad, alpha=1 - dampening)
            tl.store(buffer + idx, cast(buf, B), mask=mask)
            if NESTEROV:
                g = tl.fma(momentum, buf, g)
            else:
                g = buf
        p = tl.fma(-lr, g, p)  # param.add_(grad, alpha=-lr)
        tl.store(param + idx, cast(p, P), mask=mask)


@triton.jit
def adamw_kernel(rows, chunks, grad, grad_scale, decay, lerp_weight, beta2, one_minus_beta2,
                 bias_correction2_sqrt, eps, neg_step_size,
                 P: tl.constexpr, M: tl.constexpr, V: tl.constexpr, VMAX: tl.constexpr,
                 WEIGHT_DECAY: tl.constexpr, SMALL_WEIGHT: tl.constexpr,
                 AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr, ALIGNED: tl.constexpr,
                 CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    # row: param, numel, offset in the bucket, exp_avg, exp_avg_sq, max_exp_avg_sq
    row, first, numel, offset = chunk_of(rows, chunks, 6, ALIGNED, BLOCK)
    param = tl.load(row).to(tl.pointer_type(P))
    exp_avg = tl.load(row + 3).to(tl.pointer_type(M))
    exp_avg_sq = tl.load(row + 4).to(tl.pointer_type(V))
    max_exp_avg_sq = tl.load(row + 5).to(tl.pointer_type(VMAX))
    if ALIGNED:  # checked on the host; lets the compiler use 16-byte loads and stores
        param = tl.multiple_of(param, 16)
        exp_avg = tl.multiple_of(exp_avg, 16)
        exp_avg_sq = tl.multiple_of(exp_avg_sq, 16)
        max_exp_avg_sq = tl.multiple_of(max_exp_avg_sq, 16)
    grad += offset
    for step in range(0, CHUNK, BLOCK):
        idx = first + step + tl.arange(0, BLOCK)
        mask = idx < numel
        g = tl.load(grad + idx, mask=mask).to(tl.float32) * grad_scale
        if MAXIMIZE:
            g = -g
        p = tl.load(param + idx, mask=mask).to(tl.float32)
        if WEIGHT_DECAY:
            p = p * decay  # param.mul_(1 - lr * weight_decay)
        # exp_avg.lerp_(grad, 1 - beta1), as torch computes lerp
        m = tl.load(exp_avg + idx, mask=mask).to(tl.float32)
        if SMALL_WEIGHT:
            m = tl.fma(lerp_weight, g - m, m)
        else:
            m = tl.fma(lerp_weight - 1.0, g - m, g)
        # exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        v = tl.load(exp_avg_sq + idx, mask=mask).to(tl.float32) * beta2
        v = tl.fma(one_minus_beta2 * g, g, v)
        tl.store(exp_avg + idx, cast(m, M), mask=mask)
        tl.store(exp_avg_sq + idx, cast(v, V), mask=mask)
        if AMSGRAD:
            vmax = tl.load(max_exp_avg_sq + idx, mask=mask).to(tl.float32)
            v = tl.maximum(vmax, v, propagate_nan=tl.PropagateNan.ALL)
            tl.store(max_exp_avg_sq + idx, cast(v, VMAX), mask=mask)
        # denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
        denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
        # param.addcdiv_(exp_avg, denom, value=-step_size)
        p = p + tl.div_rn(neg_step_size * m, denom)
        tl.store(param + idx, cast(p, P), mask=mask)


def _launch(kernel, flat_grad: torch.Tensor, groups: dict, scalars: tuple, flags: dict,
            names: tuple[str, ...]) -> None:
    """One launch of ``kernel`` per group of rows; a group's key is the values of the
    constexprs ``names`` and then whether its rows are aligned."""
    kernel = launchable(kernel, flat_grad.device)
    with on_device(flat_grad.device):
        for key, rows in groups.items():
            launch = launch_layout(rows, flat_grad.device)
            constexprs = {name: TL_DTYPES[d] if isinstance(d, torch.dtype) else d
                          for name, d in zip(names, key)}
            kernel[(launch.grid,)](launch.rows, launch.chunks, flat_grad, *scalars,
                                   **constexprs, **flags, ALIGNED=key[-1], CHUNK=launch.chunk,
                                   BLOCK=launch.block, enable_fp_fusion=False)


def _add_row(groups: dict, key: tuple, row: list[int], flat_aligned: bool) -> None:
    """File ``row`` (param, numel, offset, state addresses...) under ``key`` + aligned;
    ``flat_aligned``: whether the gradient bucket starts on a 16-byte boundary."""
    is_aligned = flat_aligned and aligned([row[0], *row[3:]], row[1], row[2])
    groups.setdefault((*key, is_aligned), []).append(row)


def sgd(params: list[torch.Tensor], flat_grad: torch.Tensor,
        momentum_buffers: list[torch.Tensor | None] | None, *, lr: float, momentum: float,
        dampening: float, nesterov: bool, weight_decay: float, maximize: bool,
        grad_scale: float) -> None:
    """Launch ``sgd_kernel`` over ``params``; None buffers are created (and stored into
    ``momentum_buffers``) and filled by the kernel. Arguments are already checked."""
    groups: dict[tuple, list[list[int]]] = {}
    flat_aligned = flat_grad.data_ptr() % 16 == 0
    for i, (p, start) in enumerate(zip(params, offsets([p.numel() for p in params]))):
        buf, first = p, False  # without momentum the kernel never touches the buffer
        if momentum != 0:
            buf = momentum_buffers[i]
            if buf is None:
                momentum_buffers[i] = buf = torch.empty_like(p)
                first = True
        if p.numel():
            _add_row(groups, (p.dtype, buf.dtype, first),
                     [p.data_ptr(), p.numel(), start, buf.data_ptr()], flat_aligned)
    _launch(sgd_kernel, flat_grad, groups,
            (grad_scale, lr, weight_decay, momentum, 1 - dampening),
            dict(WEIGHT_DECAY=weight_decay != 0, MOMENTUM=momentum != 0, NESTEROV=nesterov,
                 MAXIMIZE=maximize), ("P", "B", "FIRST"))


def adamw(params: list[torch.Tensor], flat_grad: torch.Tensor, exp_avgs: list[torch.Tensor],
          exp_avg_sqs: list[torch.Tensor], max_exp_avg_sqs: list[torch.Tensor], *, step: int,
          lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
          amsgrad: bool, maximize: bool, grad_scale: float) -> None:
    """Launch ``adamw_kernel`` over ``params``. Arguments are already checked."""
    groups: dict[tuple, list[list[int]]] = {}
    flat_aligned = flat_grad.data_ptr() % 16 == 0
    for i, (p, start) in enumerate(zip(params, offsets([p.numel() for p in params]))):
        if p.numel() == 0:
            continue
        m, v = exp_avgs[i], exp_avg_sqs[i]
        vmax = max_exp_avg_sqs[i] if amsgrad else v  # never touched without amsgrad
        _add_row(groups, (p.dtype, m.dtype, v.dtype, vmax.dtype),
                 [p.data_ptr(), p.numel(), start, m.data_ptr(), v.data_ptr(), vmax.data_ptr()],
                 flat_aligned)
    # The scalars torch derives in Python (double precision) before its kernels round them
    # to float32.
    lerp_weight = 1 - beta1
    small = abs(float(torch.tensor(lerp_weight, dtype=torch.float32))) < 0.5
    scalars = (grad_scale, 1 - lr * weight_decay, lerp_weight, beta2, 1 - beta2,
               (1 - beta2**step) ** 0.5, eps, -(lr / (1 - beta1**step)))
    _launch(adamw_kernel, flat_grad, groups, scalars,
            dict(WEIGHT_DECAY=weight_decay != 0, SMALL_WEIGHT=small, AMSGRAD=amsgrad,
                 MAXIMIZE=maximize), ("P", "M", "V", "VMAX"))
