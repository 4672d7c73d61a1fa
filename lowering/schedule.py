"""schedule: issue each collective as early as its inputs allow, wait as late as its
first use allows.

The passes before this one put each wait (and the nodes that unpack its result) right
after its collective: a correct, synchronous graph. This pass owns where they go: each
collective moves right after the last of its inputs to be computed, and its wait, with
the unpacking behind it, moves right before the first node that reads the result, so
everything in between overlaps with communication. Switched off (``overlap=False``
runs the pipeline without it), the synchronous graph stays.

Saved activations that tensor parallelism redistributes in backward (sequence
parallelism's gathered norm outputs) are graph inputs too: each such collective is
issued no earlier than the previous one's wait.

Sharded parameters change two things. Their all-gathers' inputs are graph inputs, so
"as early as possible" would gather the whole model at the start; instead each bucket's
all-gather is issued right before the previous bucket's wait (prefetch, one bucket
ahead: the next layers' parameters travel while this layer computes), and the first
where its inputs allow. Their gradients' reduce-scatters hold a whole gradient bucket
until they finish, so each is waited on right before the next one is issued: one in
flight, overlapping the compute between them.
"""

from __future__ import annotations

import torch.fx as fx

from spmd.lowering.context import LoweringContext
from spmd.lowering import ops
from spmd.lowering.graph import collective_nodes

__all__ = ["schedule", "check_schedule"]


def _order(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def _chain(graph: fx.Graph, collective: fx.Node) -> list[fx.Node]:
    """The nodes that belong to ``collective`` (its wait, the unpacking, a fused optimizer
    step), in graph order."""
    out = []
    for node in graph.nodes:
        role = node.meta.get("spmd_role")
        if role is not None and role.collective == collective.name:
            out.append(node)
    return out


def schedule(gm: fx.GraphModule, ctx: LoweringContext) -> fx.GraphModule:
    graph = gm.graph
    for coll in collective_nodes(gm):
        order = _order(graph)
        last = max(coll.all_input_nodes, key=order.__getitem__)
        if last.next is not coll:
            last.append(coll)
        chain = _chain(graph, coll)
        order = _order(graph)
        members = set(chain)
        outside = {u for n in chain for u in n.users if u not in members}
        # nothing reads the result (a fused optimizer consumed it): wait at the end
        anchor = min(outside, key=order.__getitem__) if outside else graph.output_node()
        for node in chain:
            anchor.prepend(node)
    _prefetch_gathers(graph)
    _one_scatter_in_flight(graph)
    _activations_one_ahead(graph)
    check_schedule(gm)
    return gm


def _wait_of(graph: fx.Graph, collective: fx.Node) -> fx.Node:
    return next(n for n in _chain(graph, collective) if n.meta["spmd_role"].kind == "wait")


def _prefetch_gathers(graph: fx.Graph) -> None:
    gathers = [n for n in graph.nodes if n.target is ops.bucket_all_gather]
    order = _order(graph)
    gathers.sort(key=lambda c: order[_wait_of(graph, c)])
    for previous, coll in zip(gathers, gathers[1:]):
        _wait_of(graph, previous).prepend(coll)


_ACTIVATION_OPS = (ops.all_gather, ops.reduce_scatter, ops.all_to_all)


def _activations_one_ahead(graph: fx.Graph) -> None:
    """A tensor-parallel redistribution of a value the forward saved (sequence
    parallelism gathers each layer's norm output again in backward) has its input from
    the start: issued there, every layer's gathered activation would be alive at once.
    Each is issued no earlier than the previous one's wait (one ahead, as parameter
    gathers are)."""
    colls = [n for n in graph.nodes if n.target in _ACTIVATION_OPS]
    order = _order(graph)
    colls.sort(key=lambda c: order[_wait_of(graph, c)])
    for previous, coll in zip(colls, colls[1:]):
        order = _order(graph)
        wait = _wait_of(graph, previous)
        if order[coll] < order[wait]:
            wait.prepend(coll)


def _one_scatter_in_flight(graph: fx.Graph) -> None:
    scatters = [n for n in graph.nodes if n.target is ops.bucket_reduce_scatter]
    for coll, following in zip(scatters, scatters[1:]):
        order = _order(graph)
        chain = _chain(graph, coll)
        if order[chain[0]] > order[following]:
            for node in chain:
                following.prepend(node)


def check_schedule(gm: fx.GraphModule) -> None:
    """Every node (each wait included) after all of its inputs, hence no cycle."""
    order = _order(gm.graph)
    for node in gm.graph.nodes:
        for arg in node.all_input_nodes:
            if order[arg] >= order[node]:
                raise AssertionError(f"schedule: {node.name} runs before its input {arg.name}")
