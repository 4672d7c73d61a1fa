"""What a node of a planned graph is (a collective, a wait), how inserted nodes get their
``meta["val"]``, and the dependency graph of an fx graph as a ``networkx.DiGraph`` for
inspection: one node per fx node (by name), an edge from each input to its user."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import operator

import torch
import torch.fx as fx
from torch.fx.node import map_aggregate

from spmd.lowering import ops

if TYPE_CHECKING:
    import networkx as nx

__all__ = ["dependency_graph", "is_collective", "is_wait", "fill_val", "tensor_vals",
           "collective_nodes", "copy_graph", "restore_order"]

_COLLECTIVES = frozenset([*ops.COLLECTIVE_OPS.values(), *ops.SHARD_OPS.values()])


def is_collective(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in _COLLECTIVES


def is_wait(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in ops.WAIT_OPS


def collective_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The graph's collectives, in graph order."""
    return [n for n in gm.graph.nodes if is_collective(n)]


def copy_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A new module over a copy of ``gm``'s graph (each node's meta a shallow copy), for
    rewriting without touching the planned graph; the copy's ``meta`` starts empty."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return fx.GraphModule(gm, graph)


def tensor_vals(value: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_aggregate(value, lambda v: found.append(v) if isinstance(v, torch.Tensor) else None)
    return found


def fill_val(node: fx.Node) -> None:
    """Give an inserted node its ``meta["val"]``: its op run on its inputs' fake values,
    under their fake mode (the fake kernels of our ops included)."""
    from torch._guards import detect_fake_mode

    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        node.meta["val"] = node.args[0].meta["val"][node.args[1]]  # no dispatch needed
        return
    if node.target is ops.wait:  # an alias of its input
        node.meta["val"] = node.args[0].meta["val"]
        return

    args = map_aggregate(node.args, lambda a: a.meta["val"] if isinstance(a, fx.Node) else a)
    kwargs = map_aggregate(node.kwargs, lambda a: a.meta["val"] if isinstance(a, fx.Node) else a)
    mode = detect_fake_mode(tensor_vals((args, kwargs)))
    if mode is None:
        raise RuntimeError(f"fill_val: the inputs of {node.name} carry no fake tensors")
    fake = ops.FAKES.get(node.target, node.target)  # ours: straight to the fake kernel
    with mode:
        node.meta["val"] = fake(*args, **kwargs)


def dependency_graph(graph: fx.Graph) -> nx.DiGraph:
    """Nodes carry ``op``, ``target``, ``kind`` (compute/communication/wait/io) and
    ``order`` (position in the fx graph)."""
    import networkx as nx  # only inspection needs it: planning stays free of its import

    g = nx.DiGraph()
    for order, node in enumerate(graph.nodes):
        kind = ("communication" if is_collective(node) else "wait" if is_wait(node)
                else "io" if node.op in ("placeholder", "output") else "compute")
        g.add_node(node.name, op=node.op, target=str(node.target), kind=kind, order=order)
        for src in node.all_input_nodes:
            g.add_edge(src.name, node.name)
    return g


def restore_order(graph: fx.Graph) -> bool:
    """Move every node that reads a value defined after it to just after its last input
    (and so on down its readers), keeping every other node in place: the graph's order
    where a pass rewired readers to a value it placed later (a bucket of gradients
    reduced after the last of them, read by another mesh dimension's reduction that sat
    after the first). True if anything moved."""
    import heapq

    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    waiting = {n: len(set(n.all_input_nodes)) for n in nodes}
    ready = [(index[n], n.name) for n in nodes if waiting[n] == 0]
    heapq.heapify(ready)
    by_name = {n.name: n for n in nodes}
    order: list[fx.Node] = []
    while ready:
        _, name = heapq.heappop(ready)
        node = by_name[name]
        order.append(node)
        for user in node.users:
            waiting[user] -= 1
            if waiting[user] == 0:
                heapq.heappush(ready, (index[user], user.name))
    if len(order) != len(nodes):
        raise RuntimeError("restore_order: the graph has a cycle")
    if order == nodes:
        return False
    output = [n for n in order if n.op == "output"]
    order = [n for n in order if n.op != "output"] + output
    anchor = order[0]
    for node in order[1:]:
        if anchor.next is not node:
            anchor.append(node)
        anchor = node
    return True
