"""Batch norm over the whole batch: ``sync_batchnorm=True``, or ``nn.SyncBatchNorm`` in the
model, trains like one process on the whole batch (parameters and running statistics),
compiled (an all-reduce in the forward graph and one in the backward per layer, in the
plan) and eagerly (a layer behind a graph break), at 2 and 3 ranks; ranks with batches
of different sizes get the whole batch's statistics."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd
from spmd import runtime as dist

ROWS = 12


class ConvNet(nn.Module):
    def __init__(self, sync: bool = False, eager: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, bias=False)
        self.bn = (nn.SyncBatchNorm if sync else nn.BatchNorm2d)(4)
        self.fc = nn.Linear(4, 4)
        self.eager = eager

    def forward(self, x):
        h = self.conv(x)
        h = _outside_graphs(self.bn, h) if self.eager else self.bn(h)
        return self.fc(F.relu(h).mean((2, 3)))


@torch.compiler.disable
def _outside_graphs(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """Code Dynamo does not capture: the batch norm runs eagerly."""
    return layer(h)


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(ROWS, 3, 6, 6, generator=g), torch.randn(ROWS, 4, generator=g)


def _train(model, rows: slice, steps: int = 3) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = _data(step)
        F.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


VARIANTS = {"option": dict(sync=False, eager=False, sync_batchnorm=True),
            "module": dict(sync=True, eager=False, sync_batchnorm=False),
            "eager": dict(sync=False, eager=True, sync_batchnorm=True)}


def job(rank: int) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=90))
    world = dist.get_world_size()
    per = ROWS // world
    out: dict = {}
    try:
        for name, v in VARIANTS.items():
            torch.manual_seed(0)
            model = spmd.parallelize(ConvNet(v["sync"], v["eager"]),
                                     sync_batchnorm=v["sync_batchnorm"])
            out[name] = _train(model, slice(rank * per, (rank + 1) * per))
            plan = spmd.inspect(model)
            out[(name, "plan")] = [(c.phase, c.provenance.pass_name) for c in plan.collectives]
        # uneven batches: 5 rows on rank 0, the rest on the others
        torch.manual_seed(0)
        model = spmd.parallelize(ConvNet(), sync_batchnorm=True)
        x, _ = _data(0)
        cut = [0, 5] + [5 + (ROWS - 5) * (r + 1) // (world - 1) for r in range(world - 1)]
        model(x[cut[rank]:cut[rank + 1]])
        out["uneven"] = (model.bn.running_mean.clone(), model.bn.running_var.clone())
    finally:
        dist.destroy_process_group()
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["2-ranks", "3-ranks"])
def runs(request):
    return dist.spawn(job, nprocs=request.param, start_method="forkserver", timeout=115)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_trains_like_one_process_on_the_whole_batch(runs, name):
    torch.manual_seed(0)
    want = _train(ConvNet(), slice(0, ROWS))
    for rank, run in enumerate(runs):
        for key, value in want.items():
            diff = (run[name][key].float() - value.float()).abs().max().item()
            assert diff <= 1e-5, f"{name} rank {rank}: {key} differs by {diff:.3g}"


def test_the_plan_shows_one_all_reduce_each_way(runs):
    for name in ("option", "module"):
        plan = runs[0][(name, "plan")]
        assert plan.count(("forward", "sync_batchnorm")) == 1, plan
        assert plan.count(("backward", "sync_batchnorm")) == 1, plan
    # behind a graph break the layer synchronises eagerly: no statistics in the graphs
    assert ("forward", "sync_batchnorm") not in runs[0][("eager", "plan")]


def test_uneven_batches_get_the_whole_batch_statistics(runs):
    torch.manual_seed(0)
    model = ConvNet()
    model(_data(0)[0])
    for run in runs:
        mean, var = run["uneven"]
        assert torch.allclose(mean, model.bn.running_mean, atol=1e-6)
        assert torch.allclose(var, model.bn.running_var, atol=1e-6)


def test_batch_norm_with_several_data_dimensions_is_refused():
    with pytest.raises(NotImplementedError, match="several mesh dimensions"):
        spmd.parallelize(ConvNet(), strategy="hsdp", sync_batchnorm=True,
                         mesh=spmd.Mesh.simulated((2, 2), dim_names=("dp", "fsdp")))
