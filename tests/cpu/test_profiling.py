"""spmd.profile and calibration on real ranks: the mechanism, not the timings (timings
are benchmarks: see benchmarks/prediction.py)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F

import spmd
from spmd import runtime as dist
from spmd.lowering.cost_model import CostModel, overlap_share
from spmd.plan.profiling import completions

from ..models import MODELS, batch

STEPS = 3


def profiled(rank: int) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    world = dist.get_world_size()
    model = spmd.parallelize(MODELS["mlp"](), calibrate=True, bucket_cap_mb=0.001)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(i: int) -> None:
        x, y = batch("mlp", step=i)
        rows = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
        F.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()
        opt.zero_grad()

    step(0)
    prof = spmd.profile(model, steps=STEPS)
    for i in range(STEPS + 2):  # two more steps: the profile must have stopped by itself
        step(i)
    plan = spmd.inspect(model)
    dist.destroy_process_group()
    return {
        "timelines": len(prof.timelines), "lanes": [sorted({s.lane for s in tl.spans})
                                                    for tl in prof.timelines],
        "comm spans": len(plan.measured.lane("communication")),
        "collectives": len(plan.collectives),
        "compute labels": sorted(s.label for s in plan.measured.lane("compute")),
        "model": plan.cost_model, "armed": model._spmd.profiler is not None,
        "raw kinds": sorted({k for k, _, _ in prof.raw[-1]}),
        "predicted": plan.predicted_timeline(),
    }


@pytest.fixture(scope="module")
def runs():
    return dist.spawn(profiled, nprocs=2, start_method="forkserver", timeout=100)


def test_profile_records_the_requested_steps_then_stops(runs):
    for r in runs:
        assert r["timelines"] == STEPS and not r["armed"]
        assert r["comm spans"] == r["collectives"] > 1
        assert r["compute labels"] == ["graph0 backward", "graph0 forward"]
        assert set(r["raw kinds"]) >= {"compute_start", "compute_end", "issue", "done",
                                       "wait_start", "wait_end"}
        for lanes in r["lanes"]:
            assert {"compute", "communication"} <= set(lanes)


def test_calibration_is_shared_by_every_rank(runs):
    models = [r["model"] for r in runs]
    assert models[0].source.startswith("calibrated on the live group")
    assert models[0].alpha > 0 and models[0].beta > 0
    assert all(m == models[0] for m in models)  # decided once, the same everywhere


def test_predicted_timeline_uses_the_shared_model(runs):
    tl = runs[0]["predicted"]
    assert len(tl.lane("communication")) == runs[0]["collectives"]
    assert tl.step_seconds > 0


def test_completion_is_the_earlier_of_callback_and_wait_end():
    events = [("issue", "b0", 1.0), ("wait_end", "b0", 2.0), ("done", "b0", 2.5),
              ("done", "b1", 3.0)]
    assert completions(events) == {"b0": 2.0, "b1": 3.0}


def test_overlap_share_and_bucket_size():
    assert overlap_share("nccl", 8, 8, 1)[0] == 1.0
    assert overlap_share("gloo", 2, 2, 1)[0] == 0.0  # both cores compute: nothing hides
    assert overlap_share("gloo", 2, 8, 1)[0] == 1.0
    hidden = CostModel.default("gloo", 2)
    crowded = CostModel(backend="gloo", world_size=2, alpha=hidden.alpha, beta=hidden.beta,
                        overlap=0.0)
    total = 16 << 20
    assert crowded.bucket_bytes(total, backward_seconds=1.0) == total  # one bucket
    assert hidden.bucket_bytes(total, backward_seconds=1.0) < total  # buckets to hide behind


def test_profile_rejects_bad_arguments():
    with pytest.raises(TypeError, match="not a parallelized module"):
        spmd.profile(torch.nn.Linear(2, 2))
    model = spmd.parallelize(torch.nn.Linear(2, 2), mesh=spmd.Mesh.simulated(2))
    with pytest.raises(ValueError, match="positive int"):
        spmd.profile(model, steps=0)
