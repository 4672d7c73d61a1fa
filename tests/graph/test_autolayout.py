"""The layout search's integer program against enumeration: on random small problems
(choices, the edges that link them, recompute counts, overlap, a budget) HiGHS finds the
optimum that trying every assignment finds, within the budget, deterministically; and a
budget nothing fits is refused with the least memory possible."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spmd.auto.solver import (Choice, Edge, Infeasible, Problem, Recompute, Variable,
                                      enumerate_optimum, evaluate, solve)

costs = st.floats(min_value=0.0, max_value=10.0, allow_nan=False).map(lambda v: round(v, 3))


@st.composite
def problems(draw):
    nvars = draw(st.integers(1, 4))
    variables = []
    for k in range(nvars):
        n = draw(st.integers(1, 3))
        choices = tuple(Choice(name=f"c{i}", seconds=draw(costs), bytes=draw(costs),
                               hidden=draw(costs), hides=draw(costs)) for i in range(n))
        variables.append(Variable(name=f"v{k}", choices=choices, count=draw(st.integers(1, 3))))
    edges = []
    for _ in range(draw(st.integers(0, 3))):
        if nvars < 2:
            break
        a, b = draw(st.sampled_from([(i, j) for i in range(nvars) for j in range(nvars) if i < j]))
        va, vb = variables[a], variables[b]
        pairs = {(i, j): Choice(name="", seconds=draw(costs), bytes=draw(costs),
                                hidden=draw(costs))
                 for i in range(len(va.choices)) for j in range(len(vb.choices))
                 if draw(st.booleans())}
        edges.append(Edge(a=va.name, b=vb.name, costs=pairs, count=draw(st.integers(1, 2))))
    recompute = tuple(Recompute(name=f"r{k}", count=draw(st.integers(0, 3)),
                                seconds=draw(costs), saved=draw(costs))
                      for k in range(draw(st.integers(0, 2))))
    fixed = draw(costs)
    budget = draw(st.one_of(st.just(math.inf), st.floats(0.0, 80.0).map(lambda v: round(v, 2))))
    return Problem(variables=tuple(variables), edges=tuple(edges), recompute=recompute,
                   budget=budget, fixed_bytes=fixed, fixed_seconds=draw(costs))


@settings(max_examples=150, deadline=None)
@given(problems())
def test_solver_finds_the_enumerated_optimum(problem):
    best = enumerate_optimum(problem)
    if best is None:
        with pytest.raises(Infeasible) as e:
            solve(problem)
        assert e.value.smallest > problem.budget - 1e-6
        return
    sol = solve(problem)
    assert sol.seconds == pytest.approx(best[0], rel=1e-6, abs=1e-6)
    assert sol.bytes <= problem.budget + 1e-6
    # the reported figures are the assignment's own, by the objective's formula
    assert (sol.seconds, sol.bytes) == evaluate(problem, sol.choices, sol.recompute)
    assert solve(problem).choices == sol.choices  # the same problem, the same answer


def test_ties_go_to_the_earlier_choice():
    same = tuple(Choice(name=n, seconds=1.0, bytes=1.0) for n in ("ddp", "fsdp", "zero2"))
    p = Problem(variables=(Variable(name="data", choices=same),
                           Variable(name="w", choices=same[::-1])))
    sol = solve(p)
    assert sol.names == {"data": "ddp", "w": "zero2"}


def test_budget_trades_time_for_memory_and_recompute():
    data = Variable(name="data", choices=(Choice(name="ddp", seconds=1.0, bytes=10.0),
                                          Choice(name="fsdp", seconds=1.5, bytes=4.0)))
    blocks = Recompute(name="blocks", count=4, seconds=0.1, saved=2.0)
    fixed = dict(fixed_bytes=8.0)
    assert solve(Problem(variables=(data,), recompute=(blocks,), **fixed)).names == {
        "data": "ddp"}
    # 18 B: ddp without recompute; 16 B: ddp with one block recomputed beats fsdp
    sol = solve(Problem(variables=(data,), recompute=(blocks,), budget=16.0, **fixed))
    assert (sol.names["data"], sol.recompute["blocks"]) == ("ddp", 1)
    # 10 B: ddp with every block recomputed (1.4 s) still beats fsdp with one (1.6 s)
    sol = solve(Problem(variables=(data,), recompute=(blocks,), budget=10.0, **fixed))
    assert (sol.names["data"], sol.recompute["blocks"]) == ("ddp", 4)
    # 9.5 B: ddp cannot (10 B at least); fsdp with 2 blocks recomputed
    sol = solve(Problem(variables=(data,), recompute=(blocks,), budget=9.5, **fixed))
    assert (sol.names["data"], sol.recompute["blocks"]) == ("fsdp", 2)
    with pytest.raises(Infeasible, match="least memory any choice needs is"):
        solve(Problem(variables=(data,), recompute=(blocks,), budget=3.0, **fixed))


def test_overlap_hides_communication_up_to_the_compute():
    # the reduction hides behind the compute it overlaps, never more
    v = Variable(name="data", choices=(Choice(name="a", seconds=2.0, hidden=3.0, hides=2.0),
                                       Choice(name="b", seconds=2.6, hidden=0.0)))
    sol = solve(Problem(variables=(v,)))
    assert sol.names["data"] == "b" and sol.seconds == pytest.approx(2.6)
    v2 = Variable(name="data", choices=(Choice(name="a", seconds=2.0, hidden=2.5, hides=2.0),
                                        Choice(name="b", seconds=2.6)))
    assert solve(Problem(variables=(v2,))).seconds == pytest.approx(2.5)


def test_bad_problems_are_named():
    v = Variable(name="a", choices=(Choice(name="x"),))
    with pytest.raises(ValueError, match="names 'b', not a variable"):
        solve(Problem(variables=(v,), edges=(Edge(a="a", b="b", costs={}),)))
    with pytest.raises(ValueError, match="repeat"):
        solve(Problem(variables=(v, v)))
    with pytest.raises(ValueError, match="out of range"):
        solve(Problem(variables=(v, Variable(name="b", choices=(Choice(name="y"),))),
                      edges=(Edge(a="a", b="b", costs={(1, 0): Choice(name="")}),)))
