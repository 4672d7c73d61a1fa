"""Timelines of a step: what the cost model predicts, and what a profiled run measured.

A timeline is a list of spans on three lanes: ``compute`` (forward and backward graphs),
``communication`` (each bucket's all-reduce, from issue to completion) and ``exposed``
(time the step waited for communication with nothing to compute).

The prediction replays the planned graphs node by node: forwards in capture order,
backwards in reverse. Each compute node takes a share of the graph's measured (or
estimated) time, weighted by its cost (on a simulated cluster its own roofline time,
:mod:`spmd.plan.roofline`; else matmul FLOPs, or elements written); a
collective is issued where the schedule put it and the network serves collectives in
issue order; communication running beside compute slows the compute by (1 - η) of that
time (η: the cost model's overlap share); a wait whose collective has not finished
blocks, and that time is exposed. A sharded model's gathers so show their prefetch: each
runs beside the previous bucket's compute, and is exposed only where it is late. On a
simulated cluster the step ends with the optimizer (and, when asked, clipping) once
every gradient is reduced.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch.fx as fx

from spmd.lowering.cost_model import along
from spmd.lowering.graph import is_wait

if TYPE_CHECKING:
    from spmd.plan.plan import Plan

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
    optimizer_seconds: float = 0.0  # the optimizer step (and clipping) after the backward
    optimizer_label: str = ""

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


def _phase(timeline: Timeline, graph: fx.GraphModule | None, label: str, seconds: float,
           collectives: dict[str, Any], t: float, network_free: float,
           overlap: float, weights: dict[str, float] | None = None,
           blocking: dict[str, tuple[str, float]] | None = None) -> tuple[float, float]:
    """Replay one graph from time ``t``: compute nodes take their share of ``seconds``
    (slowed by communication beside them), collectives queue on the network, a wait
    blocks until its collective is done, and a node in ``blocking`` (an expert
    all-to-all inside an op: name -> (label, seconds)) holds the compute until its
    transfer is done. Returns (end of the graph, network free at)."""
    if graph is None:
        timeline.spans.append(Span(lane="compute", label=label, start=t, end=t + seconds))
        return t + seconds, network_free
    nodes = list(graph.graph.nodes)
    costs = ([weights.get(n.name, 0.0) for n in nodes] if weights
             else [node_cost(n) for n in nodes])
    total = sum(costs) or 1.0
    ends: dict[str, float] = {}
    flights: list[tuple[float, float]] = []
    segment = t
    for node, cost in zip(nodes, costs):
        held = (blocking or {}).get(node.name)
        if held is not None:  # the op sends and waits: nothing computes meanwhile
            if t > segment:
                timeline.spans.append(Span(lane="compute", label=label, start=segment, end=t))
            begin = max(t, network_free)
            network_free = begin + held[1]
            timeline.spans.append(Span(lane="communication", label=f"{held[0]} all-to-all",
                                       start=begin, end=network_free))
            timeline.spans.append(Span(lane="exposed", label=f"{label} waits for "
                                       f"{node.name}", start=t, end=network_free))
            t = segment = network_free
            continue
        c = collectives.get(node.name)
        if c is not None and c.bucket < 0:  # ring attention: its blocks' sends overlap
            begin = max(t, network_free)    # its own compute; it ends when both are done
            network_free = begin + c.predicted_seconds
            timeline.spans.append(Span(lane="communication", label=c.name, start=begin,
                                       end=network_free))
            t = max(t + seconds * cost / total, network_free)
            continue
        if c is not None:  # issue: the network serves collectives in order
            begin = max(t, network_free)
            network_free = begin + c.predicted_seconds
            timeline.spans.append(Span(lane="communication", label=c.name, start=begin,
                                       end=network_free))
            ends[node.name] = network_free
            flights.append((begin, network_free))
            continue
        if is_wait(node):
            done = ends.get(node.args[0].name, 0.0)
            if done > t:  # nothing left to compute before the value is needed
                if t > segment:
                    timeline.spans.append(Span(lane="compute", label=label, start=segment,
                                               end=t))
                timeline.spans.append(Span(lane="exposed", label=f"{label} waits for "
                                           f"{node.args[0].name}", start=t, end=done))
                t = segment = done
            continue
        d = seconds * cost / total
        beside = sum(max(0.0, min(e, t + d) - max(b, t)) for b, e in flights)
        t += d + (1.0 - overlap) * beside
    if t > segment:
        timeline.spans.append(Span(lane="compute", label=label, start=segment, end=t))
    return t, network_free


# bytes a fused optimizer step reads and writes per element of a parameter: AdamW reads
# the parameter, its gradient and two moments and writes the parameter and the moments
STEP_BYTES = {"adamw": 7, "adam": 7, "sgd_momentum": 5, "sgd": 3, None: 0}


def predict(plan: Plan, optimizer: str | None = "adamw", clip_grad_norm: bool = False,
            compute_scale: float = 1.0) -> Timeline:
    """The cost model's timeline for one step of ``plan``: every region's forward graph in
    capture order, then the backward graphs in reverse, replayed node by node (each
    node's share of its graph's time is its roofline time on a simulated cluster, else
    :func:`node_cost`); then, on a simulated cluster, the optimizer step as one fused
    pass over this rank's parameters and state (:data:`STEP_BYTES`) and, with
    ``clip_grad_norm``, clipping (the gradients read for the norm, then scaled in place,
    and the norm's all-reduce on every mesh dimension). A whole step traced as one graph
    holds its optimizer already. ``compute_scale`` stretches every graph's compute and
    the optimizer's pass (what :func:`spmd.hardware.fit_step` solves for); the
    collectives keep their times."""
    if not compute_scale > 0:
        raise ValueError(f"predicted_timeline: compute_scale must be positive, got "
                         f"{compute_scale!r}")
    if optimizer not in STEP_BYTES:
        raise ValueError(f"predicted_timeline: optimizer must be one of "
                         f"{', '.join(repr(k) for k in STEP_BYTES)}, got {optimizer!r}")
    timeline = Timeline(source="predicted")
    by_phase: dict[tuple[str, str], dict[str, Any]] = {}
    for c in plan.collectives:
        by_phase.setdefault((c.graph, getattr(c, "phase", "backward")), {})[c.name] = c
    overlap = plan.cost_model.overlap
    t = network_free = 0.0
    names = list(plan.compute)
    # spmd.ep's all-to-alls run inside ops: neither the roofline (a simulated cluster)
    # nor the timing run (one rank alone, sending nothing) prices their transfers, so
    # they are added, blocking
    from spmd.ep import all_to_all_seconds

    blocking = all_to_all_seconds(plan)
    for name in names:
        fwd = plan.compute[name][0] * compute_scale
        t, network_free = _phase(timeline, plan.graphs.get(f"{name}.forward"),
                                 f"{name} forward", fwd, by_phase.get((name, "forward"), {}),
                                 t, network_free, overlap,
                                 plan.node_seconds.get(f"{name}.forward"),
                                 blocking.get(f"{name}.forward"))
    for name in reversed(names):
        bwd = plan.compute[name][1] * compute_scale
        phase = "backward" if f"{name}.backward" in plan.graphs else "step"
        key = f"{name}.{phase}"  # a whole step traced as one graph: its collectives too
        t, network_free = _phase(timeline, plan.graphs.get(key), f"{name} {phase}", bwd,
                                 by_phase.get((name, phase), {}), t, network_free,
                                 overlap, plan.node_seconds.get(key), blocking.get(key))
    hardware = plan.mesh.hardware if plan.mesh is not None else None
    whole_step = any(key.endswith(".step") for key in plan.graphs)
    if hardware is not None and not whole_step and (optimizer or clip_grad_norm):
        device = hardware.device
        rate = device.memory_bandwidth * device.efficiency_of("memory").value
        trainable = sum(local for local, _, grad in plan.parameters.values() if grad)
        seconds = STEP_BYTES[optimizer] * trainable / rate * compute_scale
        label = f"{optimizer} step" if optimizer else ""
        if clip_grad_norm:
            seconds += 3 * trainable / rate * compute_scale + sum(
                along(plan.mesh, d, plan.cost_model).seconds("all_reduce", 4)
                for d in plan.mesh.dim_names)
            label = f"{label} and clipping" if label else "clipping"
        network_free = max(network_free, t)  # the step needs every gradient reduced
        timeline.spans.append(Span(lane="compute", label=label, start=network_free,
                                   end=network_free + seconds))
        timeline.optimizer_seconds, timeline.optimizer_label = seconds, label
    return timeline
