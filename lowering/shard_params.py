"""shard_params: turn the gathers and reduce-scatters of sharded parameters into
bucketable, asynchronous collectives.

Under ``fsdp``/``hsdp`` a module reads each parameter as ``spmd.shard_gather(shard,
h)`` (its shard, whole again) and autograd leaves its gradient as ``spmd.shard_reduce(
grad, h)``: blocking collectives, correct eagerly. In a traced graph this pass rewrites
each into the pair the schedule can move apart, as a bucket of one that the bucketing
pass merges:

    flat = spmd.bucket_all_gather([shard], h')       # Shard(0) -> Replicate()
    flat = spmd.wait(flat, h')
    param = spmd.unpack_gathered(flat, h')[0]

    flat = spmd.bucket_reduce_scatter([grad], h')    # Partial("avg") -> Shard(0)
    flat = spmd.wait(flat, h')
    grad_shard = view(flat, shard_shape)             # after a cast to the shard's dtype

A parameter read several times in one graph (tied weights, or a saved copy gathered
again in backward) is gathered once; its gradients from several uses, which autograd
reduces separately and adds, are added first and reduce-scattered once.
:func:`build_gather` and :func:`build_scatter` are the one place these patterns are
written.
"""

from __future__ import annotations

import operator
from dataclasses import replace

import torch
import torch.fx as fx

from spmd.lowering import ops
from spmd.lowering.specs import ShardBucketSpec, ShardSpec, lookup
from spmd.lowering.collectives import across_hosts, new_node, unpack_after
from spmd.lowering.context import LoweringContext
from spmd.lowering.passes import Provenance
from spmd.lowering.placements import Partial, Replicate, Shard
from spmd.lowering.redistribute import Step
from spmd.lowering.state import Boundary, CollectiveInfo, Gradient, Role, needs, put

__all__ = ["shard_params", "build_gather", "build_scatter", "gathered_results",
           "scattered_results", "strategy_note"]

aten = torch.ops.aten


def strategy_note(spec: ShardSpec, kind: str) -> str:
    """What the strategy changes about a parameter's collective, for its provenance:
    zero1/zero2's gathers are kept, zero1's reduce-scatter is an all-reduce."""
    if kind == "all_gather" and spec.persistent:
        return "; kept whole until the shards change (gathered once per optimizer step)"
    if kind == "reduce_scatter" and spec.all_reduce:
        return "; sent as an all-reduce of the whole gradient, own rows kept (zero1)"
    return ""


def _bucket_spec(ctx: LoweringContext, kind: str, specs: list[ShardSpec],
                 wire: torch.dtype | None) -> tuple[ShardBucketSpec, int]:
    first = specs[0]
    placed = Shard(first.dim)  # (one dimension per bucket)
    src, dst = (placed, Replicate()) if kind == "all_gather" else (Partial("avg"), placed)
    regroups = kind == "all_gather" and first.regroup_size > 0
    sent = "all_reduce" if kind == "reduce_scatter" and first.all_reduce else kind
    itemsize = (wire or first.gather_dtype).itemsize
    algorithm, why = across_hosts(ctx, first.mesh_dim, sent,
                                  first.size * sum(s.local_numel for s in specs) * itemsize)
    spec = ShardBucketSpec(step=Step(src=src, dst=dst, kind=kind, mesh_dim=first.mesh_dim),
                               group=first.group, size=first.size,
                               params=tuple(s.param for s in specs), shards=tuple(specs),
                               wire_dtype=wire, sync=ctx.sync,  # sync: the profiler's hook
                               copy_held=ctx.compute == "inductor",
                               keeps_parts=regroups and ctx.role == "forward",
                               regathers=regroups and ctx.role == "backward",
                               algorithm=algorithm, choice=why)
    return spec, ctx.handles.add(spec)


def build_gather(gm: fx.GraphModule, ctx: LoweringContext, shards: list[fx.Node],
                 specs: list[ShardSpec], provenance: Provenance,
                 before: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """One all-gather of ``shards`` (their specs in ``specs``), inserted before ``before``
    with its wait and unpacking; the collective and each parameter's whole tensor."""
    graph = gm.graph
    spec, handle = _bucket_spec(ctx, "all_gather", specs, None)
    sharding = shards[0].meta["sharding"]
    whole = sharding.with_placement(spec.step.mesh_dim, Replicate())
    with graph.inserting_before(before):
        coll = new_node(graph, ops.bucket_all_gather, (list(shards), handle), sharding=sharding,
                        name="all_gather")
    spec.name = f"{ctx.graph_name}:{coll.name}"
    dtype = specs[0].gather_dtype
    within = 0
    if spec.regathers:
        within = specs[0].regroup_size
        provenance = Provenance(
            params=provenance.params, pass_name=provenance.pass_name,
            reason=f"{provenance.reason}; gathered among {within} rank(s) from the 1/{within} "
                   f"of each parameter that every rank kept after the forward "
                   f"(reshard_after_forward={within})")
    if spec.choice:
        provenance = replace(provenance, reason=f"{provenance.reason}; {spec.choice}")
    coll.meta["spmd_collective"] = CollectiveInfo(
        kind="all_gather", mesh_dim=spec.step.mesh_dim, src=spec.step.src, dst=spec.step.dst,
        params=spec.params, numels=tuple(s.local_numel for s in specs), dtype=dtype,
        wire_dtype=dtype, bytes=spec.size * spec.total * dtype.itemsize, handle=handle,
        provenance=provenance, within=within)
    unpack = Role(kind="unpack", collective=coll.name)
    with graph.inserting_before(before):
        done = new_node(graph, ops.wait, (coll, handle), sharding=whole,
                        role=Role(kind="wait", collective=coll.name))
        parts = new_node(graph, ops.unpack_gathered, (done, handle), role=unpack)
        results = [new_node(graph, operator.getitem, (parts, k), role=unpack)
                   for k in range(len(specs))]
    return coll, results


def build_scatter(gm: fx.GraphModule, ctx: LoweringContext, grads: list[fx.Node],
                  specs: list[ShardSpec], provenance: Provenance
                  ) -> tuple[fx.Node, list[fx.Node]]:
    """One reduce-scatter of ``grads`` (whole gradients of the parameters ``specs``),
    inserted after the last of them with its wait and unpacking; the collective and each
    parameter's gradient shard, in the shard's dtype."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    last = max(grads, key=order.__getitem__)
    dtype = grads[0].meta["val"].dtype
    wire = specs[0].reduce_dtype or dtype
    spec, handle = _bucket_spec(ctx, "reduce_scatter", specs, wire)
    strategy = ctx.strategy
    dst = strategy.parameter_sharding(specs[0].param)
    src = dst
    for d in strategy.data_dims:
        src = src.with_placement(d, Partial("avg"))
    with graph.inserting_after(last):
        coll = new_node(graph, ops.bucket_reduce_scatter, (list(grads), handle), sharding=src,
                        name="reduce_scatter")
    spec.name = f"{ctx.graph_name}:{coll.name}"
    if spec.choice:
        provenance = replace(provenance, reason=f"{provenance.reason}; {spec.choice}")
    coll.meta["spmd_collective"] = CollectiveInfo(
        kind="reduce_scatter", mesh_dim=spec.step.mesh_dim, src=spec.step.src,
        dst=spec.step.dst, params=spec.params, numels=tuple(s.local_numel for s in specs),
        dtype=dtype, wire_dtype=wire, bytes=spec.size * spec.total * wire.itemsize,
        handle=handle, provenance=provenance,
        sent_as="all_reduce" if specs[0].all_reduce else "")
    unpack = Role(kind="unpack", collective=coll.name)
    anchor = coll
    with graph.inserting_after(anchor):
        done = anchor = new_node(graph, ops.wait, (coll, handle), sharding=dst,
                                 role=Role(kind="wait", collective=coll.name))
    stored = specs[0].dtype
    if wire != stored:
        with graph.inserting_after(anchor):
            anchor = new_node(graph, aten._to_copy.default, (done,), {"dtype": stored},
                              role=unpack)
    results = unpack_after(graph, anchor, [s.local_numel for s in specs],
                           [list(s.local_shape) for s in specs], unpack)
    return coll, results


def _role_nodes(gm: fx.GraphModule, collective: fx.Node) -> list[fx.Node]:
    """The nodes tagged as part of ``collective`` (its wait, unpack, results), in graph
    order: found by walking its users, so a pass over many buckets stays linear."""
    def ours(n: fx.Node) -> bool:
        return (r := n.meta.get("spmd_role")) is not None and r.collective == collective.name

    found, seen, frontier = [], {collective}, [collective]
    while frontier:
        node = frontier.pop()
        if ours(node):
            found.append(node)
        for user in node.users:
            if user not in seen and ours(user):
                seen.add(user)
                frontier.append(user)
    return sorted(found)


def gathered_results(gm: fx.GraphModule, collective: fx.Node) -> list[fx.Node]:
    """A gather bucket's whole parameters, in bucket order."""
    getitems = [n for n in _role_nodes(gm, collective) if n.target is operator.getitem]
    return sorted(getitems, key=lambda n: n.args[1])


def scattered_results(gm: fx.GraphModule, collective: fx.Node) -> list[fx.Node]:
    """A reduce-scatter bucket's gradient shards, in bucket order (the final views)."""
    return [n for n in _role_nodes(gm, collective) if n.target is aten.view.default]


def _combine_reduces(gm: fx.GraphModule) -> dict[str, str]:
    """``add(shard_reduce(a, h), shard_reduce(b, h))`` -> ``shard_reduce(add(a, b), h)``:
    one reduce-scatter per parameter, however many times it was used. Returns the names
    of the replaced sums -> their reductions'."""
    graph = gm.graph
    renamed: dict[str, str] = {}
    changed = True
    while changed:
        changed = False
        for node in list(graph.nodes):
            if node.target is not aten.add.Tensor or len(node.args) != 2 or node.kwargs:
                continue
            a, b = node.args
            if not all(isinstance(x, fx.Node) and x.target is ops.shard_reduce
                       and len(x.users) == 1 for x in (a, b)):
                continue
            if a.args[1] != b.args[1]:
                continue
            with graph.inserting_before(node):
                total = new_node(graph, aten.add.Tensor, (a.args[0], b.args[0]))
                merged = new_node(graph, ops.shard_reduce, (total, a.args[1]))
            node.replace_all_uses_with(merged)
            renamed[node.name] = merged.name
            for key, value in renamed.items():
                if value in (a.name, b.name):
                    renamed[key] = merged.name
            for dead in (node, a, b):
                graph.erase_node(dead)
            changed = True
            break
    return renamed


def shard_params(gm: fx.GraphModule, ctx: LoweringContext) -> fx.GraphModule:
    boundary = needs(gm, Boundary, "shard_params")
    graph = gm.graph
    if not any(n.target in (ops.shard_gather, ops.shard_reduce) for n in graph.nodes):
        return gm
    combined = _combine_reduces(gm)  # gradient node name -> its replacement's
    grad_of = {combined.get(g.node, g.node): g for g in boundary.gradients}
    renamed = {g.node: combined[g.node] for g in boundary.gradients if g.node in combined}
    first: dict[int, fx.Node] = {}  # handle -> the parameter's one gather in this graph
    for node in list(graph.nodes):
        if node.target is ops.shard_gather:
            handle = node.args[1]
            if handle in first:  # read again: the same whole tensor
                node.replace_all_uses_with(first[handle])
                graph.erase_node(node)
                continue
            spec: ShardSpec = lookup(handle)
            why = Provenance(params=(spec.param,), pass_name="shard_params",
                             reason=f"parameter is Shard({spec.dim}) on {spec.mesh_dim!r}; used whole "
                                    f"here (all-gather in {str(spec.gather_dtype)[6:]})"
                                    + strategy_note(spec, "all_gather"))
            _, (whole,) = build_gather(gm, ctx, [node.args[0]], [spec], why, before=node)
            node.replace_all_uses_with(whole)
            graph.erase_node(node)
            first[handle] = whole
        elif node.target is ops.shard_reduce:
            spec = lookup(node.args[1])
            wire = spec.reduce_dtype or node.args[0].meta["val"].dtype
            extra = (f", then averaged across {spec.replicate_dim!r}"
                     if spec.replicate_size > 1 else "")
            why = Provenance(params=(spec.param,), pass_name="shard_params",
                             reason=f"gradient is Partial('avg') on {spec.mesh_dim!r}; the "
                                    f"parameter's shard needs its rows (reduce-scatter in "
                                    f"{str(wire)[6:]}{extra})"
                                    + strategy_note(spec, "reduce_scatter"))
            _, (shard,) = build_scatter(gm, ctx, [node.args[0]], [spec], why)
            node.replace_all_uses_with(shard)
            if node.name in grad_of:
                original = grad_of[node.name].node
                renamed[original] = shard.name
            graph.erase_node(node)
    if renamed:
        gradients = tuple(Gradient(param=g.param, node=renamed.get(g.node, g.node),
                                   output=g.output) for g in boundary.gradients)
        put(gm, Boundary(role=boundary.role, gradients=gradients))
    return gm
