"""Optimizer steps that read the reduced gradient bucket directly.

After a bucket's all-reduce the gradients sit in one flat buffer. Instead of unpacking them
into ``p.grad`` and running ``torch.optim``, ``sgd_step`` and ``adamw_step`` read the buffer
and update the parameters and their state in one Triton launch on CUDA (one per distinct
combination of dtypes); on CPU, and wherever ``SPMD_KERNELS=torch``, the torch reference
below does the same arithmetic op for op.

State is kept per parameter, as ``torch.optim`` keeps it, so state can be handed over in
either direction::

    state = [opt.state[p] for p in params]
    adamw_step(params, flat, [s["exp_avg"] for s in state], [s["exp_avg_sq"] for s in state],
               step=int(state[0]["step"]) + 1, lr=1e-3)

Numerics: gradients are read as float32 and multiplied by ``grad_scale``; the update is
``torch.optim``'s with ``foreach=False``, in its order of operations and with fused
multiply-adds where torch's kernels use them (``add(alpha=)``, ``lerp``, ``addcmul``).
For float32 parameters the torch path below gives ``torch.optim``'s result bit for bit,
and so does the Triton path for SGD; Triton's AdamW takes IEEE square roots where torch's
CPU kernels use a vectorised square root that is off by one ulp now and then, so it agrees
to about 1e-7 relative (the tests allow 1e-6 after several steps). float16 and bfloat16
parameters and state are computed in float32 and rounded once per step, as torch's
``fused=True`` does, rather than after every operation.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import Any

import torch

from spmd.kernels import checks
from spmd.kernels.dispatch import implementation
from spmd.kernels.layout import offsets

__all__ = ["sgd_step", "adamw_step", "sgd_reference", "adamw_reference"]


@torch.no_grad()
def sgd_step(params: Sequence[torch.Tensor], flat_grad: torch.Tensor,
             momentum_buffers: list[torch.Tensor | None] | None, *, lr: float,
             momentum: float = 0.0, dampening: float = 0.0, nesterov: bool = False,
             weight_decay: float = 0.0, maximize: bool = False, grad_scale: float = 1.0) -> None:
    """One ``torch.optim.SGD`` step of ``params``, in place, from a flat gradient bucket.

    Args:
        params: contiguous float32/bfloat16/float16 parameters on ``flat_grad``'s device.
        flat_grad: their gradients as ``pack(params_grads)`` lays them out (1-D, at least
            as many elements as the parameters).
        momentum_buffers: with ``momentum``, a list with one entry per parameter: its buffer
            (contiguous, the parameter's shape) or None before the first step. As in
            ``torch.optim.SGD`` a None buffer becomes a copy of the gradient (with weight
            decay applied), stored into the list in place. Ignored (may be None) without
            momentum.
        lr, momentum, dampening, nesterov, weight_decay, maximize: as ``torch.optim.SGD``.
        grad_scale: multiplies every gradient as it is read (e.g. ``1 / world_size``).

    Example::

        >>> params = [torch.ones(3), torch.ones(2, 2)]
        >>> buffers = [None, None]
        >>> sgd_step(params, torch.full((7,), 2.0), buffers, lr=0.1, momentum=0.9,
        ...          grad_scale=0.5)
        >>> params[0], buffers[0]
        (tensor([0.9000, 0.9000, 0.9000]), tensor([1., 1., 1.]))
    """
    params, flat_grad = _check_common("sgd_step", params, flat_grad)
    lr, momentum, dampening, weight_decay, grad_scale = (
        checks.scalar("sgd_step", name, value) for name, value in (
            ("lr", lr), ("momentum", momentum), ("dampening", dampening),
            ("weight_decay", weight_decay), ("grad_scale", grad_scale)))
    if lr < 0 or momentum < 0 or weight_decay < 0:
        raise ValueError(f"sgd_step: lr, momentum and weight_decay must be >= 0, got lr={lr}, "
                         f"momentum={momentum}, weight_decay={weight_decay}")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("sgd_step: nesterov momentum requires a momentum and zero dampening")
    if momentum != 0:
        if not isinstance(momentum_buffers, list):
            raise TypeError(f"sgd_step: with momentum, momentum_buffers must be a list (new "
                            f"buffers are stored into it), got {type(momentum_buffers).__name__}")
        _check_state("sgd_step", "momentum_buffers", params, momentum_buffers, optional=True)
    hyper = dict(lr=lr, momentum=momentum, dampening=dampening, nesterov=bool(nesterov),
                 weight_decay=weight_decay, maximize=bool(maximize), grad_scale=grad_scale)
    if not params:
        return
    if implementation(flat_grad.device) == "triton":
        from spmd.kernels import optim_triton

        optim_triton.sgd(params, flat_grad, momentum_buffers, **hyper)
    else:
        sgd_reference(params, flat_grad, momentum_buffers, **hyper)


@torch.no_grad()
def adamw_step(params: Sequence[torch.Tensor], flat_grad: torch.Tensor,
               exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor],
               max_exp_avg_sqs: Sequence[torch.Tensor] | None = None, *, step: int, lr: float,
               betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
               weight_decay: float = 1e-2, amsgrad: bool = False, maximize: bool = False,
               grad_scale: float = 1.0) -> None:
    """One ``torch.optim.AdamW`` step of ``params`` and their state, in place, from a flat
    gradient bucket.

    Args:
        params: contiguous float32/bfloat16/float16 parameters on ``flat_grad``'s device.
        flat_grad: their gradients as ``pack(params_grads)`` lays them out.
        exp_avgs, exp_avg_sqs: per-parameter moments (contiguous, the parameter's shape;
            zeros before the first step, as ``torch.optim`` creates them).
        max_exp_avg_sqs: with ``amsgrad``, the running maxima (zeros at first); else None.
        step: the number of this step, counting from 1 (``torch.optim``'s ``state["step"]``
            after it is incremented); it sets the bias correction.
        lr, betas, eps, weight_decay, amsgrad, maximize: as ``torch.optim.AdamW``.
        grad_scale: multiplies every gradient as it is read (e.g. ``1 / world_size``).

    Example::

        >>> params = [torch.ones(4)]
        >>> m, v = [torch.zeros(4)], [torch.zeros(4)]
        >>> adamw_step(params, torch.full((4,), 3.0), m, v, step=1, lr=0.1, weight_decay=0.0)
        >>> params[0]
        tensor([0.9000, 0.9000, 0.9000, 0.9000])
    """
    params, flat_grad = _check_common("adamw_step", params, flat_grad)
    lr, eps, weight_decay, grad_scale = (
        checks.scalar("adamw_step", name, value) for name, value in (
            ("lr", lr), ("eps", eps), ("weight_decay", weight_decay),
            ("grad_scale", grad_scale)))
    if not isinstance(betas, Sequence) or len(betas) != 2:
        raise TypeError(f"adamw_step: betas must be a pair of numbers, got {betas!r}")
    beta1, beta2 = (checks.scalar("adamw_step", "betas", b) for b in betas)
    if isinstance(step, torch.Tensor) and step.numel() == 1:
        step = step.item()
    if isinstance(step, float) and step.is_integer():
        step = int(step)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"adamw_step: step must be an integer >= 1 (the number of this "
                         f"step), got {step!r}")
    if lr < 0 or eps < 0 or weight_decay < 0 or not (0 <= beta1 < 1 and 0 <= beta2 < 1):
        raise ValueError(f"adamw_step: need lr, eps, weight_decay >= 0 and 0 <= betas < 1, "
                         f"got lr={lr}, eps={eps}, weight_decay={weight_decay}, betas={betas}")
    _check_state("adamw_step", "exp_avgs", params, exp_avgs)
    _check_state("adamw_step", "exp_avg_sqs", params, exp_avg_sqs)
    if amsgrad:
        if max_exp_avg_sqs is None:
            raise ValueError("adamw_step: amsgrad=True needs max_exp_avg_sqs")
        _check_state("adamw_step", "max_exp_avg_sqs", params, max_exp_avg_sqs)
    elif max_exp_avg_sqs is not None:
        raise ValueError("adamw_step: max_exp_avg_sqs given but amsgrad=False")
    hyper = dict(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                 weight_decay=weight_decay, amsgrad=bool(amsgrad), maximize=bool(maximize),
                 grad_scale=grad_scale)
    if not params:
        return
    if implementation(flat_grad.device) == "triton":
        from spmd.kernels import optim_triton

        optim_triton.adamw(params, flat_grad, list(exp_avgs), list(exp_avg_sqs),
                           list(max_exp_avg_sqs or []), **hyper)
    else:
        adamw_reference(params, flat_grad, list(exp_avgs), list(exp_avg_sqs),
                        list(max_exp_avg_sqs or []), **hyper)


def _check_common(fn: str, params: Any, flat_grad: Any) -> tuple[list[torch.Tensor], torch.Tensor]:
    params = checks.tensor_list(fn, "params", params)
    total = sum(p.numel() for p in params)
    flat_grad = checks.flat(fn, "flat_grad", flat_grad, total)
    for i, p in enumerate(params):
        name = f"params[{i}]"
        checks.same_device(fn, flat_grad.device, name, p)
        checks.dtype(fn, name, p)
        checks.contiguous(fn, name, p)
    return params, flat_grad


def _check_state(fn: str, name: str, params: list[torch.Tensor], state: Any, *,
                 optional: bool = False) -> None:
    if not isinstance(state, Sequence) or isinstance(state, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a list of tensors, got {type(state).__name__}")
    if len(state) != len(params):
        raise ValueError(f"{fn}: {name} has {len(state)} entries for {len(params)} params")
    for i, (s, p) in enumerate(zip(state, params)):
        if s is None and optional:
            continue
        entry = f"{name}[{i}]"
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"{fn}: {entry} is a {type(s).__name__}, not a tensor")
        if s.shape != p.shape:
            raise ValueError(f"{fn}: {entry} has shape {tuple(s.shape)}, its parameter "
                             f"{tuple(p.shape)}")
        checks.same_device(fn, p.device, entry, s)
        checks.dtype(fn, entry, s)
        checks.contiguous(fn, entry, s)


def _grads(params: list[torch.Tensor], flat_grad: torch.Tensor, grad_scale: float,
           maximize: bool, skip: Container[int] = ()):
    """(index, param, its float32 gradient) for every parameter not in ``skip``, gradients
    read as the kernels read them. The buffer itself is never written."""
    for i, (p, start) in enumerate(zip(params, offsets([p.numel() for p in params]))):
        if i in skip:
            continue
        grad = flat_grad[start:start + p.numel()].view(p.shape).float()
        if grad_scale != 1.0:
            grad = grad * grad_scale
        yield i, p, (-grad if maximize else grad)


def _f32(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when float32 (updated in place), else a float32 copy to write back."""
    return t if t.dtype == torch.float32 else t.float()


def _write_back(target: torch.Tensor, value: torch.Tensor) -> None:
    if value is not target:
        target.copy_(value)


# Elements up to which a float32 tensor's update is taken with torch's foreach ops rather
# than the Python loop: a small tensor's ops cost their dispatch, and one foreach call
# per op dispatches all of them in C++ (AdamW over the 244 small tensors of
# benchmarks/ddp.py's "small" case: 2.6 against 4.3 ms here); a large one is cheaper
# taken through all its ops while it is in cache, as the loop does (the 51 tensors of the
# "d256" case, all in foreach: 11.0 against 5.3 ms). Either way each tensor gets the same
# operations on the same elements, so the results are the same bit for bit.
FOREACH_MAX = 32768


def _split_small(params: list[torch.Tensor], states: list[list[Any]]) -> list[int]:
    """Indices of the parameters whose update the foreach ops take: float32 parameter and
    state, at most ``FOREACH_MAX`` elements."""
    return [i for i, p in enumerate(params)
            if p.numel() <= FOREACH_MAX and p.dtype == torch.float32
            and all(state[i] is not None and state[i].dtype == torch.float32
                    for state in states)]


def _grad_list(grads: list[torch.Tensor], grad_scale: float, maximize: bool
               ) -> list[torch.Tensor]:
    """``_grads``' arithmetic on float32 views, in foreach calls."""
    if grad_scale != 1.0:
        grads = torch._foreach_mul(grads, grad_scale)
    return torch._foreach_neg(grads) if maximize else grads


def _views(params: list[torch.Tensor], flat_grad: torch.Tensor, which: list[int]
           ) -> list[torch.Tensor]:
    """The float32 gradients of ``params[i]`` for ``i`` in ``which``, viewed in the
    buffer (a float32 copy of the buffer when it holds another dtype)."""
    flat = flat_grad.float()
    at = offsets([p.numel() for p in params])
    return [flat[at[i]:at[i] + params[i].numel()].view(params[i].shape) for i in which]


def sgd_reference(params: list[torch.Tensor], flat_grad: torch.Tensor,
                  momentum_buffers: list[torch.Tensor | None] | None, *, lr: float,
                  momentum: float, dampening: float, nesterov: bool, weight_decay: float,
                  maximize: bool, grad_scale: float) -> None:
    """Plain torch ``sgd_step``: ``torch.optim.SGD``'s single-tensor loop, in float32;
    small float32 tensors through the same operations in foreach calls."""
    buffers = momentum_buffers if momentum != 0 else None
    small = _split_small(params, [buffers] if buffers is not None else [])
    if len(small) > 1:
        P = [params[i] for i in small]
        G = _grad_list(_views(params, flat_grad, small), grad_scale, maximize)
        if weight_decay != 0:
            G = torch._foreach_add(G, P, alpha=weight_decay)
        if buffers is not None:
            B = [buffers[i] for i in small]
            torch._foreach_mul_(B, momentum)
            torch._foreach_add_(B, G, alpha=1 - dampening)
            G = torch._foreach_add(G, B, alpha=momentum) if nesterov else B
        torch._foreach_add_(P, G, alpha=-lr)
        done = set(small)
    else:
        done = set()
    for i, p, grad in _grads(params, flat_grad, grad_scale, maximize, skip=done):
        param = _f32(p)
        if weight_decay != 0:
            grad = grad.add(param, alpha=weight_decay)
        if momentum != 0:
            buf = momentum_buffers[i]
            if buf is None:  # the first step: the buffer starts as the gradient
                buf32 = grad.clone()
                momentum_buffers[i] = buf32.to(p.dtype)
            else:
                buf32 = _f32(buf)
                buf32.mul_(momentum).add_(grad, alpha=1 - dampening)
                _write_back(buf, buf32)
            grad = grad.add(buf32, alpha=momentum) if nesterov else buf32
        param.add_(grad, alpha=-lr)
        _write_back(p, param)


def adamw_reference(params: list[torch.Tensor], flat_grad: torch.Tensor,
                    exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
                    max_exp_avg_sqs: list[torch.Tensor], *, step: int, lr: float,
                    beta1: float, beta2: float, eps: float, weight_decay: float,
                    amsgrad: bool, maximize: bool, grad_scale: float) -> None:
    """Plain torch ``adamw_step``: ``torch.optim.AdamW``'s single-tensor loop, in float32;
    small float32 tensors through the same operations in foreach calls (not with
    ``amsgrad``, which keeps the loop)."""
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    step_size = lr / bias_correction1
    small = [] if amsgrad else _split_small(params, [exp_avgs, exp_avg_sqs])
    if len(small) > 1:
        P = [params[i] for i in small]
        M, V = [exp_avgs[i] for i in small], [exp_avg_sqs[i] for i in small]
        G = _grad_list(_views(params, flat_grad, small), grad_scale, maximize)
        if weight_decay != 0:
            torch._foreach_mul_(P, 1 - lr * weight_decay)
        torch._foreach_lerp_(M, G, 1 - beta1)
        torch._foreach_mul_(V, beta2)
        torch._foreach_addcmul_(V, G, G, value=1 - beta2)
        denom = torch._foreach_sqrt(V)
        torch._foreach_div_(denom, bias_correction2_sqrt)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(P, M, denom, value=-step_size)
        done = set(small)
    else:
        done = set()
    for i, p, grad in _grads(params, flat_grad, grad_scale, maximize, skip=done):
        param, exp_avg, exp_avg_sq = _f32(p), _f32(exp_avgs[i]), _f32(exp_avg_sqs[i])
        if weight_decay != 0:
            param.mul_(1 - lr * weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        second = exp_avg_sq
        if amsgrad:
            second = _f32(max_exp_avg_sqs[i])
            torch.maximum(second, exp_avg_sq, out=second)
            _write_back(max_exp_avg_sqs[i], second)
        denom = (second.sqrt() / bias_correction2_sqrt).add_(eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)
        for target, value in ((p, param), (exp_avgs[i], exp_avg), (exp_avg_sqs[i], exp_avg_sq)):
            _write_back(target, value)
