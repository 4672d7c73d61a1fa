"""``spmd.parallelize``: the decorator, in every form users reach for.

    model = spmd.parallelize(Net())                  # an instance, parallelized in place
    @spmd.parallelize                                # a class: instances on construction
    class Net(nn.Module): ...
    @spmd.parallelize(bucket_cap_mb=4)               # with options
    def train_step(model, batch, opt): ...           # a whole training step

Options are keyword-only and checked before anything is traced; a bad one raises
``TypeError``/``ValueError`` naming it.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

import torch.nn as nn

from spmd.lowering.cost_model import CostModel
from spmd.lowering.options import Options
from spmd.runtime import context
from spmd.runtime.mesh import Mesh

__all__ = ["parallelize", "resolve_mesh"]


def resolve_mesh(mesh: Mesh | None, where: str) -> tuple[Any, int, str]:
    """(process group or None, data-parallel size, backend) for ``mesh``.

    The data-parallel dimension is the one named ``"dp"``, else the first.
    """
    from spmd.runtime import groups

    if mesh is None:
        if not groups.is_initialized():
            raise RuntimeError(
                f"{where}: there is no process group; call spmd.runtime.init_process_group() "
                f"first, or pass mesh=spmd.Mesh.simulated(n) to plan for n ranks without "
                f"processes")
        group = groups.world(where).default
        return group, group.size(), group.backend
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{where}: mesh must be an spmd.Mesh or None, got {type(mesh).__name__}")
    dim = "dp" if "dp" in mesh.dim_names else 0
    if mesh.simulated:
        return None, mesh.size(dim), "gloo"
    group = mesh.get_group(dim)
    return group, group.size(), group.backend


def _signature(module: nn.Module) -> list[tuple]:
    sig = [("parameter", n, tuple(p.shape), str(p.dtype), p.requires_grad)
           for n, p in module.named_parameters()]
    sig += [("buffer", n, tuple(b.shape), str(b.dtype), False) for n, b in module.named_buffers()]
    return sig


def check_same_model(module: nn.Module, group: Any, where: str) -> None:
    """Every rank of ``group`` must hold the same parameters and buffers (names, shapes,
    dtypes, trainability); ``ValueError`` naming the first difference otherwise."""
    from spmd.runtime.objects import all_gather_object

    mine = _signature(module)
    every: list[Any] = [None] * group.size()
    all_gather_object(every, mine, group=group)
    reference = every[0]
    for r, sig in enumerate(every[1:], start=1):
        if sig == reference:
            continue
        rank, first = group.ranks[r], group.ranks[0]
        for a, b in zip(reference, sig):
            if a != b:
                raise ValueError(
                    f"{where}: the model differs across ranks: {a[0]} {a[1]!r} is "
                    f"shape={a[2]}, dtype={a[3]}, requires_grad={a[4]} on rank {first} but "
                    f"{b[0]} {b[1]!r} is shape={b[2]}, dtype={b[3]}, requires_grad={b[4]} on "
                    f"rank {rank}")
        raise ValueError(f"{where}: the model differs across ranks: rank {first} has "
                         f"{len(reference)} parameters and buffers, rank {rank} has {len(sig)}")


def cost_model_for(group: Any, world_size: int, backend: str, options: Options) -> CostModel:
    """The cost model every rank of ``group`` plans with: defaults, calibrated on the live
    group when asked, with the overlap share of this machine; decided on the group's
    first rank and shared, so every rank derives the same buckets."""
    import os

    import torch

    from spmd.lowering.cost_model import overlap_share

    model = CostModel.default(backend, world_size)
    if group is not None and world_size > 1 and options.calibrate:
        from spmd.lowering.calibrate import calibrate

        model = calibrate(group, model)
    # ranks sharing this machine: the launcher says; a live group without one is taken as
    # one machine; a simulated mesh plans for the machine it runs on, whatever its size
    local = int(context.getenv("LOCAL_WORLD_SIZE") or (world_size if group is not None else 1))
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    share, why = overlap_share(backend, local, cores, torch.get_num_threads())
    model = replace(model, overlap=share, source=f"{model.source}; overlap {share:g}: {why}")
    if group is not None and world_size > 1:
        from spmd.runtime.objects import broadcast_object_list

        box = [model]
        broadcast_object_list(box, src=group.ranks[0], group=group)
        model = box[0]
    return model


def _next_index() -> int:
    state = context.current().state
    state["spmd_models"] = state.get("spmd_models", 0) + 1
    return state["spmd_models"]


def prepare_model(module: nn.Module, options: Options, mesh: Mesh | None,
                  where: str) -> tuple[Any, int, CostModel, int]:
    """What every rank does before it parallelizes ``module``, in the same order everywhere:
    resolve the mesh, check the model is the same on every rank, agree on the cost model,
    and overwrite parameters and buffers with the group's first rank's.

    Returns:
        (process group or None, data-parallel size, cost model, the model's index on
        this rank, the same on every rank).
    """
    from spmd.reducer import broadcast_coalesced

    group, world_size, backend = resolve_mesh(mesh, where)
    live = group is not None and world_size > 1
    if live:
        check_same_model(module, group, where)
    cost_model = cost_model_for(group, world_size, backend, options)
    index = _next_index()
    if live:
        broadcast_coalesced([*module.parameters(), *module.buffers()], group.ranks[0], group)
    return group, world_size, cost_model, index


def _parallelize_instance(module: nn.Module, options: Options, mesh: Mesh | None) -> nn.Module:
    from spmd.module import DataParallel, parallelize_module

    if isinstance(module, DataParallel):
        raise ValueError("parallelize: this module is already parallelized")
    group, world_size, cost_model, index = prepare_model(
        module, options, mesh, f"parallelize({type(module).__name__})")
    return parallelize_module(module, options, group, world_size, index, cost_model)


def _parallelize_class(cls: type, options: Options, mesh: Mesh | None) -> type:
    """A subclass whose instances are parallelized when constructed."""
    original_init = cls.__init__

    @functools.wraps(original_init)
    def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        if type(self) is new_cls:  # subclasses of the decorated class parallelize once
            _parallelize_instance(self, options, mesh)

    new_cls = type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__,
                                          "__doc__": cls.__doc__})
    return new_cls


def parallelize(obj: Any = None, *, mesh: Mesh | None = None, strategy: str = "ddp",
                bucket_cap_mb: float | None = None, overlap: bool = True,
                reduce_dtype: Any = None, broadcast_buffers: bool = True,
                compile_compute: bool | None = None, calibrate: bool = False) -> Any:
    """Data-parallel training, planned by a compiler: capture, bucket, overlap, run.

    Args:
        obj: an ``nn.Module`` instance (parallelized in place and returned), an
            ``nn.Module`` subclass (its instances are parallelized when constructed; the
            decorator itself needs no process group), or a whole training-step function
            ``fn(model, batch, optimizer, ...)``. Omitted: returns a decorator.
        mesh: where to run; None is the default process group; ``Mesh.simulated(n)`` plans
            for n ranks without processes (collectives then do nothing).
        strategy: ``"ddp"``: parameters replicated, batch sharded, gradients averaged.
        bucket_cap_mb: gradient bytes per all-reduce (MiB); None: the cost model decides;
            0: one all-reduce per parameter.
        overlap: start each bucket's all-reduce as soon as its gradients exist.
        reduce_dtype: dtype of gradients on the wire (e.g. ``torch.bfloat16``).
        broadcast_buffers: broadcast buffers from rank 0 before each training forward.
        compile_compute: Inductor for the graphs' compute (True), generated Python (False),
            or the planner's choice (None).
        calibrate: measure the collective cost model on the live group first.

    Returns:
        The parallelized module, class or step function; with ``obj`` omitted, a decorator.

    Example::

        dist.init_process_group("gloo")
        model = spmd.parallelize(Net(), bucket_cap_mb=4)
        loss_fn(model(x), y).backward()          # .grad arrives averaged across ranks
        print(spmd.inspect(model))
    """
    options = Options.from_kwargs(
        "parallelize", strategy=strategy, bucket_cap_mb=bucket_cap_mb, overlap=overlap,
        reduce_dtype=reduce_dtype, broadcast_buffers=broadcast_buffers,
        compile_compute=compile_compute, calibrate=calibrate)
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(f"parallelize: mesh must be an spmd.Mesh or None, got "
                        f"{type(mesh).__name__}")

    def apply(target: Any) -> Any:
        if isinstance(target, nn.Module):
            return _parallelize_instance(target, options, mesh)
        if isinstance(target, type) and issubclass(target, nn.Module):
            return _parallelize_class(target, options, mesh)
        if callable(target):
            from spmd.step import ParallelStep

            return ParallelStep(target, options, mesh)
        raise TypeError(f"parallelize: expected an nn.Module, an nn.Module subclass or a "
                        f"training-step function, got {type(target).__name__}")

    return apply if obj is None else apply(obj)
