"""A whole training step under parallelize: one graph with forward, backward, the
collectives and (for SGD and AdamW) the optimizer fused onto the reduced buckets."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F

import spmd
from spmd import runtime as dist
from spmd.lowering.optimizer import optimizer_step

from ..models import SHARDED_MODELS, batch

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, amsgrad=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.05),  # no flat kernel: runs as recorded
}
STEPS = 3


@spmd.parallelize(bucket_cap_mb=0.001)
def train_step(model, x, y, opt):
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return {"loss": loss, "tag": "step"}


def job(rank: int) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    world = dist.get_world_size()
    out = {}
    for model_name in ("mlp", "encoder", "tied"):
        for opt_name, make in OPTIMIZERS.items():
            model = SHARDED_MODELS[model_name]()
            opt = make(model.parameters())
            for step in range(STEPS):
                x, y = batch(model_name, step=step)
                rows = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
                result = train_step(model, x[rows], y[rows], opt)
            plan = spmd.inspect(train_step)
            (graph,) = plan.graphs.values()
            fused = sum(n.target is optimizer_step for n in graph.graph.nodes)
            out[(model_name, opt_name)] = ({k: v.clone() for k, v in model.state_dict().items()},
                                           result["tag"], float(result["loss"]), fused,
                                           len(plan.buckets))
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def runs():
    return dist.spawn(job, nprocs=2, start_method="forkserver", timeout=110)


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("model_name", ["mlp", "encoder", "tied"])
def test_step_equals_one_process(runs, model_name, opt_name):
    # tied: one parameter in two layers is one input of the traced step
    model = SHARDED_MODELS[model_name]()
    opt = OPTIMIZERS[opt_name](model.parameters())
    for step in range(STEPS):
        x, y = batch(model_name, step=step)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    atol = 2e-4 if opt_name == "adamw" else 1e-5
    for r in runs:
        state, tag, loss, fused, buckets = r[(model_name, opt_name)]
        assert tag == "step" and loss > 0
        for k, v in model.state_dict().items():
            assert torch.allclose(state[k], v, atol=atol, rtol=1e-4), (model_name, opt_name, k)


def test_sgd_and_adamw_run_from_the_buckets(runs):
    for model_name in ("mlp", "encoder"):
        for opt_name in ("sgd", "adamw"):
            _, _, _, fused, buckets = runs[0][(model_name, opt_name)]
            assert fused == buckets > 1  # one fused optimizer step per bucket
        assert runs[0][(model_name, "adagrad")][3] == 0


def test_a_step_needs_one_module():
    @spmd.parallelize
    def no_model(x):
        return x

    with pytest.raises(TypeError, match="exactly one nn.Module"):
        no_model(torch.ones(2))
