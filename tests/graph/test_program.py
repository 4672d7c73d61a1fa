"""One program type: a model, a whole training step and a pipeline are each built by the
one dispatch (``spmd.program.build``) into a ``Program`` that answers ``options``,
``mesh``, ``plan()`` and ``plan_for(*inputs)``; ``spmd.inspect`` with example inputs is
``plan_for`` of the same program built on a simulated mesh. No processes."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd
from spmd.lowering.options import Options
from spmd.pipeline.module import PipelineModule
from spmd.program.build import Target, build, target_of
from spmd.program.module import ModuleState
from spmd.program.program import Program, program_of
from spmd.program.step import ParallelStep


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, opt: torch.optim.Optimizer):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _signature(plan) -> list[tuple]:
    return [(c.phase, c.kind, c.bytes, c.mesh_dim) for c in plan.collectives]


def test_each_target_builds_a_program():
    mesh = spmd.Mesh.simulated(4)
    options = Options.from_kwargs("here", strategy="fsdp")
    model = build(Net(), options, mesh)
    fn = build(step, options, mesh)
    piped = build(Net(), Options.from_kwargs("here", strategy="ddp",
                                             pipeline=spmd.pp.schedule("gpipe", 2)),
                  spmd.Mesh.simulated((2, 2), ("pp", "dp")))
    kinds = {type(program_of(obj)) for obj in (model, fn, piped)}
    assert kinds == {ModuleState, ParallelStep, PipelineModule}
    for obj in (model, fn, piped):
        program = program_of(obj)
        assert isinstance(program, Program) and program.simulated
        assert program.options.strategy in ("fsdp", "ddp")
    assert program_of(Net()) is None and program_of(step) is None
    assert [target_of(t, options, "here") for t in (Net(), Net, step)] == [
        Target.MODULE, Target.CLASS, Target.STEP]
    with pytest.raises(TypeError, match="Program"):
        Program()  # abstract: plan() and plan_for() are each kind's


def test_inspect_is_plan_for_of_the_same_program():
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    mesh = spmd.Mesh.simulated(4)
    options = Options.from_kwargs("here", strategy="fsdp", calibrate=False)
    by_inspect = spmd.inspect(Net(), x, mesh=mesh, strategy="fsdp")
    model = build(Net(), options, mesh)  # (the program holds its model weakly)
    by_program = program_of(model).plan_for(x)
    assert _signature(by_inspect) == _signature(by_program) and _signature(by_program)

    model = Net()
    opt = torch.optim.AdamW(model.parameters())
    stepped = spmd.inspect(step, model, x, y, opt, mesh=mesh, strategy="fsdp")
    program = program_of(build(step, options, mesh))
    assert _signature(program.plan_for(model, x, y, opt)) == _signature(stepped)


def test_a_pipeline_plans_for_inputs_on_a_simulated_mesh_only():
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    mesh = spmd.Mesh.simulated((2, 2), ("pp", "dp"))
    schedule = spmd.pp.schedule("1f1b", 4)
    planned = spmd.inspect(Net(), x, mesh=mesh, pipeline=schedule, loss_fn=F.mse_loss,
                           target=y)
    pm = build(Net(), Options.from_kwargs("here", pipeline=schedule), mesh)
    again = pm.plan_for(x, target=y, loss_fn=F.mse_loss)
    assert len(again.stages) == len(planned.stages) == 2
    assert again.split_points == planned.split_points
    with pytest.raises(TypeError, match="target= and loss_fn="):
        pm.plan_for(x, labels=y)
