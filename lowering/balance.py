"""Choosing where to cut a pipeline: the spans between the traced marks, each with its
forward FLOPs and the parameter bytes first read in it, split into contiguous stages so
that the largest stage's cost is least (dynamic programming, exact), within each rank's
memory when the planner gives a bound."""

from __future__ import annotations

from typing import Callable, Sequence

from spmd.lowering.stages import Traced, _bytes, _free_nodes, _val

__all__ = ["balance", "span_flops", "span_param_bytes"]


def span_flops(traced: Traced, points: Sequence[str]) -> list[float]:
    """Forward FLOPs of the spans between consecutive marks of ``points`` (in forward
    order): ``len(points) + 1`` numbers. What every stage recomputes for itself (masks,
    positions) is not counted; a span of nothing else is 0."""
    order = {node: i for i, node in enumerate(traced.gm.graph.nodes)}
    marks = dict(traced.marks)
    free = _free_nodes(traced)
    bounds = [order[marks[p]] if marks[p] is not None else -1 for p in points]
    spans = [0.0] * (len(points) + 1)
    current = 0
    for i, node in enumerate(traced.gm.graph.nodes):
        while current < len(bounds) and i > bounds[current]:
            current += 1
        if node not in free:
            spans[current] += traced.flops.get(node.name, 0.0)
    return spans


def span_param_bytes(traced: Traced, points: Sequence[str]) -> list[int]:
    """Bytes of the trainable parameters first read in each span between the marks of
    ``points``."""
    order = {node: i for i, node in enumerate(traced.gm.graph.nodes)}
    marks = dict(traced.marks)
    bounds = [order[marks[p]] if marks[p] is not None else -1 for p in points]
    out = [0] * (len(points) + 1)
    kinds = iter(traced.kinds)
    for node in traced.gm.graph.nodes:
        if node.op != "placeholder":
            continue
        kind, name = next(kinds)
        if kind != "param" or not node.users:
            continue
        first = min(order[u] for u in node.users)
        span = sum(1 for b in bounds if first > b)
        out[span] += _bytes(_val(node))
    return out


def balance(traced: Traced, n_stages: int, where: str,
            seconds: Callable[[str | None, float], float] | None = None,
            fits: Callable[[int, float, float], bool] | None = None,
            memory: Callable[[str | None, float, int], tuple[float, float]] | None = None
            ) -> tuple[list[str], str]:
    """The cut points (among the traced marks) that minimise the largest stage's cost
    over ``n_stages`` contiguous stages, and why. A span's cost is its forward FLOPs, or
    ``seconds(the mark it begins at (None: the start), its FLOPs)`` when the planner
    knows better (what each stage's own plan predicted per FLOP). With ``fits(stage, A,
    B)`` only cuts whose every stage fits its rank's memory are taken (``ValueError`` when
    none is): A and B are the sums over the stage's spans of ``memory(the mark it begins
    at, its FLOPs, its parameter bytes)``, a pair (default: the FLOPs and the parameter
    bytes themselves). Dynamic programming over the spans, exact for this objective."""
    order = {node: i for i, node in enumerate(traced.gm.graph.nodes)}
    points = sorted({p for p, _ in traced.marks},
                    key=lambda p: order.get(dict(traced.marks)[p], -1))
    # only marks that split the graph somewhere new
    spans = span_flops(traced, points)
    weights = span_param_bytes(traced, points)
    # a span with nothing to compute joins the one before it (a stage must compute)
    kept_points: list[str | None] = []
    kept_spans: list[float] = []
    kept_bytes: list[int] = []
    for i, f in enumerate(spans):
        if f == 0.0 and i + 1 < len(spans):
            if kept_bytes:
                kept_bytes[-1] += weights[i]
            elif i + 1 < len(weights):
                weights[i + 1] += weights[i]
            continue
        kept_spans.append(f)
        kept_bytes.append(weights[i])
        kept_points.append(points[i - 1] if i else None)
    points = [p for p in kept_points[1:] if p is not None]
    spans = kept_spans
    flops = list(spans)
    units = len(spans)
    if units < n_stages:
        raise ValueError(f"{where}: {n_stages} stages, but the model has only {units} spans "
                         f"with work to cut between (at {', '.join(points)}); name "
                         f"split_points yourself or use fewer stages")
    if seconds is not None:
        spans = [seconds(p, f) for p, f in zip(kept_points, spans)]
    measure = memory or (lambda p, f, b: (float(f), float(b)))
    pairs = [measure(p, f, b) for p, f, b in zip(kept_points, flops, kept_bytes)]
    prefix, a_prefix, b_prefix = [0.0], [0.0], [0.0]
    for f, (a, b) in zip(spans, pairs):
        prefix.append(prefix[-1] + f)
        a_prefix.append(a_prefix[-1] + a)
        b_prefix.append(b_prefix[-1] + b)
    inf = float("inf")
    # best[k][j]: the smallest largest stage cost over the first j spans in k stages
    best = [[inf] * (units + 1) for _ in range(n_stages + 1)]
    back = [[0] * (units + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for j in range(k, units - (n_stages - k) + 1):
            for i in range(k - 1, j):
                if fits is not None and not fits(k - 1, a_prefix[j] - a_prefix[i],
                                                 b_prefix[j] - b_prefix[i]):
                    continue
                cost = max(best[k - 1][i], prefix[j] - prefix[i])
                if cost < best[k][j]:
                    best[k][j], back[k][j] = cost, i
    if best[n_stages][units] == inf:
        raise ValueError(f"{where}: no cut into {n_stages} stages fits every rank's memory")
    cuts, j = [], units
    for k in range(n_stages, 0, -1):
        i = back[k][j]
        if k > 1:
            cuts.append(i)
        j = i
    cuts.reverse()
    chosen = [points[i - 1] for i in cuts]
    total = prefix[-1]
    largest = best[n_stages][units]
    what = "predicted seconds" if seconds is not None else "forward FLOPs"
    if fits is not None:
        what += " within each rank's memory"
    why = (f"balanced by {what}: the largest stage has {largest / total:.0%} of "
           f"{total:.3g} (ideal {1 / n_stages:.0%})" if total else "balanced by op count")
    return chosen, why
