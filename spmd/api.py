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

from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch

from spmd.lowering.options import Options
from spmd.lowering.placements import Placement, Shard
from spmd.program.build import build
from spmd.runtime.mesh import Mesh

if TYPE_CHECKING:
    from spmd.cp import ContextParallel
    from spmd.pp import Schedule
    from spmd.tp import Preset

    # what ``placements=`` takes: patterns per mesh dimension, a preset
    # (``spmd.tp.megatron()``, ``spmd.cp.ring()``), or a list of them
    Spec = Mapping[str, Mapping[str, Placement]]
    Placements = Spec | Preset | ContextParallel | Sequence[Spec | Preset | ContextParallel]

__all__ = ["parallelize"]


def parallelize(obj: Any = None, *, mesh: Mesh | None = None, strategy: str = "ddp",
                reshard_after_forward: bool | int = True, param_dtype: torch.dtype | None = None,
                bucket_cap_mb: float | None = None, overlap: bool = True,
                reduce_dtype: torch.dtype | None = None, broadcast_buffers: bool = True,
                compile_compute: bool | None = None, calibrate: bool = False,
                placements: Placements | None = None,
                comm_hook: Callable[..., Any] | None = None, comm_state: Any = None,
                sync_batchnorm: bool = False,
                shard_placement_fn: Callable[[torch.nn.Parameter], Shard | None] | None = None,
                pipeline: Schedule | None = None,
                memory_budget: int | float | str | None = None) -> Any:
    """Data parallelism and parameter sharding, planned by a compiler: capture, bucket,
    overlap, run.

    Args:
        obj: an ``nn.Module`` instance (parallelized in place and returned), an
            ``nn.Module`` subclass (its instances are parallelized when constructed; the
            decorator itself needs no process group), or a whole training-step function
            ``fn(model, batch, optimizer, ...)``. Omitted: returns a decorator.
        mesh: where to run; None is the default process group (a 1-D mesh ``"dp"``);
            ``Mesh.simulated(n)`` plans for n ranks without processes (collectives then do
            nothing). On a mesh of several dimensions the strategy says which it uses;
            another dimension larger than 1 is refused, naming it.
        strategy: ``"ddp"``: parameters replicated, batch sharded along the ``"dp"``
            dimension (or the mesh's only one), gradients averaged. ``"fsdp"`` (ZeRO-3):
            every parameter stored as its dim-0 shard along the ``"fsdp"`` (or ``"dp"``,
            or only) dimension, so its gradient and optimizer state are too; the
            compiler gathers parameters (bucketed, one bucket ahead) where they are used
            and reduce-scatters their gradients. ``"hsdp"``: ``fsdp`` along ``"fsdp"``,
            replicated along ``"dp"`` of a 2-D mesh; ``"fsdp"`` on a mesh of ``"dp"``
            and ``"fsdp"`` shards over both at once (2-D). ``"zero2"``/``"zero1"``
            (DeepSpeed's ZeRO stages): stored as ``fsdp`` stores, gathered once per
            optimizer step and kept whole; ``zero1`` all-reduces gradients whole.
            ``"auto"`` (:mod:`spmd.auto.search`): the compiler chooses among those, Megatron
            pieces of ``placements`` (each parameter group its piece or replicated) and
            recomputing blocks, the fastest predicted layout within ``memory_budget``; it
            searches at the first call (on the first rank, sent to the others), then
            parallelizes the model in place with the choice.
        reshard_after_forward: (``fsdp``/``hsdp``) free gathered parameters after the
            forward and gather them again in backward (True), keep them (False), or
            (an int N, FSDP2's) keep 1/N of each and gather it again among N consecutive
            ranks of the sharding dimension (N ranks per host: the backward's gathers
            stay on the host's links).
        param_dtype: (``fsdp``/``hsdp``) gather and compute in this dtype (mixed
            precision); the shards, gradients and optimizer stay in the parameters'.
        bucket_cap_mb: gradient bytes per all-reduce (MiB); None: the cost model decides;
            0: one all-reduce per parameter.
        overlap: start each bucket's all-reduce as soon as its gradients exist.
        reduce_dtype: dtype of gradients on the wire (e.g. ``torch.bfloat16``,
            ``torch.float8_e4m3fn``; for ``fsdp`` with ``param_dtype``, e.g.
            ``torch.float32`` to reduce exactly). With ``ddp``, where the backend would
            add in that dtype (bfloat16/float16 over more than 2 ranks, float8 always),
            spmd adds in float32 instead: the result is rounded once.
        broadcast_buffers: broadcast buffers from rank 0 before each training forward.
        compile_compute: Inductor for the graphs' compute (True), generated Python (False),
            or the planner's choice (None).
        calibrate: measure the collective cost model on the live group first.
        sync_batchnorm: batch norms normalise by the whole batch's statistics (as
            ``nn.SyncBatchNorm``; a model holding those turns it on): the compiler makes
            each layer's statistics and their gradients whole with one all-reduce each.
        comm_hook: a communication hook with torch's DDP signature, ``hook(state,
            bucket) -> Future``, e.g. ``torch.distributed.algorithms.ddp_comm_hooks
            .default_hooks.bf16_compress_hook`` or ``powerSGD_hook``; it reduces every
            gradient bucket (``ddp``).
        comm_state: the hook's state (e.g. a ``PowerSGDState``).
        placements: tensor parallelism (``spmd.tp``), context parallelism (``spmd.cp``)
            and expert parallelism (``spmd.ep.experts()``: a mixture's experts split by
            expert index along a data dimension), alone or in a list. For tensor
            parallelism: where parameters live on named mesh
            dimensions, ``{"tp": {"layers.*.linear1.weight": spmd.Shard(0), ...}}`` (glob
            patterns over parameter names; unnamed parameters are replicated there; a
            pattern that names modules instead places their outputs, as sequence
            parallelism does: ``"layers.*.norm": spmd.Shard(1)``), or a preset such as
            ``spmd.tp.megatron(sequence_parallel=True)``. Those dimensions are not data
            dimensions: ``strategy`` runs along the others.
        shard_placement_fn: (sharded strategies) FSDP2's ``shard_placement_fn``:
            ``fn(param) -> spmd.Shard(d) | None`` chooses the dimension each parameter is
            sharded along (None: dim 0, padded where it does not divide); another
            dimension must divide evenly. ``spmd.shard_evenly`` chooses, per parameter,
            dim 0 where it divides, else the first dimension that does (no padding).
        memory_budget: (``"auto"``) the predicted peak per rank the layout must fit:
            bytes, or ``"70GiB"``, ``"512MiB"``, ``"80GB"``; None: no limit. Memory is
            counted with AdamW's state.

    Returns:
        The parallelized module, class or step function; with ``obj`` omitted, a decorator.

    Example::

        dist.init_process_group("gloo")
        model = spmd.parallelize(Net(), bucket_cap_mb=4)
        loss_fn(model(x), y).backward()          # .grad arrives averaged across ranks
        print(spmd.inspect(model))
    """
    if strategy == "auto":
        from spmd.auto.live import parallelize_auto

        if pipeline is not None:
            raise TypeError("parallelize: strategy='auto' with pipeline= is searched by "
                            "spmd.inspect(model, x, mesh=Mesh.simulated(...), strategy='auto', "
                            "pipeline=..., loss_fn=, target=); parallelize the pipeline with "
                            "the strategy it chooses")
        rest = dict(reshard_after_forward=reshard_after_forward, param_dtype=param_dtype,
                    bucket_cap_mb=bucket_cap_mb, overlap=overlap, reduce_dtype=reduce_dtype,
                    broadcast_buffers=broadcast_buffers, compile_compute=compile_compute,
                    calibrate=calibrate, comm_hook=comm_hook, comm_state=comm_state,
                    sync_batchnorm=sync_batchnorm, shard_placement_fn=shard_placement_fn)
        Options.from_kwargs("parallelize", strategy="ddp", placements=placements, **rest)
        if mesh is not None and not isinstance(mesh, Mesh):
            raise TypeError(f"parallelize: mesh must be an spmd.Mesh or None, got "
                            f"{type(mesh).__name__}")

        def auto(target: Any) -> Any:
            return parallelize_auto(target, mesh, memory_budget, placements, rest,
                                    f"parallelize({type(target).__name__})")

        return auto if obj is None else auto(obj)
    if memory_budget is not None:
        raise TypeError("parallelize: memory_budget= is the budget of strategy='auto'")
    options = Options.from_kwargs(
        "parallelize", strategy=strategy, reshard_after_forward=reshard_after_forward,
        param_dtype=param_dtype, bucket_cap_mb=bucket_cap_mb, overlap=overlap,
        reduce_dtype=reduce_dtype, broadcast_buffers=broadcast_buffers,
        compile_compute=compile_compute, calibrate=calibrate, placements=placements,
        comm_hook=comm_hook, comm_state=comm_state, sync_batchnorm=sync_batchnorm,
        shard_placement_fn=shard_placement_fn, pipeline=pipeline)
    if mesh is not None:
        if not isinstance(mesh, Mesh):
            raise TypeError(f"parallelize: mesh must be an spmd.Mesh or None, got "
                            f"{type(mesh).__name__}")
        from spmd.lowering.strategy import flatten_data_dims, resolve_strategy
        from spmd.tp import tp_dims_of

        # refuse a mesh it cannot use (before any group is made: on a simulated copy);
        # with a pipeline, the dimensions its stages run on
        dims = [(n, s) for n, s in zip(mesh.dim_names, mesh.shape)]
        if pipeline is not None:
            from spmd.pipeline.module import check_pipeline

            check_pipeline(pipeline, mesh, "parallelize")
            dims = [(n, s) for n, s in dims if n != pipeline.dim]
        if dims:
            tp_dims = tp_dims_of(placements)
            shape = flatten_data_dims(
                options.strategy, Mesh.simulated([s for _, s in dims], [n for n, _ in dims]),
                "parallelize", tp_dims)
            resolve_strategy(options.strategy, shape, "parallelize", tp_dims)

    def apply(target: Any) -> Any:
        return build(target, options, mesh)

    return apply if obj is None else apply(obj)
