"""Strategies as rows of ``KINDS`` (``lowering/strategy.py``): the modes are enums that
print as plans always printed them; the search's costs and the strategies it tries are
read from a row's fields, so a row the code has never seen is priced and searched from
them alone; an unknown strategy is refused by name (never given another's costs); and
FSDP2's ``reshard_after_forward=False`` and its integer are rows that the layout, the
memory view and the options read (their equality with one process:
``tests/cpu/test_fsdp.py``, ``tests/cpu/test_reshard_groups.py``)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd
from spmd.auto.candidates import Roles, kinds_for, roles_of
from spmd.auto.program import _data_costs
from spmd.lowering.options import Options
from spmd.lowering.strategy import (KINDS, STRATEGIES, Gathered, Reduced, StrategyKind,
                                    kind_name, kind_of, resolve_strategy)

SLOPE = {"all_reduce": 2e-9, "all_gather": 3e-9, "reduce_scatter": 5e-9}  # s per byte


class Linear:
    """A cost model of one latency and a slope per collective."""

    def seconds(self, kind: str, nbytes: int) -> float:
        return 1e-5 + SLOPE[kind] * nbytes


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


def _expected(row: StrategyKind, size: int, itemsize: int, gather: int, states: int):
    """A row's costs written out from its fields, independently of ``_data_costs``."""
    whole_param = not row.shards or row.gathered in (Gathered.PER_STEP, Gathered.PER_FORWARD)
    whole_grad = not row.shards or row.reduced is not Reduced.REDUCE_SCATTER
    stored = ((itemsize if whole_param else itemsize / size)
              + (itemsize if whole_grad else itemsize / size)
              + states * itemsize / (size if row.shards else 1))
    gathers = {Gathered.EACH_USE: 2, Gathered.PER_FORWARD: 1, Gathered.REGROUPED: 2,
               Gathered.PER_STEP: 1, Gathered.NEVER: 0}[row.gathered]
    reduce = SLOPE["reduce_scatter" if row.reduced is Reduced.REDUCE_SCATTER
                   else "all_reduce"] * itemsize
    return stored, gathers * SLOPE["all_gather"] * gather + reduce


def test_modes_are_enums_that_print_as_before():
    assert KINDS["fsdp"].gathered is Gathered.EACH_USE
    assert KINDS["zero1"].reduced is Reduced.ALL_REDUCE_OWN_ROWS
    assert f"{KINDS['zero2'].gathered}" == "per step" and str(Reduced.REDUCE_SCATTER) == \
        "reduce-scatter"
    assert f"{Reduced.ALL_REDUCE_OWN_ROWS}" == "all-reduce, own rows kept"
    assert STRATEGIES == ("ddp", "fsdp", "hsdp", "zero1", "zero2")


@pytest.mark.parametrize("name", list(KINDS))
def test_each_rows_costs_follow_its_fields(name):
    row = KINDS[name]
    for size, itemsize, gather in ((4, 4, 4), (8, 4, 2)):
        got = _data_costs(name, Linear(), size, itemsize, gather, 2)
        assert got == pytest.approx(_expected(row, size, itemsize, gather, 2), rel=1e-9)
    assert _data_costs(name, None, 1, 4, 4, 2) == (16, 0.0)  # one rank: whole, no traffic


def test_the_costs_of_todays_rows_are_unchanged():
    """The figures the search priced before the rows were read field by field."""
    ar, ag, rs = (SLOPE[k] * 4 for k in ("all_reduce", "all_gather", "reduce_scatter"))
    costs = {k: _data_costs(k, Linear(), 4, 4, 4, 2) for k in STRATEGIES}
    assert costs["ddp"] == pytest.approx((16, ar))
    assert costs["fsdp"] == costs["hsdp"] == pytest.approx((4, 2 * ag + rs))
    assert costs["zero2"] == pytest.approx((4 + 3, ag + rs))
    assert costs["zero1"] == pytest.approx((8 + 2, ar + ag))
    kept = _data_costs("fsdp(reshard_after_forward=False)", Linear(), 4, 4, 4, 2)
    assert kept[1] == pytest.approx(ag + rs) and kept[0] > costs["fsdp"][0]


def test_a_row_the_code_has_never_seen_is_priced_from_its_fields(monkeypatch):
    new = StrategyKind(strategy="zero1", reshard_after_forward=False, shards=True,
                       gathered=Gathered.PER_FORWARD, reduced=Reduced.ALL_REDUCE_OWN_ROWS)
    monkeypatch.setitem(KINDS, "made-up", new)
    stored, comm = _data_costs("made-up", Linear(), 4, 4, 4, 2)
    assert (stored, comm) == pytest.approx(_expected(new, 4, 4, 4, 2))
    assert comm == pytest.approx(SLOPE["all_gather"] * 4 + SLOPE["all_reduce"] * 4)


def test_an_unknown_strategy_is_refused_by_name():
    with pytest.raises(ValueError, match="'zero3'"):
        _data_costs("zero3", Linear(), 4, 4, 4, 2)  # it once got zero1's costs
    with pytest.raises(ValueError, match="'zero3'"):
        kind_of("zero3")
    with pytest.raises(ValueError, match="strategy 'zero3' is not supported"):
        resolve_strategy("zero3", spmd.Mesh.simulated(2), "here")
    with pytest.raises(ValueError, match="strategy 'zero3' is not supported"):
        spmd.parallelize(Net(), strategy="zero3", mesh=spmd.Mesh.simulated(2))


def test_the_search_tries_the_rows_marked_searched(monkeypatch):
    flat = spmd.Mesh.simulated(4)
    square = spmd.Mesh.simulated((2, 2), ("a", "b"))
    alone, with_tp = roles_of(square, ("b",))
    assert kinds_for(roles_of(flat, ())[0], flat) == ["ddp", "fsdp", "zero2", "zero1"]
    assert kinds_for(alone, square) == ["ddp", "fsdp", "hsdp", "zero2", "zero1"]
    assert kinds_for(with_tp, square) == ["ddp", "fsdp", "zero2"]
    one = spmd.Mesh.simulated(1)
    assert kinds_for(roles_of(one, ())[0], one) == ["ddp"]
    assert kinds_for(roles_of(one, ())[0], one, mixed=True) == ["fsdp"]
    assert kinds_for(roles_of(flat, ())[0], flat, mixed=True) == ["fsdp", "zero2", "zero1"]
    kept = "fsdp(reshard_after_forward=False)"
    monkeypatch.setitem(KINDS, kept, replace(KINDS[kept], searched=True))
    monkeypatch.setitem(KINDS, "zero1", replace(KINDS["zero1"], searched=False))
    assert kinds_for(roles_of(flat, ())[0], flat) == ["ddp", "fsdp", "zero2", kept]
    assert kept not in kinds_for(with_tp, square)  # not marked searched_with_tp


def test_the_search_plans_a_row_with_the_keywords_that_select_it(monkeypatch):
    kept = "fsdp(reshard_after_forward=False)"
    monkeypatch.setitem(KINDS, kept, replace(KINDS[kept], searched=True))
    x = torch.randn(8, 8)
    plan = spmd.inspect(Net(), x, mesh=spmd.Mesh.simulated(2), strategy="auto")
    (cand,) = [c for c in plan.auto.candidates if c.strategy == kept]
    assert not cand.error, cand.error
    assert cand.plan.options.reshard_after_forward is False
    assert cand.plan.options.kind_name == kept


def test_reshard_after_forward_false_selects_its_row():
    assert kind_name("fsdp") == "fsdp" and kind_name("hsdp", False) == \
        "hsdp(reshard_after_forward=False)"
    options = Options.from_kwargs("here", strategy="fsdp", reshard_after_forward=False)
    assert options.kind is KINDS["fsdp(reshard_after_forward=False)"]
    assert options.gathered is Gathered.PER_FORWARD and not options.reshards
    assert Options.from_kwargs("here", strategy="fsdp").reshards
    model = spmd.parallelize(Net(), mesh=spmd.Mesh.simulated(2), strategy="fsdp",
                             reshard_after_forward=False)
    placed = spmd.placement_of(model.fc1.weight)
    assert placed.gathered is Gathered.PER_FORWARD
    assert placed.gathered == "per forward, kept for backward"
    assert placed.reduced is Reduced.REDUCE_SCATTER
    assert model._spmd.setup.strategy.kind is KINDS["fsdp(reshard_after_forward=False)"]


def test_reshard_after_forward_an_integer_selects_its_row_and_plans_smaller_gathers():
    """FSDP2's integer: one row for every N; the backward's all-gathers priced among N
    consecutive ranks (cheaper than the forward's among all), and the 1/N each rank
    keeps from forward to backward counted in the memory view."""
    assert kind_name("fsdp", 2) == "fsdp(reshard_after_forward=N)"
    assert kind_name("hsdp", 4) == "hsdp(reshard_after_forward=N)"
    assert Options.from_kwargs("here", strategy="fsdp", reshard_after_forward=2).reshards
    x = torch.randn(8, 8)
    # (keyed by name: True == 1 as a dict key)
    plans = {str(n): spmd.inspect(Net(), x, strategy="fsdp", reshard_after_forward=n,
                                  mesh=spmd.Mesh.simulated(4, ("fsdp",)))
             for n in (True, 2, 1, 4)}

    def gathers(plan, phase):
        return [c for c in plan.collectives if c.kind == "all_gather" and c.phase == phase]

    for n in ("2", "1"):
        assert sum(c.predicted_seconds for c in gathers(plans[n], "forward")) == \
            pytest.approx(sum(c.predicted_seconds for c in gathers(plans["True"], "forward")))
    full, two, one = (sum(c.predicted_seconds for c in gathers(plans[n], "backward"))
                      for n in ("True", "2", "1"))
    assert full > two > one and one == 0.0
    # N = 4, the whole dimension: True's gathers, nothing kept
    assert [(c.phase, c.kind, c.predicted_seconds) for c in plans["4"].collectives] == \
        [(c.phase, c.kind, c.predicted_seconds) for c in plans["True"].collectives]
    assert plans["4"].memory().activations == plans["True"].memory().activations
    assert all("gathered among 2 rank(s)" in c.provenance.reason
               for c in gathers(plans["2"], "backward"))
    # fc2's weight is saved for backward: its shard (True), and 2 or 4 shards more kept
    saved = {n: plan.memory().activations for n, plan in plans.items()}
    assert saved["True"] < saved["2"] < saved["1"]
    assert saved["1"] - saved["True"] == 2 * (saved["2"] - saved["True"])
    model = spmd.parallelize(Net(), mesh=spmd.Mesh.simulated(4), strategy="fsdp",
                             reshard_after_forward=2)
    assert spmd.placement_of(model.fc1.weight).gathered is Gathered.REGROUPED
    assert model._spmd.setup.strategy.reshard_to == 2


def test_an_hsdp_integer_splits_the_sharding_dimension_only():
    plan = spmd.inspect(Net(), torch.randn(8, 8), strategy="hsdp", reshard_after_forward=2,
                        mesh=spmd.Mesh.simulated((2, 4), ("dp", "fsdp")))
    backward = [c for c in plan.collectives if c.kind == "all_gather" and c.phase == "backward"]
    assert backward and all("among 2 rank(s)" in c.provenance.reason for c in backward)


@pytest.mark.parametrize("n, exc, match", [
    (3, ValueError, "reshard_after_forward=3 must divide the 4 ranks of the sharding "
                    "dimension 'dp'"),
    (8, ValueError, "reshard_after_forward=8 must divide"),
    (0, ValueError, "at least 1"),
    (-2, ValueError, "at least 1"),
    (2.0, TypeError, "must be a bool or an int, got float"),
])
def test_a_bad_integer_is_refused_before_anything_runs(n, exc, match):
    with pytest.raises(exc, match=match):
        spmd.parallelize(Net(), strategy="fsdp", reshard_after_forward=n,
                         mesh=spmd.Mesh.simulated(4))
    with pytest.raises(ValueError, match="applies to the sharded strategies"):
        spmd.parallelize(Net(), strategy="zero2", reshard_after_forward=2,
                         mesh=spmd.Mesh.simulated(4))
