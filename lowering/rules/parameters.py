"""What the user placed: a tensor-parallel parameter's read (``spmd::tp_param``) and its
gradient (``spmd::tp_grad``), and a module's output activation (``spmd::place``). The read
is the stored piece as it is; the gradient is placed as the parameter is stored, whatever
the rules made it; a placed activation (and its gradient, through the same op in
backward) is brought to its placement, which is how sequence parallelism turns a
row-parallel layer's all-reduce into a reduce-scatter (``tensor_parallel`` brings each
value there).
"""

from __future__ import annotations

import torch.fx as fx

from spmd.lowering import ops
from spmd.lowering.placements import Placement, Replicate
from spmd.lowering.annotate import ShardingError
from spmd.lowering.rules.registry import Decision, register, shape
from spmd.lowering.specs import lookup


@register(ops.tp_param, strided=True)
def tp_param(node: fx.Node, inputs: tuple[Placement, ...], size: int) -> Decision:
    return Decision(output=inputs[0], reason="the parameter's stored pieces")




def tp_grad(node: fx.Node, inputs: tuple[Placement, ...], size: int, dim: str) -> Decision:
    want = lookup(node.args[1]).placements.get(dim, Replicate())
    return Decision(output=want, inputs=(want,),
                    reason="a parameter's gradient is placed as the parameter")


register(ops.tp_grad, wants_dim=True, strided=True)(tp_grad)


def place(node: fx.Node, inputs: tuple[Placement, ...], size: int, dim: str) -> Decision:
    spec = lookup(node.args[1])
    want = spec.placements.get(dim)
    if want is None:
        return Decision(output=inputs[0], reason="not placed on this dimension")
    if want.is_shard():
        whole = shape(node)
        if not 0 <= want.dim < len(whole) or whole[want.dim] % size:
            raise ShardingError(
                f"the output of {spec.module} has shape {whole}: it cannot be placed "
                f"{want!r} over the {size} ranks of {dim!r} (sequence parallelism needs "
                f"the sequence length divisible by the tensor-parallel size)")
    return Decision(output=want, inputs=(want,),
                    reason=f"the output of {spec.module} is placed {want!r}")


register(ops.place, wants_dim=True)(place)
