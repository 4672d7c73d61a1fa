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
3. **The integer program** (:mod:`spmd.auto.solver`) per role assignment: the
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
import time
from dataclasses import dataclass, replace
from typing import Any

import torch.nn as nn

from spmd.auto.candidates import (SEARCHED, Candidate, Roles, checkpoint_modules, gib,
                                  kinds_for, parse_budget, plan_candidate, roles_of)
from spmd.auto.program import Search, assignment, build_program, decode, layer_io, own_cost
from spmd.auto.solver import Infeasible, evaluate, solve
from spmd.lowering.options import Options
from spmd.lowering.placements import Replicate, divides
from spmd.lowering.strategy import kind_of
from spmd.runtime.mesh import Mesh

__all__ = ["AutoPlan", "Candidate", "Roles", "plan_auto", "parse_budget", "checkpoint_modules",
           "SEARCHED"]

_ROUNDS = 3


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
    searches: list[Search]
    solve_seconds: float
    seconds: float
    optimizer: str
    experts_forced: bool = False  # placements held spmd.ep.experts(): only layouts with it

    def admits(self, c: Candidate) -> bool:
        """Whether ``c`` fits the budget and is a layout the caller allowed."""
        return c.fits(self.budget) and (not self.experts_forced or c.experts is not None)

    def summary(self) -> str:
        lines = [f"strategy='auto' on {self.mesh} under a budget of {gib(self.budget)} "
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
        choices, counts = assignment(search, self.chosen)
        var = next(v for v in p.variables if v.name == group.pattern)
        here = var.choices[choices[var.name]].name
        lines = [f"{name}: group {group.pattern} ({len(group.names)} parameter(s) of "
                 f"{group.numel:,} elements, one choice for the identical blocks); chosen: "
                 f"data strategy {self.chosen.strategy}" + (
                     f", on the tensor-parallel dimension {self.chosen.roles.tp!r} {here}"
                     if self.chosen.roles.tp else "") + f" ({self.chosen.source})"]
        own_s, own_b = own_cost(p, choices, var.name)
        lines.append(f"  its share of the step: {own_s * 1e3:.3f} ms of compute and "
                     f"communication (overlappable included), {gib(own_b)} per rank")
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
                    c.recompute) + ((c.experts,) if c.experts is not None else ()))
        return hashlib.sha256(key.encode()).hexdigest()[:16]


def _runner_up(what: str, seconds: float, nbytes: float, fits: bool) -> str:
    return (f"  with {what} instead: predicted step {seconds * 1e3:+.3f} ms, peak "
            f"{nbytes / 2**20:+.1f} MiB" + ("" if fits else " (over the budget)"))


def plan_auto(model: nn.Module, args: tuple, *, mesh: Mesh, memory_budget: Any = None,
              placements: Any = None, search_roles: bool = True, optimizer: str = "adamw",
              where: str = "spmd.inspect", **options: Options) -> AutoPlan:
    """Search the layout of ``model`` on ``mesh`` (see the module doc); the
    :class:`AutoPlan`, whose ``chosen.plan`` is the chosen layout's
    :class:`~spmd.plan.plan.Plan`. ``args``: one rank's batch when every dimension is data."""
    from spmd.ep import ExpertParallel, find_experts, split_experts
    from spmd.lowering.annotate import PlanningError
    from spmd.tp import megatron, tp_dims_of

    started = time.perf_counter()
    # expert parallelism: forced where placements hold spmd.ep.experts(), else tried
    # beside each layout where the model has experts modules
    placements, forced = split_experts(placements)
    if forced is not None and forced.tensor_parallel is not None:
        raise NotImplementedError(f"{where}: strategy='auto' with expert tensor parallelism "
                                  f"(tensor_parallel=) is not searched yet; pass "
                                  f"spmd.ep.experts() without it")
    experts = forced if forced is not None else (
        ExpertParallel() if find_experts(model) else None)
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
        from spmd.state.resolve import resolve_placements

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
    roles_list = roles_of(mesh, candidates_tp)
    if named:  # on a live mesh: the named dimension is tensor-parallel, the rest data
        roles_list = [r for r in roles_list if r.tp == named[0]]
    io = layer_io(copy.deepcopy(model), args)
    candidates: list[Candidate] = []
    searches: list[Search] = []
    solve_seconds = 0.0
    all_data = roles_of(mesh, ())[0]
    # the reference: the model replicated (every dimension data): its compute and
    # activations price the replicated choices; with param_dtype= (which ddp does not
    # apply) fsdp, whose compute runs in that dtype
    mixed = options.get("param_dtype") is not None
    ref_kind = "fsdp" if mixed else "ddp"
    ref = plan_candidate(model, args, mesh, Candidate(
        label=f"{ref_kind} (reference)", strategy=ref_kind, roles=all_data), options,
        optimizer)
    if ref.error:
        raise PlanningError(f"{where}: strategy='auto' could not plan {type(model).__name__} "
                            f"replicated to price it: {ref.error}")
    for roles in roles_list:
        base: dict[str, Candidate] = {"@data": ref}
        for kind in kinds_for(roles, mesh, mixed):
            label = kind if roles.tp is None else f"{kind} x megatron tp on {roles.tp!r}"
            if roles.tp is None and kind == ref_kind and not named and ref.roles == roles:
                cand = replace(ref, label=kind)
                if ref.plan is not None and ref.plan.fallbacks:  # (the reference may be)
                    cand.error = (f"left to the eager safety net "
                                  f"({ref.plan.fallbacks[0].reason[:120]}), which the "
                                  f"prediction would not price")
            else:
                cand = plan_candidate(model, args, mesh, Candidate(
                    label=label, strategy=kind, roles=roles,
                    pieces=dict(pieces) if roles.tp else {}), options, optimizer, ref)
            base[kind] = cand
            if roles.tp is not None or not named:
                candidates.append(cand)
                if experts is not None:  # the same layout, its experts split by index
                    candidates.append(plan_candidate(model, args, mesh, Candidate(
                        label=f"{label} x ep", strategy=kind, roles=roles,
                        pieces=dict(pieces) if roles.tp else {}, experts=experts),
                        options, optimizer, ref))
        if not any(not c.error for k, c in base.items() if k != "@data"):
            continue
        search = build_program(model, roles, mesh, base, pieces, budget, optimizer, options, io)
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
            cand = decode(search, sol, pieces)
            same = next((c for c in candidates if c.strategy == cand.strategy
                         and c.roles == cand.roles and c.pieces == cand.pieces
                         and c.recompute == cand.recompute and not c.error), None)
            if same is not None:
                break
            cand = plan_candidate(model, args, mesh, cand, options, optimizer, ref)
            candidates.append(cand)
            if cand.error or cand.peak <= budget:
                break
            target -= cand.peak - budget  # its real peak overshot: ask for that much less
    fitting = [c for c in candidates if c.fits(budget)
               and (forced is None or c.experts is not None)]
    if not fitting:
        planned = [c for c in candidates if not c.error]
        least = min(planned, key=lambda c: c.peak, default=None)
        hint = _what_would_fit(least, budget, optimizer, mesh)
        table = "\n".join(c.row(budget, False) for c in candidates)
        raise PlanningError(
            f"{where}: no layout of {type(model).__name__} on {mesh} fits the memory budget of "
            f"{gib(budget)}" + (f"; the least found is {least.label} at {gib(least.peak)}"
                                 if least else "") +
            f" (recomputation included where it helps). What would fit: {hint}.\n{table}")
    # fastest that fits; ties to the hand-written one, then the earlier
    chosen = min(fitting, key=lambda c: (round(c.seconds, 12), c.source != "hand-written"))
    return AutoPlan(budget=budget, mesh=mesh, chosen=chosen, candidates=candidates,
                    searches=searches, solve_seconds=solve_seconds,
                    seconds=time.perf_counter() - started, optimizer=optimizer,
                    experts_forced=forced is not None)


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
    if kind_of(least.strategy).shards and budget > rest:
        ranks = math.ceil(state * data / (budget - rest))
        hints.append(f"about {ranks} data ranks instead of {data} (the sharded state "
                     f"divides over them)")
    else:
        hints.append("more ranks along a data dimension with fsdp")
    if view.activations and view.peak - view.activations < budget:
        share = (budget - (view.peak - view.activations)) / view.activations
        hints.append(f"at most {share:.0%} of this batch per rank (activations "
                     f"{gib(view.activations)})")
    else:
        hints.append("a smaller batch per rank")
    hints.append("recomputing more of the model (blocks already recomputed: "
                 f"{len(least.recompute)})")
    return "; ".join(hints)
