"""A backward that computes no gradient at all is refused, not planned: on the meta device
torch 2.13 has no derivative for ``nll_loss``, so a model computing ``F.cross_entropy``
inside its forward traces to a backward graph of ``None`` s, and the planner used to
price the forward alone and report a plausible step."""

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


def test_a_backward_without_gradients_is_refused_by_name():
    with torch.device("meta"):
        model = LossInside()
        x, y = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))
    with pytest.warns(UserWarning, match="autograd kernel was not registered"), \
            pytest.raises(EmptyBackwardError, match=r"no gradient for any of the 3 trainable "
                                                    r"parameters \(emb.weight, out.weight, "
                                                    r"out.bias\).*nll_loss"):
        spmd.inspect(model, x, y, mesh=spmd.Mesh.simulated(4))


def test_the_same_model_on_real_tensors_plans_its_backward():
    model = LossInside()
    x, y = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))
    plan = spmd.inspect(model, x, y, mesh=spmd.Mesh.simulated(4))
    reduced = {p for c in plan.collectives for p in c.provenance.params}
    assert reduced == {"emb.weight", "out.weight", "out.bias"}
