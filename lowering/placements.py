"""Where a tensor lives across the ranks of a mesh dimension (DTensor's vocabulary).

- ``Replicate()``: every rank holds the whole tensor, the same values.
- ``Shard(dim)``: every rank holds one slice along ``dim``.
- ``Partial(reduce_op)``: every rank holds a partial value; the true value is their
  reduction (``"sum"`` or ``"avg"``). A gradient of a replicated parameter computed on a
  shard of the batch is ``Partial("avg")``: the all-reduce that makes it ``Replicate``
  is the collective data parallelism inserts.

Placements are frozen, hashable specs: they key caches and appear in plans.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Placement", "Replicate", "Shard", "Partial"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """Base of the placements."""

    def is_replicate(self) -> bool:
        return isinstance(self, Replicate)

    def is_partial(self) -> bool:
        return isinstance(self, Partial)


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
class Partial(Placement):
    reduce_op: str = "sum"

    def __post_init__(self) -> None:
        if self.reduce_op not in ("sum", "avg"):
            raise ValueError(f"Partial reduce_op must be 'sum' or 'avg', got {self.reduce_op!r}")

    def __repr__(self) -> str:
        return f"Partial({self.reduce_op!r})"
