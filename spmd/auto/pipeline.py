"""``strategy="auto"`` with pipeline stages (:mod:`spmd.auto.search`): the outer loop.

    plan = spmd.inspect(model, tokens, mesh=spmd.Mesh.simulated((4, 8), ("pp", "b"),
                        hardware=...), strategy="auto", memory_budget="70GiB",
                        pipeline=spmd.pp.schedule("1f1b", 8), loss_fn=F.cross_entropy,
                        target=labels)

The stages run on the dimension the schedule names; the other dimension (one) splits the
batch (ddp, fsdp, zero2 or zero1 inside each stage) or the model (Megatron tensor
parallelism, each rank of it then holding the rows of all of them: the same global
batch). Each layout is planned as a hand-written pipeline is: the model traced with its
loss, cut where the planner balances the stages' predicted time (exact dynamic
programming over the blocks) and, when a stage is over its device, within each rank's
memory, each distinct stage planned on the other dimension, the schedule simulated with
the sends priced. The fastest whose every stage's peak fits the budget is chosen; the
plan lists every layout tried. The number of stages is the schedule's (the ``"pp"``
dimension's size times its ``virtual_stages``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from spmd.auto.candidates import SEARCHED, Planned, gib, parse_budget, tiled
from spmd.lowering.options import Options
from spmd.lowering.strategy import kind_of
from spmd.runtime.mesh import Mesh

__all__ = ["PipelineSearch", "PipelineCandidate", "plan_pipeline_auto"]


@dataclass(kw_only=True)
class PipelineCandidate(Planned):
    """One pipeline layout planned: the stages' strategy and tensor parallelism, the
    predicted step and the largest stage peak."""

    tp: bool


@dataclass(kw_only=True)
class PipelineSearch:
    """What ``strategy="auto"`` tried for a pipeline, and what it chose."""

    budget: float
    chosen: PipelineCandidate
    candidates: list[PipelineCandidate] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        lines = [f"strategy='auto' with pipeline stages under a budget of {gib(self.budget)}"
                 f" per rank: chose {self.chosen.label} (searched in {self.seconds:.1f} s)",
                 f"  {'layout of the stages':<40} {'predicted step':>15} {'largest peak':>14}"]
        for c in self.candidates:
            if c.error:
                lines.append(f"  {c.label:<40} not plannable: {c.error}")
                continue
            mark = ("<- chosen" if c is self.chosen else
                    "" if c.fits(self.budget) else "over budget")
            lines.append(f"  {c.label:<40} {c.seconds * 1e3:12.3f} ms {gib(c.peak):>14}  "
                         f"{mark}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def explain(self, name: str) -> None:
        return None  # the stages' own plans explain each parameter


def plan_pipeline_auto(model: nn.Module, args: tuple, *, mesh: Mesh, pipeline: Any,
                       loss_fn: Any, target: Any, memory_budget: Any = None,
                       placements: Any = None, where: str = "spmd.inspect",
                       **options: Options) -> Any:
    """The fastest pipeline layout within the budget (see the module doc): its
    :class:`~spmd.pipeline.plan.PipelinePlan`, with ``auto`` the :class:`PipelineSearch`."""
    from spmd.lowering.annotate import PlanningError
    from spmd.pipeline.module import check_pipeline
    from spmd.lowering.options import Options as Built
    from spmd.program.build import plan_for
    from spmd.tp import megatron

    check_pipeline(pipeline, mesh, where)
    started = time.perf_counter()
    budget = parse_budget(memory_budget, where)
    if not math.isfinite(budget) and mesh.hardware is not None:
        budget = float(mesh.hardware.device.memory_bytes)
    others = [d for d in mesh.dim_names if d != pipeline.dim]
    if len(others) != 1:
        raise ValueError(f"{where}: strategy='auto' with pipeline stages searches one mesh "
                         f"dimension beside {pipeline.dim!r}; mesh {mesh} has {len(others)}")
    other = others[0]
    size = mesh.size(other)
    spec = placements if placements is not None else megatron()
    layouts: list[tuple[str, str, bool]] = [(k, k, False) for k in SEARCHED]
    if options.get("param_dtype") is not None:
        layouts = [lay for lay in layouts if kind_of(lay[0]).shards]
    if size > 1:
        layouts.append(("ddp", f"megatron tp on {other!r}", True))
    candidates = []
    for kind, label, tp in layouts:
        names = tuple(pipeline.dim if d == pipeline.dim else ("tp" if tp else "dp")
                      for d in mesh.dim_names)
        cand = PipelineCandidate(label=label, strategy=kind, tp=tp)
        factor = size if tp else 1  # the same global batch: a tp rank holds its group's rows
        kwargs = dict(options)
        if tp:
            kwargs["placements"] = spec
        try:
            row = kind_of(kind).arguments  # the keywords that select it
            strategy = row.pop("strategy")
            built = Built.from_kwargs(where, strategy=strategy,
                                      **{**kwargs, **row, "pipeline": pipeline})
            plan = plan_for(model, tiled(args, factor), built, mesh.rename(names), where,
                            loss_fn=loss_fn, target=tiled((target,), factor)[0])
        except (ValueError, TypeError, NotImplementedError, RuntimeError) as e:
            cand.error = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            candidates.append(cand)
            continue
        peaks = [st.peak_bytes for st in plan.stages if st.peak_bytes is not None]
        cand.plan, cand.seconds = plan, plan.step_seconds
        cand.peak = float(max(peaks)) if peaks else math.inf
        candidates.append(cand)
    fitting = [c for c in candidates if c.fits(budget)]
    if not fitting:
        least = min((c for c in candidates if not c.error), key=lambda c: c.peak, default=None)
        rows = "\n".join(f"  {c.label}: " + (c.error or f"largest stage peak {gib(c.peak)}")
                         for c in candidates)
        raise PlanningError(
            f"{where}: no pipeline layout of {type(model).__name__} on {mesh} fits the memory "
            f"budget of {gib(budget)}" + (f"; the least is {least.label} at {gib(least.peak)}"
                                          if least else "") +
            f". What would fit: more pipeline stages or ranks beside them, more microbatches "
            f"(each holds less), recomputing blocks.\n{rows}")
    chosen = min(fitting, key=lambda c: c.seconds)
    plan = chosen.plan
    plan.auto = PipelineSearch(budget=budget, chosen=chosen, candidates=candidates,
                               seconds=time.perf_counter() - started)
    return plan
