"""A pipeline's plan made without processes (``spmd.inspect(model, x, mesh=, pipeline=,
loss_fn=, target=)`` and the layout search's outer loop): the model cut into stages, each
distinct stage planned on the other dimensions, the schedule simulated."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
import torch.nn as nn
import torch.utils._pytree as pytree

from spmd.lowering.options import Options
from spmd.plan.planning import plan_model
from spmd.runtime.mesh import Mesh

__all__ = ["plan_pipeline"]


def _structure(stage: Any) -> tuple:
    """What makes two stages plan the same: their ops, wiring and shapes (not names)."""
    index: dict[Any, int] = {}
    rows = []
    for i, node in enumerate(stage.code.graph.nodes):
        index[node] = i
        val = node.meta.get("val")
        shape = (tuple(val.shape), str(val.dtype)) if isinstance(val, torch.Tensor) else None
        args = torch.fx.node.map_aggregate(
            (node.args, node.kwargs), lambda a: ("n", index[a]) if isinstance(a, torch.fx.Node)
            else repr(a))
        rows.append((node.op, str(node.target) if node.op != "placeholder" else "",
                     repr(args), shape))
    return (tuple(rows), stage.loss)


def plan_pipeline(pm: Any, args: tuple, *, target: Any, loss_fn: Any) -> Any:
    """``PipelineModule.plan_for`` (``spmd.inspect(model, *args, mesh=Mesh.simulated(...),
    pipeline=, loss_fn=, target=)``): the plan of pipeline ``pm`` without processes. The model is cut as a run would
    cut it; each distinct stage is planned on the other mesh dimensions with the strategy
    and placements (``spmd.inspect`` of the stage: its collectives, its roofline on the
    simulated device, its memory); stages of the same structure (the middle ones of a
    deep model) are planned once. The schedule is simulated on those stage times, with
    every activation's send priced on the pipeline dimension's link."""
    from dataclasses import replace

    from spmd.lowering.annotate import PlanningError
    from spmd.lowering.cost_model import CostModel
    from spmd.pipeline.plan import build, stage_seconds_from_plan

    where = "spmd.inspect"
    from spmd.lowering.balance import balance
    from spmd.lowering.stages import Cut
    from spmd.pipeline.stage import stage_placements

    model, mesh, options = pm.module, pm.mesh, pm.options
    m = pm.schedule.microbatches
    leaves, spec = pytree.tree_flatten((args, target))
    rows = {t.shape[0] for t in leaves if isinstance(t, torch.Tensor) and t.dim()}
    if len(rows) != 1 or next(iter(rows)) % m:
        raise ValueError(f"{where}: microbatches={m} must divide the batch's rows along dim "
                         f"0 (got {sorted(rows)})")
    micro = [t.chunk(m, 0)[0] if isinstance(t, torch.Tensor) and t.dim() else t
             for t in leaves]
    program = pm._program(micro, spec, loss_fn)
    cut = program.cut
    others = pm._others
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    stage_options = replace(options, pipeline=None, calibrate=False)

    def plan_stages(cut: "Cut") -> dict[int, Any]:
        plans: dict[int, Any] = {}
        done: dict[tuple, Any] = {}
        for stage in cut.stages:
            key = _structure(stage)
            if key in done:
                plans[stage.index] = done[key]
                continue
            module = pm._stages[stage.index]
            inputs = [micro[i] for i in stage.inputs]
            for c in stage.received:
                info = cut.crossings[c]
                inputs.append(torch.empty(info.shape, dtype=info.dtype, device=device,
                                          requires_grad=info.grad))
            opts = stage_options
            if options.placements is not None:
                opts = replace(stage_options, placements=stage_placements(
                    model, mesh, options.placements, stage.params, where, pm._experts))
            sub = others if others is not None else type(mesh).simulated(
                1, hardware=mesh.hardware)
            kwargs = {f: getattr(opts, f) for f in (
                "reshard_after_forward", "param_dtype", "bucket_cap_mb", "overlap",
                "reduce_dtype", "compile_compute", "placements", "shard_placement_fn")}
            plan = plan_model(module, tuple(inputs), sub, opts.strategy, kwargs)
            plans[stage.index] = done[key] = plan
        return plans

    plans = plan_stages(cut)
    if pm.schedule.split_points is None:
        # balanced again on what the stages' plans predict per FLOP (embedding, head and
        # loss cost other than blocks do): the cut a second round of planning confirms
        rate = {}
        for st in cut.stages:
            f, b, _ = stage_seconds_from_plan(plans[st.index])
            rate[st.index] = (f + b) / st.flops if st.flops else 0.0
        traced = pm._traced
        marks = dict(traced.marks)
        position = {n: i for i, n in enumerate(traced.gm.graph.nodes)}
        starts = [-1] + [position[marks[p]] for p in cut.split_points]

        def seconds(point: str | None, flops: float) -> float:
            at = -1 if point is None or marks.get(point) is None else position[marks[point]]
            stage = max(i for i, b in enumerate(starts) if b <= at)
            return flops * rate[stage]

        points, why = balance(traced, len(cut.stages), where, seconds)
        if tuple(points) != tuple(cut.split_points):
            cut = pm._recut(points, why)
            plans = plan_stages(cut)
        capacity = mesh.hardware.device.memory_bytes if mesh.hardware is not None else None
        margin = 0.0
        for _ in range(3):  # a stage over its memory: the fastest cut where all fit
            bound = _memory_bound(cut, plans, pm.schedule, pm._ranks, capacity, traced,
                                  margin)
            if bound is None:
                break
            fits, memory, over = bound
            try:
                points, why = balance(traced, len(cut.stages), where, seconds, fits, memory)
            except ValueError:
                break  # none fits: the check below says so
            if tuple(points) == tuple(cut.split_points):
                break
            cut = pm._recut(points, why)
            plans = plan_stages(cut)
            # the estimate missed by what the new plans show: leave that much spare
            margin += max(_overshoot(cut, plans, pm.schedule, pm._ranks, capacity), 0.0)
    costs, why = {}, {}
    optimizer = 0.0
    for s, plan in plans.items():
        f, b, opt = stage_seconds_from_plan(plan)
        costs[s], why[s] = (f, b), "the stage's plan on " + repr(plan.mesh)
        optimizer = max(optimizer, opt * pm.schedule.virtual_stages)
    hardware = mesh.hardware
    if hardware is not None and pm.schedule.dim in mesh.dim_names:
        link = hardware.cost_model(mesh, pm.schedule.dim)
    else:
        link = CostModel.default("gloo", 2)
    capacity = hardware.device.memory_bytes if hardware is not None else None
    result = build(cut, pm.schedule, pm._ranks, costs=costs, source=why,
                   send=lambda n: link.alpha + link.beta * n, stage_plans=plans,
                   capacity=capacity, optimizer_seconds=optimizer,
                   hardware=hardware.name if hardware is not None else "")
    result.keep = getattr(pm, "_expert_handles", None)
    over = [st for st in result.stages if st.fits is False]
    if over:
        st = max(over, key=lambda r: r.peak_bytes or 0)
        raise PlanningError(
            f"{where}: stage {st.index} (from {st.begins}) does not fit: predicted peak "
            f"{st.peak_bytes / 2**30:.1f} GiB with {st.in_flight} microbatch(es) in flight, "
            f"against {capacity / 2**30:.1f} GiB per device. More pipeline ranks or other "
            f"cut points (split_points), fewer microbatches held (gpipe holds every "
            f"one; 1f1b at most the number of stages), activation checkpointing, or "
            f"sharding the stage (strategy='fsdp', tensor parallelism) would fit it\n"
            + result.summary())
    return result


def _peaks(cut: Any, plans: dict[int, Any], schedule: Any, ranks: int) -> dict[int, float]:
    from spmd.pipeline.plan import in_flight

    held = in_flight(schedule, ranks)
    views = {s: plans[s].memory("adamw") for s in plans}
    return {s: v.peak + max(held.get(s, 1) - 1, 0) * v.activations for s, v in views.items()}


def _overshoot(cut: Any, plans: dict[int, Any], schedule: Any, ranks: int,
               capacity: int | None) -> float:
    """How far the most over-full stage is above ``capacity`` (negative: every one fits)."""
    if capacity is None:
        return 0.0
    return max(_peaks(cut, plans, schedule, ranks).values()) - capacity


def _memory_bound(cut: Any, plans: dict[int, Any], schedule: Any, ranks: int,
                  capacity: int | None, traced: Any, margin: float = 0.0) -> Any:
    """When some stage's predicted peak exceeds ``capacity``: ``(fits, memory, by how
    much)`` for :func:`spmd.lowering.stages.balance`. ``memory(span)`` is the span's persistent bytes
    and saved activations per microbatch, at the rates its stage's plan predicted (per
    parameter byte, per forward FLOP); ``fits(stage, persistent, activations)`` adds the
    activations times the microbatches the schedule makes that stage hold, and the
    largest transient any stage's plan showed, within ``capacity - margin``. None when
    every stage fits."""
    from spmd.pipeline.plan import in_flight

    if capacity is None:
        return None
    held = in_flight(schedule, ranks)
    views = {s: plans[s].memory("adamw") for s in plans}
    peaks = _peaks(cut, plans, schedule, ranks)
    if all(p <= capacity for p in peaks.values()):
        return None
    per_byte = {st.index: views[st.index].persistent / max(st.param_bytes, 1)
                for st in cut.stages}
    per_flop = {st.index: views[st.index].activations / max(st.flops, 1.0)
                for st in cut.stages}
    extra = max(max(v.peak - v.persistent - v.activations, 0) for v in views.values())
    marks = dict(traced.marks)
    position = {n: i for i, n in enumerate(traced.gm.graph.nodes)}
    starts = [-1] + [position[marks[p]] for p in cut.split_points]

    def memory(point: str | None, flops: float, param_bytes: int) -> tuple[float, float]:
        at = -1 if point is None or marks.get(point) is None else position[marks[point]]
        stage = max(i for i, b in enumerate(starts) if b <= at)
        return per_byte[stage] * param_bytes, per_flop[stage] * flops

    def fits(stage: int, persistent: float, activations: float) -> bool:
        return persistent + held.get(stage, 1) * activations + extra <= capacity - margin

    return fits, memory, max(peaks.values()) - capacity
