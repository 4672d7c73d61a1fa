"""Batch norms over the whole batch (``sync_batchnorm=True``, or ``nn.SyncBatchNorm`` in the
model): each layer's class is swapped for one whose forward is a plain batch norm where
the compiler captures it (``spmd.lowering.sync_batchnorm`` makes its statistics whole in
the graph) and the same arithmetic with blocking all-reduces where it runs eagerly (a
graph break, a model that cannot be captured; torch's own ``SyncBatchNorm`` refuses CPU
tensors): the statistics are the whole batch's either way, never silently one rank's."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

from spmd.lowering.options import Options

if TYPE_CHECKING:
    from spmd.program.setup import Setup

__all__ = ["prepare_batchnorms", "WholeBatchNorm"]


class _WholeStatistics(torch.autograd.Function):
    """Batch norm in training over the whole batch, eagerly: the per-channel sums, sums of
    squares and counts all-reduced in forward, the gradient sums in backward (the same
    arithmetic the compiler's pass puts in graphs)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: Any, bias: Any, norm: "WholeBatchNorm",
                group: Any) -> torch.Tensor:
        from spmd.runtime.collectives import all_reduce

        dims = [0] + list(range(2, x.dim()))
        shape = [1, -1] + [1] * (x.dim() - 2)
        xf = x.float()
        count = x.numel() // x.shape[1]
        stats = torch.cat([xf.sum(dims), (xf * xf).sum(dims),
                           xf.new_full((1,), float(count))])
        all_reduce(stats, group=group)
        c = x.shape[1]
        n = stats[-1]
        mean = stats[:c] / n
        var = (stats[c:2 * c] / n - mean * mean).clamp_min(0)
        invstd = torch.rsqrt(var + norm.eps)
        if norm.track_running_stats and norm.running_mean is not None:
            momentum = norm.momentum if norm.momentum is not None else (
                1.0 / float(norm.num_batches_tracked))
            with torch.no_grad():
                norm.running_mean.mul_(1 - momentum).add_(mean * momentum)
                norm.running_var.mul_(1 - momentum).add_(var * n / (n - 1) * momentum)
        out = (xf - mean.view(shape)) * invstd.view(shape)
        if weight is not None:
            out = out * weight.view(shape)
        if bias is not None:
            out = out + bias.view(shape)
        ctx.save_for_backward(x, weight, mean, invstd, n)
        ctx.group = group
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        from spmd.runtime.collectives import all_reduce

        x, weight, mean, invstd, n = ctx.saved_tensors
        dims = [0] + list(range(2, x.dim()))
        shape = [1, -1] + [1] * (x.dim() - 2)
        g = grad.float()
        xhat = (x.float() - mean.view(shape)) * invstd.view(shape)
        sg, sgx = g.sum(dims), (g * xhat).sum(dims)
        total = torch.cat([sg, sgx])
        all_reduce(total, group=ctx.group)
        c = x.shape[1]
        factor = invstd if weight is None else invstd * weight
        gx = (g - (total[:c] / n).view(shape) - xhat * (total[c:] / n).view(shape)
              ) * factor.view(shape)
        return (gx.to(x.dtype), None if weight is None else sgx.to(weight.dtype),
                None if weight is None else sg.to(weight.dtype), None, None)


class WholeBatchNorm(_BatchNorm):
    """A batch norm whose training statistics are the whole batch's (see the module doc)."""

    # the data-parallel group (None: one rank, or a simulated mesh)
    _spmd_group: Any = None

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if (self.training and self._spmd_group is not None
                and not torch.compiler.is_compiling()):
            self._check_input_dim(input)
            if self.track_running_stats and self.num_batches_tracked is not None:
                self.num_batches_tracked.add_(1)
            return _WholeStatistics.apply(input, self.weight, self.bias, self,
                                          self._spmd_group)
        return _BatchNorm.forward(self, input)


def prepare_batchnorms(module: nn.Module, options: Options, setup: Setup) -> Any:
    """Swap the batch norms of ``module`` when statistics must be whole (the options, with
    ``sync_batchnorm`` on where the model holds ``nn.SyncBatchNorm``)."""
    norms = [m for m in module.modules() if isinstance(m, _BatchNorm)]
    if any(isinstance(m, nn.SyncBatchNorm) for m in norms) and not options.sync_batchnorm:
        options = replace(options, sync_batchnorm=True)
    if not options.sync_batchnorm or not norms:
        return options
    strategy = setup.strategy
    if len(strategy.data_dims) > 1:
        raise NotImplementedError("sync_batchnorm: batch statistics across a batch split "
                                  "along several mesh dimensions (hsdp) are not supported")
    group = setup.group if setup.communicates else None
    for norm in norms:
        norm.__class__ = _whole_class(type(norm))
        norm._spmd_group = group
    return options


_CLASSES: dict[type, type] = {}


def _whole_class(cls: type) -> type:
    if issubclass(cls, WholeBatchNorm):
        return cls
    sub = _CLASSES.get(cls)
    if sub is None:
        bases = (WholeBatchNorm,) if issubclass(cls, nn.SyncBatchNorm) else (WholeBatchNorm, cls)
        sub = type(f"Whole{cls.__name__}", bases, {"__module__": cls.__module__})
        _CLASSES[cls] = sub
    return sub
