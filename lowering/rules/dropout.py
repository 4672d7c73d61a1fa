"""Dropout (``native_dropout``): a sharded input is dropped out piece by piece, each rank
drawing its own piece's mask (the global mask is then the pieces', as Megatron's
model-parallel random state gives); a replicated input is dropped out the same way on
every rank, which needs every rank of the dimension to draw the same numbers (seed them
alike, as the data-parallel ranks already must for identical initial weights). A partial
value is reduced first: dropping out each part with its own mask is not dropping out the
sum. The backward (``native_dropout_backward``) is pointwise, in ``pointwise``.
"""

from __future__ import annotations

import torch.fx as fx

from spmd.lowering.placements import Partial, Placement
from spmd.lowering.rules.registry import Decision, op, register, replicate_all


@register(op("native_dropout.default"))
def native_dropout(node: fx.Node, inputs: tuple[Placement, ...], size: int) -> list[Decision]:
    (p,) = inputs
    if isinstance(p, Partial):
        return [replicate_all(node, "dropout of a partial sum: reduced first")]
    return [Decision(output=(p, p), reason="each rank drops out its own piece")]
