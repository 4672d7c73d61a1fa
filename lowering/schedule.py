"""schedule: issue each collective as early as its inputs allow, wait as late as its
first use allows.

Each collective moves right after the last of its inputs to be computed. Its ``wait``
and the unpacking behind it (the nodes ``build_bucket`` tagged) move right before the
first node that consumes the reduced result, so everything in between overlaps with
communication. With ``overlap=False`` each wait follows its collective immediately: the
synchronous baseline, kept as a lever for measurement.
"""

from __future__ import annotations

import torch.fx as fx

from spmd.lowering.collectives import collective_nodes
from spmd.lowering.context import LoweringContext

__all__ = ["schedule", "check_schedule"]


def _order(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def schedule(gm: fx.GraphModule, ctx: LoweringContext) -> fx.GraphModule:
    graph = gm.graph
    for coll in collective_nodes(gm):
        order = _order(graph)
        last = max(coll.all_input_nodes, key=order.__getitem__)
        if last.next is not coll:
            last.append(coll)
        chain = [n for n in graph.nodes if n.meta.get("spmd_unpack_of") == coll.name]
        if ctx.options.overlap:
            order = _order(graph)
            members = set(chain)
            outside = {u for n in chain for u in n.users if u not in members}
            # nothing reads the result (a fused optimizer consumed it): wait at the end
            anchor = min(outside, key=order.__getitem__) if outside else graph.output_node()
            for node in chain:
                anchor.prepend(node)
        else:
            anchor = coll
            for node in chain:
                anchor.append(node)
                anchor = node
    check_schedule(gm)
    return gm


def check_schedule(gm: fx.GraphModule) -> None:
    """Every node (each wait included) after all of its inputs, hence no cycle."""
    order = _order(gm.graph)
    for node in gm.graph.nodes:
        for arg in node.all_input_nodes:
            if order[arg] >= order[node]:
                raise AssertionError(f"schedule: {node.name} runs before its input {arg.name}")
