"""The redistribution table: every (from, to) pair of placements maps to the step the
design names, and every realisable step, run on every rank's local tensors, turns a
tensor placed one way into the same tensor placed the other way, on a 1-D and a 2-D
simulated mesh (tests/cpu/test_redistribute_ops.py runs the same steps through their ops
over Gloo)."""

from __future__ import annotations

import itertools

import pytest
import torch

import spmd
from spmd.lowering.cost_model import CostModel
from spmd.lowering.placements import (Partial, Replicate, Shard, Sharding, StridedShard,
                                      Varying)
from spmd.lowering.redistribute import (from_locals, plan_redistribution, redistribution,
                                        redistribution_path, simulate, to_locals)

PLACEMENTS = [Replicate(), Shard(0), Shard(1), Partial("sum"), Partial("avg")]
EXPECTED = {  # the design's table, written out
    ("Partial", "Replicate"): "all_reduce",
    ("Partial", "Shard"): "reduce_scatter",
    ("Shard", "Replicate"): "all_gather",
    ("Replicate", "Shard"): "slice",
    ("Shard", "Shard"): "all_to_all",
    ("Partial", "Partial"): "scale",
}


def kind_of(src, dst) -> str:
    if src == dst:
        return "none"
    if isinstance(src, Replicate) and isinstance(dst, Partial):
        return "zero" if dst.reduce_op == "sum" else "none"
    return EXPECTED.get((type(src).__name__, type(dst).__name__), "refused")


def exact(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("src, dst", list(itertools.product(PLACEMENTS, PLACEMENTS)),
                         ids=lambda p: repr(p))
@pytest.mark.parametrize("ranks", [2, 3])
def test_every_pair_on_one_dimension_round_trips(src, dst, ranks):
    want = kind_of(src, dst)
    if want == "refused":
        with pytest.raises(ValueError, match="cannot redistribute"):
            redistribution(src, dst)
        return
    step = redistribution(src, dst)
    assert step.kind == want
    value = torch.randn(6, 12, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    after = simulate(step, to_locals(value, src, ranks))
    assert exact(from_locals(after, dst), value)


def test_varying_values_have_no_global_tensor_to_move():
    assert redistribution(Varying(), Varying()).kind == "none"
    assert redistribution(Replicate(), Varying()).kind == "none"
    with pytest.raises(ValueError, match="Varying"):
        redistribution(Varying(), Replicate())


def _locals_2d(value, sharding, shape):
    """Rank (i, j)'s tensor: dimension 0's placement applied, then dimension 1's."""
    rows = to_locals(value, sharding.placements[0], shape[0])
    return [[piece for piece in to_locals(r, sharding.placements[1], shape[1])] for r in rows]


def _global_2d(grid, sharding):
    rows = [from_locals(row, sharding.placements[1]) for row in grid]
    return from_locals(rows, sharding.placements[0])


def _run_2d(steps, grid, names):
    for step in steps:
        if step.mesh_dim == names[1]:  # along each row
            grid = [simulate(step, row) for row in grid]
        else:  # along each column
            columns = [simulate(step, [row[j] for row in grid]) for j in range(len(grid[0]))]
            grid = [[columns[j][i] for j in range(len(columns))] for i in range(len(grid))]
    return grid


@pytest.mark.parametrize("src, dst", [
    ((Partial("avg"), Replicate()), (Replicate(), Replicate())),  # data parallel gradients
    ((Shard(0), Shard(1)), (Replicate(), Replicate())),            # gather both
    ((Replicate(), Partial("sum")), (Shard(0), Replicate())),      # TP row-parallel output
    ((Partial("sum"), Shard(1)), (Shard(0), Shard(1))),            # reduce-scatter one dim
    ((Replicate(), Replicate()), (Shard(1), Shard(0))),            # slice both
    ((Shard(0), Replicate()), (Shard(1), Replicate())),            # all-to-all on one dim
], ids=str)
def test_shardings_round_trip_on_a_2d_mesh(src, dst):
    names = ("dp", "tp")
    mesh = spmd.Mesh.simulated((2, 3), dim_names=names)
    a, b = Sharding(mesh=mesh, placements=src), Sharding(mesh=mesh, placements=dst)
    steps = plan_redistribution(a, b)
    assert [s.mesh_dim for s in steps] == [n for n, x, y in zip(names, src, dst)
                                           if kind_of(x, y) != "none"]
    value = torch.randn(12, 18, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grid = _run_2d(steps, _locals_2d(value, a, mesh.shape), names)
    assert exact(_global_2d(grid, b), value)


def test_cost_comes_from_the_cost_model_and_local_steps_are_free():
    model = CostModel.default("gloo", 2)
    nbytes = 1 << 20
    assert redistribution(Partial("avg"), Replicate()).seconds(nbytes, model, 8) == \
        pytest.approx(CostModel.default("gloo", 8).seconds("all_reduce", nbytes))
    assert redistribution(Shard(0), Replicate()).seconds(nbytes, model, 8) == \
        pytest.approx(CostModel.default("gloo", 8).seconds("all_gather", nbytes))
    assert redistribution(Shard(0), Shard(1)).seconds(nbytes, model, 8) == \
        pytest.approx(CostModel.default("gloo", 8).seconds("all_to_all", nbytes // 8))
    for src, dst in [(Replicate(), Shard(0)), (Partial("sum"), Partial("avg"))]:
        assert redistribution(src, dst).seconds(nbytes, model, 8) == 0.0
    assert redistribution(Partial("sum"), Replicate()).seconds(nbytes, model, 1) == 0.0


def test_a_strided_shard_no_step_reaches_goes_through_replicate():
    """StridedShard <-> Shard has no one step: gathered, then placed; a pair one step
    reaches stays one step, and a pair nothing reaches still raises."""
    assert [s.kind for s in redistribution_path(StridedShard(0, 2), Shard(0))] == [
        "all_gather", "slice"]
    assert [s.kind for s in redistribution_path(Shard(1), StridedShard(0, 2))] == [
        "all_gather", "slice"]
    assert [s.kind for s in redistribution_path(StridedShard(0, 2), Replicate())] == [
        "all_gather"]
    assert [s.kind for s in redistribution_path(Shard(0), Shard(1))] == ["all_to_all"]
    with pytest.raises(ValueError, match="Varying"):
        redistribution_path(Varying(), Shard(0))
