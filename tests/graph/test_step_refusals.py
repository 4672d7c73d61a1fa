"""A whole step that uses gradients in a way the compiler cannot place after their
reduction is refused, naming what it does; nothing runs. Planned for a simulated mesh
(no process group)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import spmd

from ..models import MODELS, batch

MESH = spmd.Mesh.simulated(2)


def reads_grad_between_backwards(model, x, y, opt):
    F.mse_loss(model(x), y).backward()
    penalty = sum(p.grad.square().sum() for p in model.parameters())
    (F.mse_loss(model(x), y) + 0 * penalty.detach()).backward()
    opt.step()


def calls_autograd_grad(model, x, y, opt):
    grads = torch.autograd.grad(F.mse_loss(model(x), y), list(model.parameters()))
    with torch.no_grad():
        for p, g in zip(model.parameters(), grads):
            p -= 0.1 * g


def steps_twice(model, x, y, opt):
    F.mse_loss(model(x), y).backward()
    opt.step()
    opt.step()


def backward_after_step(model, x, y, opt):
    F.mse_loss(model(x), y).backward()
    opt.step()
    F.mse_loss(model(x), y).backward()


def higher_order(model, x, y, opt):
    F.mse_loss(model(x), y).backward(create_graph=True)
    opt.step()


@pytest.mark.parametrize("fn, match", [
    (reads_grad_between_backwards, "reads the gradient of .* between two backward\\(\\) calls"),
    (calls_autograd_grad, "calls torch.autograd.grad itself"),
    (steps_twice, "calls opt.step\\(\\) more than once"),
    (backward_after_step, "calls backward\\(\\) after opt.step\\(\\)"),
    (higher_order, "create_graph=True"),
], ids=lambda v: getattr(v, "__name__", ""))
def test_steps_the_compiler_cannot_place_are_refused_before_anything_runs(fn, match):
    model = MODELS["mlp"]()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = spmd.parallelize(fn, mesh=MESH)
    with pytest.raises(RuntimeError, match=match):
        step(model, *batch("mlp"), opt)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k  # nothing ran
    assert torch.Tensor.backward is torch.Tensor.backward  # patches undone:
    F.mse_loss(model(batch("mlp")[0]), batch("mlp")[1]).backward()  # eager backward works
    assert all(p.grad is not None for p in model.parameters())


def test_reading_gradients_needs_them_cleared_first():
    def clip_without_zero_grad(model, x, y, opt):
        F.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    model = MODELS["mlp"]()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = spmd.parallelize(clip_without_zero_grad, mesh=MESH)
    step(model, *batch("mlp"), opt)  # .grad empty before: fine
    with pytest.raises(ValueError, match="call opt.zero_grad\\(\\) before backward"):
        step(model, *batch("mlp"), opt)  # .grad still holds the last step's gradients
