"""The plan of a pipeline: where the graph was cut and why, what crosses between stages,
each stage's predicted time and memory, and the schedule's timeline with its bubbles.

Each stage's time comes from the best source there is:

- on a simulated cluster (``spmd.inspect(model, x, mesh=Mesh.simulated(...,
  hardware=), pipeline=...)``), the plan of the stage itself on the other mesh
  dimensions (its fsdp/tp collectives, the roofline of its graphs on the device);
- on a live run with a strategy on the other dimensions, the plans of this rank's stages;
- otherwise what this rank measured for its own stages in the last step, carried to the
  other stages in proportion to their FLOPs.

The pipeline's timeline is the schedule simulated on those costs (:func:`spmd.pp.simulate`),
with each activation's send priced on the ``pp`` link.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from spmd.plan.plan import Plan
from spmd.pp import Schedule, Simulation, simulate

__all__ = ["PipelinePlan", "StageRecord", "in_flight", "build", "of_run", "scaled_costs",
           "stage_seconds_from_plan"]


@dataclass(kw_only=True)
class StageRecord:
    """One stage of a pipeline plan."""

    index: int
    rank: int  # its index along the pipeline dimension
    begins: str  # the module it begins at ("(start)" for the first)
    params: int  # elements
    param_bytes: int
    flops: float  # forward, per microbatch
    receives: list[tuple[str, int, tuple[int, ...], int]]  # (value, from stage, shape, bytes)
    sends: list[tuple[str, tuple[int, ...], tuple[int, ...], int]]  # (value, to, shape, bytes)
    forward_seconds: float
    backward_seconds: float  # the whole backward (B + W of a split one)
    source: str  # where the times come from
    in_flight: int  # the most microbatches whose activations it holds at once
    memory: Any = None  # the stage's MemoryView on the other dimensions (per microbatch)
    peak_bytes: int | None = None  # predicted with in_flight microbatches held
    capacity: int | None = None

    @property
    def fits(self) -> bool | None:
        if self.peak_bytes is None or self.capacity is None:
            return None
        return self.peak_bytes <= self.capacity


@dataclass(kw_only=True)
class PipelinePlan:
    """What ``PipelineModule.plan()`` and ``spmd.inspect(..., pipeline=)`` return."""

    schedule: Schedule
    ranks: int
    stages: list[StageRecord]
    split_points: tuple[str, ...]
    chosen: str  # why these cut points
    predicted: Simulation
    theoretical_bubble: float  # the schedule's, on equal stage costs and free sends
    measured: list[tuple[Any, float, float]] | None = None  # this rank's last step
    stage_plans: dict[int, Any] = field(default_factory=dict)
    holders: dict[str, int] = field(default_factory=dict)  # parameter -> its (first) stage
    optimizer_seconds: float = 0.0
    hardware: str = ""
    auto: Any = None  # strategy="auto": the layouts tried (spmd.auto.pipeline.PipelineSearch)
    # what the stage plans' graphs refer to by handle and no stage owns (spmd.ep's specs,
    # placed on the whole model): alive as long as the plan
    keep: Any = field(default=None, repr=False)

    @property
    def step_seconds(self) -> float:
        return self.predicted.step + self.optimizer_seconds

    @property
    def bubble(self) -> float:
        return self.predicted.bubble

    def summary(self) -> str:
        s = self.schedule
        lines = [] if self.auto is None else [str(self.auto), ""]
        lines += [
            f"Pipeline: {s.name}, {s.microbatches} microbatches, {len(self.stages)} stages on "
            f"{self.ranks} ranks of {s.dim!r}" + (f" ({s.virtual_stages} per rank)"
                                                  if s.virtual_stages > 1 else "")
            + (f", on {self.hardware}" if self.hardware else ""),
            f"  cut at {', '.join(self.split_points) or '(nothing)'}: {self.chosen}",
            f"  predicted step {self.step_seconds * 1e3:.4g} ms"
            + (f" (optimizer {self.optimizer_seconds * 1e3:.4g} ms)"
               if self.optimizer_seconds else "")
            + f", bubble {self.bubble:.1%} (the schedule's on equal stages: "
              f"{self.theoretical_bubble:.1%})",
        ]
        for st in self.stages:
            mem = ""
            if st.peak_bytes is not None:
                mem = f", peak {st.peak_bytes / 2**30:.2f} GiB"
                if st.capacity is not None:
                    mem += " (fits)" if st.fits else (
                        f" DOES NOT FIT {st.capacity / 2**30:.1f} GiB")
            lines.append(
                f"  stage {st.index} (rank {st.rank}) from {st.begins}: {st.params:,} "
                f"parameters, F {st.forward_seconds * 1e3:.4g} ms, B "
                f"{st.backward_seconds * 1e3:.4g} ms, holds {st.in_flight} microbatch(es)"
                f"{mem}")
        return "\n".join(lines)

    def explain(self, what: Any = "stages") -> str:
        """``"stages"``: where the graph was cut and why, what each stage holds, receives,
        sends and costs; ``"schedule"``: each rank's actions and the timeline; a stage
        index: that stage; a parameter name: the stage that holds it."""
        if what == "schedule":
            ranks = self.schedule.actions(self.ranks)
            rows = [f"{self.schedule.name}: each rank's actions (F forward, B backward"
                    + (" input gradient, W weight gradient" if self.schedule.split_backward
                       else "") + "; stage.microbatch)"]
            for r, actions in enumerate(ranks):
                rows.append(f"  rank {r}: " + " ".join(str(a) for a in actions))
            rows.append(self.timeline())
            return "\n".join(rows)
        if isinstance(what, int):
            if not 0 <= what < len(self.stages):
                raise ValueError(f"explain: there are {len(self.stages)} stages, not {what}")
            return self._stage_text(self.stages[what])
        if what == "stages":
            head = [self.summary().splitlines()[0],
                    f"Cut points: {', '.join(self.split_points) or '(none)'}",
                    f"Why: {self.chosen}", ""]
            return "\n".join(head + [self._stage_text(st) for st in self.stages])
        if isinstance(what, str):
            for st, plan in ((st, self.stage_plans.get(st.index)) for st in self.stages):
                if plan is not None and what in plan.parameters:
                    return f"{what}: stage {st.index} (pipeline rank {st.rank})\n" + \
                        plan.explain(what)
            if what in self.holders:
                st = self.stages[self.holders[what]]
                return (f"{what}: stage {st.index} (pipeline rank {st.rank}), which begins "
                        f"at {st.begins}")
        raise ValueError(f"explain: {what!r} is not 'stages', 'schedule', a stage index or "
                         f"a parameter of the pipeline")

    def _stage_text(self, st: StageRecord) -> str:
        rows = [f"Stage {st.index}, pipeline rank {st.rank}, from {st.begins}",
                f"  parameters: {st.params:,} ({st.param_bytes / 2**20:.2f} MiB)",
                f"  forward FLOPs per microbatch: {st.flops:.4g}",
                f"  time per microbatch: F {st.forward_seconds * 1e3:.4g} ms, B "
                f"{st.backward_seconds * 1e3:.4g} ms ({st.source})"]
        for name, frm, shape, nbytes in st.receives:
            rows.append(f"  receives {name} {list(shape)} from stage {frm} "
                        f"({nbytes / 2**10:.1f} KiB per microbatch; its gradient goes back)")
        for name, to, shape, nbytes in st.sends:
            rows.append(f"  sends {name} {list(shape)} to stage(s) {list(to)} "
                        f"({nbytes / 2**10:.1f} KiB per microbatch)")
        rows.append(f"  holds up to {st.in_flight} microbatch(es) of activations "
                    f"({self.schedule.name})")
        if st.memory is not None:
            rows.append(f"  memory: persistent {st.memory.persistent / 2**30:.3f} GiB, "
                        f"activations {st.memory.activations / 2**30:.3f} GiB per microbatch"
                        + (f", predicted peak {st.peak_bytes / 2**30:.3f} GiB"
                           if st.peak_bytes is not None else ""))
        return "\n".join(rows)

    def timeline(self, width: int = 72) -> str:
        """Each pipeline rank's row over the predicted step (``.``: the bubble)."""
        return (f"predicted timeline, {self.predicted.step * 1e3:.4g} ms, bubble "
                f"{self.bubble:.1%}:\n" + self.predicted.text(width))

    def figure(self) -> Any:
        """The predicted timeline as a matplotlib figure: one row per pipeline rank, one
        box per action (forward, backward, weight gradient), the gaps are the bubble."""
        import matplotlib.pyplot as plt

        colours = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}
        fig, ax = plt.subplots(figsize=(10, 0.5 + 0.45 * self.ranks))
        for r, spans in enumerate(self.predicted.spans):
            for action, start, end in spans:
                ax.barh(r, (end - start) * 1e3, left=start * 1e3, color=colours[action.kind],
                        edgecolor="white", linewidth=0.5)
                ax.text((start + end) / 2 * 1e3, r, str(action.microbatch), ha="center",
                        va="center", fontsize=6, color="white")
        ax.set_yticks(range(self.ranks), [f"rank {r}" for r in range(self.ranks)])
        ax.invert_yaxis()
        ax.set_xlabel("ms")
        ax.set_title(f"{self.schedule.name}: bubble {self.bubble:.1%}")
        return fig

    def _repr_html_(self) -> str:
        import html

        return f"<pre>{html.escape(self.summary())}\n\n{html.escape(self.timeline())}</pre>"

    def __repr__(self) -> str:
        return (f"PipelinePlan({self.schedule.name}, {len(self.stages)} stages, step "
                f"{self.step_seconds * 1e3:.4g} ms, bubble {self.bubble:.1%})")


def in_flight(schedule: Schedule, ranks: int) -> dict[int, int]:
    """Per stage, the most microbatches whose forward ran and whose backward (its W, when
    split) has not: the activations it holds at once."""
    most: dict[int, int] = {}
    for actions in schedule.actions(ranks):
        held: dict[int, int] = {}
        release = "W" if schedule.split_backward else "B"
        for a in actions:
            if a.kind == "F":
                held[a.stage] = held.get(a.stage, 0) + 1
                most[a.stage] = max(most.get(a.stage, 0), held[a.stage])
            elif a.kind == release:
                held[a.stage] -= 1
    return most


def stage_seconds_from_plan(plan: Plan) -> tuple[float, float, float]:
    """(forward, backward, optimizer) seconds of one microbatch through a stage, from the
    stage's own plan."""
    timeline = plan.predicted_timeline(optimizer=None)
    forward = max((s.end for s in timeline.spans if s.label.endswith("forward")),
                  default=0.0)
    total = timeline.step_seconds
    with_opt = plan.predicted_timeline(optimizer="adamw").optimizer_seconds \
        if plan.mesh is not None and plan.mesh.hardware is not None else 0.0
    return forward, max(total - forward, 0.0), with_opt


def build(cut: Any, schedule: Schedule, ranks: int, *, costs: dict[int, tuple[float, float]],
          source: dict[int, str], send: Any = None, stage_plans: dict[int, Any] | None = None,
          capacity: int | None = None, optimizer_seconds: float = 0.0,
          hardware: str = "", measured: Any = None) -> PipelinePlan:
    """The plan from the cut, the schedule and each stage's (forward, backward) seconds."""
    stage_plans = stage_plans or {}
    crossings = cut.crossings
    held = in_flight(schedule, ranks)
    records = []
    for st in cut.stages:
        receives = [(crossings[c].name, crossings[c].src, crossings[c].shape,
                     crossings[c].bytes) for c in st.received]
        sends = [(crossings[c].name, crossings[c].dsts, crossings[c].shape, crossings[c].bytes)
                 for c in st.sent]
        memory = None
        peak = None
        plan = stage_plans.get(st.index)
        if plan is not None:
            memory = plan.memory("adamw")
            peak = memory.peak + max(held.get(st.index, 1) - 1, 0) * memory.activations
        f, b = costs[st.index]
        records.append(StageRecord(
            index=st.index, rank=schedule.rank_of(st.index, ranks),
            begins=cut.split_points[st.index - 1] if st.index else "(start)",
            params=st.param_numel, param_bytes=st.param_bytes,
            flops=st.flops, receives=receives, sends=sends, forward_seconds=f,
            backward_seconds=b, source=source[st.index], in_flight=held.get(st.index, 0),
            memory=memory, peak_bytes=peak, capacity=capacity))
    split = schedule.split_backward

    def cost(kind: str, stage: int) -> float:
        f, b = costs[stage]
        if kind == "F":
            return f
        if not split:
            return b
        return b / 2  # B and W: about half the backward each (one matmul of two)

    producers = {st.index: sorted({crossings[c].src for c in st.received})
                 for st in cut.stages}
    bytes_between: dict[tuple[int, int], int] = {}
    for c in crossings:
        for d in c.dsts:
            bytes_between[(c.src, d)] = bytes_between.get((c.src, d), 0) + c.bytes

    def hop(a: int, b: int) -> float:
        if send is None:
            return 0.0
        key = (a, b) if (a, b) in bytes_between else (b, a)
        return send(bytes_between.get(key, 0))

    predicted = simulate(schedule, ranks, cost, hop, producers)
    plan = PipelinePlan(schedule=schedule, ranks=ranks, stages=records,
                        split_points=cut.split_points, chosen=cut.chosen, predicted=predicted,
                        theoretical_bubble=schedule.bubble(ranks), measured=measured,
                        stage_plans=stage_plans, optimizer_seconds=optimizer_seconds,
                        hardware=hardware)
    for st in reversed(cut.stages):  # a tied parameter: its first stage
        plan.holders.update({n: st.index for n in st.params})
    return plan


def scaled_costs(cut: Any, known: dict[int, tuple[float, float]], why: dict[int, str]
            ) -> dict[int, tuple[float, float]]:
    """Every stage's (forward, backward) seconds: the known ones, the others carried over
    in proportion to their forward FLOPs (backward twice forward where nothing is known)."""
    costs = dict(known)
    flops_known = sum(cut.stages[s].flops for s in known)
    if known and flops_known:
        per_f = sum(f for f, _ in known.values()) / flops_known
        per_b = sum(b for _, b in known.values()) / flops_known
    else:
        per_f, per_b = 1e-9, 2e-9  # relative: a GFLOP a millisecond... a unit, said so
    for st in cut.stages:
        if st.index not in costs:
            costs[st.index] = (st.flops * per_f, st.flops * per_b)
            why[st.index] = ("scaled by FLOPs from the stages this rank measured" if known
                             else "forward FLOPs in relative units (nothing measured)")
    return costs


def of_run(cut: Any, schedule: Schedule, ranks: int, stages: dict[int, Any],
           spans: list) -> PipelinePlan:
    """The plan of a running pipeline, from this rank's view: its stages' own plans where
    they are parallelized, else what it measured for them in the last step (``spans``);
    the other stages' times carried over by FLOPs (:func:`scaled_costs`)."""
    from spmd.lowering.cost_model import CostModel

    plans = {s: m._spmd.plan() for s, m in stages.items() if hasattr(m, "_spmd")}
    known: dict[int, tuple[float, float]] = {}
    why: dict[int, str] = {}
    for s, plan in plans.items():
        f, b, _ = stage_seconds_from_plan(plan)
        known[s], why[s] = (f, b), "this rank's plan of the stage"
    for s in stages:
        if s in known:
            continue
        fs = [e - b for a, b, e in spans if a.stage == s and a.kind == "F"]
        bs = [e - b for a, b, e in spans if a.stage == s and a.kind != "F"]
        if fs:
            known[s] = (sum(fs) / len(fs), sum(bs) / schedule.microbatches)
            why[s] = "measured on this rank, last step"
    costs = scaled_costs(cut, known, why)
    model = CostModel.default("gloo", 2)
    return build(cut, schedule, ranks, costs=costs, source=why,
                 send=lambda n: model.alpha + model.beta * n, stage_plans=plans,
                 measured=spans or None)
