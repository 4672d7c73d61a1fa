"""spmd.runtime.optim: the distributed optimizer.

``DistributedOptimizer`` is ``torch.distributed.optim.DistributedOptimizer`` over
``spmd.runtime.rpc``: one local optimizer on each worker that owns parameters, each
stepping with the gradients a distributed autograd context accumulated there.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

__all__ = ["DistributedOptimizer", "ZeroRedundancyOptimizer", "PostLocalSGDOptimizer"]


class _LocalOptimizer:
    """Lives on a parameters' owner; steps are serialised there (several trainers may
    share one parameter server), as PyTorch's ``_LocalOptimizer`` does."""

    lock = threading.Lock()

    def __init__(self, optimizer_class: type, params_rref: list, *args: Any,
                 **kwargs: Any) -> None:
        self.params = [rref.local_value() for rref in params_rref]
        self.optim = optimizer_class(self.params, *args, **kwargs)

    def step(self, context_id: int) -> None:
        from spmd.runtime.autograd import get_gradients

        grads = get_gradients(context_id)
        with _LocalOptimizer.lock:
            for param in self.params:
                param.grad = grads.get(param)
            self.optim.step()


def _new_local(optimizer_class: type, params_rref: list, args: tuple, kwargs: dict
               ) -> _LocalOptimizer:
    return _LocalOptimizer(optimizer_class, params_rref, *args, **kwargs)


def _local_step(optimizer_rref: Any, context_id: int) -> None:
    optimizer_rref.local_value().step(context_id)


class DistributedOptimizer:
    """One ``optimizer_class`` per owner of the parameters in ``params_rref``.

    Args:
        optimizer_class: a ``torch.optim.Optimizer`` class, built on each owner as
            ``optimizer_class(params, *args, **kwargs)``.
        params_rref: RRefs of the parameters (owned anywhere, this worker included).

    Example::

        opt = DistributedOptimizer(torch.optim.SGD, param_rrefs, lr=0.05)
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, [loss])
            opt.step(cid)               # every owner steps at once
    """

    def __init__(self, optimizer_class: type, params_rref: Sequence[Any], *args: Any,
                 **kwargs: Any) -> None:
        from spmd.runtime import rpc

        if not isinstance(optimizer_class, type):
            raise TypeError(f"DistributedOptimizer: optimizer_class must be a class, got "
                            f"{type(optimizer_class).__name__}")
        if isinstance(params_rref, rpc.RRef) or not isinstance(params_rref, (list, tuple)):
            raise TypeError("DistributedOptimizer: params_rref must be a list of RRefs")
        if not params_rref:
            raise ValueError("DistributedOptimizer: params_rref is empty")
        by_owner: dict[Any, list] = {}
        for i, rref in enumerate(params_rref):
            if not isinstance(rref, rpc.RRef):
                raise TypeError(f"DistributedOptimizer: params_rref[{i}] is a "
                                f"{type(rref).__name__}, not an RRef")
            by_owner.setdefault(rref.owner(), []).append(rref)
        self.remote_optimizers = [
            rpc.remote(owner, _new_local, args=(optimizer_class, rrefs, args, kwargs))
            for owner, rrefs in by_owner.items()]
        for opt in self.remote_optimizers:
            opt._get_future().wait()  # a failed construction raises here, with its cause

    def step(self, context_id: int) -> None:
        """Apply the gradients of ``context_id`` on every owner, concurrently.

        Raises the first owner's error after all have finished.
        """
        from spmd.runtime import rpc

        if not isinstance(context_id, int) or isinstance(context_id, bool):
            raise TypeError(f"DistributedOptimizer.step: context_id must be an int, got "
                            f"{type(context_id).__name__}")
        futures = [rpc.rpc_async(opt.owner(), _local_step, args=(opt, context_id))
                   for opt in self.remote_optimizers]
        errors = []
        for future in futures:
            try:
                future.wait()
            except Exception as e:
                errors.append(e)
        if errors:
            raise errors[0]



# torch's own optimizers over process groups: they run on ours, since torch.distributed
# sees them (spmd.runtime.torch_groups); resolved on first use (they import torch's)
_TORCH_OPTIMIZERS = ("ZeroRedundancyOptimizer", "PostLocalSGDOptimizer")


def __getattr__(name: str) -> Any:
    if name in _TORCH_OPTIMIZERS:
        import torch.distributed.optim as torch_optim

        return getattr(torch_optim, name)
    raise AttributeError(f"module 'spmd.runtime.optim' has no attribute {name!r}")
