"""Views of a Plan for people: the dependency graph, explanations, a timeline figure, HTML.

- :func:`to_networkx`: every node of every captured graph, with its kind (compute,
  communication, wait, io), estimated cost, and for collectives their bytes, bucket and
  predicted time, for users' own analysis.
- :func:`overview`: the same condensed to what a person can read: per graph, compute
  segments between collectives, each collective and each wait.
- :func:`explain`: why a collective, a bucket or a parameter's communication exists and
  what it costs.
- :func:`timeline_figure`: matplotlib lanes for compute, communication and exposed time,
  predicted and (after ``spmd.profile``) measured side by side.
- :func:`html`: the bucket table and an SVG of the overview, for notebooks (Graphviz's
  ``dot`` when installed, a matplotlib drawing otherwise).
"""

from __future__ import annotations

import html as _html
import io
import shutil
import subprocess
from typing import TYPE_CHECKING, Any

import networkx as nx

from spmd.lowering.graph import dependency_graph, is_collective, is_wait
from spmd.plan.timeline import node_cost, predict

if TYPE_CHECKING:
    from spmd.plan.plan import Plan

__all__ = ["to_networkx", "overview", "explain", "timeline_figure", "html", "svg"]


def to_networkx(plan: Plan) -> nx.DiGraph:
    """One DiGraph of all captured graphs; nodes named ``"<graph>.<phase>/<node>"``, each
    node and edge with the ``sharding`` of its value (placements per mesh dimension)."""
    out = nx.DiGraph()
    by_collective = {c.name: c for c in plan.collectives}
    for key, gm in plan.graphs.items():
        deps = dependency_graph(gm.graph)
        fx_nodes = {n.name: n for n in gm.graph.nodes}
        for name, data in deps.nodes(data=True):
            attrs = dict(data, graph=key, cost=node_cost(fx_nodes[name]))
            c = by_collective.get(name)
            if c is not None and key.startswith(f"{c.graph}."):
                attrs.update(bytes=c.bytes, bucket=c.bucket,
                             kind="communication" if c.bucket >= 0 else "compute",
                             predicted_seconds=c.predicted_seconds,
                             provenance=str(c.provenance))
            sharding = fx_nodes[name].meta.get("sharding")
            if sharding is not None:
                attrs["sharding"] = repr(sharding)
            out.add_node(f"{key}/{name}", **attrs)
        for a, b in deps.edges:  # an edge carries the value of its source, so its placement
            placed = fx_nodes[a].meta.get("sharding")
            out.add_edge(f"{key}/{a}", f"{key}/{b}",
                         **({} if placed is None else {"sharding": repr(placed)}))
    return out


def overview(plan: Plan) -> nx.DiGraph:
    """Compute segments, collectives and waits, in program order, per graph."""
    g = nx.DiGraph()
    by_collective = {c.name: c for c in plan.collectives}
    for key, gm in plan.graphs.items():
        previous, segment, cost = None, 0, 0.0
        for node in gm.graph.nodes:
            kind = ("communication" if is_collective(node) else "wait" if is_wait(node)
                    else "compute")
            if kind == "compute":
                cost += node_cost(node)
                continue
            if cost:
                name = f"{key}: compute {segment}"
                g.add_node(name, kind="compute", cost=cost)
                if previous:
                    g.add_edge(previous, name)
                previous, segment, cost = name, segment + 1, 0.0
            c = by_collective.get(node.name)
            label = (f"{key}: {c.kind} b{c.bucket} ({c.bytes / 1024:.0f} KiB)" if c
                     else f"{key}: wait {node.args[0].name if node.args else ''}")
            g.add_node(label, kind=kind)
            if previous:
                g.add_edge(previous, label)
            previous = label
        if cost:
            name = f"{key}: compute {segment}"
            g.add_node(name, kind="compute", cost=cost)
            if previous:
                g.add_edge(previous, name)
    return g


def explain(plan: Plan, x: Any) -> str:
    """Why ``x`` (a collective's name, a bucket index or Bucket, or a parameter name)
    exists and what it costs."""
    buckets = plan.buckets
    if hasattr(x, "index") and hasattr(x, "params"):
        x = x.index
    if isinstance(x, int) and not isinstance(x, bool):
        if not 0 <= x < len(buckets):
            raise KeyError(f"explain: no bucket {x}; the plan has buckets 0..{len(buckets) - 1}")
        return _explain_bucket(plan, buckets[x])
    if not isinstance(x, str):
        raise TypeError(f"explain: expected a collective name, a bucket index or a parameter "
                        f"name, got {type(x).__name__}")
    for c in plan.collectives:
        if c.name == x or f"{c.graph}:{c.name}" == x:
            if c.bucket < 0:  # ring attention's sends: no bucket
                return (f"{c.name} ({c.phase}, {c.graph}): {c.kind}, {c.bytes} B sent per rank "
                        f"on {c.mesh_dim!r}, predicted {c.predicted_seconds * 1e3:.3f} ms "
                        f"(overlapped with the attention's blocks); {c.provenance.reason}")
            return _explain_bucket(plan, buckets[c.bucket])
    for b in buckets:
        if x in b.params:
            return (f"parameter {x!r}: its gradient is Partial('avg') on every rank (each rank "
                    f"saw its own shard of the batch); it travels in bucket {b.index}.\n"
                    + _explain_bucket(plan, b))
    tp = _explain_tensor_parallel(plan, x)
    if tp is not None:
        return tp
    for f in plan.fallbacks:
        if f.param == x:
            return (f"parameter {x!r} is synchronised by the eager safety net: {f.reason}; "
                    f"its gradient is averaged after backward, outside any graph")
    if x in plan.frozen:
        return f"parameter {x!r} is frozen (requires_grad=False): no gradient, no collective"
    known = [c.name for c in plan.collectives][:5]
    raise KeyError(f"explain: {x!r} is neither a collective ({', '.join(known)}...) nor a "
                   f"parameter in this plan")


def _explain_tensor_parallel(plan: Plan, x: str) -> str | None:
    """Why the collectives of module (or parameter) ``x`` exist under tensor parallelism:
    each one's rule, placements in and out and cost, then the placements the rules chose
    for its ops; None when ``x`` names nothing tensor-parallel."""
    if not plan.placed:
        return None
    module = x.rsplit(".", 1)[0] if x in plan.tp_placements else x

    def inside(path: str) -> bool:
        return path == module or path.startswith(module + ".")

    params = {n: p for n, p in plan.tp_placements.items() if inside(n.rsplit(".", 1)[0])}
    colls = [c for c in plan.collectives if c.provenance.pass_name == "tensor_parallel"
             and any(inside(m) for m in c.provenance.params)]
    placed = [p for p in plan.placed if inside(p.module)]
    if not (params or colls or placed):
        return None
    lines = [f"{x}: tensor parallel"]
    for name, where in params.items():
        shown = ", ".join(f"{d}: {p!r}" for d, p in where.items())
        lines.append(f"  parameter {name}: {shown}")
    if not colls:
        lines.append("  no collective: every value it computes is placed as its consumers "
                     "need it")
    for c in colls:
        lines.append(f"  {c.name} ({c.graph} {c.phase}): {c.kind} of {c.bytes:,} bytes on "
                     f"{c.mesh_dim!r}, {c.placements}, {c.predicted_seconds * 1e6:.1f} µs "
                     f"predicted")
        lines.append(f"    why: {c.provenance.reason}")
    if placed:
        lines.append("  placements chosen by the rules:")
        lines += [f"    {p}" for p in placed]
    return "\n".join(lines)


def _explain_bucket(plan: Plan, b: Any) -> str:
    c = next(c for c in plan.collectives if c.bucket == b.index)
    shown = ", ".join(b.params[:8]) + (f" and {len(b.params) - 8} more" if len(b.params) > 8
                                       else "")
    wire = "" if b.wire_dtype == b.dtype else f", sent as {b.wire_dtype}"
    return (f"{c.name} (bucket {b.index} of {c.graph}): {c.kind} of {b.numel:,} {b.dtype} "
            f"elements = {b.bytes:,} bytes{wire} on group {c.group!r} "
            f"({plan.world_size} ranks, mesh dimension {c.mesh_dim!r}).\n"
            f"  placement: {c.placements} for {len(b.params)} gradient(s): {shown}\n"
            f"  why: {c.provenance}\n"
            f"  cost: {b.predicted_seconds * 1e6:.1f} µs predicted "
            f"(α={plan.cost_model.alpha * 1e6:.1f} µs, β={plan.cost_model.beta * 1e9:.3f} ns/B, "
            f"{plan.cost_model.algorithm} {c.kind}); packed and unpacked by the "
            f"{b.kernel} kernels")


_COLORS = {"compute": "#4c72b0", "communication": "#dd8452", "exposed": "#c44e52"}


def timeline_figure(plan: Plan) -> Any:
    """A matplotlib Figure: one row of lanes per timeline (predicted, and measured if any)."""
    import matplotlib.pyplot as plt

    timelines = [predict(plan)] + ([plan.measured] if plan.measured is not None else [])
    fig, axes = plt.subplots(len(timelines), 1, figsize=(10, 1.6 + 1.4 * len(timelines)),
                             squeeze=False, sharex=True)
    lanes = ["compute", "communication", "exposed"]
    for ax, tl in zip(axes[:, 0], timelines):
        for row, lane in enumerate(lanes):
            for span in tl.lane(lane):
                ax.broken_barh([(span.start * 1e3, max(span.seconds * 1e3, 1e-3))],
                               (row - 0.4, 0.8), facecolors=_COLORS[lane], edgecolor="white",
                               linewidth=0.5)
        ax.set_yticks(range(len(lanes)), lanes)
        ax.invert_yaxis()
        ax.set_title(f"{tl.source}: step {tl.step_seconds * 1e3:.2f} ms, communication "
                     f"{tl.communication_seconds * 1e3:.2f} ms, exposed "
                     f"{tl.exposed_seconds * 1e3:.2f} ms", fontsize=9, loc="left")
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("milliseconds")
    fig.tight_layout()
    return fig


def _dot(g: nx.DiGraph) -> str:
    colors = {"compute": "lightsteelblue", "communication": "sandybrown", "wait": "indianred"}
    lines = ["digraph plan {", "  rankdir=LR; node [shape=box, style=filled, fontsize=10];"]
    ids = {n: f"n{i}" for i, n in enumerate(g.nodes)}
    for n, data in g.nodes(data=True):
        label = n.replace('"', "'")
        lines.append(f'  {ids[n]} [label="{label}", fillcolor={colors[data["kind"]]}];')
    lines += [f"  {ids[a]} -> {ids[b]};" for a, b in g.edges]
    lines.append("}")
    return "\n".join(lines)


def svg(plan: Plan, max_nodes: int = 60) -> str:
    """An SVG drawing of :func:`overview` (truncated to ``max_nodes`` nodes)."""
    g = overview(plan)
    if g.number_of_nodes() > max_nodes:
        g = g.subgraph(list(g.nodes)[:max_nodes]).copy()
    if shutil.which("dot"):
        done = subprocess.run(["dot", "-Tsvg"], input=_dot(g), capture_output=True, text=True,
                              timeout=30)
        if done.returncode == 0:
            return done.stdout
    import matplotlib.pyplot as plt

    order = list(nx.topological_sort(g)) if g.number_of_nodes() else []
    pos = {n: (i % 6, -(i // 6)) for i, n in enumerate(order)}
    fig, ax = plt.subplots(figsize=(12, 1 + 0.9 * (len(order) // 6 + 1)))
    colors = [{"compute": "#b0c4de", "communication": "#f4a460", "wait": "#cd5c5c"}[g.nodes[n]["kind"]]
              for n in order]
    nx.draw_networkx(g, pos, ax=ax, node_color=colors, node_shape="s", node_size=900,
                     font_size=6, labels={n: n.split(": ", 1)[-1] for n in order},
                     arrows=True)
    ax.set_axis_off()
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def html(plan: Plan) -> str:
    """The bucket table and the overview drawing, for a notebook cell."""
    rows = "".join(
        f"<tr><td>{b.index}</td><td>{b.graph}</td><td>{len(b.params)}</td>"
        f"<td>{_html.escape(str(b.dtype))}</td><td>{_html.escape(str(b.wire_dtype))}</td>"
        f"<td>{b.numel:,}</td><td>{b.bytes:,}</td><td>{b.kernel}</td>"
        f"<td>{b.predicted_seconds * 1e6:.1f}</td>"
        f"<td>{_html.escape(', '.join(b.params[:3]))}{' …' if len(b.params) > 3 else ''}</td></tr>"
        for b in plan.buckets)
    head = _html.escape(plan.summary().splitlines()[0])
    fallbacks = "".join(f"<li>{_html.escape(f.param)}: {_html.escape(f.reason)}</li>"
                        for f in plan.fallbacks)
    return (f"<div><p><b>{head}</b></p><table><thead><tr><th>bucket</th><th>graph</th>"
            f"<th>params</th><th>dtype</th><th>wire</th><th>numel</th><th>bytes</th>"
            f"<th>kernel</th><th>pred µs</th><th>first params</th></tr></thead>"
            f"<tbody>{rows}</tbody></table>"
            + (f"<p>eager safety net:</p><ul>{fallbacks}</ul>" if fallbacks else "")
            + f"<div>{svg(plan)}</div></div>")
