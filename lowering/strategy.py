"""Strategies say where the inputs of a graph live on the mesh; the passes do the rest.

A strategy names the mesh dimensions it uses and, for each input of a graph (parameter,
buffer or data), its :class:`~spmd.lowering.placements.Sharding`; for each parameter,
where its gradient must end up. Everything else (the placements of every other value,
the collectives, the buckets) is derived by the passes.

- ``ddp``: on the data-parallel dimension (named ``"dp"``, or the mesh's only one) the
  batch is ``Shard(0)``, parameters and buffers ``Replicate()``; the model runs per rank
  (DDP's semantics) and each parameter's gradient, ``Partial("avg")``, must become
  ``Replicate()``.

A mesh dimension no strategy uses is refused when larger than 1, naming it: its ranks
would each repeat the same work, which is never what the user meant.
"""

from __future__ import annotations

from dataclasses import dataclass

from spmd.lowering.state import InputInfo
from spmd.lowering.placements import Partial, Shard, Sharding
from spmd.runtime.mesh import Mesh

__all__ = ["Strategy", "resolve_strategy"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Strategy:
    """A strategy bound to a mesh: which dimension it uses, and the placements it implies."""

    name: str
    mesh: Mesh
    data_dim: str  # the dimension the batch is split along

    @property
    def data_size(self) -> int:
        return self.mesh.size(self.data_dim)

    def input_sharding(self, info: InputInfo) -> Sharding:
        """Where a graph input lives: data ``Shard(0)`` on the data dimension, everything
        else ``Replicate()``."""
        if info.kind == "data":
            return Sharding.on(self.mesh, {self.data_dim: Shard(0)})
        return Sharding.replicated(self.mesh)

    def local_gradient(self, param: str) -> Sharding:
        """Each rank's gradient of a parameter, computed on its own shard of the batch:
        ``Partial("avg")`` on the data dimension (the average over ranks is the gradient of
        the whole batch's mean loss); ``Replicate()`` when the dimension has one rank."""
        if self.data_size == 1:
            return Sharding.replicated(self.mesh)
        return Sharding.on(self.mesh, {self.data_dim: Partial("avg")})

    def gradient_target(self, param: str) -> Sharding:
        """Where a parameter's gradient must end up: where the parameter lives."""
        return Sharding.replicated(self.mesh)


def resolve_strategy(name: str, mesh: Mesh, where: str) -> Strategy:
    """The strategy ``name`` on ``mesh``; ``ValueError`` naming a dimension it cannot use."""
    if name != "ddp":
        raise ValueError(f"{where}: strategy {name!r} is not supported; expected 'ddp'")
    if "dp" in mesh.dim_names:
        data_dim = "dp"
    elif mesh.ndim == 1:
        data_dim = mesh.dim_names[0]
    else:
        raise ValueError(f"{where}: strategy 'ddp' splits the batch along a mesh dimension "
                         f"named 'dp'; mesh {mesh} has none")
    for dim, size in zip(mesh.dim_names, mesh.shape):
        if dim != data_dim and size > 1:
            raise ValueError(
                f"{where}: mesh dimension {dim!r} (size {size}) is not used by strategy "
                f"{name!r}, which places everything on {data_dim!r}; its {size} ranks would "
                f"repeat the same work. Pass a mesh without it (or of size 1 there)")
    return Strategy(name=name, mesh=mesh, data_dim=data_dim)
