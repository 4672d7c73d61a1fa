"""Scaled dot-product attention (the fused aten kernels ``scaled_dot_product_attention``
lowers to, forward and backward). Queries, keys and values ``[batch, heads, length,
head_dim]`` sharded alike along heads (Megatron's attention: each rank its heads) or
along the batch give outputs, log-sum-exps and gradients sharded the same way; any other
placement is gathered first (a sequence-sharded attention needs ring communication
this rule does not do). An attention mask is sharded along the same dimension where it
spans it, else replicated.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from spmd.lowering.placements import Placement, Replicate, Shard
from spmd.lowering.rules import Decision, op, register, replicate_all, shape, tensor_args

_FORWARD = [op("_scaled_dot_product_flash_attention_for_cpu.default"),
            op("_scaled_dot_product_flash_attention.default"),
            op("_scaled_dot_product_efficient_attention.default"),
            op("_scaled_dot_product_cudnn_attention.default")]
_BACKWARD = [op("_scaled_dot_product_flash_attention_for_cpu_backward.default"),
             op("_scaled_dot_product_flash_attention_backward.default"),
             op("_scaled_dot_product_efficient_attention_backward.default"),
             op("_scaled_dot_product_cudnn_attention_backward.default")]


def _placed(value: object, d: int, extent: int) -> Placement:
    """``Shard(d)`` for a tensor that spans the sharded extent at ``d``, else whole."""
    if isinstance(value, torch.Tensor) and value.dim() > d and value.shape[d] == extent:
        return Shard(d)
    return Replicate()


def _mask_placed(mask: torch.Tensor, d: int, extent: int) -> Placement:
    """A mask broadcasts against ``[batch, heads, length, key length]`` from the right: it is
    sharded along its dimension that spans ``d`` (not one of size 1), else whole."""
    k = d - (4 - mask.dim())
    return Shard(k) if k >= 0 and mask.shape[k] == extent else Replicate()


@register(*_FORWARD, *_BACKWARD)
def attention(node: fx.Node, inputs: tuple[Placement, ...], size: int) -> list[Decision]:
    args = tensor_args(node)
    query = node.args[1] if node.target in _BACKWARD else node.args[0]
    val = node.meta["val"]
    outs = list(val) if isinstance(val, (tuple, list)) else [val]
    mask = node.kwargs.get("attn_mask")
    decisions = []
    for d, what in ((1, "heads"), (0, "batch")):
        extent = shape(query)[d]
        if extent % size:
            continue
        needed = tuple(_mask_placed(a.meta["val"], d, extent) if a is mask
                       else _placed(a.meta["val"], d, extent) for a in args)
        out = [_placed(o, d, extent) for o in outs]
        decisions.append(Decision(output=tuple(out) if isinstance(val, (tuple, list)) else out[0],
                                  inputs=needed, reason=f"each rank its {what}"))
    decisions.append(replicate_all(node, "queries, keys and values whole"))
    return decisions
