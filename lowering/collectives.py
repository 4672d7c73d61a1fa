"""insert_collectives: realise each value whose placement differs from where it is needed,
with the step the redistribution table gives.

For data parallelism these are the gradients: each is ``Partial("avg")`` and must be
``Replicate()``, so each gets an all-reduce, built as a bucket of one that the bucketing
pass merges:

    flat = spmd.bucket_all_reduce([g], handle)   # right after g is computed
    flat = spmd.wait(flat, handle)               # right after the collective (the
                                                 # schedule pass moves it to the first use)
    g'   = view(flat, shape)                     # spmd.wait_cast first when the wire
                                                 # dtype differs from the gradient's

and every reader of ``g`` reads ``g'`` instead: the graph output, and anything else the
step computes from a gradient (clipping its norm, say), which so sees the averaged
gradient exactly as one process on the whole batch would. :func:`build_bucket` is the
one place that writes this pattern; :func:`insert_redistribution` writes the other
collectives of the table (all-gather, reduce-scatter, all-to-all, local steps), one op,
its wait and the view that restores the layout.
"""

from __future__ import annotations

import operator
from dataclasses import replace
from typing import Any

import torch
import torch.fx as fx

from spmd.lowering import ops, reduction
from spmd.lowering.cost_model import TwoLevelCostModel
from spmd.runtime import config
from spmd.lowering.specs import CollectiveSpec
from spmd.lowering.context import LoweringContext
from spmd.lowering.graph import fill_val
from spmd.lowering.passes import Provenance
from spmd.lowering.annotate import PlanningError
from spmd.lowering.placements import Shard, Sharding, StridedShard
from spmd.lowering.propagate import derive
from spmd.lowering.redistribute import Step, plan_redistribution
from spmd.lowering.state import Boundary, CollectiveInfo, Role, needs

__all__ = ["insert_collectives", "build_bucket", "insert_redistribution", "bucket_results",
           "new_node", "unpack_after"]

aten = torch.ops.aten


def new_node(graph: fx.Graph, target: Any, args: tuple, kwargs: dict | None = None,
             *, sharding: Any = None, role: Role | None = None,
             name: str | None = None) -> fx.Node:
    """A call node at the graph's insertion point, with its fake value filled in and,
    when given, its sharding and role."""
    node = graph.create_node("call_function", target, args, kwargs or {}, name=name)
    fill_val(node)
    if sharding is not None:
        node.meta["sharding"] = sharding
    if role is not None:
        node.meta["spmd_role"] = role
    return node


def _spec(ctx: LoweringContext, step: Step, **fields: Any) -> tuple[CollectiveSpec, int]:
    spec = CollectiveSpec(step=step, group=ctx.group(step.mesh_dim),
                              size=ctx.mesh.size(step.mesh_dim), **fields)
    return spec, ctx.handles.add(spec)


def across_hosts(ctx: LoweringContext, mesh_dim: str, kind: str, nbytes: int,
                 why: str = "") -> tuple[str, str]:
    """("hierarchical" or "native", why) for a ``kind`` collective of ``nbytes`` along
    ``mesh_dim``: the two-level algorithm (``spmd.runtime.hierarchical``) where the
    dimension's groups span hosts and the cost model prices it below the flat ring
    (``SPMD_HIERARCHICAL`` overrides)."""
    model = ctx.cost_model_along(mesh_dim)
    if not isinstance(model, TwoLevelCostModel) or ctx.mesh.hardware is not None:
        return "native", why  # (a hardware model's cluster: NCCL chooses its algorithm)
    pick, flat, two = model.choice(kind, nbytes)
    if two is None:
        return "native", why
    hosts = model.world_size // model.per_node
    name = kind.replace("_", "-")
    forced = config.hierarchical()
    if forced != "auto":
        pick = "hierarchical" if forced == "always" else "native"
        return pick, (f"{'two-level' if forced == 'always' else 'flat ring'} {name} across "
                      f"{hosts} hosts (SPMD_HIERARCHICAL={forced}; the cost model predicts "
                      f"{two * 1e6:.0f} µs two-level, {flat * 1e6:.0f} µs flat)")
    if pick == "hierarchical":
        return pick, (f"two-level {name} across {hosts} hosts ({model.per_node} ranks each): "
                      f"{two * 1e6:.0f} µs predicted against {flat * 1e6:.0f} µs for the flat "
                      f"ring")
    return "native", (f"flat ring across {hosts} hosts: {flat * 1e6:.0f} µs predicted against "
                      f"{two * 1e6:.0f} µs for the two-level {name}")


def build_bucket(gm: fx.GraphModule, ctx: LoweringContext, grads: list[fx.Node],
                 params: list[str], step: Step, provenance: Provenance,
                 gradients: bool = True) -> tuple[fx.Node, list[fx.Node]]:
    """Insert one bucket's all-reduce right after the last of ``grads``, its wait and
    unpacking right after it; the collective and the reduced values' nodes, in order.

    ``gradients``: the values are gradients (sent in ``reduce_dtype``, skipped under
    ``no_sync()``); other values are reduced as they are, always.
    """
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    dtype = grads[0].meta["val"].dtype
    wire = (ctx.options.reduce_dtype if gradients else None) or dtype
    last = max(grads, key=order.__getitem__)
    algorithm, why = reduction.choose(wire, dtype, ctx.mesh.size(step.mesh_dim))
    if algorithm == "native":
        nbytes = sum(int(g.meta["val"].numel()) for g in grads) * wire.itemsize
        algorithm, why = across_hosts(ctx, step.mesh_dim, "all_reduce", nbytes, why)
    if why:
        provenance = replace(provenance, reason=f"{provenance.reason}; {why}")
    # the float32 addition reads and writes the bucket in the gradients' dtype
    packed = dtype if algorithm == "fp32" else wire
    spec, handle = _spec(ctx, step, params=tuple(params),
                         wire_dtype=None if packed == dtype else packed,
                         result_dtype=None if packed == dtype else dtype,
                         sync=ctx.sync if gradients else None, algorithm=algorithm,
                         compress=wire if algorithm == "fp32" else None)
    src = grads[0].meta["sharding"]
    dst = src.with_placement(step.mesh_dim, step.dst)
    with graph.inserting_after(last):
        flat = new_node(graph, ops.bucket_all_reduce, (list(grads), handle), sharding=src,
                        name="all_reduce")  # fx numbers it
    spec.name = f"{ctx.graph_name}:{flat.name}"
    numels = tuple(int(g.meta["val"].numel()) for g in grads)
    flat.meta["spmd_collective"] = CollectiveInfo(
        kind="all_reduce", mesh_dim=step.mesh_dim, src=step.src, dst=step.dst,
        params=tuple(params), numels=numels, dtype=dtype, wire_dtype=wire,
        bytes=sum(numels) * wire.itemsize, handle=handle, provenance=provenance)
    unpack = Role(kind="unpack", collective=flat.name)
    with graph.inserting_after(flat):
        waiter = ops.wait if packed == dtype else ops.wait_cast
        done = new_node(graph, waiter, (flat, handle), sharding=dst,
                        role=Role(kind="wait", collective=flat.name))
    results = unpack_after(graph, done, list(numels),
                           [list(g.meta["val"].shape) for g in grads], unpack)
    return flat, results


def unpack_after(graph: fx.Graph, flat: fx.Node, numels: list[int], shapes: list[list[int]],
                 role: Role) -> list[fx.Node]:
    """Nodes right after ``flat`` that cut it into pieces of ``numels`` elements, each
    viewed as its shape (one piece: just the view); the views, in order."""
    anchor, pieces = flat, [flat]
    if len(numels) > 1:
        with graph.inserting_after(anchor):
            split = anchor = new_node(graph, aten.split_with_sizes.default, (flat, numels),
                                      role=role)
        pieces = []
        for k in range(len(numels)):
            with graph.inserting_after(anchor):
                anchor = new_node(graph, operator.getitem, (split, k), role=role)
            pieces.append(anchor)
    results = []
    for piece, shape in zip(pieces, shapes):
        with graph.inserting_after(anchor):
            anchor = new_node(graph, aten.view.default, (piece, shape), role=role)
        results.append(anchor)
    return results


def bucket_results(gm: fx.GraphModule, collective: fx.Node) -> list[fx.Node]:
    """The reduced gradient nodes of a bucket, in its parameters' order: the views its
    wait (through the split, for several) ends in."""
    (done,) = [u for u in collective.users if _role_of(u, "wait", collective.name)]
    pieces = [done]
    split = [u for u in done.users if u.target is aten.split_with_sizes.default]
    if split:
        getitems = sorted(split[0].users, key=lambda n: n.args[1])
        pieces = getitems
    return [next(u for u in piece.users if u.target is aten.view.default
                 and _role_of(u, "unpack", collective.name)) for piece in pieces]


def _role_of(node: fx.Node, kind: str, collective: str) -> bool:
    role = node.meta.get("spmd_role")
    return role is not None and role.kind == kind and role.collective == collective


# the provenance pass of a parameter gradient's reduction over a tensor-parallel dimension
# as it leaves the graph (``bucketing`` merges those)
GRADIENT_PASS = "tensor_parallel_gradients"

_LAYOUT = {"all_gather": lambda step: step.src.dim, "reduce_scatter": lambda step: step.dst.dim}


def insert_redistribution(gm: fx.GraphModule, ctx: LoweringContext, value: fx.Node,
                          step: Step, provenance: Provenance) -> fx.Node:
    """Insert the table's ``step`` for ``value`` right after it (the collective, its
    wait, the view back to the value's layout); the redistributed node."""
    graph = gm.graph
    src = value.meta["sharding"]
    dst = src.with_placement(step.mesh_dim, step.dst)
    strided = next((p for p in (step.src, step.dst) if isinstance(p, StridedShard)), None)
    if strided is not None:
        return _strided(gm, ctx, value, step, strided, provenance)
    if step.kind == "all_reduce":
        names = list(provenance.params[:1]) if provenance.pass_name == GRADIENT_PASS else [
            value.name]
        _, (reduced,) = build_bucket(gm, ctx, [value], names, step, provenance,
                                     gradients=False)
        return reduced
    spec, handle = _spec(ctx, step)
    if not step.communicates:
        with graph.inserting_after(value):
            node = new_node(graph, ops.local_redistribute, (value, handle), sharding=dst)
        return node
    with graph.inserting_after(value):
        coll = new_node(graph, ops.COLLECTIVE_OPS[step.kind], (value, handle), sharding=src,
                        name=step.kind)
    spec.name = f"{ctx.graph_name}:{coll.name}"
    val = value.meta["val"]
    coll.meta["spmd_collective"] = CollectiveInfo(
        kind=step.kind, mesh_dim=step.mesh_dim, src=step.src, dst=step.dst, params=(),
        numels=(int(val.numel()),), dtype=val.dtype, wire_dtype=val.dtype,
        # the cost formulas' n: all-gather's output, the others' input
        bytes=int((coll if step.kind == "all_gather" else value).meta["val"].numel())
        * val.dtype.itemsize, handle=handle,
        provenance=provenance)
    with graph.inserting_after(coll):
        done = new_node(graph, ops.wait, (coll, handle), sharding=dst,
                        role=Role(kind="wait", collective=coll.name))
    unpack = Role(kind="unpack", collective=coll.name)
    with graph.inserting_after(done):
        if step.kind == "all_to_all":  # pieces stacked in front: back along the source dim
            moved = new_node(graph, aten.movedim.int, (done, 0, step.src.dim), role=unpack)
            with graph.inserting_after(moved):
                return new_node(graph, aten.flatten.using_ints, (moved, step.src.dim,
                                step.src.dim + 1), role=unpack)
        dim = _LAYOUT[step.kind](step)
        return new_node(graph, aten.movedim.int, (done, 0, dim), role=unpack)


def _strided(gm: fx.GraphModule, ctx: LoweringContext, value: fx.Node, step: Step,
             strided: StridedShard, provenance: Provenance) -> fx.Node:
    """A step to or from ``StridedShard(d, k)``: the same step on ``Shard(d + 1)`` of the
    value reshaped with its ``k`` blocks split out, then reshaped back (each rank's part
    of every block is one piece of dimension ``d + 1`` there)."""
    graph = gm.graph
    d = strided.dim
    src = value.meta["sharding"]

    def lifted(p: Any, here: bool) -> Any:
        if here and p == strided:
            return Shard(d + 1)
        if isinstance(p, (Shard, StridedShard)) and p.dim == d and p != strided:
            raise PlanningError(f"{ctx.graph_name}: {value.name} is {p!r} on another mesh "
                                f"dimension along the same tensor dimension as {strided!r}; "
                                f"that layout has no redistribution")
        if isinstance(p, Shard) and p.dim > d:
            return Shard(p.dim + 1)
        if isinstance(p, StridedShard) and p.dim > d:
            return StridedShard(p.dim + 1, p.split)
        return p

    names = src.mesh.dim_names
    blocked = Sharding(mesh=src.mesh, placements=tuple(
        lifted(p, name == step.mesh_dim) for name, p in zip(names, src.placements)))
    with graph.inserting_after(value):
        pre = new_node(graph, aten.reshape.default,
                       (value, strided.blocks(value.meta["val"].shape)), sharding=blocked)
    inner = replace(step, src=Shard(d + 1) if step.src == strided else step.src,
                    dst=Shard(d + 1) if step.dst == strided else step.dst)
    mid = insert_redistribution(gm, ctx, pre, inner, provenance)
    shape = list(mid.meta["val"].shape)
    shape[d:d + 2] = [shape[d] * shape[d + 1]]
    with graph.inserting_after(mid):
        return new_node(graph, aten.reshape.default, (mid, shape),
                        sharding=src.with_placement(step.mesh_dim, step.dst))


def insert_collectives(gm: fx.GraphModule, ctx: LoweringContext) -> fx.GraphModule:
    boundary = needs(gm, Boundary, "insert_collectives")
    nodes = {n.name: n for n in gm.graph.nodes}
    for gradient in boundary.gradients:
        node = nodes[gradient.node]
        target: Sharding = ctx.strategy.gradient_target(gradient.param)
        current = node.meta["sharding"]
        for step in plan_redistribution(current, target):
            if step.kind != "all_reduce":
                raise NotImplementedError(f"{ctx.graph_name}: gradient of {gradient.param} "
                                          f"needs {step}, which no strategy plans yet")
            why = Provenance(params=(gradient.param,), pass_name="insert_collectives",
                             reason=f"gradient is {current[step.mesh_dim]!r} on "
                                    f"{step.mesh_dim!r}; all_reduce makes it {step.dst!r}")
            collective, (reduced,) = build_bucket(gm, ctx, [node], [gradient.param], step,
                                                  why)
            node.replace_all_uses_with(reduced, delete_user_cb=lambda user, c=collective:
                                       user is not c)
    derive(gm, ctx)
    return gm
