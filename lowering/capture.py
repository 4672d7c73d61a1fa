"""capture: the ``torch.compile`` backend that feeds Dynamo's graphs through the passes.

Dynamo hands over one fx graph per captured region (a graph break makes several) with
its example inputs: the module's real parameter and buffer tensors, then data. Each
input is identified by identity against the module's own tensors, so every parameter has
its name. AOTAutograd then splits the region into a forward graph and a backward graph
whose output i is the gradient of input i; the forward graph is emitted as is, the
backward graph goes through :data:`BACKWARD_PASSES` first (annotate → propagate →
insert_collectives → bucketing → schedule) and is emitted with its collectives inside.

A backward graph the passes cannot plan is emitted unchanged and reported: its
parameters' gradients then reach the eager safety net, so training stays correct.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx

from spmd.lowering.annotate import PlanningError, annotate
from spmd.lowering.bucketing import bucketing
from spmd.lowering.collectives import insert_collectives
from spmd.lowering.context import InputInfo, LoweringContext
from spmd.lowering.emit import emit
from spmd.lowering.passes import Pass, run_passes
from spmd.lowering.propagate import propagate
from spmd.lowering.schedule import schedule

__all__ = ["BACKWARD_PASSES", "GraphRecord", "Capture", "time_forward"]

log = logging.getLogger("spmd.lowering")

BACKWARD_PASSES: list[tuple[str, Pass]] = [
    ("annotate", annotate),
    ("propagate", propagate),
    ("insert_collectives", insert_collectives),
    ("bucketing", bucketing),
    ("schedule", schedule),
]


@dataclass(eq=False)
class GraphRecord:
    """Everything captured and decided for one Dynamo region."""

    name: str
    inputs: tuple[InputInfo, ...]
    dynamo_graph: fx.GraphModule
    forward: fx.GraphModule | None = None
    backward: fx.GraphModule | None = None
    fallback_reason: str | None = None
    forward_seconds: float | None = None  # the first real forward call, timed
    forward_run: Callable[[list], Any] | None = None  # the emitted forward
    compile_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def params(self) -> list[str]:
        return [i.name for i in self.inputs if i.kind == "param"]

    @property
    def trainable(self) -> list[str]:
        return [i.name for i in self.inputs if i.kind == "param" and i.requires_grad]


class Capture:
    """A ``torch.compile`` backend for one parallelized module.

    Args:
        names: ``id(tensor) -> (kind, name)`` for the module's parameters and buffers.
        make_context: builds the lowering context for a graph's inputs and name.
        on_backward: called with each record whose backward graph was planned, before its
            first run (the frontend compares plan hashes across ranks there).
    """

    def __init__(self, names: dict[int, tuple[str, str]],
                 make_context: Callable[[tuple[InputInfo, ...], str], LoweringContext],
                 on_backward: Callable[[GraphRecord], None]) -> None:
        self.names = names
        self.make_context = make_context
        self.on_backward = on_backward
        self.records: list[GraphRecord] = []

    def describe(self, example_inputs: list[Any]) -> tuple[InputInfo, ...]:
        infos = []
        for i, t in enumerate(example_inputs):
            if isinstance(t, torch.Tensor):
                kind, name = self.names.get(id(t), ("data", f"input{i}"))
                infos.append(InputInfo(kind=kind, name=name, shape=tuple(t.shape), dtype=t.dtype,
                                       requires_grad=t.requires_grad))
            else:
                infos.append(InputInfo(kind="data", name=f"input{i}", shape=(), dtype=torch.int64))
        return tuple(infos)

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        from torch._dynamo.backends.common import aot_autograd

        name = f"graph{len(self.records)}"
        inputs = self.describe(example_inputs)
        record = GraphRecord(name=name, inputs=inputs, dynamo_graph=gm)
        self.records.append(record)

        def forward_compiler(fw: fx.GraphModule, _: list[Any]) -> Callable[..., Any]:
            start = time.perf_counter()
            record.forward = fw
            run = emit(fw)
            record.forward_run = run
            record.compile_seconds["forward"] = time.perf_counter() - start
            return _timed_first_call(run, record)

        def backward_compiler(bw: fx.GraphModule, _: list[Any]) -> Callable[..., Any]:
            start = time.perf_counter()
            ctx = self.make_context(inputs, name, record)
            try:
                bw = run_passes(bw, ctx, BACKWARD_PASSES)
            except PlanningError as e:
                record.fallback_reason = str(e)
                log.warning("spmd: %s left to the eager safety net: %s", name, e)
            record.backward = bw
            run = emit(bw)
            record.compile_seconds["backward"] = time.perf_counter() - start
            if record.fallback_reason is None:
                self.on_backward(record)
            return run

        return aot_autograd(fw_compiler=forward_compiler, bw_compiler=backward_compiler,
                            inference_compiler=forward_compiler)(gm, example_inputs)


def _timed_first_call(run: Callable[[list], Any], record: GraphRecord) -> Callable[[list], Any]:
    """Time the first real forward (it estimates the backward compute for the cost model),
    then hand every later call straight to ``run``."""
    state = {"first": True}

    def first(args: list) -> Any:
        if not state["first"]:
            return run(args)
        state["first"] = False
        start = time.perf_counter()
        out = run(args)
        record.forward_seconds = time.perf_counter() - start
        return out

    first._boxed_call = True  # type: ignore[attr-defined]
    return first


def time_forward(record: GraphRecord, repeats: int = 3) -> float | None:
    """Seconds of one run of the emitted forward graph, best of ``repeats``, on inputs
    shaped like the traced ones (random floats, zero indices); None if it cannot run.

    The first real call is a poor estimate (cold allocator and caches); by the time the
    backward graph is planned it has run once, so a few more runs are warm.
    """
    if record.forward is None or record.forward_run is None:
        return record.forward_seconds
    try:
        values = [n.meta["val"] for n in record.forward.graph.nodes if n.op == "placeholder"]
        def make(v: Any) -> Any:
            if isinstance(v, torch.Tensor):
                shape = [int(d) for d in v.shape]
                if v.dtype.is_floating_point:
                    return torch.randn(shape, dtype=v.dtype, device=v.device)
                return torch.zeros(shape, dtype=v.dtype, device=v.device)
            return int(v) if isinstance(v, torch.SymInt) else v
        best = float("inf")
        with torch.no_grad():
            for _ in range(repeats):
                args = [make(v) for v in values]
                start = time.perf_counter()
                record.forward_run(args)
                best = min(best, time.perf_counter() - start)
        return best
    except Exception as e:  # an input the tracer constrained (e.g. valid indices): keep going
        log.debug("spmd: could not re-time %s's forward: %s", record.name, e)
        return record.forward_seconds
