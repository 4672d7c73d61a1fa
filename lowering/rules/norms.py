"""Layer norm (``native_layer_norm`` and its backward): sharded along a batch dimension
(one not normalised over), every row is normalised on its own rank, with replicated
weight and bias; the weight's and bias's gradients are then each rank's sum over its
rows, ``Partial("sum")``. Sharded along a normalised dimension, the statistics need the
whole row: gathered first. RMS norm (``F.rms_norm``, ``nn.RMSNorm``) is
``_fused_rms_norm`` on CUDA, treated the same way here (its ``rstd`` is row-shaped like
layer norm's statistics); on CPU it decomposes into pow, mean, rsqrt and mul in aten
graphs, which the pointwise and reduction rules place.
"""

from __future__ import annotations

import torch.fx as fx

from spmd.lowering.placements import Partial, Placement, Replicate, Shard
from spmd.lowering.rules.registry import Decision, op, register, replicate_all, shape, tensor_args


def _normalized(node: fx.Node, index: int) -> int:
    return len(node.args[index])


@register(op("native_layer_norm.default"), op("_fused_rms_norm.default"))
def layer_norm(node: fx.Node, inputs: tuple[Placement, ...], size: int) -> list[Decision]:
    x = tensor_args(node)[0]
    first = len(shape(x)) - _normalized(node, 1)
    p = inputs[0]
    outs = len(node.meta["val"])
    if isinstance(p, Shard) and p.dim < first:
        needed = (p,) + (Replicate(),) * (len(inputs) - 1)
        return [Decision(output=(p,) * outs, inputs=needed,
                         reason=f"rows sharded along {p.dim}, normalised on their own rank"),
                replicate_all(node, "whole rows")]
    return [replicate_all(node, "normalised over its sharded dimension (or a partial "
                                "value): the statistics need whole rows")]


@register(op("native_layer_norm_backward.default"), op("_fused_rms_norm_backward.default"))
def layer_norm_backward(node: fx.Node, inputs: tuple[Placement, ...], size: int
                        ) -> list[Decision]:
    args = tensor_args(node)
    grad = args[0]
    # both take (grad_out, input, normalized_shape, ...)
    first = len(shape(grad)) - _normalized(node, 2)
    outs = len(node.meta["val"])
    decisions = []
    ndim = len(shape(grad))
    # a row dimension sharded on a row-shaped argument (the weight's dims are normalised)
    rows = [p for a, p in zip(args, inputs)
            if isinstance(p, Shard) and p.dim < first and len(shape(a)) == ndim]
    if rows:
        d = rows[0].dim
        needed = []
        for a in args:
            # grad, input and the statistics are row-shaped; weight and bias are not
            needed.append(Shard(d) if len(shape(a)) == ndim else Replicate())
        out: list[Placement] = [Shard(d)] + [Partial("sum")] * (outs - 1)
        decisions.append(Decision(output=tuple(out), inputs=tuple(needed),
                                  reason=f"rows sharded along {d}: the input's gradient "
                                         f"sharded, the weight's a partial sum"))
    decisions.append(replicate_all(node, "whole rows"))
    return decisions
