"""What a planned graph refers to (collective specs, optimizers) belongs to the
parallelized model or step: when that is collected, so is everything its graphs named.
No process-lifetime registry keeps anything alive."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

import spmd
from spmd.lowering.graph import collective_nodes
from spmd.lowering.specs import lookup

from ..models import MODELS, batch

MESH = spmd.Mesh.simulated(2)


def referenced(plan) -> list:
    return [lookup(c.meta["spmd_collective"].handle)
            for gm in plan.graphs.values() for c in collective_nodes(gm)]


def test_a_parallelized_model_is_collected_with_its_specs():
    model = spmd.parallelize(MODELS["mlp"](), mesh=MESH, bucket_cap_mb=0.0005)
    x, y = batch("mlp")
    F.mse_loss(model(x), y).backward()
    plan = spmd.inspect(model)
    specs = referenced(plan)
    assert len(specs) > 1
    handles = [c.meta["spmd_collective"].handle for gm in plan.graphs.values()
               for c in collective_nodes(gm)]
    refs = [weakref.ref(model)] + [weakref.ref(s) for s in specs]
    del model, plan, specs
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)
    with pytest.raises(RuntimeError, match="collected"):
        lookup(handles[0])


def test_a_parallelized_step_is_collected_with_its_specs_and_optimizer():
    def train_step(model, x, y, opt):
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    step = spmd.parallelize(train_step, mesh=MESH, bucket_cap_mb=0.0005)
    model = MODELS["mlp"]()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    step(model, *batch("mlp"), opt)
    plan = spmd.inspect(step)
    assert plan.optimizer["step0"].startswith("fused")
    refs = [weakref.ref(o) for o in (step, model, opt, *referenced(plan))]
    del step, model, opt, plan
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)
