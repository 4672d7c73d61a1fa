"""Where a tensor lives across the ranks of a mesh: one placement per mesh dimension
(DTensor's vocabulary), gathered with the mesh into a frozen :class:`Sharding` spec that
every value node of a planned graph carries in ``node.meta["sharding"]``.

- ``Replicate()``: every rank holds the whole tensor, the same values.
- ``Shard(dim)``: every rank holds one slice along ``dim``.
- ``Partial(reduce_op)``: every rank holds a partial value; the true value is their
  reduction (``"sum"`` or ``"avg"``). A gradient of a replicated parameter computed on a
  shard of the batch is ``Partial("avg")``: the all-reduce that makes it ``Replicate``
  is the collective data parallelism inserts.
- ``Varying()``: every rank holds its own value, computed from its own shard of the
  batch, with no global tensor behind it (JAX ``shard_map``'s device-varying values). Along
  a data-parallel dimension the model runs per rank, as DDP runs it: a batch norm's
  statistics or a loss are each rank's own, and nothing reduces them unless the strategy
  says so.

Placements and specs are frozen and hashable: they key caches and appear in plans.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from spmd.runtime.mesh import Mesh

__all__ = ["Placement", "Replicate", "Shard", "StridedShard", "Partial", "Varying",
           "Sharding", "divides"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """Base of the placements."""

    def is_replicate(self) -> bool:
        return isinstance(self, Replicate)

    def is_partial(self) -> bool:
        return isinstance(self, Partial)

    def is_shard(self, dim: int | None = None) -> bool:
        return isinstance(self, Shard) and (dim is None or self.dim == dim)


@dataclass(frozen=True, kw_only=True, slots=True)
class Replicate(Placement):
    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True, slots=True)
class Shard(Placement):
    dim: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise TypeError(f"Shard dim must be an int, got {self.dim!r}")

    def __repr__(self) -> str:
        return f"Shard({self.dim})"


@dataclass(frozen=True, slots=True)
class StridedShard(Placement):
    """Dimension ``dim`` read as ``split`` equal blocks, each block split across the
    ranks: rank r holds the r-th part of every block, the blocks in order. What a reshape
    merging a whole dimension (the batch) with a split one after it (the sequence, under
    context parallelism) leaves: ``[B, S] Shard(1) -> [B * S] StridedShard(0, split=B)``,
    and what splitting it back restores. ``StridedShard(d, 1)`` is ``Shard(d)``; it is
    not a ``Shard`` (rules that do not know it gather it)."""

    dim: int = 0
    split: int = 1

    def __post_init__(self) -> None:
        for name, v in (("dim", self.dim), ("split", self.split)):
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"StridedShard {name} must be an int, got {v!r}")
        if self.split < 1:
            raise ValueError(f"StridedShard split must be at least 1, got {self.split}")

    def __repr__(self) -> str:
        return f"StridedShard({self.dim}, split={self.split})"

    def blocks(self, shape: tuple[int, ...] | list[int]) -> list[int]:
        """``shape`` with dimension ``dim`` read as its ``split`` blocks: the shape in
        which this placement is ``Shard(dim + 1)``."""
        shape = list(shape)
        n = shape[self.dim]
        if n % self.split:
            raise ValueError(f"{self!r} of a dimension of {n}: the blocks do not divide it")
        return shape[:self.dim] + [self.split, n // self.split] + shape[self.dim + 1:]


@dataclass(frozen=True, slots=True)
class Partial(Placement):
    reduce_op: str = "sum"

    def __post_init__(self) -> None:
        if self.reduce_op not in ("sum", "avg"):
            raise ValueError(f"Partial reduce_op must be 'sum' or 'avg', got {self.reduce_op!r}")

    def __repr__(self) -> str:
        return f"Partial({self.reduce_op!r})"


@dataclass(frozen=True, kw_only=True, slots=True)
class Varying(Placement):
    def __repr__(self) -> str:
        return "Varying()"


@dataclass(frozen=True, kw_only=True, slots=True)
class Sharding:
    """A value's placement on every dimension of ``mesh`` (DTensor's ``DTensorSpec``, JAX's
    ``NamedSharding``).

    Example::

        Sharding(mesh=Mesh.simulated((2, 4), ("dp", "tp")),
                 placements=(Shard(0), Replicate()))
    """

    mesh: "Mesh"
    placements: tuple[Placement, ...]

    def __post_init__(self) -> None:
        if len(self.placements) != self.mesh.ndim:
            raise ValueError(f"Sharding has {len(self.placements)} placements for a mesh of "
                             f"{self.mesh.ndim} dimensions {self.mesh.dim_names}")
        for p in self.placements:
            if not isinstance(p, Placement) or type(p) is Placement:
                raise TypeError(f"Sharding placements must be Replicate, Shard, Partial or "
                                f"Varying, got {p!r}")

    @classmethod
    def replicated(cls, mesh: "Mesh") -> "Sharding":
        return cls(mesh=mesh, placements=(Replicate(),) * mesh.ndim)

    @classmethod
    def on(cls, mesh: "Mesh", placements: dict[str, Placement] | Sequence[Placement]
           ) -> "Sharding":
        """Placements by dimension name (the others ``Replicate()``) or in mesh order."""
        if isinstance(placements, dict):
            for name in placements:
                if name not in mesh.dim_names:
                    raise ValueError(f"mesh {mesh} has no dimension {name!r}")
            return cls(mesh=mesh, placements=tuple(placements.get(n, Replicate())
                                                   for n in mesh.dim_names))
        return cls(mesh=mesh, placements=tuple(placements))

    def __getitem__(self, dim: str | int) -> Placement:
        """The placement on mesh dimension ``dim`` (a name or an index)."""
        index = self.mesh.dim_names.index(dim) if isinstance(dim, str) else dim
        return self.placements[index]

    def with_placement(self, dim: str | int, placement: Placement) -> "Sharding":
        index = self.mesh.dim_names.index(dim) if isinstance(dim, str) else dim
        placements = list(self.placements)
        placements[index] = placement
        return Sharding(mesh=self.mesh, placements=tuple(placements))

    def is_replicated(self) -> bool:
        return all(p.is_replicate() for p in self.placements)

    def __repr__(self) -> str:
        dims = ", ".join(f"{n}: {p!r}" for n, p in zip(self.mesh.dim_names, self.placements))
        return f"Sharding({dims})"


def divides(p: Placement) -> bool:
    """Whether ``p`` splits its tensor across the ranks (``Shard`` or ``StridedShard``):
    each rank holds 1/size of dimension ``p.dim``."""
    return isinstance(p, (Shard, StridedShard))
