"""A backward that computes no gradient at all is refused, not planned, and the case that
found it plans: on the meta device torch 2.13 has no derivative for ``nll_loss``, so a
model computing ``F.cross_entropy`` inside its forward traced to a backward graph of
``None`` s, and the planner priced the forward alone. Tracing on meta now decomposes the
loss (``spmd.lowering.meta_trace``); an op that really has no derivative is still
refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd
from spmd.lowering.annotate import EmptyBackwardError


class LossInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.out = nn.Embedding(32, 16), nn.Linear(16, 32)

    def forward(self, x, y):
        return F.cross_entropy(self.out(self.emb(x)).flatten(0, 1), y.flatten())


def _reduced(plan) -> set[str]:
    return {p for c in plan.collectives for p in c.provenance.params}


def test_a_loss_inside_the_forward_plans_its_backward_on_meta():
    with torch.device("meta"):
        model = LossInside()
        x, y = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))
    plan = spmd.inspect(model, x, y, mesh=spmd.Mesh.simulated(4))
    assert _reduced(plan) == {"emb.weight", "out.weight", "out.bias"}
    assert any("cross_entropy traced as its decomposition" in note
               for notes in plan.traced_as.values() for note in notes)
    assert "cross_entropy traced as its decomposition" in plan.summary()


def test_the_same_model_on_real_tensors_plans_its_backward():
    model = LossInside()
    x, y = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))
    plan = spmd.inspect(model, x, y, mesh=spmd.Mesh.simulated(4))
    assert _reduced(plan) == {"emb.weight", "out.weight", "out.bias"}
    assert not plan.traced_as  # real tensors are traced as they are


_lib = torch.library.Library("spmd_test_opaque", "DEF")
_lib.define("opaque(Tensor x) -> Tensor")
_lib.impl("opaque", lambda x: x * 2, "CompositeExplicitAutograd")  # no derivative


class Opaque(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.ops.spmd_test_opaque.opaque(self.fc(x)).sum()


def test_a_backward_without_gradients_is_refused_by_name():
    with pytest.warns(UserWarning, match="autograd kernel was not registered"), \
            pytest.raises(EmptyBackwardError, match=r"no gradient for any of the 2 trainable "
                                                    r"parameters \(fc.weight, fc.bias\).*"
                                                    r"register_autograd"):
        spmd.inspect(Opaque(), torch.randn(2, 4), mesh=spmd.Mesh.simulated(4))
