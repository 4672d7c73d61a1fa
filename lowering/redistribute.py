"""The redistribution table: for a (from, to) pair of placements on one mesh dimension,
the collective (or local operation) that turns one into the other, and its cost.

    Partial  -> Replicate   all_reduce
    Partial  -> Shard(d)    reduce_scatter
    Shard(d) -> Replicate   all_gather
    Replicate-> Shard(d)    slice          (local: each rank keeps its piece)
    Shard(i) -> Shard(j)    all_to_all
    Replicate-> Partial     zero / nothing (local: sum keeps one rank's copy; avg is as is)
    Partial  -> Partial     scale          (local: sum <-> avg)
    x        -> x           nothing
    x        -> Varying     nothing        (the local value, no global meaning kept)

``Varying`` values have no global tensor, so nothing redistributes them; ``Shard`` to
``Partial`` goes through ``Replicate``. A multi-dimensional redistribution is one step
per mesh dimension (:func:`plan_redistribution`). :func:`simulate` runs a step on the
local tensors of every rank in one process: the structural tests round-trip every pair
with it, and a simulated mesh's graph runs its collectives through it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Sequence

import torch

from spmd.lowering.placements import (Partial, Placement, Replicate, Shard, Sharding,
                                     StridedShard, Varying)

if TYPE_CHECKING:
    from spmd.lowering.cost_model import CostModel

__all__ = ["Step", "redistribution", "redistribution_path", "plan_redistribution", "simulate",
           "to_locals",
           "from_locals", "COLLECTIVES"]

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")


@dataclass(frozen=True, kw_only=True, slots=True)
class Step:
    """One row of the table: ``src -> dst`` on one mesh dimension by ``kind``.

    ``kind`` is a collective (``all_reduce``, ``reduce_scatter``, ``all_gather``,
    ``all_to_all``), a local operation (``slice``, ``zero``, ``scale``), or ``none``.
    """

    src: Placement
    dst: Placement
    kind: str
    mesh_dim: str = ""

    @property
    def communicates(self) -> bool:
        return self.kind in COLLECTIVES

    def seconds(self, global_bytes: int, cost_model: "CostModel", ranks: int) -> float:
        """Predicted time on a dimension of ``ranks`` for a tensor of ``global_bytes``
        (its whole size; the formulas take the buffer each rank sends or receives)."""
        if not self.communicates or ranks <= 1:
            return 0.0
        model = replace(cost_model, world_size=ranks)
        local = global_bytes // ranks
        nbytes = {"all_reduce": global_bytes, "reduce_scatter": global_bytes,
                  "all_gather": global_bytes, "all_to_all": local}[self.kind]
        return model.seconds(self.kind, nbytes)

    def __repr__(self) -> str:
        where = f" on {self.mesh_dim!r}" if self.mesh_dim else ""
        return f"{self.src!r} -> {self.dst!r}{where}: {self.kind}"


def redistribution(src: Placement, dst: Placement) -> Step:
    """The table's row for ``src -> dst``; ``ValueError`` for a pair no step realises."""
    if isinstance(src, Varying):
        if isinstance(dst, Varying):
            return Step(src=src, dst=dst, kind="none")
        raise ValueError(f"cannot redistribute Varying() to {dst!r}: a varying value is each "
                         f"rank's own, with no global tensor to place")
    if src == dst or isinstance(dst, Varying):
        return Step(src=src, dst=dst, kind="none")
    if isinstance(src, StridedShard) or isinstance(dst, StridedShard):
        # as Shard(dim + 1) of the tensor viewed with the blocks split out
        if isinstance(src, StridedShard) and isinstance(dst, Replicate):
            return Step(src=src, dst=dst, kind="all_gather")
        if isinstance(src, Partial) and isinstance(dst, StridedShard):
            return Step(src=src, dst=dst, kind="reduce_scatter")
        if isinstance(src, Replicate) and isinstance(dst, StridedShard):
            return Step(src=src, dst=dst, kind="slice")
        raise ValueError(f"cannot redistribute {src!r} to {dst!r} in one step; gather it to "
                         f"Replicate() first")
    if isinstance(src, Partial):
        if isinstance(dst, Replicate):
            return Step(src=src, dst=dst, kind="all_reduce")
        if isinstance(dst, Shard):
            return Step(src=src, dst=dst, kind="reduce_scatter")
        return Step(src=src, dst=dst, kind="scale")  # Partial(sum) <-> Partial(avg)
    if isinstance(src, Shard):
        if isinstance(dst, Replicate):
            return Step(src=src, dst=dst, kind="all_gather")
        if isinstance(dst, Shard):
            return Step(src=src, dst=dst, kind="all_to_all")
        raise ValueError(f"cannot redistribute {src!r} to {dst!r} in one step; gather it to "
                         f"Replicate() first")
    # src is Replicate
    if isinstance(dst, Shard):
        return Step(src=src, dst=dst, kind="slice")
    return Step(src=src, dst=dst, kind="zero" if dst.reduce_op == "sum" else "none")


def redistribution_path(src: Placement, dst: Placement) -> list[Step]:
    """The steps from ``src`` to ``dst`` on one mesh dimension: the table's one step, or,
    for a pair with a ``StridedShard`` that no one step realises (a fused gate/up
    projection's gradient, strided by the ``chunk`` after it, brought to the contiguous
    ``Shard(0)`` its weight is stored in), gathered to ``Replicate()`` and placed from
    there. ``ValueError`` for a pair neither reaches."""
    try:
        return [redistribution(src, dst)]
    except ValueError:
        if not (isinstance(src, StridedShard) or isinstance(dst, StridedShard)):
            raise
        return [redistribution(src, Replicate()), redistribution(Replicate(), dst)]


def plan_redistribution(src: Sharding, dst: Sharding) -> list[Step]:
    """The steps from ``src`` to ``dst``, one per mesh dimension that changes, in mesh
    order; every placement must already refer to the same mesh."""
    if src.mesh != dst.mesh:
        raise ValueError(f"cannot redistribute between different meshes ({src.mesh} and "
                         f"{dst.mesh})")
    steps = []
    for name, a, b in zip(src.mesh.dim_names, src.placements, dst.placements):
        step = redistribution(a, b)
        if step.kind != "none":
            steps.append(replace(step, mesh_dim=name))
    return steps


# -- the table, executed on every rank's local tensors in one process ---------------------


def to_locals(value: torch.Tensor, placement: Placement, ranks: int,
              generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """Each rank's local tensor for a global ``value`` placed as ``placement``; a
    ``Partial`` is cut into random parts that reduce back to ``value``."""
    if isinstance(placement, Replicate):
        return [value.clone() for _ in range(ranks)]
    if isinstance(placement, Shard):
        return [c.clone() for c in _chunks(value, ranks, placement.dim)]
    if isinstance(placement, StridedShard):
        d = placement.dim
        blocked = value.reshape(placement.blocks(value.shape))
        return [c.flatten(d, d + 1).clone() for c in _chunks(blocked, ranks, d + 1)]
    if isinstance(placement, Partial):
        parts = [torch.randn(value.shape, generator=generator, dtype=value.dtype)
                 for _ in range(ranks - 1)]
        total = value * ranks if placement.reduce_op == "avg" else value
        last = total - sum(parts, torch.zeros_like(value))
        return parts + [last]
    raise ValueError(f"{placement!r} has no global value to cut into local tensors")


def from_locals(locals_: Sequence[torch.Tensor], placement: Placement) -> torch.Tensor:
    """The global value ``locals_`` hold under ``placement`` (checking replicas agree)."""
    if isinstance(placement, Replicate):
        for t in locals_[1:]:
            if not torch.equal(t, locals_[0]):
                raise AssertionError("replicas differ across ranks")
        return locals_[0]
    if isinstance(placement, Shard):
        return torch.cat(list(locals_), dim=placement.dim)
    if isinstance(placement, StridedShard):
        d = placement.dim
        blocked = [t.reshape(StridedShard(d, placement.split).blocks(t.shape))
                   for t in locals_]
        return torch.cat(blocked, dim=d + 1).flatten(d, d + 1)
    if isinstance(placement, Partial):
        total = sum(locals_[1:], locals_[0].clone())
        return total / len(locals_) if placement.reduce_op == "avg" else total
    raise ValueError(f"{placement!r} has no global value")


def _chunks(value: torch.Tensor, ranks: int, dim: int) -> list[torch.Tensor]:
    if value.shape[dim] % ranks:
        raise ValueError(f"Shard({dim}) of a tensor of shape {tuple(value.shape)} over {ranks} "
                         f"ranks: dimension {dim} does not divide evenly")
    return list(value.chunk(ranks, dim=dim))


def simulate(step: Step, locals_: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Run ``step`` on the local tensors of every rank of one mesh dimension (rank i holds
    ``locals_[i]``); the local tensors after it. The arithmetic the real collectives do."""
    p = len(locals_)
    kind, src, dst = step.kind, step.src, step.dst
    if kind == "none":
        return list(locals_)
    if isinstance(src, StridedShard) or isinstance(dst, StridedShard):
        if kind == "all_gather":
            whole = from_locals(locals_, src)
            return [whole.clone() for _ in range(p)]
        if kind == "reduce_scatter":
            return to_locals(from_locals(locals_, src), dst, p)
        if kind == "slice":
            return [to_locals(t, dst, p)[i] for i, t in enumerate(locals_)]
        raise ValueError(f"unknown redistribution step {kind!r} for {src!r} -> {dst!r}")
    if kind == "all_reduce":
        total = sum(locals_[1:], locals_[0].clone())
        value = total / p if src.reduce_op == "avg" else total
        return [value.clone() for _ in range(p)]
    if kind == "reduce_scatter":
        total = sum(locals_[1:], locals_[0].clone())
        value = total / p if src.reduce_op == "avg" else total
        return [c.clone() for c in _chunks(value, p, dst.dim)]
    if kind == "all_gather":
        whole = torch.cat(list(locals_), dim=src.dim)
        return [whole.clone() for _ in range(p)]
    if kind == "all_to_all":
        pieces = [_chunks(t, p, dst.dim) for t in locals_]  # pieces[sender][receiver]
        return [torch.cat([pieces[s][r] for s in range(p)], dim=src.dim) for r in range(p)]
    if kind == "slice":
        return [_chunks(t, p, dst.dim)[i].clone() for i, t in enumerate(locals_)]
    if kind == "zero":
        return [t.clone() if i == 0 else torch.zeros_like(t) for i, t in enumerate(locals_)]
    if kind == "scale":
        # sum(locals) = mean(locals * p): sum -> avg multiplies by p, avg -> sum divides
        factor = 1.0 / p if src.reduce_op == "avg" else float(p)
        return [t * factor for t in locals_]
    raise ValueError(f"unknown redistribution step {kind!r}")
