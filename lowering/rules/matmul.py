"""Matrix products: ``mm``, ``addmm``, ``bmm`` (what ``nn.Linear`` and ``matmul``
decompose to in an aten graph).

For ``a @ b`` with ``a: [.., M, K]`` and ``b: [.., K, N]`` the valid placements are
rows of ``a`` sharded (output rows sharded), columns of ``b`` sharded (output columns
sharded), the contraction dimension sharded on both (each rank's product a partial sum:
``Partial("sum")``), a batch dimension sharded on both, or a Partial factor times a
replicated one. Megatron's column-parallel linear is the second (weight rows, i.e.
``b``'s columns), its row-parallel linear the third; the cost model chooses among the
ones the inputs' placements reach most cheaply.
"""

from __future__ import annotations

import torch.fx as fx

from spmd.lowering.placements import Partial, Placement, Replicate, Shard, StridedShard
from spmd.lowering.rules.registry import Decision, op, register, shape, tensor_args
from spmd.lowering.rules.pointwise import aligned_dim

R = Replicate


def _product(a: tuple[int, ...], b: tuple[int, ...], inputs: tuple[Placement, ...],
             size: int) -> list[tuple[Placement, Placement, Placement, str]]:
    """(a's placement, b's placement, the product's placement, why) for every valid way,
    the inputs' own first."""
    batch = len(a) - 2
    m, k, n = a[-2], a[-1], b[-1]
    ways: list[tuple[Placement, Placement, Placement, str]] = []
    pa, pb = inputs
    partial = [p for p in inputs if isinstance(p, Partial)]
    if len(partial) == 1 and all(isinstance(p, (Partial, Replicate)) for p in inputs):
        ways.append((pa, pb, partial[0], "a Partial factor times a replicated one"))
    if m % size == 0:
        ways.append((Shard(batch), R(), Shard(batch), "rows of the first factor sharded"))
    if n % size == 0:
        ways.append((R(), Shard(batch + 1), Shard(batch + 1),
                     "columns of the second factor sharded"))
    if k % size == 0:
        ways.append((Shard(batch + 1), Shard(batch), Partial("sum"),
                     "contraction dimension sharded: each rank's product a partial sum"))
    for d in range(batch):
        if a[d] % size == 0:
            ways.append((Shard(d), Shard(d), Shard(d), f"batch dimension {d} sharded"))
    ways += _strided_ways(a, b, inputs, size)
    ways.append((R(), R(), R(), "whole factors"))
    return ways


def _strided_ways(a: tuple[int, ...], b: tuple[int, ...], inputs: tuple[Placement, ...],
                  size: int) -> list[tuple[Placement, Placement, Placement, str]]:
    """The same ways for a factor that is ``StridedShard`` (rows merged from a batch and
    a split sequence): rows, columns and the contraction dimension read block by block."""
    batch = len(a) - 2
    m, k, n = a[-2], a[-1], b[-1]
    ways: list[tuple[Placement, Placement, Placement, str]] = []
    for p in inputs:
        if not isinstance(p, StridedShard):
            continue
        blocks = p.split
        if p == inputs[0] and p.dim == batch and m % (blocks * size) == 0:
            ways.append((p, R(), p, f"rows of the first factor {p!r}"))
        contraction = (StridedShard(batch + 1, blocks), StridedShard(batch, blocks))
        if p in contraction and k % (blocks * size) == 0:
            ways.append((*contraction, Partial("sum"),
                         f"contraction dimension {p!r} on both: each rank's product a "
                         f"partial sum"))
        if p == inputs[1] and p.dim == batch + 1 and n % (blocks * size) == 0:
            ways.append((R(), p, p, f"columns of the second factor {p!r}"))
    return ways


@register(op("mm.default"), op("bmm.default"), strided=True)
def mm(node: fx.Node, inputs: tuple[Placement, ...], size: int) -> list[Decision]:
    a, b = (shape(x) for x in tensor_args(node))
    return [Decision(output=out, inputs=(pa, pb), reason=why)
            for pa, pb, out, why in _product(a, b, inputs, size)]


@register(op("addmm.default"), op("baddbmm.default"), strided=True)
def addmm(node: fx.Node, inputs: tuple[Placement, ...], size: int) -> list[Decision]:
    """``bias + a @ b``: the product's ways, with the bias placed to match (sliced along
    a sharded output dimension, or kept on one rank, zeros elsewhere, for a partial sum,
    both local)."""
    bias, a, b = tensor_args(node)
    out = shape(node)
    decisions = []
    for pa, pb, prod, why in _product(shape(a), shape(b), inputs[1:], size):
        if isinstance(prod, Shard):
            k = aligned_dim(shape(bias), out, prod.dim)
            pbias: Placement = R() if k is None else Shard(k)
        elif isinstance(prod, StridedShard):
            k = aligned_dim(shape(bias), out, prod.dim)
            pbias = R() if k is None else StridedShard(k, prod.split)
        elif isinstance(prod, Partial):
            if isinstance(inputs[0], Partial) and inputs[0] != prod:
                continue
            pbias = prod  # Replicate -> Partial: local (one rank's copy, or as is for avg)
        else:
            pbias = R()
        decisions.append(Decision(output=prod, inputs=(pbias, pa, pb), reason=why))
    return decisions


