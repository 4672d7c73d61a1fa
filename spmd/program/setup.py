"""What every rank does before it plans a model, module and whole step alike, in the same
order everywhere: resolve the mesh and the strategy on it, check the model is the same on
every rank, agree on the cost model, and overwrite parameters and buffers with the
group's first rank's."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn as nn

from spmd.lowering.cost_model import CostModel, along, overlap_share
from spmd.lowering.options import Options
from spmd.lowering.strategy import (Gathered, Reduced, Strategy, flatten_data_dims,
                                    resolve_strategy)
from spmd.runtime import context
from spmd.runtime.mesh import Mesh

__all__ = ["Setup", "resolve_mesh", "prepare_model", "check_same_model", "cost_model_for"]


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class Setup:
    """A model's place on the mesh, agreed by every rank.

    Attributes:
        strategy: the strategy bound to the mesh (``strategy.mesh``).
        group: the process group of every rank the batch is split over (the data
            dimension's); None on a simulated mesh.
        world_size: ranks in it.
        cost_model: the collective cost model every rank plans with.
        index: the how-many-th model this rank parallelized (the same on every rank).
        reshard_mesh: ``reshard_after_forward=N`` (1 < N < the sharding dimension's
            ranks): the mesh with the sharding dimension split into groups of N
            consecutive ranks (``"<dim>_across"``, ``"<dim>_within"``), whose
            ``"<dim>_within"`` groups the backward gathers among; None otherwise.
    """

    strategy: Strategy
    group: Any
    world_size: int
    cost_model: CostModel
    index: int
    reshard_mesh: Mesh | None = None

    @property
    def communicates(self) -> bool:
        """A live group of more than one rank: collectives run."""
        return self.group is not None and self.world_size > 1


def resolve_mesh(mesh: Mesh | None, where: str) -> Mesh:
    """``mesh``, or a 1-D mesh ``("dp",)`` over the default process group."""
    from spmd.runtime import groups

    if mesh is None:
        if not groups.is_initialized():
            raise RuntimeError(
                f"{where}: there is no process group; call spmd.runtime.init_process_group() "
                f"first, or pass mesh=spmd.Mesh.simulated(n) to plan for n ranks without "
                f"processes")
        return Mesh.from_group(groups.world(where).default, "dp")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{where}: mesh must be an spmd.Mesh or None, got {type(mesh).__name__}")
    return mesh


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


def cost_model_for(group: Any, world_size: int, backend: str, options: Options,
                   kinds: tuple[str, ...] = ("all_reduce",)) -> CostModel:
    """The cost model every rank of ``group`` plans with: defaults, calibrated on the live
    group when asked, the link between hosts probed where it spans some (its collectives
    of ``kinds`` timed), with the overlap share of this machine; decided on the group's
    first rank and shared, so every rank derives the same buckets."""
    model = CostModel.default(backend, world_size)
    if group is not None and world_size > 1 and options.calibrate:
        from spmd.lowering.calibrate import calibrate

        model = calibrate(group, model)
    if group is not None and world_size > 1:  # the link between hosts, where it spans some
        from spmd.lowering.calibrate import probe_network

        model = probe_network(group, model, kinds)
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


def _kinds(strategy: Strategy) -> tuple[str, ...]:
    """The collectives the data dimension runs: all-reduces (gradients, or an hsdp
    replica's average), and the gathers and reduce-scatters of sharded parameters or
    optimizer states."""
    kinds = ["all_reduce"]
    if strategy.gathered is not Gathered.NEVER or strategy.reduced in (
            Reduced.ALL_REDUCE_OWN_ROWS, Reduced.REDUCE_SCATTER):
        kinds.append("all_gather")
    if strategy.reduced is Reduced.REDUCE_SCATTER:
        kinds.append("reduce_scatter")
    return tuple(kinds)


def _next_index() -> int:
    state = context.current().state
    state["spmd_models"] = state.get("spmd_models", 0) + 1
    return state["spmd_models"]


def _data_group(strategy: Strategy) -> Any:
    """The group of every rank the batch is split over: the data dimension's, or for a
    batch split along several dimensions (``hsdp``) one over the whole mesh (the default
    group when the mesh is the world; a new group, which every rank of the world must
    create, otherwise)."""
    mesh = strategy.mesh
    if len(strategy.data_dims) == 1:
        return mesh.get_group(strategy.data_dim)
    whole = getattr(mesh, "_whole_group", None)  # a pipeline's stage mesh: made by all
    if whole is not None:
        return whole
    from spmd.runtime import groups

    state = groups.world("parallelize")
    if list(mesh.ranks) == list(range(state.size)):
        return state.default
    return groups.new_group(list(mesh.ranks))


def _check_materialized(module: nn.Module, where: str) -> None:
    """A model that is to train must hold data: a meta-device parameter is refused here,
    naming it, before any rank sends anything."""
    for kind, named in (("parameter", module.named_parameters()),
                        ("buffer", module.named_buffers())):
        for name, t in named:
            if t.is_meta:
                raise ValueError(
                    f"{where}: {kind} {name!r} is on the meta device (no data); materialize the "
                    f"model first (model.to_empty(device='cpu') and initialize it, or build "
                    f"it on a real device), or plan it without processes with "
                    f"spmd.inspect(model, ..., mesh=spmd.Mesh.simulated(n))")


def prepare_model(module: nn.Module, options: Options, mesh: Mesh | None,
                  where: str) -> Setup:
    """Set ``module`` up on every rank (see the module doc); the agreed :class:`Setup`."""
    from spmd.eager.reducer import broadcast_coalesced

    mesh = resolve_mesh(mesh, where)
    if not mesh.simulated:
        _check_materialized(module, where)
    placed: dict = {}
    dims: tuple[str, ...] = ()
    from spmd.ep import expert_parameters, split_experts

    placements, experts = split_experts(options.placements)
    if placements is not None:
        from spmd.tp import tp_dims_of

        dims = tp_dims_of(placements)
    mesh = flatten_data_dims(options.strategy, mesh, where, dims)  # 2-D fsdp
    if placements is not None:
        from dataclasses import replace as with_fields

        from spmd.state.resolve import layout_options, resolve_layout

        placed, activations = resolve_layout(module, mesh, placements, where)
        strategy = resolve_strategy(options.kind_name, mesh, where, dims, placed)
        strategy = with_fields(strategy, activations=activations,
                               **layout_options(placements))
    else:
        strategy = resolve_strategy(options.kind_name, mesh, where)
    if experts is not None:
        strategy = replace(strategy, experts=expert_parameters(
            experts, module, mesh, strategy, where))
    reshard_mesh = None
    if strategy.gathered is Gathered.REGROUPED:
        strategy, reshard_mesh = _regroup(strategy, options.reshard_after_forward, where)
    if options.shard_placement_fn is not None and strategy.shards_parameters:
        from dataclasses import replace as with_fields

        from spmd.state.layout import shard_dims_for

        strategy = with_fields(strategy, shard_dims=shard_dims_for(
            module, strategy, options.shard_placement_fn, where))
    group = None if mesh.simulated else _data_group(strategy)
    world_size = strategy.data_size
    backend = "gloo" if group is None else group.backend
    live = group is not None and world_size > 1
    if live:
        check_same_model(module, group, where)
    if mesh.hardware is not None:  # a simulated cluster: its links, not this machine
        cost_model = along(mesh, strategy.data_dim or mesh.dim_names[0], None)
    else:
        cost_model = cost_model_for(group, world_size, backend, options,
                                    _kinds(strategy))
    # only live models number their store keys: a plan on a simulated mesh made on one
    # rank alone (spmd.inspect, strategy="auto"'s search) must not shift the others'
    index = 0 if mesh.simulated else _next_index()
    if live:
        broadcast_coalesced([*module.parameters(), *module.buffers()], group.ranks[0], group)
    if strategy.tp_dims and not mesh.simulated:
        for dim in strategy.tp_dims:  # the ranks splitting a layer start from one model
            tp_group = mesh.get_group(dim)
            if tp_group.size() > 1:
                check_same_model(module, tp_group, where)
                broadcast_coalesced([*module.parameters(), *module.buffers()],
                                    tp_group.ranks[0], tp_group)
    return Setup(strategy=strategy, group=group, world_size=world_size, cost_model=cost_model,
                 index=index, reshard_mesh=reshard_mesh)


def _regroup(strategy: Strategy, n: int, where: str) -> tuple[Strategy, Mesh | None]:
    """``reshard_after_forward=n`` bound to the mesh: the strategy with ``reshard_to``,
    and the mesh whose ``"<dim>_within"`` groups of ``n`` ranks the backward gathers
    among (made here, on every rank, in the same order); ``ValueError`` for an ``n`` that
    does not divide the sharding dimension. As FSDP2: ``n`` equal to the dimension is
    ``True``'s behaviour, and 1 keeps the whole parameter (``False``'s memory)."""
    mesh, dim = strategy.mesh, strategy.shard_dim
    assert dim is not None
    size = mesh.size(dim)
    if n > size or size % n:
        raise ValueError(f"{where}: reshard_after_forward={n} must divide the {size} ranks of "
                         f"the sharding dimension {dim!r} (FSDP2's rule): the backward gathers "
                         f"among groups of {n} consecutive ranks")
    strategy = replace(strategy, reshard_to=n)
    if not 1 < n < size:
        return strategy, None
    return strategy, mesh.unflatten(dim, (size // n, n), (f"{dim}_across", f"{dim}_within"))
