"""Reductions and softmax: summing over a sharded dimension leaves each rank a partial sum
(``Partial("sum")``), averaging over it a partial average (equal pieces: the average of
the ranks' averages); a maximum over it, or a softmax along it, needs the whole
dimension. Over other dimensions the shards stay, shifted past removed dimensions.
``Partial`` values pass through sums and means (linear) but not through max or softmax.
"""

from __future__ import annotations

import torch.fx as fx

from spmd.lowering.placements import Partial, Placement, Shard, StridedShard
from spmd.lowering.rules.registry import (Decision, norm_dim, op, register, replicate_all, shape,
                                          tensor_args)


def _reduced_dims(node: fx.Node) -> tuple[list[int], bool]:
    """The dimensions reduced over (all of them when none are named) and keepdim."""
    ndim = len(shape(tensor_args(node)[0]))
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keepdim = bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
    # these take no dimensions (amax/amin take a list: ``amax.default(x, [-1], True)``)
    if node.target in (op("sum.default"), op("mean.default"), op("max.default"),
                       op("min.default")):
        dims, keepdim = None, False
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(ndim)), keepdim
    if isinstance(dims, int):
        dims = [dims]
    return [norm_dim(int(d), ndim) for d in dims], keepdim


def _kept(p: Shard | StridedShard, dims: list[int], keepdim: bool) -> Shard | StridedShard:
    if keepdim:
        return p
    dim = p.dim - sum(1 for d in dims if d < p.dim)
    return StridedShard(dim, p.split) if isinstance(p, StridedShard) else Shard(dim)


def _linear(kind: str):
    def rule(node: fx.Node, inputs: tuple[Placement, ...], size: int) -> list[Decision]:
        p = inputs[0]
        if isinstance(p, Partial):
            return [Decision(output=p, reason=f"the {kind} of partial values is partial")]
        dims, keepdim = _reduced_dims(node)
        if p.dim in dims:
            reduce_op = "sum" if kind == "sum" else "avg"
            return [Decision(output=Partial(reduce_op),
                             reason=f"{kind} over sharded dimension {p.dim}: each rank's "
                                    f"{kind} of its piece, Partial({reduce_op!r})")]
        return [Decision(output=_kept(p, dims, keepdim),
                         reason=f"{kind} over other dimensions than the sharded one")]
    return rule


_sum, _mean = _linear("sum"), _linear("mean")
register(op("sum.dim_IntList"), op("sum.default"), strided=True)(_sum)
register(op("mean.dim"), op("mean.default"), strided=True)(_mean)


@register(op("amax.default"), op("amin.default"), op("max.dim"), op("min.dim"),
          op("argmax.default"), op("argmin.default"), op("max.default"), op("min.default"),
          op("logsumexp.default"), op("var.correction"), op("any.dim"), op("all.dim"))
def extreme(node: fx.Node, inputs: tuple[Placement, ...], size: int) -> list[Decision]:
    p = inputs[0]
    if isinstance(p, Shard):
        dims, keepdim = _reduced_dims(node)
        if p.dim not in dims:
            out = _kept(p, dims, keepdim)
            outputs = node.meta.get("val")
            return [Decision(output=(out, out) if isinstance(outputs, (tuple, list)) else out,
                             reason="reduced over other dimensions than the sharded one")]
    return [replicate_all(node, "reduced over its sharded dimension (or of partial values), "
                                "which needs the whole tensor")]


def _softmax_dim(node: fx.Node) -> int:
    ndim = len(shape(tensor_args(node)[0]))
    if node.target in (op("_softmax_backward_data.default"),
                       op("_log_softmax_backward_data.default")):
        return norm_dim(int(node.args[2]), ndim)
    return norm_dim(int(node.args[1]), ndim)


_LOSS_PARALLEL = {op("_log_softmax.default"): "sharded_log_softmax",
                  op("_log_softmax_backward_data.default"): "sharded_log_softmax_backward"}


@register(op("_softmax.default"), op("_log_softmax.default"), op("_safe_softmax.default"),
          op("_softmax_backward_data.default"), op("_log_softmax_backward_data.default"),
          strided=True)
def softmax(node: fx.Node, inputs: tuple[Placement, ...], size: int) -> list[Decision]:
    dim = _softmax_dim(node)
    decisions = []
    ranked = _LOSS_PARALLEL.get(node.target)
    if ranked is not None and all(isinstance(p, Shard) and p.dim == dim for p in inputs) \
            and shape(tensor_args(node)[0])[dim] % size == 0:
        # loss parallelism: the row maximum and the sum of exponentials are reduced over
        # the ranks inside the op, never the logits
        from spmd.lowering import ranked as ranked_ops

        decisions.append(Decision(
            output=Shard(dim), inputs=(Shard(dim),) * len(inputs),
            reason=f"log-softmax along its sharded dimension {dim} (loss parallelism): "
                   f"each rank its classes, the row maximum and sum of exponentials "
                   f"all-reduced inside the op",
            ranked=getattr(ranked_ops, ranked)))
    for p in inputs:
        if isinstance(p, (Shard, StridedShard)) and p.dim != dim:
            decisions.append(Decision(output=p, inputs=(p,) * len(inputs),
                                      reason=f"normalised along {dim}, sharded along {p.dim}"))
            break
    decisions.append(replicate_all(node, f"normalised along dimension {dim}, which needs it "
                                         f"whole"))
    return decisions


@register(op("topk.default"), strided=True)
def topk(node: fx.Node, inputs: tuple[Placement, ...], size: int) -> list[Decision]:
    """The k largest along one dimension (an MoE router's choice per token): along any
    other, the shards stay (values and indices alike)."""
    p = inputs[0]
    dim = norm_dim(int(node.args[2]) if len(node.args) > 2 else int(node.kwargs.get("dim", -1)),
                   len(shape(tensor_args(node)[0])))
    if isinstance(p, (Shard, StridedShard)) and p.dim != dim:
        return [Decision(output=(p, p), reason=f"top-k along {dim}, sharded along {p.dim}")]
    return [replicate_all(node, "top-k along its sharded dimension needs the whole tensor")]


@register(op("scatter.src"), op("scatter.value"), op("scatter_add.default"),
          op("gather.default"), strided=True)
def scatter(node: fx.Node, inputs: tuple[Placement, ...], size: int) -> list[Decision]:
    """``self.scatter(dim, index, src)``, ``scatter_add`` and ``self.gather(dim,
    index)``: values moved along ``dim`` within each slice of the other dimensions, so a
    shard along another dimension of all of them stays, where they are equally long
    there (an MoE router's dense scores from its top-k, DeepSeek's scores of its chosen
    experts)."""
    dim = norm_dim(int(node.args[1]), len(shape(tensor_args(node)[0])))
    verb = "gathered" if node.target is op("gather.default") else "scattered"
    for p in inputs:
        if isinstance(p, (Shard, StridedShard)) and p.dim != dim:
            if len({shape(a)[p.dim] for a in tensor_args(node)}) == 1:
                return [Decision(output=p, inputs=(p,) * len(inputs),
                                 reason=f"{verb} along {dim}, sharded along {p.dim}")]
            break
    return [replicate_all(node, f"{verb} along its sharded dimension")]
