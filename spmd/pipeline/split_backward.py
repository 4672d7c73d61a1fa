"""A backward split into its input gradient (B) and its weight gradient (W), on the
autograd graph, for zero-bubble pipeline schedules: B runs what the stage's inputs need
and keeps the gradient where the graph turns towards weights; W later runs just the
weights' part from there. The idea of ``torch.distributed.pipelining``'s
``stage_backward_input``/``stage_backward_weight``, written for this runtime."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["backward_input", "backward_weight"]


def _node_of(t: torch.Tensor) -> Any:
    if t.grad_fn is not None:
        return t.grad_fn
    if t.requires_grad:  # a leaf: its gradient accumulator
        return t.view_as(t).grad_fn.next_functions[0][0]
    return None


def backward_input(roots: list[torch.Tensor], grads: list[torch.Tensor],
                   inputs: list[torch.Tensor], weights: list[torch.Tensor]
                   ) -> tuple[list[torch.Tensor | None], list[dict]]:
    """The B of a split backward: the gradients of ``inputs``, computing no weight
    gradient. Where the autograd graph turns off towards weights (a node on an input's
    path whose edge leads to weights only), the gradient flowing into that node is kept,
    so that :func:`backward_weight` later runs just that node's weights' part (the idea of
    ``torch.distributed.pipelining``'s ``stage_backward_input``). A weight reached from
    two such nodes (a weight used twice in the stage) would be summed twice: then the
    whole backward runs here and W has nothing left to do."""
    input_nodes = {n for n in (_node_of(t) for t in inputs) if n is not None}
    weight_of = {n: w for w in weights if (n := _node_of(w)) is not None}
    reach_input: dict[Any, bool] = {}
    reach_weights: dict[Any, frozenset] = {}
    order: list[Any] = []
    seen: set = set()
    stack = [(r.grad_fn, False) for r in roots if r.grad_fn is not None]
    while stack:  # post-order over the autograd graph
        n, expanded = stack.pop()
        if expanded:
            order.append(n)
            continue
        if n in seen:
            continue
        seen.add(n)
        stack.append((n, True))
        stack.extend((c, False) for c, _ in n.next_functions if c is not None and c not in seen)
    for n in order:
        children = [c for c, _ in n.next_functions if c is not None]
        reach_input[n] = n in input_nodes or any(reach_input[c] for c in children)
        found = frozenset([n]) if n in weight_of else frozenset()
        reach_weights[n] = found.union(*(reach_weights[c] for c in children))
    groups: list[dict] = []
    owner: dict[Any, Any] = {}
    for n in order:
        if not reach_input[n]:
            continue
        mine = frozenset().union(*(reach_weights[c] for c, _ in n.next_functions
                                   if c is not None and not reach_input[c]))
        if mine:
            groups.append({"node": n, "weights": mine})
    for r, g in zip(roots, grads):
        if r.grad_fn is not None and not reach_input[r.grad_fn] and reach_weights[r.grad_fn]:
            groups.append({"root": r, "grad": g, "weights": reach_weights[r.grad_fn]})
    for group in groups:
        for w in group["weights"]:
            if owner.setdefault(w, id(group)) != id(group):  # shared: no split here
                torch.autograd.backward(roots, grads, inputs=inputs + weights or None)
                return [t.grad for t in inputs], []
    captured: dict[Any, tuple] = {}
    handles = []
    for group in groups:
        if "node" in group:
            def keep(grad_outputs: tuple, node: Any = group["node"]) -> None:
                captured[node] = tuple(None if g is None else g.detach() for g in grad_outputs)
            handles.append(group["node"].register_prehook(keep))
    try:
        if inputs:
            got = list(torch.autograd.grad(roots, inputs, grads, retain_graph=True,
                                           allow_unused=True))
        else:  # the first stage: nothing but weights; W runs it all
            return [], [{"roots": roots, "grads": grads,
                         "weights": [w for w in weights if _node_of(w) is not None]}]
    finally:
        for h in handles:
            h.remove()
    out = []
    for group in groups:
        params = [weight_of[w] for w in group["weights"]]
        if "node" in group:
            kept = captured.get(group["node"], ())
            edges = [(group["node"], i) for i, g in enumerate(kept) if g is not None]
            out.append({"edges": edges, "grads": [g for g in kept if g is not None],
                        "weights": params})
        else:
            out.append({"roots": [group["root"]], "grads": [group["grad"]], "weights": params})
    return got, out


def backward_weight(groups: list[dict]) -> None:
    """The W of a split backward: each group's weight gradients from what B kept,
    accumulated into ``.grad``."""
    from torch.autograd.graph import GradientEdge

    for group in groups:
        weights = group["weights"]
        if "roots" in group:
            outputs = group["roots"]
        else:
            outputs = [GradientEdge(n, i) for n, i in group["edges"]]
        if not outputs or not weights:
            continue
        got = torch.autograd.grad(outputs, weights, group["grads"], allow_unused=True,
                                  retain_graph=True)
        for w, g in zip(weights, got):
            if g is None:
                continue
            if w.grad is None:
                w.grad = g
            else:
                w.grad += g
