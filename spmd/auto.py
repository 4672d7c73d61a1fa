"""``strategy="auto"``: the compiler chooses the layout under a memory budget.

    model = spmd.parallelize(Net(), mesh=mesh, strategy="auto", memory_budget="70GiB")
    plan = spmd.inspect(Net(), x, mesh=spmd.Mesh.simulated((8, 8), ("a", "b"),
                        hardware=spmd.hardware.H100_SXM()), strategy="auto")
    plan.explain("layers.3.feed_forward.w1.weight")  # chosen, its cost, the runner-up

How it chooses:

1. **Roles.** Each mesh dimension is a data dimension (the batch split along it) or a
   tensor-parallel one (the model split along it; at most one). ``spmd.inspect`` tries
   each assignment, the example inputs being one rank's batch when every dimension splits
   the batch (a tensor-parallel dimension of t ranks gives each data rank t times the
   rows: the same global batch). On a live mesh a dimension's role decides what each
   rank must feed, so ``parallelize`` splits the model only along the dimension
   ``placements`` names (every other one is data).
2. **The obvious layouts** are planned for real, with the planner every hand-written
   strategy uses: ddp, fsdp, zero2, zero1 (hsdp on two data dimensions), and Megatron
   tensor parallelism composed with each. Their predicted step and peak are the
   candidates the plan lists.
3. **The integer program** (:mod:`spmd.lowering.autolayout`) per role assignment: the
   data strategy (one for the model: the runtime's strategies are per model); each
   parameter group's placement on the tensor-parallel dimension (its piece, as
   ``placements`` or ``spmd.tp.megatron()`` gives it, or replicated; identical blocks'
   parameters are one group); how many blocks of each class of identical blocks are
   recomputed in backward (torch's ``checkpoint`` around the block; searched where the
   model is not split, as the compiler does not plan checkpointed blocks under tensor
   parallelism yet). The pairs are
   linked by what their choices move: a column-parallel layer feeding a replicated one
   gathers its output, a row-parallel layer's partial sums are all-reduced, a
   parameter's gradient is reduced along the data dimensions in its strategy's way.
   Costs come from the cost model and from the planned candidates: the program is
   calibrated to reproduce each candidate's predicted step time and peak exactly.
4. **The solution is planned for real** (the same records as a hand-written layout:
   ``explain``, ``memory()``, the timeline and ``verify()`` apply), and kept only if it
   beats every candidate that fits; if its real peak overshoots the budget, the budget
   is tightened by the overshoot and the program solved again (3 rounds at most).

Every rank reaches the same layout: on a live mesh the first rank searches and sends the
choice to the others, who check its fingerprint. A budget no layout fits raises
:class:`spmd.lowering.annotate.PlanningError` with the least memory found and what
would help.
"""

from __future__ import annotations

import copy
import hashlib
import math
import os
import re
import time
import types
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from spmd.lowering.autolayout import (Choice, Edge, Infeasible, Problem, Recompute, Solution,
                                      Variable, evaluate, solve)
from spmd.lowering.placements import Replicate, Shard, divides
from spmd.runtime.mesh import Mesh

__all__ = ["AutoPlan", "Candidate", "Roles", "Searched", "plan_auto", "parse_budget", "checkpoint_modules",
           "parallelize_auto", "SEARCHED"]

SEARCHED = ("ddp", "fsdp", "zero2", "zero1")  # data strategies tried on one data dimension
_ROUNDS = 3


def parse_budget(budget: Any, where: str) -> float:
    """Bytes from ``memory_budget``: an int (bytes), or a string such as ``"70GiB"``,
    ``"512MiB"``, ``"80GB"``; None: no limit (a simulated cluster: its device's memory)."""
    if budget is None:
        return math.inf
    if isinstance(budget, bool):
        raise TypeError(f"{where}: memory_budget must be bytes or a string like '70GiB', got "
                        f"{budget!r}")
    if isinstance(budget, (int, float)):
        if not budget > 0 or not math.isfinite(budget):
            raise ValueError(f"{where}: memory_budget must be a positive number of bytes, got "
                             f"{budget!r}")
        return float(budget)
    if not isinstance(budget, str):
        raise TypeError(f"{where}: memory_budget must be bytes or a string like '70GiB', got "
                        f"{type(budget).__name__}")
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B|B)\s*", budget)
    if not m:
        raise ValueError(f"{where}: memory_budget {budget!r} is not a size; write e.g. '70GiB', "
                         f"'512MiB', '80GB' or a number of bytes")
    unit = m.group(2)
    power = "BKMGT".index(unit[0])
    base = 1024 if "i" in unit else 1000
    value = float(m.group(1)) * base ** power
    if value <= 0:
        raise ValueError(f"{where}: memory_budget must be positive, got {budget!r}")
    return value


def _gib(n: float) -> str:
    if not math.isfinite(n):
        return "no limit"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.3f} {unit}"
    return f"{n:.0f} B"


# -- roles of the mesh's dimensions ---------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Roles:
    """What each of the user's mesh dimensions does: ``data`` (the batch split along them)
    and ``tp`` (the model split along it, or None). ``names`` renames the user's
    dimensions to the strategies' (``"dp"``, ``"fsdp"``, ``"tp"``)."""

    data: tuple[str, ...]
    tp: str | None
    names: tuple[str, ...]  # the renamed mesh's dimension names, in the user's order
    tile: int = 1  # rows each data rank holds per row of the example (the tp size)

    def describe(self, mesh: Mesh) -> str:
        return ", ".join(f"{u!r} ({mesh.size(u)}) " + ("tensor-parallel" if u == self.tp
                                                       else "data")
                         for u in mesh.dim_names)


def _roles(mesh: Mesh, tp_candidates: tuple[str, ...]) -> list[Roles]:
    """Every assignment: all data; each of ``tp_candidates`` tensor-parallel, the rest data."""
    dims = mesh.dim_names
    if len(dims) > 2:
        raise ValueError(f"strategy='auto': meshes of one or two dimensions are searched; "
                         f"{mesh} has {len(dims)}")

    def data_names(data: list[str]) -> dict[str, str]:
        return ({data[0]: "dp"} if len(data) == 1 else
                {data[0]: "dp", data[1]: "fsdp"} if len(data) == 2 else {})

    out = []
    names = data_names(list(dims))
    out.append(Roles(data=dims, tp=None, names=tuple(names[d] for d in dims)))
    for tp in tp_candidates:
        data = [d for d in dims if d != tp]
        names = {**data_names(data), tp: "tp"}
        out.append(Roles(data=tuple(data), tp=tp, names=tuple(names[d] for d in dims),
                         tile=mesh.size(tp)))
    return out


def _kinds(roles: Roles, mesh: Mesh, mixed: bool = False) -> list[str]:
    """The data strategies tried: every one on the data dimensions alone; beside tensor
    parallelism ddp, fsdp and zero2 (zero1 keeps zero2's memory for more traffic).
    ``mixed`` (``param_dtype=``, which the sharded strategies apply): no ddp."""
    several = [d for d in roles.data if mesh.size(d) > 1]
    if not several:
        kinds = ["ddp"]
    elif len(several) == 2:
        kinds = ["ddp", "fsdp", "hsdp", "zero2", "zero1"]
    else:
        kinds = list(SEARCHED) if roles.tp is None else ["ddp", "fsdp", "zero2"]
    if mixed:
        kinds = [k for k in kinds if k != "ddp"] or ["fsdp"]
    return kinds


def _strategy_mesh(mesh: Mesh, roles: Roles, kind: str) -> Mesh:
    """The user's mesh renamed for ``kind``; ddp (and the ZeRO stages) on two data
    dimensions run on the two flattened into one."""
    renamed = mesh.rename(roles.names)
    data = [n for n, u in zip(roles.names, mesh.dim_names) if u in roles.data]
    if kind in ("ddp",) and len(data) == 2 and all(renamed.size(d) > 1 for d in data):
        return renamed.flatten(tuple(data), "dp")
    return renamed


# -- parameter groups -----------------------------------------------------------------


def _pattern(name: str) -> str:
    return re.sub(r"\.\d+\.", ".*.", f".{name}.")[1:-1]


@dataclass(frozen=True, kw_only=True, slots=True)
class _Group:
    pattern: str
    names: tuple[str, ...]
    numel: int  # per parameter
    itemsize: int
    piece: Any  # its placement on the tp dimension when split (None: only replicated)
    parent: str  # the pattern of the module holding it (pairs column and row layers)


def _groups(model: nn.Module, pieces: dict[str, Any]) -> list[_Group]:
    by: dict[tuple, list[str]] = {}
    params = dict(model.named_parameters())
    for name, p in params.items():
        if not p.requires_grad:
            continue
        key = (_pattern(name), tuple(p.shape), p.dtype, repr(pieces.get(name)))
        by.setdefault(key, []).append(name)
    out = []
    for (pattern, shape, dtype, _), names in by.items():
        p = params[names[0]]
        out.append(_Group(pattern=pattern, names=tuple(names), numel=p.numel(),
                          itemsize=p.element_size(), piece=pieces.get(names[0]),
                          parent=pattern.rsplit(".", 2)[0] if pattern.count(".") >= 2 else ""))
    return out


def _blocks(model: nn.Module) -> list[tuple[str, ...]]:
    """Classes of identical blocks: the children of each ``nn.ModuleList`` with the same
    type and parameter shapes, by module path."""
    out = []
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 1:
            continue
        classes: dict[tuple, list[str]] = {}
        for i, child in enumerate(module):
            key = (type(child).__qualname__,
                   tuple((n, tuple(p.shape)) for n, p in child.named_parameters()))
            if key[1]:
                classes.setdefault(key, []).append(f"{path}.{i}" if path else str(i))
        out += [tuple(v) for v in classes.values()]
    return out


def checkpoint_modules(model: nn.Module, paths: tuple[str, ...]) -> None:
    """Recompute each module at ``paths`` in backward (torch's non-reentrant
    ``checkpoint`` around its forward), as torchtitan's activation checkpointing wraps
    blocks; the modules stay where they are, their parameters keep their names."""
    from torch.utils.checkpoint import checkpoint

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(type(self).forward, self, *args, use_reentrant=False, **kwargs)

    for path in paths:
        sub = model.get_submodule(path)
        sub.forward = types.MethodType(forward, sub)
        sub._spmd_recomputed = True


# -- candidates ------------------------------------------------------------------------


@dataclass(kw_only=True)
class Candidate:
    """One layout planned for real: its strategy, placements on the tensor-parallel
    dimension, recomputed blocks, and its predicted step and peak."""

    label: str
    strategy: str
    roles: Roles
    pieces: dict[str, Any] = field(default_factory=dict)  # parameter -> tp placement
    recompute: tuple[str, ...] = ()
    source: str = "hand-written"  # or "solver"
    plan: Any = None
    seconds: float = math.inf
    peak: float = math.inf
    error: str = ""

    def fits(self, budget: float) -> bool:
        return not self.error and self.peak <= budget

    def row(self, budget: float, chosen: bool) -> str:
        if self.error:
            return f"  {self.label:<44} not plannable: {self.error}"
        mark = "<- chosen" if chosen else ("" if self.fits(budget) else "over budget")
        return f"  {self.label:<44} {self.seconds * 1e3:12.3f} ms {_gib(self.peak):>14}  {mark}"


def _tiled(args: tuple, factor: int) -> tuple:
    if factor == 1:
        return args
    leaves, spec = pytree.tree_flatten(args)
    out = [torch.cat([t] * factor) if isinstance(t, torch.Tensor) and t.dim() else t
           for t in leaves]
    return pytree.tree_unflatten(out, spec)


def _plan_candidate(model: nn.Module, args: tuple, mesh: Mesh, cand: Candidate,
                    options: dict, optimizer: str, ref: Candidate | None = None) -> Candidate:
    """Plan ``cand`` for real on a copy of ``model``. Without a hardware model the compute
    is measured on this machine; a layout that replicates the model (every dimension
    data) computes what ``ref`` computes, so it takes ``ref``'s measurement, and the
    candidates differ by their communication and memory, not by a timer's noise."""
    from spmd.inspection import inspect

    copy_ = copy.deepcopy(model)
    checkpoint_modules(copy_, cand.recompute)
    kwargs = dict(options)
    if cand.roles.tp is not None:
        kwargs["placements"] = {"tp": dict(cand.pieces)}
    try:
        plan = inspect(copy_, *_tiled(args, cand.roles.tile), mesh=_strategy_mesh(
            mesh, cand.roles, cand.strategy), strategy=cand.strategy, **kwargs)
    except (ValueError, TypeError, NotImplementedError, RuntimeError) as e:
        cand.error = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        return cand
    if plan.fallbacks and not cand.label.endswith("(reference)"):
        cand.error = (f"left to the eager safety net ({plan.fallbacks[0].reason[:120]}), "
                      f"which the prediction would not price")
        return cand
    if (ref is not None and ref.plan is not None and mesh.hardware is None
            and cand.roles.tp is None and not cand.recompute
            and set(plan.compute) == set(ref.plan.compute)):
        plan.compute = dict(ref.plan.compute)
    cand.plan = plan
    cand.seconds = plan.predicted_timeline(optimizer).step_seconds
    cand.peak = float(plan.memory(optimizer).peak)
    return cand


# -- the program for one role assignment -----------------------------------------------


def _slope(cost_model: Any, kind: str) -> float:
    big = 1 << 30
    return (cost_model.seconds(kind, big) - cost_model.seconds(kind, 0)) / big


def _data_costs(kind: str, cm: Any, size: int, itemsize: int, gather_size: int,
                optimizer_states: int) -> tuple[float, float]:
    """(bytes stored per element, communication seconds per element) of one parameter
    under ``kind`` along a data dimension of ``size`` ranks."""
    state = 1 + 1 + optimizer_states  # parameter, gradient, optimizer state
    if size <= 1:
        return state * itemsize, 0.0
    ar = _slope(cm, "all_reduce") * itemsize
    ag = _slope(cm, "all_gather") * gather_size
    rs = _slope(cm, "reduce_scatter") * itemsize
    if kind == "ddp":
        return state * itemsize, ar
    if kind in ("fsdp", "hsdp"):
        return state * itemsize / size, 2 * ag + rs
    if kind == "zero2":
        return itemsize + (state - 1) * itemsize / size, ag + rs
    return 2 * itemsize + optimizer_states * itemsize / size, ar + ag  # zero1


@dataclass(kw_only=True)
class _Search:
    """One role assignment's program, what its variables mean, and its solution."""

    roles: Roles
    problem: Problem
    groups: list[_Group]
    blocks: list[tuple[str, ...]]
    kinds: list[str]
    solution: Solution | None = None
    target: float = math.inf  # the budget the solution was solved for (tightened rounds)
    error: str = ""


def _layer_saved(plan: Any, optimizer: str) -> dict[str, int]:
    return {layer: n for layer, n, _ in plan.memory(optimizer).saved_by_layer}


def _build(model: nn.Module, roles: Roles, mesh: Mesh, base: dict[str, Candidate],
           pieces: dict[str, Any], budget: float, optimizer: str, options: dict,
           inputs_bytes: dict[str, int]) -> _Search:
    """The integer program of one role assignment from its planned candidates ``base``
    (kind -> the candidate: every parameter its piece on the tp dimension, if any) and
    the all-data ddp candidate's compute (``base["@data"]``)."""
    from spmd.memory import OPTIMIZER_STATES

    states = OPTIMIZER_STATES[optimizer]
    mixed = options.get("param_dtype") is not None
    kinds = [k for k in _kinds(roles, mesh, mixed) if k in base and not base[k].error]
    groups = _groups(model, pieces if roles.tp else {})
    blocks = _blocks(model)
    t = mesh.size(roles.tp) if roles.tp else 1
    ref = base["@data"].plan  # every parameter replicated, the batch over every rank
    r_compute = t * sum(f + b for f, b in ref.compute.values())
    r_forward = t * sum(f for f, _ in ref.compute.values())
    r_saved = t * ref.memory(optimizer).activations
    any_kind = base[kinds[0]].plan
    p_compute = sum(f + b for f, b in any_kind.compute.values())
    p_saved = any_kind.memory(optimizer).activations
    split = [g for g in groups if g.piece is not None and divides(g.piece)]
    weight = {g.pattern: g.numel * len(g.names) for g in split}
    total_w = sum(weight.values()) or 1
    gather = options.get("param_dtype")
    variables = [Variable(name="model", choices=(Choice(
        name="as traced", seconds=r_compute, hides=r_compute, bytes=r_saved),))]
    # the data strategy: its correction is set after calibration below
    variables.append(Variable(name="data", choices=tuple(Choice(name=k) for k in kinds)))
    edges: list[Edge] = []
    tp_cm = mesh.rename(roles.names).cost_model("tp", ref.cost_model) if roles.tp else None
    for g in groups:
        choices = [Choice(name="Replicate()")]
        if g in split:
            share = weight[g.pattern] / total_w
            saving = (r_compute - p_compute) * share
            choices.append(Choice(name=repr(g.piece), seconds=-saving, hides=-saving,
                                  bytes=-(r_saved - p_saved) * share))
        variables.append(Variable(name=g.pattern, choices=tuple(choices), count=len(g.names)))
        costs = {}
        for k_i, k in enumerate(kinds):
            dim = "fsdp" if k == "hsdp" else "dp"
            renamed = _strategy_mesh(mesh, roles, k)
            size = renamed.size(dim) if dim in renamed.dim_names else 1
            cm = renamed.cost_model(dim, ref.cost_model) if size > 1 else None
            gsize = torch.empty((), dtype=gather).element_size() if gather else g.itemsize
            for c_i in range(len(choices)):
                per = g.numel / (t if c_i else 1)
                stored, comm = _data_costs(k, cm, size, g.itemsize, gsize, states)
                if k == "hsdp":  # the shards' average across the replicas
                    rep = renamed.size("dp")
                    stored, comm = stored, comm + (_slope(renamed.cost_model("dp", ref.cost_model),
                                                          "all_reduce") * g.itemsize / size
                                                   if rep > 1 else 0.0)
                costs[(k_i, c_i)] = Choice(name="", bytes=per * stored, hidden=per * comm)
        edges.append(Edge(a="data", b=g.pattern, costs=costs, count=len(g.names)))
    if roles.tp is not None:
        edges += _pair_edges(split, groups, model, tp_cm, inputs_bytes, t)
    recompute = []
    if roles.tp is not None:
        blocks = []  # checkpointed blocks under tensor parallelism are not planned yet
    saved = _layer_saved(base[kinds[0]].plan, optimizer)
    numel = sum(p.numel() for p in model.parameters()) or 1
    for cls in blocks:
        if any(getattr(model.get_submodule(p), "_spmd_recomputed", False) for p in cls):
            continue
        each = [saved.get(p, 0) - inputs_bytes.get(p, 0) for p in cls]
        gain = min(each)
        if gain <= 0:
            continue
        block = sum(q.numel() for q in model.get_submodule(cls[0]).parameters())
        recompute.append(Recompute(name=cls[0], count=len(cls), saved=gain,
                                   seconds=r_forward * block / numel / (t if split else 1)))
    problem = Problem(variables=tuple(variables), edges=tuple(edges),
                      recompute=tuple(recompute), budget=budget)
    problem = _calibrate(problem, kinds, base, split)
    return _Search(roles=roles, problem=problem, groups=groups, blocks=blocks, kinds=kinds)


def _pair_edges(split: list[_Group], groups: list[_Group], model: nn.Module, cm: Any,
                inputs_bytes: dict[str, int], t: int) -> list[Edge]:
    """Column-parallel and row-parallel layers of one module (Megatron's pairs): what
    each pair of their choices moves on the tensor-parallel dimension."""
    edges = []
    by_parent: dict[str, list[_Group]] = {}
    for g in split:
        by_parent.setdefault(g.parent, []).append(g)
    ar = _slope(cm, "all_reduce")
    ag = _slope(cm, "all_gather")
    for parent, members in by_parent.items():
        cols = [g for g in members if g.pattern.endswith("weight") and _is_column(g)]
        rows = [g for g in members if g.pattern.endswith("weight") and not _is_column(g)]
        for col in cols:
            layer = col.names[0].rsplit(".", 1)[0]
            out_b = inputs_bytes.get(layer + ":out", 0) * t
            in_b = inputs_bytes.get(layer, 0) * t
            for row in rows:
                rlayer = row.names[0].rsplit(".", 1)[0]
                r_out = inputs_bytes.get(rlayer + ":out", 0) * t
                share = 1.0 / len(cols)
                costs = {
                    # row split: its partial sums all-reduced in forward; column split:
                    # its input's gradient all-reduced in backward
                    (1, 1): Choice(name="", seconds=ar * (r_out + in_b) * share),
                    (1, 0): Choice(name="", seconds=ag * out_b + ar * in_b * share),
                    (0, 1): Choice(name="", seconds=ag * out_b + ar * r_out * share),
                }
                edges.append(Edge(a=col.pattern, b=row.pattern, costs=costs,
                                  count=len(col.names)))
    return edges


def _is_column(g: _Group) -> bool:
    return isinstance(g.piece, Shard) and g.piece.dim == 0 or "Strided" in repr(g.piece)


def _calibrate(problem: Problem, kinds: list[str], base: dict[str, Candidate],
               split: list[_Group]) -> Problem:
    """Each data strategy's choice corrected so that the program gives its planned
    candidate's predicted seconds and peak exactly (every split group its piece)."""
    choices = {v.name: len(v.choices) - 1 for v in problem.variables}
    corrected = []
    for i, k in enumerate(kinds):
        seconds, bytes_ = evaluate(problem, {**choices, "data": i}, {})
        real = base[k]
        corrected.append(Choice(name=k, seconds=real.seconds - seconds,
                                bytes=real.peak - bytes_))
    variables = tuple(replace(v, choices=tuple(corrected)) if v.name == "data" else v
                      for v in problem.variables)
    return replace(problem, variables=variables)


# -- the search -------------------------------------------------------------------------


@dataclass(kw_only=True)
class AutoPlan:
    """What ``strategy="auto"`` searched and chose: the candidates planned (hand-written
    and the solver's) with their predicted step and peak, the chosen one, each role
    assignment's integer program and solution, and the time it took."""

    budget: float
    mesh: Mesh
    chosen: Candidate
    candidates: list[Candidate]
    searches: list[_Search]
    solve_seconds: float
    seconds: float
    optimizer: str

    def summary(self) -> str:
        lines = [f"strategy='auto' on {self.mesh} under a budget of {_gib(self.budget)} "
                 f"(memory counted with {self.optimizer}'s state): chose "
                 f"{self.chosen.label} ({self.chosen.roles.describe(self.mesh)})",
                 f"  searched in {self.seconds:.1f} s ({self.solve_seconds:.2f} s in the "
                 f"integer programs, the rest planning candidates)",
                 f"  {'candidate':<44} {'predicted step':>15} {'peak':>14}"]
        for c in self.candidates:
            lines.append(c.row(self.budget, c is self.chosen))
        for s in self.searches:
            if s.solution is not None:
                p = s.problem
                lines.append(f"  program for {s.roles.describe(self.mesh)}: {len(p.variables)} "
                             f"variables ({sum(v.count for v in p.variables)} with the tied "
                             f"blocks), {s.solution.variables} columns, "
                             f"{s.solution.constraints} rows, solved in "
                             f"{s.solution.solve_seconds * 1e3:.1f} ms")
            elif s.error:
                lines.append(f"  program for {s.roles.describe(self.mesh)}: {s.error}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def explain(self, name: str) -> str | None:
        """What was chosen for the parameter (or module) ``name``, what it costs and the
        runner-up: each other choice with the rest fixed, re-priced by the program."""
        search = next((s for s in self.searches if s.roles == self.chosen.roles
                       and s.solution is not None), None)
        if search is None:
            return None
        group = next((g for g in search.groups if any(
            n == name or n.startswith(name + ".") for n in g.names)), None)
        if group is None:
            return None
        p = search.problem
        choices, counts = _assignment(search, self.chosen)
        var = next(v for v in p.variables if v.name == group.pattern)
        here = var.choices[choices[var.name]].name
        lines = [f"{name}: group {group.pattern} ({len(group.names)} parameter(s) of "
                 f"{group.numel:,} elements, one choice for the identical blocks); chosen: "
                 f"data strategy {self.chosen.strategy}" + (
                     f", on the tensor-parallel dimension {self.chosen.roles.tp!r} {here}"
                     if self.chosen.roles.tp else "") + f" ({self.chosen.source})"]
        own_s, own_b = _own_cost(p, choices, var.name)
        lines.append(f"  its share of the step: {own_s * 1e3:.3f} ms of compute and "
                     f"communication (overlappable included), {_gib(own_b)} per rank")
        base_s, base_b = evaluate(p, choices, counts)
        for i, c in enumerate(var.choices):
            if i != choices[var.name]:
                s, b = evaluate(p, {**choices, var.name: i}, counts)
                lines.append(_runner_up(f"{c.name} on {self.chosen.roles.tp!r}", s - base_s,
                                        b - base_b, b <= self.budget))
        for k_i, k in enumerate(search.kinds):
            if k != self.chosen.strategy:
                s, b = evaluate(p, {**choices, "data": k_i}, counts)
                lines.append(_runner_up(f"data strategy {k}", s - base_s, b - base_b,
                                        b <= self.budget))
        if len(lines) == 1:
            lines.append("  no other choice: it is replicated in every layout searched")
        return "\n".join(lines)

    def fingerprint(self) -> str:
        c = self.chosen
        key = repr((c.strategy, c.roles, sorted((k, repr(v)) for k, v in c.pieces.items()),
                    c.recompute))
        return hashlib.sha256(key.encode()).hexdigest()[:16]


def _own_cost(problem: Problem, choices: dict[str, int], name: str) -> tuple[float, float]:
    """Seconds (overlappable communication included) and bytes the program charges to
    variable ``name`` under ``choices``: its own choice and the edges that touch it."""
    var = next(v for v in problem.variables if v.name == name)
    c = var.choices[choices[name]]
    seconds, nbytes = var.count * (c.seconds + c.hidden), var.count * c.bytes
    for e in problem.edges:
        if name in (e.a, e.b):
            got = e.costs.get((choices[e.a], choices[e.b]))
            if got is not None:
                seconds += e.count * (got.seconds + got.hidden)
                nbytes += e.count * got.bytes
    return seconds, nbytes


def _runner_up(what: str, seconds: float, nbytes: float, fits: bool) -> str:
    return (f"  with {what} instead: predicted step {seconds * 1e3:+.3f} ms, peak "
            f"{nbytes / 2**20:+.1f} MiB" + ("" if fits else " (over the budget)"))


def _assignment(search: _Search, cand: Candidate) -> tuple[dict[str, int], dict[str, int]]:
    """``cand``'s layout as the program's choices (a hand-written candidate too)."""
    choices = {v.name: 0 for v in search.problem.variables}
    choices["data"] = search.kinds.index(cand.strategy)
    for g in search.groups:
        if g.names[0] in cand.pieces and len(next(
                v for v in search.problem.variables if v.name == g.pattern).choices) > 1:
            choices[g.pattern] = 1
    counts = {item.name: sum(1 for p in cand.recompute if p in next(
        c for c in search.blocks if c[0] == item.name)) for item in search.problem.recompute}
    return choices, counts


def _layer_io(model: nn.Module, args: tuple) -> dict[str, int]:
    """Bytes of each module's first input (``path``) and output (``path:out``) on one
    forward of a copy, on the meta device where the model is there."""
    out: dict[str, int] = {}
    handles = []

    def nbytes(x: Any) -> int:
        t = x[0] if isinstance(x, tuple) and x else x
        return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

    for path, module in model.named_modules():
        if path:
            handles.append(module.register_forward_hook(
                lambda m, a, o, path=path: out.update({path: nbytes(a), f"{path}:out": nbytes(o)})))
    try:
        with torch.no_grad():
            model(*args)
    finally:
        for h in handles:
            h.remove()
    return out


def plan_auto(model: nn.Module, args: tuple, *, mesh: Mesh, memory_budget: Any = None,
              placements: Any = None, search_roles: bool = True, optimizer: str = "adamw",
              where: str = "spmd.inspect", **options: Any) -> AutoPlan:
    """Search the layout of ``model`` on ``mesh`` (see the module doc); the
    :class:`AutoPlan`, whose ``chosen.plan`` is the chosen layout's
    :class:`~spmd.plan.Plan`. ``args``: one rank's batch when every dimension is data."""
    from spmd.lowering.annotate import PlanningError
    from spmd.tp import megatron, tp_dims_of

    started = time.perf_counter()
    budget = parse_budget(memory_budget, where)
    if not math.isfinite(budget) and mesh.hardware is not None:
        budget = float(mesh.hardware.device.memory_bytes)
    if "pipeline" in options and options["pipeline"] is not None:
        raise TypeError(f"{where}: strategy='auto' does not search pipeline stages yet; pass "
                        f"a strategy with pipeline=, or no pipeline")
    named = tp_dims_of(placements)
    if len(named) > 1:
        raise ValueError(f"{where}: strategy='auto' splits the model along one dimension; "
                         f"placements name {named}")
    for d in named:
        if d not in mesh.dim_names:
            raise ValueError(f"{where}: placements name mesh dimension {d!r}, which mesh "
                             f"{mesh} does not have")
    if named:
        candidates_tp = named
        spec = placements
    elif search_roles:
        candidates_tp = tuple(d for d in mesh.dim_names if mesh.size(d) > 1)
        spec = megatron()
    else:
        candidates_tp, spec = (), None
    pieces: dict[str, Any] = {}
    if spec is not None:
        from spmd.tp import resolve_placements

        try:
            dim = named[0] if named else "tp"
            src = spec if named else megatron(dim="tp")
            probe = Mesh.simulated(2, (dim,)) if not named else mesh
            pieces = {n: p[dim] for n, p in resolve_placements(model, probe, src, where).items()
                      if divides(p.get(dim, Replicate()))}
        except ValueError:
            pieces = {}
        if not pieces:
            if named:
                raise ValueError(f"{where}: placements split no parameter of "
                                 f"{type(model).__name__}; there is no tensor parallelism to "
                                 f"search")
            candidates_tp = ()
    roles_list = _roles(mesh, candidates_tp)
    if named:  # on a live mesh: the named dimension is tensor-parallel, the rest data
        roles_list = [r for r in roles_list if r.tp == named[0]]
    io = _layer_io(copy.deepcopy(model), args)
    candidates: list[Candidate] = []
    searches: list[_Search] = []
    solve_seconds = 0.0
    all_data = _roles(mesh, ())[0]
    # the reference: the model replicated (every dimension data): its compute and
    # activations price the replicated choices; with param_dtype= (which ddp does not
    # apply) fsdp, whose compute runs in that dtype
    mixed = options.get("param_dtype") is not None
    ref_kind = "fsdp" if mixed else "ddp"
    ref = _plan_candidate(model, args, mesh, Candidate(
        label=f"{ref_kind} (reference)", strategy=ref_kind, roles=all_data), options,
        optimizer)
    if ref.error:
        raise PlanningError(f"{where}: strategy='auto' could not plan {type(model).__name__} "
                            f"replicated to price it: {ref.error}")
    for roles in roles_list:
        base: dict[str, Candidate] = {"@data": ref}
        for kind in _kinds(roles, mesh, mixed):
            label = kind if roles.tp is None else f"{kind} x megatron tp on {roles.tp!r}"
            if roles.tp is None and kind == ref_kind and not named and ref.roles == roles:
                cand = replace(ref, label=kind)
            else:
                cand = _plan_candidate(model, args, mesh, Candidate(
                    label=label, strategy=kind, roles=roles,
                    pieces=dict(pieces) if roles.tp else {}), options, optimizer, ref)
            base[kind] = cand
            if roles.tp is not None or not named:
                candidates.append(cand)
        if not any(not c.error for k, c in base.items() if k != "@data"):
            continue
        search = _build(model, roles, mesh, base, pieces, budget, optimizer, options, io)
        searches.append(search)
        target = budget
        for _ in range(_ROUNDS):
            try:
                sol = solve(replace(search.problem, budget=target))
            except Infeasible as e:
                search.error = str(e)
                break
            solve_seconds += sol.solve_seconds
            search.solution, search.target = sol, target
            cand = _decode(search, sol, pieces)
            same = next((c for c in candidates if c.strategy == cand.strategy
                         and c.roles == cand.roles and c.pieces == cand.pieces
                         and c.recompute == cand.recompute and not c.error), None)
            if same is not None:
                break
            cand = _plan_candidate(model, args, mesh, cand, options, optimizer, ref)
            candidates.append(cand)
            if cand.error or cand.peak <= budget:
                break
            target -= cand.peak - budget  # its real peak overshot: ask for that much less
    fitting = [c for c in candidates if c.fits(budget)]
    if not fitting:
        planned = [c for c in candidates if not c.error]
        least = min(planned, key=lambda c: c.peak, default=None)
        hint = _what_would_fit(least, budget, optimizer, mesh)
        table = "\n".join(c.row(budget, False) for c in candidates)
        raise PlanningError(
            f"{where}: no layout of {type(model).__name__} on {mesh} fits the memory budget of "
            f"{_gib(budget)}" + (f"; the least found is {least.label} at {_gib(least.peak)}"
                                 if least else "") +
            f" (recomputation included where it helps). What would fit: {hint}.\n{table}")
    # fastest that fits; ties to the hand-written one, then the earlier
    chosen = min(fitting, key=lambda c: (round(c.seconds, 12), c.source != "hand-written"))
    return AutoPlan(budget=budget, mesh=mesh, chosen=chosen, candidates=candidates,
                    searches=searches, solve_seconds=solve_seconds,
                    seconds=time.perf_counter() - started, optimizer=optimizer)


def _what_would_fit(least: Candidate | None, budget: float, optimizer: str, mesh: Mesh
                    ) -> str:
    """What would make the least-memory layout fit, with figures where its memory view
    gives them: more data ranks (its sharded state divides over them), a smaller batch
    (its activations shrink with it), recomputing blocks."""
    if least is None or least.plan is None:
        return ("more ranks along a data dimension (fsdp shards the state over them), "
                "recomputing blocks, or a smaller batch per rank")
    view = least.plan.memory(optimizer)
    state = view.params + view.grads + view.optimizer_state
    rest = view.peak - state
    data = math.prod(mesh.size(d) for d in least.roles.data)
    hints = []
    if least.strategy != "ddp" and budget > rest:
        ranks = math.ceil(state * data / (budget - rest))
        hints.append(f"about {ranks} data ranks instead of {data} (the sharded state "
                     f"divides over them)")
    else:
        hints.append("more ranks along a data dimension with fsdp")
    if view.activations and view.peak - view.activations < budget:
        share = (budget - (view.peak - view.activations)) / view.activations
        hints.append(f"at most {share:.0%} of this batch per rank (activations "
                     f"{_gib(view.activations)})")
    else:
        hints.append("a smaller batch per rank")
    hints.append("recomputing more of the model (blocks already recomputed: "
                 f"{len(least.recompute)})")
    return "; ".join(hints)


def _decode(search: _Search, sol: Solution, pieces: dict[str, Any]) -> Candidate:
    kind = search.kinds[sol.choices["data"]]
    chosen: dict[str, Any] = {}
    for g in search.groups:
        if sol.choices.get(g.pattern, 0) == 1:
            for n in g.names:
                chosen[n] = pieces[n]
    # a bias follows its weight's choice (column-parallel biases are split with it)
    recompute: list[str] = []
    for item in search.problem.recompute:
        cls = next(c for c in search.blocks if c[0] == item.name)
        recompute += list(cls[:sol.recompute.get(item.name, 0)])
    parts = [kind]
    if search.roles.tp is not None:
        parts.append(f"tp on {search.roles.tp!r} ({len(chosen)} of {len(pieces)} pieces)")
    if recompute:
        parts.append(f"{len(recompute)} block(s) recomputed")
    return Candidate(label="auto: " + " x ".join(parts), strategy=kind, roles=search.roles,
                     pieces=chosen, recompute=tuple(recompute), source="solver")


# -- on a live mesh -----------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Searched:
    """What a live model's search chose, as the first rank sent it (the plans it made
    stay there): the table of candidates and the layout's fingerprint."""

    summary: str
    fingerprint: str
    runs: str = ""  # the layout it runs (the fastest measured of the close ones)

    def explain(self, name: str) -> None:
        return None  # the program stayed on the first rank: the plan explains the rest

    def __str__(self) -> str:
        return self.summary


def parallelize_auto(module: nn.Module, mesh: Mesh | None, memory_budget: Any,
                     placements: Any, options: dict, where: str) -> nn.Module:
    """``parallelize(module, strategy="auto")``: the layout is searched at the first call
    (it needs the batch's shapes), on the first rank, and sent to the others; then the
    module is parallelized with it in place and the call goes on. Until then the module is
    itself (an optimizer made now keeps stepping the same parameters)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"{where}: strategy='auto' takes a model instance (the layout is "
                        f"searched on it), got {type(module).__name__}")
    parse_budget(memory_budget, where)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise TypeError(f"{where}: strategy='auto' searches on positional inputs; got "
                            f"keyword inputs {sorted(kwargs)}")
        del self.forward
        return _first_call(self, mesh, memory_budget, placements, options, where,
                           args)

    module.forward = types.MethodType(forward, module)
    return module


_FINALISTS = 3  # layouts measured on a live mesh at most
_WITHIN = 1.25  # ... whose predicted step is within this factor of the best's
_STEPS = 3  # measured steps of each (after one that compiles)


def _layout(c: Candidate) -> tuple:
    return (c.strategy, c.roles, dict(c.pieces), tuple(c.recompute), c.label)


def _free_bytes(module: nn.Module) -> int:
    """Memory free now where the model lives: the GPU's (``mem_get_info``), else the
    host's available physical memory."""
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def _finalists(auto: AutoPlan, model_bytes: int, free: int) -> list[Candidate]:
    """The fitting layouts worth measuring: predicted within ``_WITHIN`` of the best, at
    most ``_FINALISTS``, where a whole copy of the model and its predicted peak fit in
    half the memory free now (measuring runs copies); else the predicted best alone."""
    fitting = sorted((c for c in auto.candidates if c.fits(auto.budget)),
                     key=lambda c: c.seconds)
    best = auto.chosen
    close = [c for c in fitting if c.seconds <= best.seconds * _WITHIN][:_FINALISTS]
    if best not in close:
        close = [best] + close[:_FINALISTS - 1]
    if len(close) < 2 or any(2 * (model_bytes + c.peak) > free for c in close):
        return [best]
    return close


def _measure(module: nn.Module, mesh: Mesh, layouts: list[tuple], args: tuple,
             options: dict, where: str) -> list[float]:
    """Each layout's step on this mesh, every rank at once: a copy of ``module``
    parallelized with it runs one step that compiles, then ``_STEPS`` forward-backward
    passes on ``args`` (gradients of the sum of the outputs; the model's own and the
    random state are untouched); the slowest rank's median, the same on every rank."""
    import statistics

    from spmd.api import _parallelize_instance
    from spmd.lowering.options import Options
    from spmd.runtime import collectives
    from spmd.runtime.reduction import ReduceOp

    out = []
    for kind, roles, pieces, recompute, _ in layouts:
        copy_ = copy.deepcopy(module)
        checkpoint_modules(copy_, recompute)
        kwargs = dict(options)
        if roles.tp is not None:
            kwargs["placements"] = {"tp": dict(pieces)}
        run = _parallelize_instance(copy_, Options.from_kwargs(where, strategy=kind, **kwargs),
                                    _strategy_mesh(mesh, roles, kind))
        times = []
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            for step in range(_STEPS + 1):
                start = time.perf_counter()
                leaves = [t for t in pytree.tree_leaves(run(*args))
                          if isinstance(t, torch.Tensor) and t.requires_grad]
                sum(t.float().sum() for t in leaves).backward()
                if step:
                    times.append(time.perf_counter() - start)
        mine = torch.tensor([statistics.median(times)], dtype=torch.float64)
        for d in range(mesh.ndim):
            collectives.all_reduce(mine, op=ReduceOp.MAX, group=mesh.get_group(d))
        out.append(float(mine))
        del run, copy_
    return out


def _first_call(module: nn.Module, mesh: Mesh | None, memory_budget: Any,
                placements: Any, options: dict, where: str, args: tuple) -> Any:
    """The search on the first rank, its finalists sent to every rank and, when several
    are close, measured there; the fastest measured is applied to ``module``."""
    from spmd.api import _parallelize_instance
    from spmd.lowering.options import Options
    from spmd.runtime import groups
    from spmd.runtime.objects import broadcast_object_list

    if mesh is None:
        mesh = Mesh(groups.get_world_size())
    first = mesh.rank_at([0] * mesh.ndim)
    choice: list[Any] = [None]
    if groups.get_rank() == first:
        planning = Mesh.simulated(mesh.shape, mesh.dim_names)
        try:
            auto = plan_auto(module, args, mesh=planning, memory_budget=memory_budget,
                             placements=placements, search_roles=False, where=where,
                             **options)
            model_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
            finalists = _finalists(auto, model_bytes, _free_bytes(module))
            choice[0] = ("ok", [_layout(c) for c in finalists],
                         auto.summary())
        except Exception as e:  # every rank raises it, not only this one
            choice[0] = ("error", type(e).__name__, str(e))
    # from the first rank along each dimension in turn: after dimension d, every rank whose
    # coordinates after d are 0 holds it (a group's first rank along d has coordinate 0)
    for d in range(mesh.ndim):
        group = mesh.get_group(d)
        broadcast_object_list(choice, src=group.ranks[0], group=group)
    if choice[0][0] == "error":
        from spmd.lowering.annotate import PlanningError

        raise PlanningError(f"{where}: strategy='auto' (searched on rank {first}): "
                            f"{choice[0][1]}: {choice[0][2]}")
    _, layouts, summary = choice[0]
    pick = 0
    if len(layouts) > 1:
        measured = _measure(module, mesh, layouts, args, options, where)
        pick = min(range(len(layouts)), key=lambda i: (measured[i], i))
        summary += ("\n  measured here, the slowest rank's median of "
                    f"{_STEPS} steps (the predictions within {_WITHIN}x of the best): "
                    + ", ".join(f"{lay[4]} {t * 1e3:.2f} ms" for lay, t in zip(layouts, measured))
                    + f"; runs {layouts[pick][4]}")
    kind, roles, pieces, recompute, label = layouts[pick]
    checkpoint_modules(module, recompute)
    kwargs = dict(options)
    if roles.tp is not None:
        kwargs["placements"] = {"tp": dict(pieces)}
    opts = Options.from_kwargs(where, strategy=kind, **kwargs)
    _parallelize_instance(module, opts, _strategy_mesh(mesh, roles, kind))
    fingerprint = hashlib.sha256(repr(layouts[pick][:4]).encode()).hexdigest()[:16]
    module._spmd.auto = Searched(summary=summary, fingerprint=fingerprint, runs=label)
    return module(*args)
