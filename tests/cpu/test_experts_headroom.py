"""Dropless expert layers whose received rows are bounded by a headroom
(``spmd.ep.experts(headroom=)``, ``spmd.ep.DEFAULT_HEADROOM``) on real ranks over Gloo,
in float64: routing that overflows the bound on some rank makes every rank run the
forward again with the bound grown, equal to one process on the whole batch, the random
state restored; the default's cases, planned; the arguments refused by name."""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F

import spmd
from spmd import runtime as dist

from ..moe import MoELM
from .test_experts import ROWS, _train, assert_like_one_process, train_parallel


def test_a_headroom_is_a_number_of_at_least_one_for_dropless_layers_outside_pipelines():
    for bad in (0.5, 0, "2", True):
        with pytest.raises(ValueError, match="headroom must be a number >= 1"):
            spmd.ep.experts(headroom=bad)
    with pytest.raises(ValueError, match="capacity_factor=1.0 already bounds them"):
        spmd.ep.experts(headroom=2, capacity_factor=1.0)
    with pytest.raises(NotImplementedError, match=r"headroom=1.5\) in a pipeline"):
        spmd.parallelize(MoELM(), mesh=spmd.Mesh.simulated((2, 2), dim_names=("pp", "ep")),
                         placements=spmd.ep.experts(headroom=1.5),
                         pipeline=spmd.pp.schedule("gpipe", microbatches=2))


def test_the_default_headroom_is_two_and_every_pair_in_a_pipeline():
    """Dropless by default with the rows bounded at twice what even routing brings
    (``spmd.ep.DEFAULT_HEADROOM``) where that is below every pair of every rank; every
    pair on 2 expert ranks (the same bound), with ``headroom=math.inf``, and in a
    pipeline."""
    import math

    def headroom(mesh, preset, **kw):
        model = MoELM()
        spmd.parallelize(model, mesh=mesh, placements=preset, **kw)
        return {m._spmd_ep.headroom for m in model.modules() if hasattr(m, "_spmd_ep")}

    assert spmd.ep.DEFAULT_HEADROOM == 2.0
    assert headroom(spmd.Mesh.simulated(4), spmd.ep.experts()) == {2000}  # thousandths
    assert headroom(spmd.Mesh.simulated(4), spmd.ep.experts(headroom=1.5)) == {1500}
    assert headroom(spmd.Mesh.simulated(4), spmd.ep.experts(headroom=math.inf)) == {None}
    assert headroom(spmd.Mesh.simulated(2), spmd.ep.experts()) == {None}
    assert headroom(spmd.Mesh.simulated(4), spmd.ep.experts(capacity_factor=1.0)) == {None}
    assert headroom(spmd.Mesh.simulated((2, 4), dim_names=("pp", "ep")), spmd.ep.experts(),
                    pipeline=spmd.pp.schedule("gpipe", microbatches=2)) == {None}


def _dropout_before_routing(model):
    """``model`` with dropout on its token embeddings: a forward run again must draw the
    same masks."""
    model.embed.register_forward_hook(lambda m, i, out: F.dropout(out, 0.3, m.training))
    return model


def headroom_job(rank: int, base) -> dict:
    from ..zoo import data_index

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=90))
    out = {}
    for strategy, sizes in (("ddp", [2, 2, 2]), ("fsdp", ROWS)):
        model = spmd.parallelize(copy.deepcopy(base), mesh=spmd.Mesh((2,), dim_names=("ep",)),
                                 strategy=strategy, placements=spmd.ep.experts(headroom=1.0))
        index, count = data_index(model._spmd.setup.strategy.mesh, model._spmd.setup.strategy)
        got = _train(model, index, count, sizes=sizes)
        got["index"], got["plan"] = index, str(spmd.inspect(model))
        got["grown"] = {p: (spec.headroom, spec.grown) for p, spec in model._spmd.experts.items()}
        out[strategy] = got
    dropped = {}  # the same seed, with and without a headroom (which makes forwards rerun)
    for headroom in (None, 1.0):
        torch.manual_seed(7 + rank)
        model = spmd.parallelize(_dropout_before_routing(copy.deepcopy(base)),
                                 mesh=spmd.Mesh((2,), dim_names=("ep",)),
                                 placements=spmd.ep.experts(headroom=headroom))
        dropped[headroom] = _train(model, rank, 2, sizes=[2, 2])["state"]
    out["dropout"] = dropped
    dist.destroy_process_group()
    return out


def test_a_headroom_bounds_the_received_rows_and_grows_where_a_forward_overflows():
    """``spmd.ep.experts(headroom=1.0)``: each rank's experts receive at most ``T·k``
    rows (what even routing brings) instead of ``2·T·k``; routing so skewed that every
    pair goes to one rank overflows that bound, every rank learns it, and the forward
    runs again with the layer's headroom grown (a recompiled graph; the eager path
    with the batch size changing under fsdp). Still dropless: equal to one process in
    float64. A forward run again draws the same dropout masks as one never stopped."""
    torch.manual_seed(0)
    base = MoELM(skew=4.0).double()
    runs = dist.spawn(headroom_job, args=(base,), nprocs=2, start_method="forkserver",
                      timeout=115)
    for strategy, sizes in (("ddp", [2, 2, 2]), ("fsdp", ROWS)):
        want = _train(copy.deepcopy(base), None, 2, sizes=sizes)
        for rank, out in enumerate(runs):
            got = out[strategy]
            assert_like_one_process(got, want, rank)
            # each layer overflowed once and grew to every pair of both ranks
            assert set(got["grown"].values()) == {(2.0, 1)}, got["grown"]
            plan = got["plan"]
            assert "grown where a forward overflowed: 2 time(s)" in plan, plan
            assert "recompiled: the expert headroom of blocks.0.moe.experts grew to 2" in plan
    for rank, out in enumerate(runs):
        whole, bounded = out["dropout"][None], out["dropout"][1.0]
        for key, value in whole.items():
            assert torch.equal(bounded[key], value), f"rank {rank}: {key} differs"


def default_headroom_job(rank: int, base) -> dict:
    model, out = train_parallel(base, (4,), ("ep",), "ddp", spmd.ep.experts(), [1, 1, 1])
    out["grown"] = {p: (spec.headroom, spec.grown) for p, spec in model._spmd.experts.items()}
    dist.destroy_process_group()
    return out


def test_the_default_headroom_on_four_expert_ranks_grows_where_routing_is_skewed():
    """4 expert ranks, the default headroom of 2 (below every pair of every rank, 4):
    routing so skewed that one rank's experts receive every pair overflows it; the
    forward runs again with the bound grown to every pair, equal to one process."""
    torch.manual_seed(0)
    base = MoELM(skew=4.0).double()
    want = _train(copy.deepcopy(base), None, 4, sizes=[1, 1, 1])
    runs = dist.spawn(default_headroom_job, args=(base,), nprocs=4, start_method="forkserver",
                      timeout=115)
    for rank, got in enumerate(runs):
        assert_like_one_process(got, want, rank)
        assert set(got["grown"].values()) == {(4.0, 1)}, got["grown"]


def accumulating_job(rank: int, base) -> dict:
    from .test_experts_compose import _train_accumulating

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=90))
    model = spmd.parallelize(copy.deepcopy(base), mesh=spmd.Mesh((2,), dim_names=("ep",)),
                             placements=spmd.ep.experts(headroom=1.0))
    out = _train_accumulating(model, rank, 2)
    out["index"] = rank
    out["grown"] = sum(spec.grown for spec in model._spmd.experts.values())
    dist.destroy_process_group()
    return out


def test_a_forward_run_again_inside_accumulation_and_a_frozen_step_trains_like_one_process():
    """The loop users write around an overflowing headroom: two microbatches accumulated
    per step (the first one's gradients already there when the second's forward runs
    again), the routers frozen for a step and trained again, clipping, an evaluation
    forward; equal to one process accumulating the same microbatches."""
    from .test_experts_compose import _train_accumulating

    torch.manual_seed(0)
    base = MoELM(skew=4.0).double()
    want = _train_accumulating(copy.deepcopy(base), None, 2)
    runs = dist.spawn(accumulating_job, args=(base,), nprocs=2, start_method="forkserver",
                      timeout=115)
    for rank, got in enumerate(runs):
        assert_like_one_process(got, want, rank)
        assert got["grown"] > 0, got["grown"]
