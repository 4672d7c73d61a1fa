"""Losses: the negative log-likelihood (what ``cross_entropy`` decomposes to, after
``_log_softmax``) and the mean squared error read whole rows of classes and average over
the batch with weights that depend on every row (``ignore_index``, class weights), so on
a tensor-parallel dimension they run on whole, replicated inputs: the rule says so,
rather than leaving it to the no-rule fallback, and the plan shows the gather. The one
exception is loss parallelism (torch's ``loss_parallel``): log-probabilities split along
the classes, without class weights, give each rank the targets in its range.
"""

from __future__ import annotations

import torch.fx as fx

from spmd.lowering.placements import Partial, Placement, Replicate, Shard
from spmd.lowering.meta_trace import nll as _meta_nll
from spmd.lowering.meta_trace import nll_backward as _meta_nll_backward
from spmd.lowering.rules.registry import Decision, op, register, replicate_all, shape


def _fused(node: fx.Node) -> bool:
    """The meta trace's fused ``spmd::nll`` (no weight argument)."""
    from spmd.lowering.meta_trace import nll, nll_backward

    return node.target in (nll, nll_backward)


@register(op("nll_loss_forward.default"), _meta_nll)
def nll_loss(node: fx.Node, inputs: tuple[Placement, ...], size: int) -> list[Decision]:
    """Log-probabilities ``(rows, classes)`` split along the classes (loss parallelism,
    after a sharded log-softmax): each rank picks the targets in its range, the others
    read as 0 (``spmd::sharded_nll_loss``): the ranks' losses are partial sums, the
    total weight (the targets counted) every rank's alike. Class weights: whole."""
    from spmd.lowering import ranked

    decisions = []
    x = node.args[0]
    weight = None if _fused(node) else (
        node.args[2] if len(node.args) > 2 else node.kwargs.get("weight"))
    if isinstance(inputs[0], Shard) and inputs[0].dim == 1 and weight is None and len(
            shape(x)) == 2 and shape(x)[1] % size == 0:
        decisions.append(Decision(
            output=(Partial("sum"), Replicate()), inputs=(Shard(1), Replicate()),
            reason="loss parallelism: each rank the targets in its range of classes, a "
                   "partial sum of the loss", ranked=ranked.sharded_nll_loss))
    decisions.append(replicate_all(node, "a loss reads every class and every row"))
    return decisions


@register(op("nll_loss_backward.default"), _meta_nll_backward)
def nll_loss_backward(node: fx.Node, inputs: tuple[Placement, ...], size: int
                      ) -> list[Decision]:
    """The gradient of the log-probabilities, split along the classes as they are: each
    rank writes the targets in its range (``spmd::sharded_nll_loss_backward``)."""
    from spmd.lowering import ranked

    decisions = []
    x = node.args[1]
    weight = None if _fused(node) else node.args[3]
    if isinstance(inputs[1], Shard) and inputs[1].dim == 1 and weight is None and len(
            shape(x)) == 2 and shape(x)[1] % size == 0:
        decisions.append(Decision(
            output=Shard(1), inputs=(Replicate(), Shard(1), Replicate(), Replicate()),
            reason="loss parallelism: each rank the gradient of its classes",
            ranked=ranked.sharded_nll_loss_backward))
    decisions.append(replicate_all(node, "a loss reads every class and every row"))
    return decisions


@register(op("nll_loss2d_forward.default"), op("nll_loss2d_backward.default"),
          op("mse_loss.default"), op("mse_loss_backward.default"),
          op("binary_cross_entropy_with_logits.default"),
          op("smooth_l1_loss.default"), op("smooth_l1_loss_backward.default"))
def loss(node: fx.Node, inputs: tuple[Placement, ...], size: int) -> list[Decision]:
    return [replicate_all(node, "a loss reads every class and every row")]
