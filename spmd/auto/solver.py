"""The layout search as an integer program: choices, the costs that link them, a memory
budget; solved by HiGHS (``scipy.optimize.milp``), as GSPMD's auto-sharding and Alpa
solve theirs.

A :class:`Problem` is what ``spmd.auto.search`` builds from a model:

- :class:`Variable` s, each taking exactly one of its :class:`Choice` s: the strategy
  along the data dimensions (ddp, fsdp, zero1, zero2, hsdp), each parameter group's
  placement on a tensor-parallel dimension (its piece or replicated). Identical blocks
  share one variable (``count`` blocks), so the program does not grow with depth.
- :class:`Edge` s between two variables: what a pair of choices costs together beyond
  their own costs (a column-parallel layer feeding a replicated one gathers its output;
  a parameter's gradient reduction depends on both the data strategy and its piece).
- :class:`Recompute` items: how many of ``count`` identical blocks are recomputed in
  backward (an integer): each costs its forward again and saves its activations.

Every cost is a pair (seconds, bytes). The objective is the step's predicted seconds:
the compute and the communication that cannot overlap, the recompute, plus the
communication that can overlap (``hidden``) beyond the compute that hides it
(``hides``): ``max(0, sum(hidden) - sum(hides))``, linear with one continuous variable.
The constraint: the bytes (the persistent state, the activations kept, edge bytes, minus
the recomputed blocks' savings) within the budget.

Ties are broken deterministically: after the solve, each variable in order takes its
earliest choice that keeps the optimum's seconds and the budget, and each recompute
count its smallest; so every rank that builds the same problem gets the same answer
(``spmd.auto.search`` still compares a fingerprint across ranks).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

__all__ = ["Choice", "Variable", "Edge", "Recompute", "Problem", "Solution", "solve",
           "evaluate", "enumerate_optimum", "Infeasible"]

_TIE = 1e-9  # relative: two assignments whose seconds differ by less are tied


class Infeasible(ValueError):
    """No assignment of the problem fits its budget; ``smallest`` is the least memory
    any assignment needs (recompute everything allowed)."""

    def __init__(self, message: str, smallest: float) -> None:
        super().__init__(message)
        self.smallest = smallest


@dataclass(frozen=True, kw_only=True, slots=True)
class Choice:
    """One option of a variable.

    Attributes:
        name: what it is, as the plan shows it (``"fsdp"``, ``"Shard(0)"``).
        seconds: step time it adds that no communication hides behind (compute, exposed
            communication).
        bytes: memory it adds per rank.
        hidden: communication seconds that can overlap compute (gradient reductions,
            prefetched gathers).
        hides: compute seconds that such communication can overlap.
    """

    name: str
    seconds: float = 0.0
    bytes: float = 0.0
    hidden: float = 0.0
    hides: float = 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Variable:
    """One decision: exactly one of ``choices``; its costs count ``count`` times (identical
    blocks tied to one choice)."""

    name: str
    choices: tuple[Choice, ...]
    count: int = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class Edge:
    """The joint cost of two variables' choices: ``costs[(i, j)]`` is the :class:`Choice`
    (its seconds, bytes, hidden, hides) added when ``a`` takes choice i and ``b`` choice
    j; missing pairs cost nothing. It counts ``count`` times."""

    a: str
    b: str
    costs: dict[tuple[int, int], Choice]
    count: int = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class Recompute:
    """Up to ``count`` identical blocks recomputed in backward: each costs ``seconds`` and
    saves ``saved`` bytes."""

    name: str
    count: int
    seconds: float
    saved: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Problem:
    variables: tuple[Variable, ...]
    edges: tuple[Edge, ...] = ()
    recompute: tuple[Recompute, ...] = ()
    budget: float = math.inf
    fixed_seconds: float = 0.0  # what no choice changes (other compute)
    fixed_bytes: float = 0.0

    def check(self) -> None:
        names = [v.name for v in self.variables]
        if len(set(names)) != len(names):
            raise ValueError(f"autolayout: variable names repeat: {names}")
        by = {v.name: v for v in self.variables}
        for v in self.variables:
            if not v.choices:
                raise ValueError(f"autolayout: variable {v.name!r} has no choice")
            if v.count < 1:
                raise ValueError(f"autolayout: variable {v.name!r} counts {v.count} times")
        for e in self.edges:
            for end in (e.a, e.b):
                if end not in by:
                    raise ValueError(f"autolayout: edge {e.a!r}-{e.b!r} names {end!r}, not a "
                                     f"variable")
            for i, j in e.costs:
                if not (0 <= i < len(by[e.a].choices) and 0 <= j < len(by[e.b].choices)):
                    raise ValueError(f"autolayout: edge {e.a!r}-{e.b!r} prices choices "
                                     f"({i}, {j}), out of range")
        for r in self.recompute:
            if r.count < 0:
                raise ValueError(f"autolayout: recompute {r.name!r} of {r.count} blocks")


@dataclass(frozen=True, kw_only=True, slots=True)
class Solution:
    """The optimum: each variable's choice index, each recompute item's block count, the
    predicted seconds (the objective) and bytes, and the solver's own time."""

    choices: dict[str, int]
    recompute: dict[str, int]
    seconds: float
    bytes: float
    solve_seconds: float = 0.0
    status: str = "optimal"
    variables: int = 0
    constraints: int = 0
    names: dict[str, str] = field(default_factory=dict)  # variable -> chosen choice's name


def evaluate(problem: Problem, choices: dict[str, int], recompute: dict[str, int]
             ) -> tuple[float, float]:
    """(seconds, bytes) of one assignment, by the objective's own formula."""
    by = {v.name: v for v in problem.variables}
    seconds, bytes_, hidden, hides = problem.fixed_seconds, problem.fixed_bytes, 0.0, 0.0

    def add(c: Choice, n: int) -> None:
        nonlocal seconds, bytes_, hidden, hides
        seconds += n * c.seconds
        bytes_ += n * c.bytes
        hidden += n * c.hidden
        hides += n * c.hides

    for name, v in by.items():
        add(v.choices[choices[name]], v.count)
    for e in problem.edges:
        c = e.costs.get((choices[e.a], choices[e.b]))
        if c is not None:
            add(c, e.count)
    for r in problem.recompute:
        k = recompute.get(r.name, 0)
        seconds += k * r.seconds
        bytes_ -= k * r.saved
    return seconds + max(0.0, hidden - hides), bytes_


def enumerate_optimum(problem: Problem) -> tuple[float, dict[str, int], dict[str, int]] | None:
    """The optimum by trying every assignment (small problems: the solver's test); None
    when none fits."""
    best = None
    names = [v.name for v in problem.variables]
    for pick in itertools.product(*(range(len(v.choices)) for v in problem.variables)):
        choices = dict(zip(names, pick))
        for counts in itertools.product(*(range(r.count + 1) for r in problem.recompute)):
            rc = {r.name: k for r, k in zip(problem.recompute, counts)}
            s, b = evaluate(problem, choices, rc)
            if b <= problem.budget * (1 + 1e-12) + 1e-9 and (best is None or s < best[0] - 1e-12):
                best = (s, choices, rc)
    return best


def solve(problem: Problem, time_limit: float = 60.0) -> Solution:
    """The assignment of least predicted seconds within the budget (HiGHS, exact);
    :class:`Infeasible` naming the least memory possible when none fits."""
    import time

    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp

    problem.check()
    start = time.perf_counter()
    cols: list[tuple[str, object]] = []  # what each column is
    obj: list[float] = []
    mem: list[float] = []
    integer: list[int] = []
    upper: list[float] = []
    hidden_row: list[float] = []  # sum(hidden) - sum(hides) per column

    def column(what: object, seconds: float, bytes_: float, hidden: float, integral: bool,
               ub: float) -> int:
        cols.append(("", what))
        obj.append(seconds)
        mem.append(bytes_)
        hidden_row.append(hidden)
        integer.append(1 if integral else 0)
        upper.append(ub)
        return len(cols) - 1

    x: dict[tuple[str, int], int] = {}
    for v in problem.variables:
        for i, c in enumerate(v.choices):
            x[(v.name, i)] = column((v.name, i), v.count * c.seconds,
                                    v.count * c.bytes, v.count * (c.hidden - c.hides), True, 1)
    y: dict[tuple[int, int, int], int] = {}
    for k, e in enumerate(problem.edges):
        for (i, j), c in sorted(e.costs.items()):
            y[(k, i, j)] = column((k, i, j), e.count * c.seconds, e.count * c.bytes,
                                  e.count * (c.hidden - c.hides), False, 1)
    r: dict[str, int] = {}
    for item in problem.recompute:
        r[item.name] = column(item.name, item.seconds, -item.saved, 0.0, True, item.count)
    column("exposed", 1.0, 0.0, -1.0, False, np.inf)  # >= hidden - hides

    n = len(cols)
    rows: list[np.ndarray] = []
    lo: list[float] = []
    hi: list[float] = []

    def row(coef: dict[int, float], low: float, high: float) -> None:
        a = np.zeros(n)
        for c, val in coef.items():
            a[c] += val
        rows.append(a)
        lo.append(low)
        hi.append(high)

    for v in problem.variables:  # exactly one choice
        row({x[(v.name, i)]: 1.0 for i in range(len(v.choices))}, 1.0, 1.0)
    for k, e in enumerate(problem.edges):
        # y[k, i, j] = x[a, i] * x[b, j] on the pairs priced: y <= x_a, y <= x_b,
        # y >= x_a + x_b - 1 (y is continuous in [0, 1]; the x are binary)
        for (i, j) in e.costs:
            col = y[(k, i, j)]
            row({col: 1.0, x[(e.a, i)]: -1.0}, -np.inf, 0.0)
            row({col: 1.0, x[(e.b, j)]: -1.0}, -np.inf, 0.0)
            row({col: 1.0, x[(e.a, i)]: -1.0, x[(e.b, j)]: -1.0}, -1.0, np.inf)
    # exposed >= sum(hidden - hides)  <=>  sum(hidden - hides) - exposed <= 0
    row({c: h for c, h in enumerate(hidden_row) if h}, -np.inf, 0.0)
    if math.isfinite(problem.budget):
        row({c: m for c, m in enumerate(mem) if m}, -np.inf, problem.budget - problem.fixed_bytes)
    constraints = LinearConstraint(np.vstack(rows), np.array(lo), np.array(hi))
    result = milp(c=np.array(obj), constraints=constraints, integrality=np.array(integer),
                  bounds=Bounds(np.zeros(n), np.array(upper)),
                  options={"time_limit": time_limit, "mip_rel_gap": 0.0})
    elapsed = time.perf_counter() - start
    if result.x is None:
        smallest = _least_memory(problem)
        raise Infeasible(f"no layout fits the budget of {_gib(problem.budget)}: the least "
                         f"memory any choice needs is {_gib(smallest)}", smallest)
    sol = result.x
    choices = {v.name: max(range(len(v.choices)), key=lambda i: sol[x[(v.name, i)]])
               for v in problem.variables}
    counts = {item.name: int(round(sol[r[item.name]])) for item in problem.recompute}
    choices, counts = _earliest(problem, choices, counts)
    seconds, bytes_ = evaluate(problem, choices, counts)
    return Solution(choices=choices, recompute=counts, seconds=seconds, bytes=bytes_,
                    solve_seconds=elapsed, status="optimal" if result.status == 0 else
                    result.message, variables=n, constraints=len(rows),
                    names={v.name: v.choices[choices[v.name]].name for v in problem.variables})


def _earliest(problem: Problem, choices: dict[str, int], counts: dict[str, int]
              ) -> tuple[dict[str, int], dict[str, int]]:
    """The optimum's ties broken the same way on every rank: each variable in order its
    earliest choice, each recompute item its fewest blocks, that keep the seconds (to
    ``_TIE``) and the budget."""
    best, _ = evaluate(problem, choices, counts)
    tol = _TIE * max(abs(best), 1e-30) + 1e-15
    budget = problem.budget * (1 + 1e-12) + 1e-9
    for v in problem.variables:
        for i in range(choices[v.name]):
            trial = {**choices, v.name: i}
            s, b = evaluate(problem, trial, counts)
            if s <= best + tol and b <= budget:
                choices = trial
                break
    for item in problem.recompute:
        for k in range(counts[item.name]):
            trial = {**counts, item.name: k}
            s, b = evaluate(problem, choices, trial)
            if s <= best + tol and b <= budget:
                counts = trial
                break
    return choices, counts


def _least_memory(problem: Problem) -> float:
    """The least bytes any assignment takes (the budget relaxed, memory minimised)."""
    relaxed = Problem(
        variables=tuple(Variable(name=v.name, count=v.count, choices=tuple(
            Choice(name=c.name, seconds=c.bytes) for c in v.choices)) for v in problem.variables),
        edges=tuple(Edge(a=e.a, b=e.b, count=e.count, costs={
            k: Choice(name="", seconds=c.bytes) for k, c in e.costs.items()})
            for e in problem.edges),
        recompute=tuple(Recompute(name=r.name, count=r.count, seconds=-r.saved, saved=0.0)
                        for r in problem.recompute),
        fixed_seconds=problem.fixed_bytes)
    return solve(relaxed).seconds


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if math.isfinite(n) else "no limit"
