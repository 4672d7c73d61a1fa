"""sync_batchnorm: batch statistics over the whole batch, not each rank's shard of it.

Along a data dimension the model runs per rank (DDP's semantics), so a batch norm in
training normalises by its own rank's mean and variance. With ``sync_batchnorm=True``
(or a model holding ``nn.SyncBatchNorm``) this pass rewrites every training batch norm
into its statistics, made whole by one all-reduce each (bucketed together, visible in the
plan), as torch's ``SyncBatchNorm`` does:

- forward (``_native_batch_norm_legit_functional``): each rank's per-channel sum, sum of
  squares and element count are all-reduced; mean ``S1/N``, biased variance ``S2/N -
  mean²`` normalise; the running statistics take the mean and the unbiased variance
  ``var·N/(N-1)`` (ranks may hold different batch sizes: the counts are summed too);
- backward (``native_batch_norm_backward``): the per-channel sums of the output gradient
  and of its product with the normalised input are all-reduced, and the input's gradient
  is ``w·invstd·(g - ΣG/N - x̂·ΣGx̂/N)``; the weight's and bias's gradients are each rank's
  own sums, which data parallelism then averages with every other gradient.

That is one process on the whole batch, up to the order of the additions; the gradient of
the input is the sum over ranks' losses, as torch's SyncBatchNorm gives it, so the
averaged parameter gradients are the whole batch's.
"""

from __future__ import annotations

import operator
from dataclasses import replace

import torch
import torch.fx as fx

from spmd.lowering.collectives import build_bucket, new_node
from spmd.lowering.context import LoweringContext
from spmd.lowering.passes import Provenance
from spmd.lowering.placements import Partial, Replicate
from spmd.lowering.propagate import derive, module_of
from spmd.lowering.redistribute import Step
from spmd.lowering.state import Boundary, needs, put

__all__ = ["sync_batchnorm", "PASS_NAME"]

aten = torch.ops.aten
PASS_NAME = "sync_batchnorm"
_FORWARD = aten._native_batch_norm_legit_functional.default
_BACKWARD = aten.native_batch_norm_backward.default


def _sum_over(graph: fx.Graph, x: fx.Node, dims: list[int]) -> fx.Node:
    return new_node(graph, aten.sum.dim_IntList, (x, dims))


def _channel(graph: fx.Graph, v: fx.Node, ndim: int) -> fx.Node:
    """A per-channel vector shaped to broadcast over an ``ndim`` input (``[1, C, 1, ...]``)."""
    return new_node(graph, aten.view.default, (v, [1, -1] + [1] * (ndim - 2)))


def _whole(gm: fx.GraphModule, ctx: LoweringContext, values: list[fx.Node], names: list[str],
           why: str) -> list[fx.Node]:
    """``values`` summed over every data dimension's ranks (one all-reduce per dimension,
    all of them in one bucket). Each is this rank's own until then."""
    from spmd.lowering.placements import Sharding, Varying

    local = Sharding.on(ctx.mesh, {d: Varying() for d in ctx.strategy.data_dims})
    for v in values:
        v.meta.setdefault("sharding", local)
    for dim in ctx.strategy.data_dims:
        if ctx.mesh.size(dim) <= 1:
            continue
        step = Step(src=Partial("sum"), dst=Replicate(), kind="all_reduce", mesh_dim=dim)
        reason = Provenance(params=tuple(names), pass_name=PASS_NAME, reason=why)
        _, values = build_bucket(gm, ctx, values, names, step, reason, gradients=False)
    return values


def _count(graph: fx.Graph, x: fx.Node, channels: int) -> fx.Node:
    """This rank's elements per channel, as a one-element float tensor."""
    val = x.meta["val"]
    return new_node(graph, aten.new_full.default, (x, [1], float(val.numel() // channels)))


def _forward(gm: fx.GraphModule, ctx: LoweringContext, node: fx.Node) -> None:
    graph = gm.graph
    x, w, b, rm, rv, training, momentum, eps = node.args
    ndim = x.meta["val"].dim()
    channels = int(x.meta["val"].shape[1])
    dims = [0] + list(range(2, ndim))
    where = module_of(node) or node.name
    with graph.inserting_before(node):
        s1 = _sum_over(graph, x, dims)
        s2 = _sum_over(graph, new_node(graph, aten.mul.Tensor, (x, x)), dims)
        count = _count(graph, x, channels)
    s1, s2, count = _whole(gm, ctx, [s1, s2, count], [f"{where}:sum", f"{where}:sum_sq",
                                                      f"{where}:count"],
                           f"batch norm {where}: statistics of the whole batch "
                           f"(per-channel sum, sum of squares, count)")
    with graph.inserting_before(node):
        mean = new_node(graph, aten.div.Tensor, (s1, count))
        square = new_node(graph, aten.div.Tensor, (s2, count))
        var = new_node(graph, aten.sub.Tensor, (square, new_node(graph, aten.mul.Tensor,
                                                                   (mean, mean))))
        var = new_node(graph, aten.clamp_min.default, (var, 0.0))
        invstd = new_node(graph, aten.rsqrt.default, (new_node(graph, aten.add.Tensor,
                                                               (var, eps)),))
        centred = new_node(graph, aten.sub.Tensor, (x, _channel(graph, mean, ndim)))
        out = new_node(graph, aten.mul.Tensor, (centred, _channel(graph, invstd, ndim)))
        if w is not None:
            out = new_node(graph, aten.mul.Tensor, (out, _channel(graph, w, ndim)))
        if b is not None:
            out = new_node(graph, aten.add.Tensor, (out, _channel(graph, b, ndim)))
        results = [out, mean, invstd, rm, rv]
        if rm is not None and rv is not None:
            # unbiased variance for the running estimate: var * N / (N - 1)
            less = new_node(graph, aten.sub.Tensor, (count, 1.0))
            unbiased = new_node(graph, aten.div.Tensor, (new_node(
                graph, aten.mul.Tensor, (var, count)), less))
            results[3] = new_node(graph, aten.add.Tensor, (
                new_node(graph, aten.mul.Tensor, (rm, 1.0 - momentum)),
                new_node(graph, aten.mul.Tensor, (mean, momentum))))
            results[4] = new_node(graph, aten.add.Tensor, (
                new_node(graph, aten.mul.Tensor, (rv, 1.0 - momentum)),
                new_node(graph, aten.mul.Tensor, (unbiased, momentum))))
    for user in list(node.users):
        if user.target is operator.getitem:
            user.replace_all_uses_with(results[user.args[1]])
            graph.erase_node(user)
    graph.erase_node(node)


def _backward(gm: fx.GraphModule, ctx: LoweringContext, node: fx.Node,
              renamed: dict[str, str]) -> None:
    graph = gm.graph
    g, x, w, rm, rv, save_mean, save_invstd, train, eps, mask = node.args
    ndim = x.meta["val"].dim()
    channels = int(x.meta["val"].shape[1])
    dims = [0] + list(range(2, ndim))
    where = module_of(node) or node.name
    with graph.inserting_before(node):
        xhat = new_node(graph, aten.mul.Tensor, (
            new_node(graph, aten.sub.Tensor, (x, _channel(graph, save_mean, ndim))),
            _channel(graph, save_invstd, ndim)))
        sg = _sum_over(graph, g, dims)  # the bias's gradient, this rank's
        sgx = _sum_over(graph, new_node(graph, aten.mul.Tensor, (g, xhat)), dims)  # weight's
        count = _count(graph, x, channels)
    total_g, total_gx, n = _whole(gm, ctx, [sg, sgx, count],
                                  [f"{where}:grad_sum", f"{where}:grad_dot", f"{where}:count"],
                                  f"batch norm {where} backward: the whole batch's gradient "
                                  f"sums")
    with graph.inserting_before(node):
        mean_g = new_node(graph, aten.div.Tensor, (total_g, n))
        mean_gx = new_node(graph, aten.div.Tensor, (total_gx, n))
        inner = new_node(graph, aten.sub.Tensor, (
            new_node(graph, aten.sub.Tensor, (g, _channel(graph, mean_g, ndim))),
            new_node(graph, aten.mul.Tensor, (xhat, _channel(graph, mean_gx, ndim)))))
        factor = save_invstd if w is None else new_node(graph, aten.mul.Tensor,
                                                        (save_invstd, w))
        gx = new_node(graph, aten.mul.Tensor, (inner, _channel(graph, factor, ndim)))
        # the weight's and bias's gradients as nodes of their own: data parallelism then
        # reads (and reduces) those, while the statistics keep this rank's sums
        results = [gx, new_node(graph, aten.alias.default, (sgx,)),
                   new_node(graph, aten.alias.default, (sg,))]
    for user in list(node.users):
        if user.target is operator.getitem:
            renamed[user.name] = results[user.args[1]].name
            user.replace_all_uses_with(results[user.args[1]])
            graph.erase_node(user)
    graph.erase_node(node)


def sync_batchnorm(gm: fx.GraphModule, ctx: LoweringContext) -> fx.GraphModule:
    if not ctx.options.sync_batchnorm or ctx.strategy.data_size <= 1:
        return gm
    changed = False
    renamed: dict[str, str] = {}  # a gradient's node -> the one computing it now
    for node in list(gm.graph.nodes):
        if node.target is _FORWARD and node.args[5]:  # training
            _forward(gm, ctx, node)
            changed = True
        elif node.target is _BACKWARD and node.args[7]:
            _backward(gm, ctx, node, renamed)
            changed = True
    if renamed:
        boundary = needs(gm, Boundary, PASS_NAME)
        put(gm, replace(boundary, gradients=tuple(
            replace(g, node=renamed.get(g.node, g.node)) for g in boundary.gradients)))
    if changed:
        gm.graph.eliminate_dead_code()
        derive(gm, ctx)
    return gm
