"""Embedding lookups and their backward.

A table sharded along its columns (the embedding dimension) gives each rank those
columns of every looked-up row; indices sharded along a dimension (a replicated table)
give the rows of those indices. A table sharded along its rows (vocabulary-parallel)
needs masking this rule does not do: it is gathered first. In backward, the table's
gradient from column-sharded output gradients is column-sharded; from row-sharded
indices it is each rank's partial sum.
"""

from __future__ import annotations

import torch.fx as fx

from spmd.lowering.placements import Partial, Placement, Replicate, Shard
from spmd.lowering.rules import Decision, op, register, replicate_all, shape


@register(op("embedding.default"))
def embedding(node: fx.Node, inputs: tuple[Placement, ...], size: int) -> list[Decision]:
    pw, pi = inputs
    last = len(shape(node)) - 1
    decisions = []
    if isinstance(pw, Partial) and isinstance(pi, Replicate):
        decisions.append(Decision(output=pw, reason="rows of a partial table are partial"))
    if isinstance(pw, Shard) and pw.dim == 1 or isinstance(pi, Replicate):
        if shape(node)[last] % size == 0:
            decisions.append(Decision(output=Shard(last), inputs=(Shard(1), Replicate()),
                                      reason="table sharded along its columns"))
    if isinstance(pi, Shard):
        decisions.append(Decision(output=Shard(pi.dim), inputs=(Replicate(), pi),
                                  reason="indices sharded, table whole"))
    decisions.append(replicate_all(node, "table sharded along its rows: gathered first"))
    return decisions


@register(op("embedding_dense_backward.default"))
def embedding_backward(node: fx.Node, inputs: tuple[Placement, ...], size: int
                       ) -> list[Decision]:
    pg, pi = inputs
    last = len(shape(node.args[0])) - 1
    decisions = []
    if isinstance(pg, Partial) and isinstance(pi, Replicate):
        decisions.append(Decision(output=pg, reason="linear in the output gradient"))
    if isinstance(pg, Shard) and pg.dim == last:
        decisions.append(Decision(output=Shard(1), inputs=(pg, Replicate()),
                                  reason="output gradient sharded along the embedding "
                                         "dimension: the table's gradient by columns"))
    by_freq = bool(node.args[4] if len(node.args) > 4 else node.kwargs.get(
        "scale_grad_by_freq", False))
    # scaled by each index's frequency, a rank's rows need the whole batch's counts
    if not by_freq and (isinstance(pg, Shard) and pg.dim < last or isinstance(pi, Shard)):
        d = pg.dim if isinstance(pg, Shard) and pg.dim < last else pi.dim  # type: ignore
        decisions.append(Decision(output=Partial("sum"), inputs=(Shard(d), Shard(d)),
                                  reason="indices sharded: each rank's rows add up"))
    decisions.append(replicate_all(node, "whole gradient"))
    return decisions
