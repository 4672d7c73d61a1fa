"""A parameter registered on a parallelized model after ``parallelize`` is refused at the
assignment, naming it (its gradient would go unsynchronised, or meet graphs planned for
shards); the model's own modules and parameters may move, and buffers may arrive."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import spmd


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero1"])
def test_a_new_parameter_or_module_is_refused_by_name(strategy):
    model = spmd.parallelize(Net(), strategy=strategy, mesh=spmd.Mesh.simulated(2))
    with pytest.raises(RuntimeError, match=r"parallelize\(Net\): module \(Linear, holding "
                                           r"parameters\) 'head' is registered after"):
        model.head = nn.Linear(8, 2)
    with pytest.raises(RuntimeError, match=r"parameter 'body.0.bias' is registered after"):
        model.body[0].bias = nn.Parameter(torch.zeros(8))
    with pytest.raises(RuntimeError, match=r"'body.2' is registered after"):
        model.body.append(nn.Linear(8, 8))
    # refused before anything changed: the model is the planned one still
    assert isinstance(model.head, nn.Linear) and len(model.body) == 2


def test_own_modules_move_and_buffers_arrive():
    model = spmd.parallelize(Net(), strategy="fsdp", mesh=spmd.Mesh.simulated(2))
    head = model.head
    model.head = head  # the same module, its parameters planned
    model.alias = head
    model.register_buffer("cache", torch.zeros(3), persistent=False)
    model.body.add_module("act", nn.Tanh())  # no parameters
    assert model.alias is model.head


def test_other_models_are_untouched():
    spmd.parallelize(Net(), mesh=spmd.Mesh.simulated(2))
    plain = Net()
    assert not hasattr(plain, "_spmd_owned_by")
    plain.head = nn.Linear(8, 3)  # a model nobody parallelized changes freely
    plain.head.weight = nn.Parameter(torch.zeros(3, 8))


def test_a_whole_step_owns_its_model_after_the_first_call():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @spmd.parallelize(mesh=spmd.Mesh.simulated(2))
    def train_step(model, x, y, opt):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    model.head = nn.Linear(8, 2)  # before the first call: still the user's to change
    train_step(model, torch.randn(4, 4), torch.randn(4, 2), opt)
    with pytest.raises(RuntimeError, match=r"parallelize\(train_step\): module \(Linear"):
        model.head = nn.Linear(8, 2)
