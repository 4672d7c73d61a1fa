"""Parallelizing an ``nn.Module`` instance in place: the class swap.

The instance is kept (no wrapper, so ``state_dict()`` keys, hooks, ``.train()`` and
``isinstance`` are untouched); its class is swapped for a generated subclass of
:class:`DataParallel` and the model's class whose ``forward`` runs the captured graphs
(:class:`~spmd.program.module.ModuleState`) and which adds DDP's methods (``module``,
``join``, ``register_comm_hook``, ``no_sync``, ``clip_grad_norm_``), as FSDP2 does."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn as nn

from spmd.lowering.options import Options
from spmd.program.module import ModuleState
from spmd.program.setup import Setup
from spmd.runtime.mesh import Mesh

__all__ = ["DataParallel", "parallelize_module", "parallelize_instance"]


class DataParallel:
    """Methods the generated subclass adds to a parallelized module."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        state: ModuleState = self._spmd  # type: ignore[attr-defined]
        return state.forward(self, self._spmd_original_forward, *args, **kwargs)

    @property
    def module(self) -> nn.Module:
        """The model itself, as ``DistributedDataParallel.module`` gives the wrapped model
        (code written for DDP reads ``model.module.state_dict()``); a child the model
        itself named ``module`` wins."""
        own = self._modules.get("module")  # type: ignore[attr-defined]
        return own if own is not None else self  # type: ignore[return-value]

    @module.setter
    def module(self, value: nn.Module) -> None:
        nn.Module.__setattr__(self, "module", value)  # type: ignore[arg-type]

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Any:
        """A context for uneven inputs (:class:`spmd.Join` over this model), as
        ``DistributedDataParallel.join``: ranks that run out of batches shadow the others'
        collectives until all are done, and all end with the same parameters."""
        from spmd.eager.join import Join

        return Join([self], enable=enable,  # type: ignore[list-item]
                    throw_on_early_termination=throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        """Reduce every gradient bucket with ``hook(state, bucket) -> Future``, as
        ``DistributedDataParallel.register_comm_hook`` does (torch's hooks work as they
        are: ``bf16_compress_hook``, ``powerSGD_hook`` with a ``PowerSGDState``, ...);
        ``parallelize(comm_hook=, comm_state=)`` is the same from the start. Once, before
        the first backward, on every rank."""
        from spmd.lowering.reduction import check_hook

        st: ModuleState = self._spmd  # type: ignore[attr-defined]
        where = "register_comm_hook"
        check_hook(hook, where)
        if st.sync.comm_hook is not None:
            raise RuntimeError(f"{where}: a communication hook is already registered; it can "
                               f"be registered only once, as with DDP")
        if st.sharded or st.options.reduce_dtype is not None:
            raise ValueError(f"{where}: communication hooks reduce 'ddp' all-reduce buckets "
                             f"without reduce_dtype (the hook decides the wire format)")
        st.sync.comm_hook, st.sync.comm_state = hook, state

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Skip gradient averaging in this context (gradient accumulation), as DDP does:
        the next backward outside it averages everything accumulated. Sharded strategies
        reduce-scatter every backward anyway (a gradient must stay a shard); the
        accumulated result is the same."""
        return self._spmd.no_sync()  # type: ignore[attr-defined]

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients by the norm of the whole gradient, as
        ``torch.nn.utils.clip_grad_norm_`` does on one process; the total norm.

        With ``fsdp``/``hsdp`` or tensor parallelism each rank holds parts of the
        gradients, whose local norm is not the norm: this sums the ranks' parts first
        (torch's function on ``model.parameters()`` is rerouted to do the same). Every
        rank must call it."""
        from spmd.eager.clip import clip_grad_norm_

        return clip_grad_norm_(self.parameters(), max_norm, norm_type)  # type: ignore


_SUBCLASSES: dict[type, type] = {}


def _parallel_class(cls: type) -> type:
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        sub = type(f"Parallel{cls.__name__}", (DataParallel, cls),
                   {"_spmd_original_forward": staticmethod(cls.forward),
                    "__module__": cls.__module__})
        _SUBCLASSES[cls] = sub
    return sub


def parallelize_module(module: nn.Module, options: Options, setup: Setup) -> nn.Module:
    """Turn ``module`` (in place) into a data-parallel module; returns it. The caller has
    set it up on every rank first (``spmd.program.setup.prepare_model``)."""
    from spmd.eager.batchnorm import prepare_batchnorms
    from spmd.state.ownership import own

    options = prepare_batchnorms(module, options, setup)
    state = ModuleState(module, options, setup)
    module.__class__ = _parallel_class(type(module))
    module._spmd = state
    own(module, f"parallelize({type(module).__name__.removeprefix('Parallel')})")
    return module


def parallelize_instance(module: nn.Module, options: Options, mesh: Mesh) -> nn.Module:
    """``parallelize(module, ...)`` of an instance, in place: its setup on ``mesh`` (the
    strategy resolved, every rank's copy checked and broadcast), then its parallel class."""
    from spmd.program.setup import prepare_model

    if isinstance(module, DataParallel):
        raise ValueError("parallelize: this module is already parallelized")
    setup = prepare_model(module, options, mesh, f"parallelize({type(module).__name__})")
    return parallelize_module(module, options, setup)
