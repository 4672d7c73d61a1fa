"""The eager safety net of a ``ddp`` model: every gradient no planned bucket averaged.

A gradient can reach a parameter from outside the compiled graphs at any step: a loss
term reading a parameter in eager code, a graph break on a new code path, a forward
Dynamo ran without a graph (its recompile limit), a model that could not be captured at
all, gradients accumulated under ``no_sync()``. A hook on every trainable parameter sees
each parameter's summed gradient once per backward; what a planned bucket already
averaged passes (one dictionary lookup), the rest goes to the :class:`EagerReducer`,
which sets ``.grad`` to what every rank held alike before (an earlier step's average, a
planned bucket's share) plus ``avg(part)`` once backward is over, and the parameter is
listed in the plan with the reason. Gradients accumulated under ``no_sync()`` are
averaged at the forward that ends it, before its backward adds to them: every rank
then holds the same bits. Sharded strategies need none: their
gathers' backward reduce-scatters every gradient, in a graph or eagerly.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from spmd.lowering.specs import SyncState
from spmd.eager.reducer import EagerReducer

__all__ = ["SafetyNet"]


class SafetyNet:
    """The hooks, the reducer and what they averaged for one model.

    Args:
        params: the model's parameters by name.
        sync: its ``no_sync`` switch and what the planned buckets reduced this step.
        fallbacks: parameter name -> why the safety net averaged it (the plan's list,
            shared with the model's state).
        reducer: averages the parts at the end of backward.
        active: the model has something to average here (several live ranks, ``ddp``).
    """

    def __init__(self, params: dict[str, torch.nn.Parameter], sync: SyncState,
                 fallbacks: dict[str, str], reducer: EagerReducer, active: bool) -> None:
        self.params, self.sync, self.fallbacks = params, sync, fallbacks
        self.reducer, self.active = reducer, active
        self.hooks: dict[str, Any] = {}
        self.accumulated = False  # gradients were accumulated under no_sync()
        self.finish_queued = False
        self.eager_forward: str | None = None  # why the last forward ran no graph, if so

    def hook_all(self) -> None:
        """A gradient hook on every trainable parameter (a layer unfrozen later gets its
        own at the next training forward).

        The hooks stay for the life of the model: a hook removed after the first steps
        would let a late eager gradient through unaveraged (BENCHMARKS.md measures the
        hooks' price per step)."""
        if not self.active:
            return
        for name, param in self.params.items():
            if param.requires_grad and name not in self.hooks:
                self.hooks[name] = param.register_hook(functools.partial(self._on_grad, name))

    def _on_grad(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """Every parameter's summed gradient for this backward passes here once (None
        where a graph gave it none: nothing to reduce, as eager leaves it)."""
        if grad is None or not self.sync.backward:  # (not: under no_sync(), kept locally)
            return grad
        if self.reducer.pending:
            self.queue_finish()
        key = grad.untyped_storage().data_ptr() if grad.layout is torch.strided else None
        if key in self.sync.reduced:
            return grad  # a planned bucket already averaged it
        part = grad.detach().clone()
        # what .grad holds before this backward adds to it (an earlier average, the same
        # on every rank); the hook runs before the accumulation
        prior = self.params[name].grad
        base = None if prior is None else prior.detach().clone()
        reason = self.eager_forward or ("received its gradient outside any compiled graph "
                                        "(graph break or eager code)")
        if any(name in s.params for s, _ in self.sync.reduced.values()):
            reason = "received gradient from a compiled graph and also from eager code"
            reduced = self._reduced_part(name).to(part.dtype)  # (averaged: alike)
            part = part - reduced
            base = reduced.clone() if base is None else base + reduced.to(base.dtype)
        self.fallbacks.setdefault(name, reason)
        self.reducer.add(self.params[name], part, base)
        self.queue_finish()
        return grad

    def _reduced_part(self, name: str) -> torch.Tensor:
        for spec, flat in self.sync.reduced.values():
            if name in spec.params:
                at = spec.params.index(name)
                start = sum(self.params[p].numel() for p in spec.params[:at])
                n = self.params[name].numel()
                return flat[start:start + n].view(self.params[name].shape)
        raise KeyError(name)

    def queue_finish(self) -> None:
        """Average what the reducer holds when this backward ends (once)."""
        if not self.finish_queued:
            self.finish_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _finish(self) -> None:
        self.finish_queued = False
        self.reducer.finish()

    def reduce_accumulated(self) -> None:
        """Gradients summed locally under no_sync() are averaged now, at the forward
        that ends it, before its backward adds this step's averaged gradients: every
        rank then holds the same bits (correcting them after backward would round
        differently on each rank, and replicas would drift apart)."""
        self.accumulated = False
        for param in self.params.values():
            if param.grad is not None:
                self.reducer.add(param, param.grad.detach().clone())
        self.reducer.finish()
