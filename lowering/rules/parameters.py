"""A tensor-parallel parameter's read (``spmd::tp_param``) and its gradient
(``spmd::tp_grad``): the read is the stored piece as it is; the gradient is placed as the
parameter is stored, whatever the rules made it (``tensor_parallel`` brings it there).
"""

from __future__ import annotations

import torch.fx as fx

from spmd.lowering import ops
from spmd.lowering.placements import Placement, Replicate
from spmd.lowering.rules import Decision, register
from spmd.lowering.specs import lookup


@register(ops.tp_param)
def tp_param(node: fx.Node, inputs: tuple[Placement, ...], size: int) -> Decision:
    return Decision(output=inputs[0], reason="the parameter's stored pieces")


def tp_grad(node: fx.Node, inputs: tuple[Placement, ...], size: int, dim: str) -> Decision:
    want = lookup(node.args[1]).placements.get(dim, Replicate())
    return Decision(output=want, inputs=(want,),
                    reason="a parameter's gradient is placed as the parameter")


tp_grad.wants_dim = True  # type: ignore[attr-defined]
register(ops.tp_grad)(tp_grad)
