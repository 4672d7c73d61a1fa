"""The integer program of one role assignment (:mod:`spmd.auto.search`): the model's parameter
groups (identical blocks' parameters are one), its classes of identical blocks, the
variables and the costs that link them, calibrated to the planned candidates; and the
solution read back as a layout (:func:`decode`)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn as nn

from spmd.auto.candidates import Candidate, Roles, kinds_for, strategy_mesh
from spmd.auto.solver import Choice, Edge, Problem, Recompute, Solution, Variable, evaluate
from spmd.lowering.cost_model import along
from spmd.lowering.placements import Shard, divides
from spmd.lowering.strategy import kind_of
from spmd.plan.plan import Plan
from spmd.runtime.mesh import Mesh

__all__ = ["Group", "Search", "build_program", "decode", "assignment", "own_cost",
           "layer_io", "groups_of", "blocks_of", "pattern_of"]


# -- parameter groups -----------------------------------------------------------------


def pattern_of(name: str) -> str:
    return re.sub(r"\.\d+\.", ".*.", f".{name}.")[1:-1]


def _block_pattern(name: str) -> str:
    """``name`` with only its first index starred (the block's)."""
    return re.sub(r"\.\d+\.", ".*.", f".{name}.", count=1)[1:-1]


@dataclass(frozen=True, kw_only=True, slots=True)
class Group:
    pattern: str
    names: tuple[str, ...]
    numel: int  # per parameter
    itemsize: int
    piece: Any  # its placement on the tp dimension when split (None: only replicated)
    parent: str  # the pattern of the module holding it (pairs column and row layers)


def groups_of(model: nn.Module, pieces: dict[str, Any]) -> list[Group]:
    by: dict[tuple, list[str]] = {}
    params = dict(model.named_parameters())
    for name, p in params.items():
        if not p.requires_grad:
            continue
        key = (pattern_of(name), tuple(p.shape), p.dtype, repr(pieces.get(name)))
        by.setdefault(key, []).append(name)
    # one pattern, several groups (a block's nn.Sequential: "shared.0.weight" and
    # "shared.2.weight" are both "shared.*.weight"): those keep their own indices but
    # the first (the block's), so that each group is one variable of the program
    seen: dict[str, int] = {}
    for key in by:
        seen[key[0]] = seen.get(key[0], 0) + 1
    regrouped: dict[tuple, list[str]] = {}
    for key, names in by.items():
        if seen[key[0]] > 1:
            key = (_block_pattern(names[0]), *key[1:])
        regrouped.setdefault(key, []).extend(names)
    out = []
    for (pattern, shape, dtype, _), names in regrouped.items():
        p = params[names[0]]
        out.append(Group(pattern=pattern, names=tuple(names), numel=p.numel(),
                          itemsize=p.element_size(), piece=pieces.get(names[0]),
                          parent=pattern.rsplit(".", 2)[0] if pattern.count(".") >= 2 else ""))
    return out


def blocks_of(model: nn.Module) -> list[tuple[str, ...]]:
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


# -- the program for one role assignment -----------------------------------------------


def _slope(cost_model: Any, kind: str) -> float:
    big = 1 << 30
    return (cost_model.seconds(kind, big) - cost_model.seconds(kind, 0)) / big


def _data_costs(kind: str, cm: Any, size: int, itemsize: int, gather_size: int,
                optimizer_states: int) -> tuple[float, float]:
    """(bytes stored per element, communication seconds per element) of one parameter
    under ``kind`` (a row of ``KINDS``, read field by field) along a data dimension of
    ``size`` ranks: its gathers per step (``Gathered.gathers``) and its gradient's
    collective (``Reduced.collective``); the parameter whole where the row holds it
    whole at the peak, else its shard; the gradient whole where it is all-reduced, else
    its shard; the optimizer state a shard where the row shards. ``ValueError`` naming
    an unknown row."""
    row = kind_of(kind)
    state = 1 + 1 + optimizer_states  # parameter, gradient, optimizer state
    if size <= 1:
        return state * itemsize, 0.0
    whole = (state if not row.shards  # of the three, those each rank holds whole
             else int(row.gathered.holds_whole) + int(row.reduced.keeps_whole))
    ag = _slope(cm, "all_gather") * gather_size
    reduce = _slope(cm, row.reduced.collective) * itemsize
    stored = whole * itemsize + (state - whole) * itemsize / size
    return stored, row.gathered.gathers * ag + reduce


@dataclass(kw_only=True)
class Search:
    """One role assignment's program, what its variables mean, and its solution."""

    roles: Roles
    problem: Problem
    groups: list[Group]
    blocks: list[tuple[str, ...]]
    kinds: list[str]
    solution: Solution | None = None
    target: float = math.inf  # the budget the solution was solved for (tightened rounds)
    error: str = ""


def _layer_saved(plan: Plan, optimizer: str) -> dict[str, int]:
    return {layer: n for layer, n, _ in plan.memory(optimizer).saved_by_layer}


def build_program(model: nn.Module, roles: Roles, mesh: Mesh, base: dict[str, Candidate],
                  pieces: dict[str, Any], budget: float, optimizer: str, options: dict,
                  inputs_bytes: dict[str, int]) -> Search:
    """The integer program of one role assignment from its planned candidates ``base``
    (kind -> the candidate: every parameter its piece on the tp dimension, if any) and
    the all-data ddp candidate's compute (``base["@data"]``)."""
    from spmd.plan.memory import OPTIMIZER_STATES

    states = OPTIMIZER_STATES[optimizer]
    mixed = options.get("param_dtype") is not None
    kinds = [k for k in kinds_for(roles, mesh, mixed) if k in base and not base[k].error]
    groups = groups_of(model, pieces if roles.tp else {})
    blocks = blocks_of(model)
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
    tp_cm = along(mesh.rename(roles.names), "tp", ref.cost_model) if roles.tp else None
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
            hybrid = kind_of(k).hybrid  # sharded along "fsdp", replicated along "dp"
            dim = "fsdp" if hybrid else "dp"
            renamed = strategy_mesh(mesh, roles, k)
            size = renamed.size(dim) if dim in renamed.dim_names else 1
            cm = along(renamed, dim, ref.cost_model) if size > 1 else None
            gsize = torch.empty((), dtype=gather).element_size() if gather else g.itemsize
            for c_i in range(len(choices)):
                per = g.numel / (t if c_i else 1)
                stored, comm = _data_costs(k, cm, size, g.itemsize, gsize, states)
                if hybrid and renamed.size("dp") > 1:  # shards averaged over replicas
                    replicas = along(renamed, "dp", ref.cost_model)
                    comm += _slope(replicas, "all_reduce") * g.itemsize / size
                costs[(k_i, c_i)] = Choice(name="", bytes=per * stored, hidden=per * comm)
        edges.append(Edge(a="data", b=g.pattern, costs=costs, count=len(g.names)))
    if roles.tp is not None:
        edges += _pair_edges(split, tp_cm, inputs_bytes, t)
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
                                   seconds=r_forward * block / numel))
    problem = Problem(variables=tuple(variables), edges=tuple(edges),
                      recompute=tuple(recompute), budget=budget)
    problem = _calibrate(problem, kinds, base)
    return Search(roles=roles, problem=problem, groups=groups, blocks=blocks, kinds=kinds)


def _pair_edges(split: list[Group], cm: Any, inputs_bytes: dict[str, int], t: int
                ) -> list[Edge]:
    """Column-parallel and row-parallel layers of one module (Megatron's pairs): what
    each pair of their choices moves on the tensor-parallel dimension."""
    edges = []
    by_parent: dict[str, list[Group]] = {}
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


def _is_column(g: Group) -> bool:
    return isinstance(g.piece, Shard) and g.piece.dim == 0 or "Strided" in repr(g.piece)


def _calibrate(problem: Problem, kinds: list[str], base: dict[str, Candidate]) -> Problem:
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


def own_cost(problem: Problem, choices: dict[str, int], name: str) -> tuple[float, float]:
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


def assignment(search: Search, cand: Candidate) -> tuple[dict[str, int], dict[str, int]]:
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


def layer_io(model: nn.Module, args: tuple) -> dict[str, int]:
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


def decode(search: Search, sol: Solution, pieces: dict[str, Any]) -> Candidate:
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
