"""``spmd.ep`` in the plan: its all-to-alls priced per graph node
(:func:`all_to_all_seconds`, which the predicted timeline adds) and the plan's section
(:func:`plan_lines`)."""

from __future__ import annotations

from typing import Any


def all_to_all_seconds(plan: Any) -> dict[str, dict[str, tuple[str, float]]]:
    """Each graph's expert ops that move data between ranks, priced for even routing by
    the cost model along their dimension (on a simulated cluster, per link: what
    crosses nodes on the network, the rest on NVLink at once): graph key -> {node name:
    (layer, seconds)}. ``ep_route`` exchanges the counts (``E`` int64s), and with a
    headroom agrees the largest over the mesh (an all-reduce of one int64 along each of
    its dimensions); ``ep_scatter`` sends its input's rows, ``ep_gather`` returns its
    output's (each rank's pairs)."""
    from spmd.lowering import experts as ops
    from spmd.lowering.cost_model import along
    from spmd.lowering.propagate import module_of
    from spmd.lowering.specs import lookup

    out: dict[str, dict[str, tuple[str, float]]] = {}
    models: dict[str, Any] = {}

    def on(dim: str) -> Any:  # the cost model along a mesh dimension, made once
        if dim not in models:
            models[dim] = along(plan.mesh, dim, plan.cost_model)
        return models[dim]

    for key, graph in plan.graphs.items():
        for node in graph.graph.nodes:
            if node.target not in (ops.ep_route, ops.ep_scatter, ops.ep_gather):
                continue
            try:  # (ep_route's handle comes before how many parts it routes one of)
                spec = lookup(node.args[1] if node.target is ops.ep_route else node.args[-1])
            except RuntimeError:  # a plan that outlived its model
                continue
            if spec.size <= 1:
                continue
            if node.target is ops.ep_route:
                nbytes = spec.num_experts * 8
            else:
                val = (node.args[0] if node.target is ops.ep_scatter else node).meta.get("val")
                nbytes = int(val.numel()) * val.element_size() if val is not None else 0
            seconds = on(spec.mesh_dim).seconds("all_to_all", nbytes)
            if node.target is ops.ep_route and spec.headroom is not None and plan.mesh:
                seconds += sum(on(d).seconds("all_reduce", 8) for d in plan.mesh.dim_names
                               if plan.mesh.size(d) > 1)
            out.setdefault(key, {})[node.name] = (spec.module or module_of(node), seconds)
    return out


def plan_lines(plan: Any) -> list[str]:
    """The plan's section on expert parallelism: each layer's experts per rank, the rows
    it sends per step and its all-to-alls priced by the plan's cost model for even
    routing (:func:`all_to_all_seconds`: the counts' exchange, then rows out and back in
    forward, and again in backward); [] for a model without it."""
    from spmd.lowering import experts as ops
    from spmd.lowering.propagate import module_of
    from spmd.lowering.specs import lookup

    layers: dict[str, tuple[Any, int, int, int]] = {}
    for name, graph in plan.graphs.items():
        if not name.endswith(".forward"):
            continue
        for node in graph.graph.nodes:
            if node.target is not ops.ep_scatter:
                continue
            val = node.args[0].meta.get("val")
            try:
                spec = lookup(node.args[-1])
            except RuntimeError:
                continue
            nbytes = int(val.numel()) * val.element_size() if val is not None else 0
            bound = node.meta.get("val")
            layers[spec.module or module_of(node)] = (
                spec, int(val.shape[0]), nbytes,
                int(bound.shape[0]) if bound is not None else 0)
    if not layers:
        return []
    seconds: dict[str, float] = {}
    for nodes in all_to_all_seconds(plan).values():
        for layer, t in nodes.values():
            seconds[layer] = seconds.get(layer, 0.0) + t
    first = next(iter(layers.values()))[0]
    kept = ("dropless" if first.capacity_factor is None else
            f"capacity factor {first.capacity_factor:g} (each expert at most "
            f"ceil({first.capacity_factor:g}·T·k/E) of each rank's pairs, the rest dropped)")
    if first.capacity_factor is None:
        grown = sum(spec.grown for spec, *_ in layers.values())
        kept += (" (rows in: every pair of every rank)" if first.headroom is None else
                 f" (rows in: bounded by a headroom over even routing, grown where a "
                 f"forward overflowed: {grown} time(s))")
    where = (f" on {plan.mesh.hardware.name}, per link" if plan.mesh is not None
             and plan.mesh.hardware is not None else "")
    lines = ["", f"expert parallelism along {first.mesh_dim!r} ({first.size} ranks), {kept}; "
                 f"all-to-alls priced for even routing{where}:",
             f"{'layer':<36} {'experts':>7} {'per rank':>8} {'rows out':>8} "
             f"{'bytes out':>10} {'rows in':>8} {'headroom':>8} {'pred µs/step':>12}"]
    total = 0.0
    for path, (spec, rows, nbytes, bound) in sorted(layers.items()):
        total += seconds.get(path, 0.0)
        room = f"{bound / rows:.3g}" if rows else "-"
        lines.append(f"{path:<36} {spec.num_experts:>7} {spec.local:>8} {rows:>8} "
                     f"{nbytes:>10,} {bound:>8} {room:>8} {seconds.get(path, 0.0) * 1e6:>12.1f}")
    lines.append(f"expert all-to-alls per step: {total * 1e3:.3f} ms predicted, blocking "
                 f"(spmd.ep.expert_load(model): each expert's tokens in the last forward)")
    return lines
