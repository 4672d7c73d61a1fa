"""propagate: decide the placement of every gradient at the parameter boundary.

A replicated parameter used on a batch sharded along dim 0 gets, on each rank, the
gradient of its own shard's loss: ``Partial("avg")`` (the average over ranks is the
gradient of the whole batch's mean loss). That holds in every graph of the model, also
one after a graph break whose inputs are activations rather than the batch: the loss is
always computed from sharded data. On one rank there is nothing to combine and the
gradient is already ``Replicate()``. Data parallelism needs no per-op rules: the decision
is made at the boundary, from the input placements alone.
"""

from __future__ import annotations

import torch.fx as fx

from spmd.lowering.context import LoweringContext
from spmd.lowering.placements import Partial, Replicate

__all__ = ["propagate"]


def propagate(gm: fx.GraphModule, ctx: LoweringContext) -> fx.GraphModule:
    inputs = gm.meta["spmd_input_placements"]
    placements = {}
    for position in gm.meta["spmd_param_grads"]:
        partial = inputs[position].is_replicate() and ctx.world_size > 1
        placements[position] = Partial("avg") if partial else Replicate()
    gm.meta["spmd_grad_placements"] = placements
    return gm
