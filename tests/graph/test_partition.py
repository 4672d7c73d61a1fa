"""The partition of a region into forward and backward: copies that only duplicate a
saved activation are dropped, copies the caller receives are kept, training is unchanged."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd


class FeedForward(nn.Module):
    """ReLU then dropout(p=0): AOTAutograd decomposes the dropout into a clone of the
    ReLU's output, and both would be saved for backward."""

    def __init__(self, copy_out: bool = False) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 64), nn.Linear(64, 4)
        self.copy_out = copy_out

    def forward(self, x):
        h = F.dropout(F.relu(self.up(x)), p=0.0, training=self.training)
        out = self.down(h)
        return (out, h.clone()) if self.copy_out else out


def _clones(model: nn.Module, x: torch.Tensor) -> tuple[int, spmd.Plan]:
    model = spmd.parallelize(model, mesh=spmd.Mesh.simulated(2))
    out = model(x)
    (out[0] if isinstance(out, tuple) else out).sum().backward()
    plan = spmd.inspect(model)
    (fw,) = [g for n, g in plan.graphs.items() if n.endswith("forward")]
    return sum(n.target is torch.ops.aten.clone.default for n in fw.graph.nodes), plan


def test_a_copy_of_a_saved_activation_is_dropped_and_gradients_are_unchanged():
    torch.manual_seed(0)
    reference = FeedForward()
    model = FeedForward()
    model.load_state_dict(reference.state_dict())
    x = torch.randn(16, 8)
    clones, plan = _clones(model, x)
    assert clones == 0
    # the saved activations: one (16, 64) ReLU output, not two
    assert plan.memory().activations < 2 * 16 * 64 * 4 + 16 * 8 * 4 + 1024
    reference(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), name


def test_a_copy_the_caller_receives_is_kept():
    torch.manual_seed(0)
    model = FeedForward(copy_out=True)
    clones, _ = _clones(model, torch.randn(16, 8))
    assert clones >= 1
