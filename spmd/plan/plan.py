"""Plan: everything the compiler decided for a parallelized model, for people to read.

A plan is built from the captured graphs: their buckets, every collective with its size,
group and provenance (which parameters, which pass, why), the parameters the eager
safety net handled and why, and the cost model's predictions. ``summary()`` prints it as
a table; ``str(plan)`` is the summary.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from spmd.ep import plan_lines as ep_lines
from spmd.lowering.cost_model import CostModel, along
from spmd.lowering.graph import collective_nodes
from spmd.lowering.options import Options
from spmd.lowering.passes import Provenance
from spmd.lowering.placements import divides
from spmd.lowering.state import CollectiveInfo, OptimizerFusion, find
from spmd.plan.pricing import model_of, priced_as, replica_all_reduce, spec_of
from spmd.lowering.strategy import Strategy
from spmd.runtime.mesh import Mesh

if TYPE_CHECKING:
    from spmd.plan.hardware import Hardware
    from spmd.program.setup import Setup
    from spmd.state.layout import Layout

__all__ = ["Plan", "Bucket", "Collective", "Fallback", "Placed", "Verification",
           "plan_from_records", "module_plan"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Bucket:
    """One flat buffer of gradients reduced by one collective."""

    index: int
    graph: str
    params: tuple[str, ...]
    dtype: torch.dtype
    wire_dtype: torch.dtype
    numel: int
    bytes: int
    kernel: str  # "triton" or "torch": what packs and unpacks it
    predicted_seconds: float
    collective: str
    kind: str = "all_reduce"  # the collective's kind
    phase: str = "backward"  # the graph it runs in: "forward", "backward" or "step"
    algorithm: str = "native"  # "native", "fp32" (compressed) or "hierarchical" (two-level)


@dataclass(frozen=True, kw_only=True, slots=True)
class Collective:
    """One inserted collective: what, how big, on which group, and why it exists."""

    name: str
    kind: str
    bytes: int
    group: str
    group_ranks: tuple[int, ...]
    bucket: int
    graph: str
    provenance: Provenance
    predicted_seconds: float
    mesh_dim: str = ""
    placements: str = ""  # "Partial('avg') -> Replicate()"
    phase: str = "backward"  # the graph it runs in: "forward", "backward" or "step"

    def __repr__(self) -> str:
        return (f"Collective({self.kind} {self.name} in {self.graph}, {self.bytes} B on group "
                f"{self.group!r}, bucket {self.bucket}; {self.provenance})")


@dataclass(frozen=True, kw_only=True, slots=True)
class Placed:
    """What propagation decided for one op on one tensor-parallel mesh dimension."""

    graph: str
    phase: str
    node: str
    op: str
    module: str  # the model code's module path, "" when unknown
    mesh_dim: str
    inputs: tuple[str, ...]  # the inputs' placements before
    needed: tuple[str, ...]  # the placements the rule needs them in
    output: str
    reason: str
    fallback: bool  # no rule for the op: its inputs replicated first

    def __str__(self) -> str:
        moved = "" if self.inputs == self.needed else f" (inputs brought to {list(self.needed)})"
        return (f"{self.graph} {self.phase} {self.node} = {self.op}{list(self.inputs)} -> "
                f"{self.output} on {self.mesh_dim!r}{moved}: {self.reason}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Fallback:
    """A parameter whose gradient the eager safety net synchronised, and why."""

    param: str
    reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Verification:
    """What :meth:`Plan.verify` checked: each graph's
    :class:`~spmd.lowering.verify.Verified` record."""

    graphs: dict[str, Any]

    @property
    def decisions(self) -> int:
        """Sharding decisions checked on real shards (each distinct one once)."""
        return sum(v.decisions for v in self.graphs.values())

    def __str__(self) -> str:
        lines = [f"plan verified: {len(self.graphs)} graph(s), "
                 f"{sum(v.nodes for v in self.graphs.values())} values placed, "
                 f"{self.decisions} sharding decision(s) checked on real shards"]
        for name, v in self.graphs.items():
            for why in v.unchecked:
                lines.append(f"  {name}: not checked on real shards: {why}")
        return "\n".join(lines)


@dataclass(eq=False)
class Plan:
    """The plan of a parallelized model's last captured step."""

    strategy: str
    world_size: int
    group: str
    options: Options
    cost_model: CostModel
    graphs: dict[str, fx.GraphModule] = field(default_factory=dict)
    buckets: list[Bucket] = field(default_factory=list)
    collectives: list[Collective] = field(default_factory=list)
    fallbacks: list[Fallback] = field(default_factory=list)
    frozen: list[str] = field(default_factory=list)
    compute: dict[str, tuple[float, float]] = field(default_factory=dict)  # graph -> (fwd, bwd) s
    compute_paths: dict[str, str] = field(default_factory=dict)  # graph -> how its compute runs
    graph_reasons: dict[str, str] = field(default_factory=dict)  # graph -> why it was compiled
    optimizer: dict[str, str] = field(default_factory=dict)  # step graph -> fused or why not
    mesh: Mesh = None  # the mesh planned for (``spmd.Mesh``, live or simulated)
    # parameter -> (bytes this rank stores, bytes whole, trainable); tied ones once
    parameters: dict[str, tuple[int, int, bool]] = field(default_factory=dict)
    buffer_bytes: int = 0
    sharded: list[str] = field(default_factory=list)  # parameters stored as shards
    shard_dims: dict[str, int] = field(default_factory=dict)  # those not cut along dim 0
    # tensor parallelism: parameter -> its placement per tensor-parallel dimension, and
    # every op's decision where some input was not replicated
    tp_placements: dict[str, dict[str, Any]] = field(default_factory=dict)
    placed: list[Placed] = field(default_factory=list)
    tokens_per_step: int = 0  # elements of the first integer input (token ids), if any
    # on a simulated cluster: whether the roofline fused memory-bound chains (a compiled
    # run), each graph's predicted seconds per node, and what tracing on meta rewrote
    fused: bool = False
    node_seconds: dict[str, dict[str, float]] = field(default_factory=dict)
    traced_as: dict[str, list[str]] = field(default_factory=dict)
    measured: Any = None  # a measured Timeline, after spmd.profile
    measured_steps: list = field(default_factory=list)  # every profiled step's Timeline
    auto: Any = None  # strategy="auto": what was searched and chosen (spmd.auto.search.AutoPlan)
    # reshard_after_forward=N: how many times a shard's bytes each rank keeps of a
    # parameter from its forward to its backward (the sharding dimension's ranks / N)
    kept_part: float = 0.0

    def fingerprint(self) -> str:
        """A hash of the decisions every rank must share (bucket layout and collectives)."""
        h = hashlib.sha256()
        for b in self.buckets:
            h.update(repr((b.graph, b.kind, b.phase, b.params, str(b.dtype), str(b.wire_dtype),
                           b.numel)).encode())
        return h.hexdigest()[:16]

    def memory(self, optimizer: str | None = "adamw") -> Any:
        """Predicted memory per rank (:class:`spmd.plan.memory.MemoryView`): parameters,
        gradients and ``optimizer``'s state (``"adamw"``, ``"adam"``, ``"sgd_momentum"``,
        ``"sgd"`` or None) as this rank stores them, the forward's saved activations, the
        most parameter bytes held gathered at once, and the predicted peak with the node
        where it happens."""
        from spmd.plan.memory import memory_view

        return memory_view(self, optimizer)

    def predicted_communication_seconds(self) -> float:
        return sum(c.predicted_seconds for c in self.collectives)

    def summary(self) -> str:
        regions = {name.rsplit(".", 1)[0] for name in self.graphs}
        moved = {}
        for b in self.buckets:
            moved[b.kind] = moved.get(b.kind, 0) + b.bytes
        per_kind = ", ".join(f"{v / 2**20:.2f} MiB {k.replace('_', '-')}"
                             for k, v in moved.items()) or "nothing"
        lines = [] if self.auto is None else [str(self.auto), ""]
        lines += [f"Plan: {self.strategy} over {self.world_size} rank(s) (group {self.group!r}), "
                 f"{len(regions)} captured region(s), {len(self.buckets)} "
                 f"bucket(s), {len(self.collectives)} collective(s); per step {per_kind}"]
        hook = self.options.comm_hook
        if hook is not None:
            lines.append(f"gradient buckets reduced by communication hook "
                         f"{getattr(hook, '__qualname__', hook)!s} (torch's DDP signature), "
                         f"in the graphs and in the eager safety net")
        if self.tp_placements:
            dims = sorted({d for p in self.tp_placements.values() for d in p})
            sizes = ", ".join(f"{d!r} ({self.mesh.size(d)} ranks)" for d in dims)
            split = sum(1 for p in self.tp_placements.values()
                        if any(divides(q) for q in p.values()))
            lines.append(f"tensor parallel along {sizes}: {split} parameter(s) stored as "
                         f"pieces; {len(self.placed)} op placement(s) decided by rules")
            missing = sorted({p.op for p in self.placed if p.fallback})
            if missing:
                lines.append(f"  replicated for want of a sharding rule: {', '.join(missing)}")
        if self.sharded:
            lines.append(f"parameters stored as dim-0 shards: {len(self.sharded)} (every "
                         f"parameter; 0-dim ones as one row)" + (
                             "; along another dimension (shard_placement_fn): " + ", ".join(
                                 f"{n} Shard({d})" for n, d in self.shard_dims.items())
                             if self.shard_dims else ""))
        lines.append(f"cost model: {self.cost_model.backend} α={self.cost_model.alpha * 1e6:.1f} µs "
                     f"β={self.cost_model.beta * 1e9:.3f} ns/B ({self.cost_model.source})")
        lines += self._links()
        for name, path in self.compute_paths.items():
            why = self.graph_reasons.get(name)
            lines.append(f"{name} ({why}) compute: {path}" if why else f"{name} compute: {path}")
        for name, how in self.optimizer.items():
            lines.append(f"{name} optimizer: {how}")
        for name, notes in self.traced_as.items():
            lines += [f"{name} on meta: {note}" for note in notes]
        if self.buckets:
            lines.append("")
            lines.append(f"{'bucket':>6}  {'graph':<8} {'kind':<14} {'params':>6}  {'dtype':<9} "
                         f"{'wire':<9} {'numel':>10} {'bytes':>12} {'kernel':<6} {'pred µs':>9}  "
                         f"first params")
            for b in self.buckets:
                names = ", ".join(b.params[:3]) + (f" +{len(b.params) - 3}" if len(b.params) > 3
                                                   else "")
                where = f"{b.kind} ({b.phase[0]})"
                lines.append(f"{b.index:>6}  {b.graph:<8} {where:<14} {len(b.params):>6}  "
                             f"{str(b.dtype).removeprefix('torch.'):<9} "
                             f"{str(b.wire_dtype).removeprefix('torch.'):<9} {b.numel:>10,} "
                             f"{b.bytes:>12,} {b.kernel:<6} {b.predicted_seconds * 1e6:>9.1f}  {names}")
        if self.collectives:
            lines.append("")
            lines.append(f"{'collective':<24} {'kind':<11} {'bytes':>12}  {'group':<10} why")
            for c in self.collectives:
                lines.append(f"{c.name:<24} {c.kind:<11} {c.bytes:>12,}  {c.group:<10} "
                             f"{c.provenance.pass_name}: {c.provenance.reason}")
        experts = ep_lines(self)
        lines += experts
        if self.fallbacks:
            lines.append("")
            lines.append("synchronised by the eager safety net:")
            lines += [f"  {f.param}: {f.reason}" for f in self.fallbacks]
        if self.frozen:
            lines.append(f"frozen (no gradient, never reduced): {', '.join(self.frozen)}")
        if self.mesh is not None and self.mesh.hardware is not None and self.compute:
            from spmd.plan.roofline import throughput

            lines.append(throughput(self))
        apart = " (the buckets'; the expert all-to-alls above apart)" if experts else ""
        lines.append(f"predicted communication per step: "
                     f"{self.predicted_communication_seconds() * 1e3:.3f} ms{apart}; "
                     f"plan {self.fingerprint()}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def _links(self) -> list[str]:
        """The summary's lines on the link between hosts, where a live mesh spans some."""
        net = self.cost_model.network
        if net is None and self.mesh is not None:
            net = self.mesh.network
        if net is None or self.mesh is None or self.mesh.hardware is not None:
            return []
        lines = [f"hosts: {self.mesh.topology.describe()}"]
        for dim in self.mesh.dim_names:
            if self.mesh.size(dim) > 1 and self.mesh.crosses_hosts(dim):
                lines.append(f"  mesh dimension {dim!r} crosses {self.mesh.hosts_along(dim)} "
                             f"hosts: α {net.alpha * 1e6:.1f} µs, β {net.beta * 1e9:.3f} ns/B "
                             f"per flow ({net.source})")
        two = [b for b in self.buckets if b.algorithm == "hierarchical"]
        if two:
            lines.append(f"  {len(two)} of {len(self.buckets)} bucket(s) all-reduced in two "
                         f"levels (within hosts, across on a share, within)")
        return lines

    # -- views (spmd.plan.views) ---------------------------------------------------------------

    def to_networkx(self) -> Any:
        """The dependency graph of every captured graph (``networkx.DiGraph``)."""
        from spmd.plan.views import to_networkx

        return to_networkx(self)

    def predicted_timeline(self, optimizer: str | None = "adamw",
                           clip_grad_norm: bool = False, compute_scale: float = 1.0) -> Any:
        """The cost model's :class:`~spmd.plan.timeline.Timeline` of one step; on a simulated
        cluster it ends with ``optimizer``'s step (``"adamw"``, ``"adam"``,
        ``"sgd_momentum"``, ``"sgd"`` or None) and, with ``clip_grad_norm``, gradient
        clipping; ``compute_scale`` stretches the compute (:func:`spmd.plan.timeline.predict`)."""
        from spmd.plan.timeline import predict

        return predict(self, optimizer, clip_grad_norm, compute_scale)

    def timeline(self) -> Any:
        """A matplotlib figure: compute, communication and exposed lanes, predicted and,
        after ``spmd.profile``, measured."""
        from spmd.plan.views import timeline_figure

        return timeline_figure(self)

    def save_profile(self, path: Any) -> None:
        """Write what the profiled steps measured (each collective's and graph's time, with
        the graphs' FLOPs and bytes) as JSON, for ``spmd.hardware.fit`` to fit a hardware
        model to."""
        import json

        from spmd.plan.fit import profile_record

        with open(path, "w") as f:
            json.dump(profile_record(self), f)

    def verify(self, numerics: int | None = None) -> "Verification":
        """Check every graph of the plan, re-deriving each value's placement without
        trusting the passes (:mod:`spmd.lowering.verify`): local shapes match placements,
        every gradient leaves reduced where its parameter lives, no partial sum reaches
        an op that needs it whole, and each sharding decision holds on real shards of the
        graph's own shapes. Raises ``spmd.PlanVerificationError`` naming the node, its
        placements, the rule and the model code; returns what was checked.

        Args:
            numerics: sharding decisions at most checked on real shards per graph (None:
                every distinct one; 0: none).

        Example::

            spmd.inspect(model, x, mesh=spmd.Mesh.simulated((2, 4), ("fsdp", "tp")),
                         strategy="fsdp", placements=spmd.tp.megatron()).verify()
        """
        from spmd.lowering.state import state_of
        from spmd.lowering.verify import Verified, verify

        checked: dict[str, Verified] = {}
        for name, gm in self.graphs.items():  # a forward before its backward
            if state_of(gm).context is None:
                continue  # left unplanned (the safety net's): nothing was decided
            verify(gm, numerics=numerics)
            checked[name] = find(gm, Verified)
        return Verification(graphs=checked)

    def explain(self, x: Any) -> str:
        """Why a collective, a bucket or a parameter's communication exists, and its cost."""
        from spmd.plan.views import explain

        if self.auto is not None and isinstance(x, str):
            why = self.auto.explain(x)
            if why is not None:
                try:
                    return why + "\n" + explain(self, x)
                except KeyError:
                    return why
        return explain(self, x)

    def _repr_html_(self) -> str:
        from spmd.plan.views import html

        return html(self)

    def __repr__(self) -> str:
        return (f"Plan({self.strategy}, world_size={self.world_size}, buckets={len(self.buckets)}, "
                f"collectives={len(self.collectives)}, fallbacks={len(self.fallbacks)})")


def module_plan(records: list, *, setup: Setup, options: Options, layout: Layout,
                params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
                estimates: dict[str, float], fallbacks: list[Fallback], frozen: list[str],
                measured: Any = None, measured_steps: list | None = None) -> Plan:
    """The plan of a parallelized module: :func:`plan_from_records` of its graphs, with
    each graph's compute (the cluster's roofline on a simulated cluster, else the
    measured backward estimate), every parameter's bytes stored and whole
    (``layout``: the module's :class:`spmd.state.layout.Layout`), the tokens a step takes, and
    the profiled timelines."""
    import spmd.kernels as kernels

    device = next(iter(params.values())).device if params else torch.device("cpu")
    plan = plan_from_records(records, setup=setup, options=options, fallbacks=fallbacks,
                             frozen=frozen, kernel=kernels.implementation(device))
    hardware = setup.strategy.mesh.hardware
    priced = price_on_hardware(plan, records, options, hardware)
    for record in records:
        if record.name in priced:
            continue
        backward = estimates.get(record.name)
        if backward is None and record.forward_seconds is not None:
            backward = 2.0 * record.forward_seconds
        plan.compute[record.name] = ((backward or 0.0) / 2.0, backward or 0.0)
    plan.measured = measured
    plan.measured_steps = list(measured_steps or [])
    seen: set[int] = set()
    for name, param in params.items():  # named_parameters(): tied ones once
        if id(param) in seen:
            continue
        seen.add(id(param))
        local = param.numel() * param.element_size()
        whole = layout.whole_numel(name, param) * param.element_size()
        plan.parameters[name] = (local, whole, param.requires_grad)
    plan.buffer_bytes = sum(b.numel() * b.element_size() for b in buffers.values())
    plan.tokens_per_step = tokens_of(records, setup.strategy)
    plan.sharded = sorted(layout.shards)
    plan.shard_dims = {n: s.dim for n, s in sorted(layout.shards.items()) if s.dim}
    return plan


def price_on_hardware(plan: Plan, records: list, options: Options, hardware: Hardware | None
                      ) -> set[str]:
    """On a simulated cluster, each record's graphs priced by the cluster's roofline
    (``plan.compute``, ``plan.node_seconds``; a whole step traced as one graph is all
    "backward"), and what tracing on meta rewrote (``plan.traced_as``). Returns the names
    of the records priced."""
    from spmd.plan.roofline import node_times

    plan.fused = compiled_on_gpu(options, records, hardware)
    priced: set[str] = set()
    for record in records:
        if getattr(record, "traced_as", None):
            plan.traced_as[record.name] = list(record.traced_as)
        if hardware is None or (record.forward is None and record.backward is None):
            continue
        forward = backward = 0.0
        if record.forward is not None:
            times = node_times(record.forward, hardware.device, plan.fused)
            plan.node_seconds[f"{record.name}.forward"] = times
            forward = backward = sum(times.values())
            backward *= 2.0
        if record.backward is not None:
            times = node_times(record.backward, hardware.device, plan.fused)
            plan.node_seconds[f"{record.name}.{getattr(record, 'label', 'backward')}"] = times
            backward = sum(times.values())
        plan.compute[record.name] = (forward, backward)
        priced.add(record.name)
    return priced


def tokens_of(records: list, strategy: Strategy | None = None) -> int:
    """Tokens each device trains on per step: the elements of the first integer data
    input (token ids) of the first record, if any, shared by the ranks of every
    tensor-parallel (and context-parallel) dimension, which all see the same batch."""
    shared = 1 if strategy is None else math.prod(strategy.mesh.size(d)
                                                  for d in strategy.tp_dims)
    for record in records[:1]:
        ids = [i for i in record.inputs if i.kind == "data" and i.shape
               and not i.dtype.is_floating_point and i.dtype != torch.bool]
        if ids:
            return math.prod(ids[0].shape) // shared
    return 0


def compiled_on_gpu(options: Options, records: list, hardware: Hardware | None = None) -> bool:
    """Whether the roofline prices a plan's graphs as Inductor compiles them (memory-bound
    chains fused): ``compile_compute=True``, a graph that was compiled so, or, on a
    simulated GPU cluster with ``compile_compute`` left to the planner, the Inductor it
    picks for CUDA tensors."""
    if options.compile_compute is not None:
        return bool(options.compile_compute)
    return hardware is not None or any(getattr(r, "compute", "") == "inductor"
                                       for r in records)


def plan_from_records(records: list, *, setup: Setup, options: Options,
                      fallbacks: list[Fallback], frozen: list[str], kernel: str) -> Plan:
    """Read the plan off the planned graphs: the graphs are the source of truth.

    ``setup`` is the model's :class:`spmd.program.setup.Setup` (strategy, mesh, group, cost model).
    """
    group = setup.group
    group_name = group.name if group is not None else "simulated"
    group_ranks = tuple(group.ranks) if group is not None else ()
    mesh = setup.strategy.mesh
    plan = Plan(strategy=options.strategy, world_size=setup.world_size, group=group_name,
                options=options, cost_model=setup.cost_model, fallbacks=list(fallbacks),
                frozen=list(frozen), mesh=mesh)
    for record in records:
        if record.forward is not None:
            plan.graphs[f"{record.name}.forward"] = record.forward
        if hasattr(record, "compute"):
            plan.compute_paths[record.name] = f"{record.compute} ({record.compute_reason})"
        if getattr(record, "reason", ""):
            plan.graph_reasons[record.name] = record.reason
        planned = []
        if record.forward is not None:
            planned.append(record.forward)  # sharded parameters' gathers
        if record.backward is not None:
            plan.graphs[f"{record.name}.{getattr(record, 'label', 'backward')}"] = record.backward
            fusion = find(record.backward, OptimizerFusion)
            if fusion is not None and getattr(record, "label", "") == "step":
                plan.optimizer[record.name] = (f"fused ({fusion.reason})" if fusion.fused
                                               else f"torch.optim after the graph "
                                                    f"({fusion.reason})")
            planned.append(record.backward)
        for graph in planned:
            phase = ("forward" if graph is record.forward
                     else getattr(record, "label", "backward"))
            for node in collective_nodes(graph):
                info: CollectiveInfo = node.meta["spmd_collective"]
                model = model_of(info, mesh, setup)
                spec = spec_of(info)
                algorithm = getattr(spec, "algorithm", "native")
                seconds = model.seconds(info.sent_as or info.kind, info.bytes,
                                        priced_as(algorithm, model, mesh))
                name, ranks = group_name, group_ranks
                if info.mesh_dim in setup.strategy.tp_dims and not mesh.simulated:
                    along_dim = mesh.get_group(info.mesh_dim)
                    name, ranks = along_dim.name, tuple(along_dim.ranks)
                elif info.within and getattr(spec, "shards", None) and spec.shards[0].regroup:
                    regroup = spec.shards[0].regroup
                    name, ranks = regroup.name, tuple(regroup.ranks)
                index = len(plan.buckets)
                plan.buckets.append(Bucket(
                    index=index, graph=record.name, params=info.params, dtype=info.dtype,
                    wire_dtype=info.wire_dtype, numel=sum(info.numels), bytes=info.bytes,
                    kernel=kernel, predicted_seconds=seconds, collective=node.name,
                    kind=info.kind, phase=phase, algorithm=algorithm))
                plan.collectives.append(Collective(
                    name=node.name, kind=info.kind, bytes=info.bytes, group=name,
                    group_ranks=ranks, bucket=index, graph=record.name,
                    provenance=info.provenance, predicted_seconds=seconds,
                    mesh_dim=info.mesh_dim, placements=f"{info.src!r} -> {info.dst!r}",
                    phase=phase))
                replicas = replica_all_reduce(info, spec, mesh, setup)
                if replicas is not None:  # hsdp's average across replicas, after the bucket
                    plan.collectives.append(Collective(
                        name=f"{node.name}.replicas", kind="all_reduce", bytes=replicas.bytes,
                        group=replicas.group, group_ranks=replicas.ranks, bucket=index,
                        graph=record.name, provenance=Provenance(
                            params=info.params, pass_name="hybrid sharding",
                            reason=f"the reduce-scattered shards averaged across the "
                                   f"{replicas.replicas} replicas along {replicas.dim!r}, "
                                   f"right after the reduce-scatter"),
                        predicted_seconds=replicas.seconds, mesh_dim=replicas.dim,
                        placements="Partial(avg) -> Replicate()", phase=phase))
            plan.collectives.extend(_rings(graph, record.name, phase, mesh, setup))
            plan.placed.extend(_placed(graph, record.name, phase))
    strategy = setup.strategy
    if strategy.reshard_to and strategy.shard_dim is not None:
        ranks = mesh.size(strategy.shard_dim)
        plan.kept_part = ranks / strategy.reshard_to if strategy.reshard_to < ranks else 0.0
    if strategy.tp_dims:
        plan.tp_placements = {n: strategy.tp_placement(n) for n in strategy.placements}
    return plan


def _rings(graph: fx.GraphModule, name: str, phase: str, mesh: Mesh, setup: Setup
           ) -> list[Collective]:
    """The key/value blocks ring attention (context parallelism) passes between ranks in
    ``graph``: one record per attention node, its sends per rank and their predicted
    time (a ring all-gather of the same blocks moves the same bytes)."""
    from spmd.lowering import ranked
    from spmd.lowering.propagate import module_of
    from spmd.lowering.specs import lookup

    found = []
    for node in graph.graph.nodes:
        if node.target not in (ranked.ring_attention, ranked.ring_attention_backward):
            continue
        try:
            spec = lookup(node.args[-1])
        except RuntimeError:
            continue
        backward = node.target is ranked.ring_attention_backward
        k, v = (node.args[i].meta["val"] for i in ((2, 3) if backward else (1, 2)))
        block = k.numel() * k.element_size() + v.numel() * v.element_size()
        n = spec.size
        hops = 2 * n - 1 if backward else n - 1  # (backward: the gradients travel too)
        model = along(mesh, spec.dim, setup.cost_model)
        seconds = model.seconds("all_gather", block * n) * (2 if backward else 1)
        module = module_of(node)
        causal = bool(node.args[5 if backward else 4])
        balance = ("; causal, load-balanced: halves of the queries, keys and values "
                   "exchanged into the zigzag layout and the results back"
                   if causal and spec.load_balance and node.args[6 if backward else 5] is None
                   else "")
        group, ranks = spec.dim, ()
        if spec.group is not None:
            group, ranks = spec.group.name, tuple(spec.group.ranks)
        why = (f"ring attention{' backward' if backward else ''} in {module or name}: queries, "
               f"keys and values sharded along the sequence on {spec.dim!r}; {n - 1} key/value "
               f"block(s) of {block} B received from the previous rank, each while the block "
               f"before computes" + (", and their gradients passed on after it" if backward
                                      else "") + balance)
        found.append(Collective(
            name=node.name, kind="ring", bytes=block * hops, group=group, group_ranks=ranks,
            bucket=-1, graph=name, provenance=Provenance(params=(), pass_name="tensor_parallel",
                                                         reason=why),
            predicted_seconds=seconds, mesh_dim=spec.dim,
            placements="Shard(2) -> Shard(2)", phase=phase))
    return found


def _placed(graph: fx.GraphModule, name: str, phase: str) -> list[Placed]:
    """The tensor-parallel decisions ``propagate`` recorded on ``graph``'s nodes."""
    from spmd.lowering.propagate import module_of

    found = []
    for node in graph.graph.nodes:
        for dim, choice in (node.meta.get("spmd_tp") or {}).items():
            needed = choice.decision.required(choice.inputs)
            found.append(Placed(
                graph=name, phase=phase, node=node.name, op=str(node.target),
                module=module_of(node), mesh_dim=dim,
                inputs=tuple(map(repr, choice.inputs)), needed=tuple(map(repr, needed)),
                output=repr(choice.output), reason=choice.why(), fallback=choice.fallback))
    return found
