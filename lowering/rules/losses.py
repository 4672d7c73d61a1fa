"""Losses: the negative log-likelihood (what ``cross_entropy`` decomposes to, after
``_log_softmax``) and the mean squared error read whole rows of classes and average over
the batch with weights that depend on every row (``ignore_index``, class weights), so on
a tensor-parallel dimension they run on whole, replicated inputs: the rule says so,
rather than leaving it to the no-rule fallback, and the plan shows the gather.
"""

from __future__ import annotations

import torch.fx as fx

from spmd.lowering.placements import Placement
from spmd.lowering.rules import Decision, op, register, replicate_all


@register(op("nll_loss_forward.default"), op("nll_loss_backward.default"),
          op("nll_loss2d_forward.default"), op("nll_loss2d_backward.default"),
          op("mse_loss.default"), op("mse_loss_backward.default"),
          op("binary_cross_entropy_with_logits.default"),
          op("smooth_l1_loss.default"), op("smooth_l1_loss_backward.default"))
def loss(node: fx.Node, inputs: tuple[Placement, ...], size: int) -> list[Decision]:
    return [replicate_all(node, "a loss reads every class and every row")]
