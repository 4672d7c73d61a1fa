"""capture: the ``torch.compile`` backend that feeds Dynamo's graphs through the passes.

Dynamo hands over one fx graph per captured region (a graph break makes several) with
its example inputs: the module's real parameter and buffer tensors, then data. Each
input is identified by identity against the module's own tensors, so every parameter has
its name. AOTAutograd then splits the region into a forward graph and a backward graph
whose output i is the gradient of input i. Both go through the pass list
(:data:`spmd.lowering.pipeline.PASSES`): the forward first, whose placements tell the
backward where the values it saved live; the backward then gets its collectives.

A graph the passes cannot plan is emitted unchanged and reported: its parameters'
gradients then reach the eager safety net, so training stays correct.
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
import torch.fx as fx

from spmd.lowering.annotate import PlanningError
from spmd.lowering.context import InputInfo, LoweringContext
from spmd.lowering.emit import emit
from spmd.lowering.graph import copy_graph
from spmd.lowering.pipeline import plan_graph
from spmd.lowering.reshard import forward_name
from spmd.lowering.run_check import RunCheck
from spmd.runtime import sizecheck
from spmd.lowering.tensor_parallel import SAVED_RENAMES

__all__ = ["GraphRecord", "Capture", "time_forward"]

log = logging.getLogger("spmd.lowering")


@dataclass(eq=False)
class GraphRecord:
    """Everything captured and decided for one Dynamo region."""

    name: str
    inputs: tuple[InputInfo, ...]
    forward: fx.GraphModule | None = None
    backward: fx.GraphModule | None = None
    fallback_reason: str | None = None
    # why the forward was left unplanned (it runs as traced, each spmd op eagerly): its
    # backward, which receives what that forward saved, is left unplanned with it
    unplanned: str | None = None
    forward_seconds: float | None = None  # the first real forward call, timed
    forward_run: Callable[[list], Any] | None = None  # the emitted forward
    compute: str = "emit"  # "emit" (generated Python) or "inductor"
    compute_reason: str = ""
    saved: dict = field(default_factory=dict)  # forward node name -> its Sharding
    reason: str = ""  # why Dynamo compiled it (the plan lists every graph with this)
    traced_as: list[str] = field(default_factory=list)  # meta tracing's rewrites

    @property
    def trainable(self) -> list[str]:
        return [i.name for i in self.inputs if i.kind == "param" and i.requires_grad]

    @property
    def structure(self) -> tuple:
        """What the graph reads, without the sizes a new batch changes: its parameters
        and buffers by name, and the dtype and rank of every tensor input (a graph
        compiled for dynamic shapes also takes the sizes themselves)."""
        return tuple((i.kind, i.name if i.kind != "data" else "", i.requires_grad,
                      str(i.dtype), len(i.shape)) for i in self.inputs if i.tensor)


class CaptureOwner(Protocol):
    """What a :class:`Capture` reports to: the parallelized module's state."""

    records: list[GraphRecord]

    def context(self, record: GraphRecord, role: str) -> LoweringContext:
        """The lowering context of a record's forward or backward graph."""

    def planned(self, record: GraphRecord) -> None:
        """Called with each record whose backward graph was planned, at its first run
        (the frontend compares plan signatures across ranks there: at run time, where
        every rank is at the same point of the program, whenever each compiled it)."""

    def forward_compiled(self, record: GraphRecord) -> None:
        """Called with each record whose forward was compiled (the frontend times it
        there for the backward's planning, without waiting for anyone)."""


class Capture:
    """A ``torch.compile`` backend for one parallelized module.

    Dynamo keeps every backend it was given for the life of the process, so a capture
    holds its owner only weakly, and the records (graphs and the specs they name) live
    in the owner: a collected model takes them with it.

    Args:
        names: ``id(tensor) -> (kind, name)`` for the module's parameters and buffers.
        owner: the module's state (:class:`CaptureOwner`), held weakly.
    """

    def __init__(self, names: dict[int, tuple[str, str]], owner: CaptureOwner,
                 compile_compute: bool | None = None, reshard: bool = False,
                 fused_attention: bool = False) -> None:
        self.names = names
        self.fused_attention = fused_attention  # meta tracing for a GPU hardware model
        self.compile_compute = compile_compute
        self.reshard = reshard  # sharded parameters: save shards, gather again in backward
        self._owner = weakref.ref(owner)
        self.profiler: Any = None  # a spmd.plan.profiling.Profiler while one records
        self.forward_runs = 0  # compiled forward graphs run (the owner sees Dynamo skip them)
        # why the next graphs Dynamo compiles were compiled, where the owner knows better
        # than their inputs tell (an expert layer's headroom grew); cleared by the owner
        self.recompiling: str | None = None

    def owner(self) -> CaptureOwner:
        owner = self._owner()
        if owner is None:
            raise RuntimeError("spmd: the parallelized module of this compiled region was "
                               "collected")
        return owner

    def choose_compute(self, example_inputs: list[Any]) -> tuple[str, str]:
        """Inductor or generated Python for a region's compute, and why.

        Measured on this project's 2-core CPU VM (2026-11-25, torch 2.13, one thread, the
        models of benchmarks/ddp.py, step times): Inductor was slower than eager on both
        the transformer encoder (19.4 ms against 14.8) and the model of many small layers
        (8.5 against 4.6), after 14 and 20 s of compilation. On GPUs Inductor's fusion
        pays (PyTorch 2, Ansel et al., ASPLOS 2024: 1.41x mean training speed-up on A100
        across 180+ models). So the planner picks Inductor for CUDA graphs and generated
        Python elsewhere; ``compile_compute`` forces either.
        """
        if self.compile_compute is not None:
            mode = "inductor" if self.compile_compute else "emit"
            return mode, f"compile_compute={self.compile_compute}"
        cuda = any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs)
        if cuda:
            return "inductor", "CUDA tensors: Inductor's fusion wins on GPUs"
        return "emit", "CPU tensors: Inductor measured slower than generated Python here"

    def describe(self, example_inputs: list[Any]) -> tuple[InputInfo, ...]:
        infos = []
        for i, t in enumerate(example_inputs):
            if isinstance(t, torch.Tensor):
                kind, name = self.names.get(id(t), ("data", f"input{i}"))
                infos.append(InputInfo(kind=kind, name=name, shape=tuple(t.shape), dtype=t.dtype,
                                       requires_grad=t.requires_grad))
            else:
                infos.append(InputInfo(kind="data", name=f"input{i}", shape=(), dtype=torch.int64,
                                       tensor=False))
        return tuple(infos)

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        from torch._dynamo.backends.common import aot_autograd

        records = self.owner().records
        name = f"graph{len(records)}"
        inputs = self.describe(example_inputs)
        record = GraphRecord(name=name, inputs=inputs)
        from spmd.lowering.meta_trace import rewrite_for_meta

        record.traced_as = rewrite_for_meta(gm, example_inputs, self.fused_attention)
        record.reason = _reason(record, records, self.recompiling)
        record.compute, record.compute_reason = self.choose_compute(example_inputs)
        records.append(record)
        inductor = record.compute == "inductor"
        # the compilers below outlive the module in AOTAutograd's caches: the record (and
        # the specs its graphs name) stays the owner's, reached weakly
        held = weakref.ref(record)

        def this_record() -> GraphRecord:
            alive = held()
            if alive is None:
                raise RuntimeError(f"spmd: the parallelized module of {name} was collected")
            return alive

        def compile_graph(graph: fx.GraphModule, fake_inputs: list[Any],
                          saved: dict[str, Any] | None = None) -> Callable[[list], Any]:
            if inductor:
                from torch._inductor.compile_fx import compile_fx_inner

                # a planned graph runs on each rank's pieces (tensor parallelism): its
                # inputs are its placeholders' local values, not the whole-shaped ones
                # AOTAutograd traced; a backward's saved inputs exactly as its forward
                # returns them (Inductor compiles for, and checks, their strides)
                placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
                local = [(saved or {}).get(forward_name(n), n.meta.get("val", f))
                         for n, f in zip(placeholders, fake_inputs)]
                return compile_fx_inner(_plain(graph), local, is_backward=saved is not None)
            return emit(graph)

        del record

        def forward_compiler(fw: fx.GraphModule, fake_inputs: list[Any],
                             training: bool = True) -> Callable[..., Any]:
            record = this_record()
            try:
                fw = plan_graph(fw, self.owner().context(record, "forward"))
                record.saved = {n.name: n.meta["sharding"] for n in fw.graph.nodes
                                if "sharding" in n.meta}
                nodes = {n.name: n for n in fw.graph.nodes}
                for old, new in fw.meta.get(SAVED_RENAMES, {}).items():
                    record.saved[old] = nodes[new].meta["sharding"]
            except PlanningError as e:
                log.warning("spmd: %s's forward left unplanned: %s", name, e)
                record.unplanned = str(e)
            record.forward = fw
            run = compile_graph(fw, fake_inputs)
            record.forward_run = run
            if training:  # its backward will be planned
                self.owner().forward_compiled(record)
            return _instrument(run, self, record, "forward")

        def backward_compiler(bw: fx.GraphModule, fake_inputs: list[Any]) -> Callable[..., Any]:
            record = this_record()
            unreached = _unreached_gradients(bw)
            if record.unplanned is not None:
                # its saved values are what an unplanned forward computed (whole tensors
                # where a plan would keep pieces): planned, it would read them as pieces
                record.fallback_reason = f"its forward was left unplanned: {record.unplanned}"
                log.warning("spmd: %s's backward left unplanned with its forward", name)
            else:
                try:
                    bw = plan_graph(bw, self.owner().context(record, "backward"))
                except PlanningError as e:
                    record.fallback_reason = str(e)
                    log.warning("spmd: %s left to the eager safety net: %s", name, e)
            record.backward = bw
            forward = record.forward
            returned = {} if forward is None else {
                v.name: v.meta["val"] for v in forward.graph.output_node().all_input_nodes
                if isinstance(v.meta.get("val"), torch.Tensor)}
            if forward is not None:
                for old, new in forward.meta.get(SAVED_RENAMES, {}).items():
                    returned[old] = returned[new]
            run = _none_where_unreached(compile_graph(bw, fake_inputs, returned), unreached)
            # resolved at the call: the compiled function outlives the module in Dynamo's
            # caches, and must not keep its state alive
            first = None if record.fallback_reason is not None else (
                lambda alive: self.owner().planned(alive))
            return _instrument(run, self, record, "backward", first)

        decompositions = None
        if inductor:  # Inductor lowers only graphs decomposed with its own table
            from torch._inductor.decomposition import select_decomp_table

            decompositions = select_decomp_table()
        from spmd.lowering.partition import partition

        # AOTAutograd plans a static graph's backward at its first backward call and a
        # dynamic one's now, inside Dynamo's compile: ranks whose graphs differ only there
        # (a view of the batch at another storage offset, another size) reach the
        # backward's planning at different points of the program. So nothing the backward's
        # planning does waits for another rank: the estimate it needs is published by the
        # first rank as the forward compiles, and plans are compared at their first run.
        return aot_autograd(fw_compiler=forward_compiler, bw_compiler=backward_compiler,
                            inference_compiler=functools.partial(forward_compiler,
                                                                 training=False),
                            decompositions=decompositions,
                            partition_fn=functools.partial(partition, reshard=self.reshard)
                            )(gm, example_inputs)


def _reason(record: GraphRecord, earlier: list[GraphRecord], known: str | None = None
            ) -> str:
    """Why Dynamo compiled ``record``, in the plan's words (``known``: what the owner
    changed that made it, if it did)."""
    data = ", ".join(str(tuple(i.shape)).replace(" ", "") for i in record.inputs
                     if i.kind == "data" and i.tensor) or "none"
    if not torch.is_grad_enabled():  # Dynamo compiles in the caller's grad mode
        return f"inference (no_grad); data {data}"
    if not earlier:
        return f"first call; data {data}"
    if known is not None:
        return f"recompiled: {known}; data {data}"
    if any(r.structure == record.structure for r in earlier):
        dynamic = any(not i.tensor for i in record.inputs)
        return (f"recompiled for new input sizes, {'dynamic' if dynamic else 'static'}; "
                f"data {data}")
    return (f"a new region or code path (a graph break, another set of trainable "
            f"parameters, train/eval); data {data}")


_OURS = ("sharding", "spmd_collective", "spmd_role")


def _plain(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` for Inductor without our annotations: its cache key pickles the
    graph, and the plan's records refer to process groups and locks."""
    plain = copy_graph(gm)
    for node in plain.graph.nodes:
        for key in _OURS:
            node.meta.pop(key, None)
    return plain


def _unreached_gradients(bw: fx.GraphModule) -> dict[int, tuple[int, ...]]:
    """Output position -> the backward's inputs it reads among the output gradients
    (``tangents_*``), for each gradient computed from some of them but not all: a
    parameter that only a graph output the loss may ignore reaches (BigBird's pooler: the
    model returns its output, the caller reads the logits). Read before planning: a
    planned graph's bucketed collectives join every gradient."""
    placeholders = [n for n in bw.graph.nodes if n.op == "placeholder"]
    tangents = {n: i for i, n in enumerate(placeholders) if n.name.startswith("tangents")}
    if len(tangents) < 2:
        return {}
    reads: dict[fx.Node, frozenset[int]] = {}
    for n in bw.graph.nodes:
        if n in tangents:
            reads[n] = frozenset((tangents[n],))
        else:
            reads[n] = frozenset().union(*(reads[a] for a in n.all_input_nodes))
    every = frozenset(tangents.values())
    outputs = bw.graph.output_node().args[0]
    return {k: tuple(sorted(reads[o])) for k, o in enumerate(outputs)
            if isinstance(o, fx.Node) and reads[o] and reads[o] != every}


def _none_where_unreached(run: Callable[[list], Any], unreached: dict[int, tuple[int, ...]]
                          ) -> Callable[[list], Any]:
    """``run``, returning no gradient (None) where every output gradient it is computed
    from is all zeros, as eager autograd leaves ``.grad`` None for a parameter the loss
    never reaches. AOTAutograd gives the graph zeros for an output nothing used, and its
    gradients would come out zeros: AdamW would then decay a weight eager training leaves
    alone. (A loss that multiplies such an output by 0 reaches it in eager and gets zeros;
    here None: the one case this cannot tell apart.)"""
    if not unreached:
        return run
    read = sorted({i for inputs in unreached.values() for i in inputs})

    def call(args: list) -> Any:
        zero = {i: isinstance(args[i], torch.Tensor) and not bool(args[i].any())
                for i in read}  # before the call, which frees its arguments
        out = run(args)
        if not any(zero.values()):
            return out
        out = list(out)
        for k, inputs in unreached.items():
            if all(zero[i] for i in inputs):
                out[k] = None
        return out
    return call


def _instrument(run: Callable[[list], Any], capture: "Capture", record: GraphRecord,
                phase: str, first: Callable[[GraphRecord], None] | None = None
                ) -> Callable[[list], Any]:
    """``run``, plus: the first forward call is timed, ``first(record)`` runs before the
    first call, every call first checks what the graph sends across ranks
    (``run_check``), and while a profiler is attached to the capture every call records
    its start and end.

    The record is held weakly: Dynamo keeps compiled regions past the module's life, and
    the record's graphs name the specs (groups, work in flight) the module owns.
    """
    label = f"{record.name} {phase}"
    owner = weakref.ref(record)
    timed = [phase != "forward" or record.forward_seconds is not None]

    forward = phase == "forward"
    pending = [first]
    checks: list[RunCheck] = []  # what the graph sends, compared across ranks each run

    def call(args: list) -> Any:
        if forward:
            capture.forward_runs += 1
        if not checks:
            alive = owner()
            checks.append(RunCheck(None if alive is None else getattr(alive, phase),
                                   functools.partial(_describe, owner, phase)))
        # first the header: a rank that alone runs another graph is named here, before
        # the first run's plan comparison would wait for ranks that are not planning
        checked = checks[0]() if checks[0].groups else None
        if pending[0] is not None:
            for group in checked or ():  # named before the plan comparison waits
                sizecheck.settle(group)
            alive = owner()
            if alive is not None:
                pending[0](alive)
            pending[0] = None
        if checked:
            with sizecheck.agreed(checked):
                out = _timed(run, args, capture, owner, label, timed)
            for group in checked:  # a row no collective of this run waited for
                sizecheck.settle(group)
            return out
        return _timed(run, args, capture, owner, label, timed)

    call._boxed_call = True  # type: ignore[attr-defined]
    return call


def _describe(owner: Any, phase: str) -> str:
    record = owner()
    if record is None:
        return f"a collected graph's {phase}"
    data = ", ".join(str(i.shape).replace(" ", "") for i in record.inputs
                     if i.kind == "data" and i.tensor) or "none"
    return f"{record.name} {phase}, traced for data of shapes {data}"


def _timed(run: Callable[[list], Any], args: list, capture: "Capture", owner: Any,
           label: str, timed: list[bool]) -> Any:
    """``run(args)``; the first forward run is timed, and every run while a profiler is
    attached records its start and end."""
    profiler = capture.profiler
    if profiler is None and timed[0]:
        return run(args)
    start = time.perf_counter()
    if profiler is not None:
        profiler.event("compute_start", label, start)
    out = run(args)
    end = time.perf_counter()
    if profiler is not None:
        profiler.event("compute_end", label, end)
    if not timed[0]:
        timed[0] = True
        alive = owner()
        if alive is not None:
            alive.forward_seconds = end - start
    return out


def time_forward(record: GraphRecord, repeats: int = 3) -> float | None:
    """Seconds of one run of the emitted forward graph, best of ``repeats``, on inputs
    shaped like the traced ones (random floats, zero indices); None if it cannot run.

    The first real call is a poor estimate (cold allocator and caches); by the time the
    backward graph is planned it has run once, so a few more runs are warm.
    """
    if record.forward is None or record.forward_run is None:
        return record.forward_seconds
    from torch.utils._python_dispatch import _disable_current_modes

    from spmd.lowering.specs import dry_run
    try:
        values = [n.meta["val"] for n in record.forward.graph.nodes if n.op == "placeholder"]
        def make(v: Any) -> Any:
            if isinstance(v, torch.Tensor):
                shape = [size_hint(d) for d in v.shape]
                if v.dtype.is_floating_point:
                    return torch.randn(shape, dtype=v.dtype, device=v.device)
                return torch.zeros(shape, dtype=v.dtype, device=v.device)
            return size_hint(v) if isinstance(v, torch.SymInt) else v
        best = float("inf")
        devices = sorted({v.device.index or 0 for v in values
                          if isinstance(v, torch.Tensor) and v.device.type == "cuda"})
        # real tensors, also while Dynamo's fake mode is on (the backward is planned as its
        # forward compiles); a sharded forward's gathers send nothing; the user's random
        # generators left as they were (the inputs, and any dropout in the graph, draw
        # from a fork of them: a run resumed from a checkpoint draws what one never
        # interrupted does)
        with torch.no_grad(), dry_run(), _disable_current_modes(), \
                torch.random.fork_rng(devices=devices):
            for _ in range(repeats):
                args = [make(v) for v in values]
                start = time.perf_counter()
                record.forward_run(args)
                best = min(best, time.perf_counter() - start)
        return best
    except Exception as e:  # an input the tracer constrained (e.g. valid indices): keep going
        log.debug("spmd: could not re-time %s's forward: %s", record.name, e)
        return record.forward_seconds


def size_hint(size: Any) -> int:
    """A symbolic size's value for this trace, without the guard ``int()`` would add (a
    guard specialises the graph to this size, and only the rank that timed it would
    then recompile for the next one)."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    try:
        from torch.fx.experimental.symbolic_shapes import optimization_hint
    except ImportError:  # older torch
        return int(size.node.hint)
    return optimization_hint(size)
