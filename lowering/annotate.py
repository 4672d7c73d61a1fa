"""annotate: give every input of the graph its placement at the parameter boundary.

For data parallelism, parameters and buffers are ``Replicate()`` and data is ``Shard(0)``
(each rank reads its own slice of the batch). In the backward graph, output i is the
gradient of forward input i; this pass checks that correspondence against the inputs'
shapes and records which outputs are parameter gradients, so no later pass guesses.
"""

from __future__ import annotations

import torch.fx as fx

from spmd.lowering.context import InputInfo, LoweringContext
from spmd.lowering.placements import Placement, Replicate, Shard

__all__ = ["annotate", "PlanningError", "gradient_outputs", "input_placements"]


class PlanningError(RuntimeError):
    """The graph does not have the shape a pass relies on; the caller falls back."""


def gradient_outputs(gm: fx.GraphModule) -> list:
    out = gm.graph.output_node()
    values = out.args[0]
    return list(values) if isinstance(values, (list, tuple)) else [values]


def input_placements(inputs: tuple[InputInfo, ...]) -> list[Placement]:
    """Data-parallel placements: data ``Shard(0)``, parameters and buffers ``Replicate()``."""
    return [Shard(0) if info.kind == "data" else Replicate() for info in inputs]


def annotate(gm: fx.GraphModule, ctx: LoweringContext) -> fx.GraphModule:
    placements = input_placements(ctx.inputs)
    outputs = gradient_outputs(gm)
    if len(outputs) != len(ctx.inputs):
        raise PlanningError(f"{ctx.graph_name}: backward graph has {len(outputs)} outputs for "
                            f"{len(ctx.inputs)} forward inputs")
    grads: dict[int, str] = {}
    for i, (value, info) in enumerate(zip(outputs, ctx.inputs)):
        if not isinstance(value, fx.Node) or info.kind != "param" or not info.requires_grad:
            continue
        val = value.meta.get("val")
        if val is not None and tuple(val.shape) != info.shape:
            raise PlanningError(f"{ctx.graph_name}: backward output {i} has shape "
                                f"{tuple(val.shape)} but parameter {info.name} has {info.shape}")
        grads[i] = info.name
    gm.meta["spmd_input_placements"] = placements
    gm.meta["spmd_param_grads"] = grads  # output position -> parameter name
    return gm
