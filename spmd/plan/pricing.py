"""What each collective of a plan costs: the link its group runs on, the algorithm it
runs, and the collectives that run inside another's wait (hybrid sharding's average
across replicas), priced by the cost model (``spmd.lowering.cost_model``)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from spmd.lowering.cost_model import CostModel, TwoLevelCostModel, along
from spmd.lowering.state import CollectiveInfo
from spmd.runtime.mesh import Mesh

if TYPE_CHECKING:
    from spmd.program.setup import Setup

__all__ = ["model_of", "spec_of", "priced_as", "replica_all_reduce", "ReplicaAllReduce"]


def model_of(info: CollectiveInfo, mesh: Mesh, setup: "Setup") -> CostModel:
    """The cost model of the link ``info``'s collective runs on: its mesh dimension's,
    or, for the backward gathers of ``reshard_after_forward=N`` (``info.within``), the
    groups of N consecutive ranks of it (on a simulated cluster, the link those ranks
    share)."""
    model = along(mesh, info.mesh_dim, setup.cost_model)
    if not info.within:
        return model
    reshard_mesh = getattr(setup, "reshard_mesh", None)
    if reshard_mesh is not None:
        return along(reshard_mesh, f"{info.mesh_dim}_within", setup.cost_model)
    return replace(model, world_size=info.within)


def spec_of(info: CollectiveInfo) -> Any:
    """The runtime half (``CollectiveSpec``) of ``info``'s collective, if still held."""
    from spmd.lowering.specs import lookup

    try:
        return lookup(info.handle)
    except RuntimeError:
        return None


def priced_as(algorithm: str, model: CostModel, mesh: Mesh) -> str | None:
    """The algorithm a collective is priced by: the one it runs where the planner chose
    (the compressed or the two-level all-reduce); on this runtime's dimension across hosts
    (live, or simulated with a topology) the flat ring otherwise (what runs); on a
    hardware model's cluster the model's own choice (None, as NCCL chooses)."""
    if algorithm == "fp32":
        return algorithm
    if isinstance(model, TwoLevelCostModel) and mesh.hardware is None:
        return "hierarchical" if algorithm == "hierarchical" else "ring"
    return None


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplicaAllReduce:
    """Hybrid sharding's all-reduce of a bucket's reduced shards across the replicas."""

    bytes: int
    seconds: float
    dim: str
    replicas: int
    group: str
    ranks: tuple[int, ...]


def replica_all_reduce(info: CollectiveInfo, spec: Any, mesh: Mesh,
                       setup: "Setup") -> ReplicaAllReduce | None:
    """The all-reduce across replicas that follows a reduce-scatter of hybrid sharding
    (it runs in the bucket's wait, so it is no node of the graph), priced on the replica
    dimension's link; None for any other collective."""
    shards = getattr(spec, "shards", None)
    if info.kind != "reduce_scatter" or not shards or shards[0].replicate_size <= 1:
        return None
    first = shards[0]
    dim = first.replicate_dim
    nbytes = info.bytes // max(1, mesh.size(info.mesh_dim))  # the reduced shards
    model = along(mesh, dim, setup.cost_model)
    group = first.replicate_group
    return ReplicaAllReduce(
        bytes=nbytes, seconds=model.seconds("all_reduce", nbytes, priced_as("native", model, mesh)),
        dim=dim, replicas=first.replicate_size,
        group=group.name if group is not None else dim,
        ranks=tuple(group.ranks) if group is not None else ())
