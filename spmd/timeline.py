"""Timelines of a step: what the cost model predicts, and what a profiled run measured.

A timeline is a list of spans on three lanes: ``compute`` (forward and backward graphs),
``communication`` (each bucket's all-reduce, from issue to completion) and ``exposed``
(time the step waited for communication with nothing to compute).

The prediction replays the plan: forwards run in capture order, backwards in reverse;
inside a backward graph a bucket becomes ready at its position in the graph, weighted
by the estimated cost of the nodes before it (matmul FLOPs, else elements written); the
network serves buckets in issue order; communication running beside compute slows the
compute by (1 - η) of that time (η: the cost model's overlap share); a graph's waits
sit at its end, so whatever is still in flight there is exposed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from spmd.lowering.graph import collective_nodes

__all__ = ["Span", "Timeline", "predict", "node_cost"]

_MATMULS = ("mm", "addmm", "bmm", "baddbmm", "convolution", "convolution_backward",
            "_scaled_dot_product")


@dataclass(frozen=True, kw_only=True, slots=True)
class Span:
    lane: str  # "compute" | "communication" | "exposed"
    label: str
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(kw_only=True)
class Timeline:
    """Spans of one step and where they came from (``"predicted"`` or ``"measured"``)."""

    source: str
    spans: list[Span] = field(default_factory=list)

    @property
    def step_seconds(self) -> float:
        return max((s.end for s in self.spans), default=0.0)

    @property
    def exposed_seconds(self) -> float:
        return sum(s.seconds for s in self.spans if s.lane == "exposed")

    @property
    def communication_seconds(self) -> float:
        return sum(s.seconds for s in self.spans if s.lane == "communication")

    def lane(self, name: str) -> list[Span]:
        return [s for s in self.spans if s.lane == name]

    def __repr__(self) -> str:
        return (f"Timeline({self.source}: step {self.step_seconds * 1e3:.3f} ms, communication "
                f"{self.communication_seconds * 1e3:.3f} ms, exposed "
                f"{self.exposed_seconds * 1e3:.3f} ms)")


def node_cost(node: fx.Node) -> float:
    """A relative cost: 2·M·N·K for matrix products, else the elements the node writes."""
    val = node.meta.get("val", node.meta.get("example_value"))
    shape = getattr(val, "shape", None)
    if shape is None:
        return 0.0
    out = 1
    for d in shape:
        out *= int(d)
    name = getattr(node.target, "__name__", str(node.target))
    if any(name.startswith(m) for m in _MATMULS):
        inner = 1
        for arg in node.all_input_nodes:
            arg_shape = getattr(arg.meta.get("val", arg.meta.get("example_value")), "shape", None)
            if arg_shape is not None and len(arg_shape):
                inner = max(inner, int(arg_shape[-1]))
        return 2.0 * out * inner
    return float(out)


def _ready_fractions(graph: fx.GraphModule) -> dict[str, float]:
    """For each collective: the share of the graph's estimated cost done before it."""
    collectives = set(collective_nodes(graph))
    costs, total, marks = [], 0.0, {}
    for node in graph.graph.nodes:
        total += node_cost(node)
        costs.append((node, total))
    for node, done in costs:
        if node in collectives:
            marks[node.name] = done / total if total else 1.0
    return marks


def predict(plan: Any) -> Timeline:
    """The cost model's timeline for one step of ``plan``."""
    timeline = Timeline(source="predicted")
    by_graph: dict[str, list] = {}
    for c in plan.collectives:
        by_graph.setdefault(c.graph, []).append(c)
    t = 0.0
    names = [n for n in plan.compute]
    for name in names:
        fwd, _ = plan.compute[name]
        timeline.spans.append(Span(lane="compute", label=f"{name} forward", start=t, end=t + fwd))
        t += fwd
    network_free = t
    for name in reversed(names):
        _, bwd = plan.compute[name]
        start = t
        backward_at = len(timeline.spans)
        timeline.spans.append(Span(lane="compute", label=f"{name} backward", start=start,
                                   end=start + bwd))
        graph = plan.graphs.get(f"{name}.backward") or plan.graphs.get(f"{name}.step")
        fractions = _ready_fractions(graph) if graph is not None else {}
        compute_end = start + bwd
        stretch = 0.0  # compute slowed by communication it could not run beside
        for c in by_graph.get(name, []):
            ready = start + stretch + fractions.get(c.name, 1.0) * bwd
            begin = max(ready, network_free)
            network_free = begin + c.predicted_seconds
            timeline.spans.append(Span(lane="communication", label=c.name, start=begin,
                                       end=network_free))
            beside = max(0.0, min(network_free, compute_end) - begin)
            slowed = (1.0 - plan.cost_model.overlap) * beside
            stretch += slowed
            compute_end += slowed
        timeline.spans[backward_at] = Span(lane="compute", label=f"{name} backward",
                                           start=start, end=compute_end)
        last_end = max(compute_end, network_free)
        if last_end > compute_end:
            timeline.spans.append(Span(lane="exposed", label=f"{name} waits", start=compute_end,
                                       end=last_end))
        t = last_end
    return timeline
