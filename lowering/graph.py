"""What a node of a planned graph is (a collective, a wait), and the dependency graph of
an fx graph as a ``networkx.DiGraph`` for inspection: one node per fx node (by name), an
edge from each input to its user."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.fx as fx

if TYPE_CHECKING:
    import networkx as nx

__all__ = ["dependency_graph", "is_collective", "is_wait"]


def is_collective(node: fx.Node) -> bool:
    from spmd.lowering import ops

    return node.op == "call_function" and node.target is ops.bucket_all_reduce


def is_wait(node: fx.Node) -> bool:
    from spmd.lowering import ops

    return node.op == "call_function" and node.target is ops.wait


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
