"""Loss parallelism planned on simulated meshes: a cross-entropy inside the model's
forward on logits split along the vocabulary runs as the sharded log-softmax and loss
(the logits never gathered), what it cannot split (class weights) is gathered with the
reason, and the preset's arguments are checked. Training equal to one process in float64
is tests/cpu/test_loss_parallel.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd
from spmd.lowering import ranked

from ..models import Transformer, tokens

SHARDED = (ranked.sharded_log_softmax, ranked.sharded_log_softmax_backward, ranked.sharded_nll_loss,
           ranked.sharded_nll_loss_backward)


class WithLoss(nn.Module):
    def __init__(self, weight: torch.Tensor | None = None) -> None:
        super().__init__()
        self.model = Transformer(layers=2)
        self.weight = weight

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.model(x)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten(), weight=self.weight)


def _plan(model: nn.Module, **options):
    torch.manual_seed(0)
    x, y = tokens(rows=2, length=8)
    return spmd.inspect(model, x, y, mesh=spmd.Mesh.simulated((2,), dim_names=("tp",)),
                        placements=spmd.tp.megatron(loss_parallel=True, **options))


def _ops(plan) -> set:
    return {n.target for g in plan.graphs.values() for n in g.graph.nodes}


def test_the_loss_runs_on_split_logits():
    plan = _plan(WithLoss())
    assert set(SHARDED) <= _ops(plan)
    forward = [c for c in plan.collectives if c.mesh_dim == "tp" and c.phase == "forward"]
    assert "all_gather" not in {c.kind for c in forward}  # the logits stay split
    loss = [c for c in forward if c.bytes == 4]  # the float32 scalar: a partial sum
    assert loss and all(c.kind == "all_reduce" for c in loss)
    placed = [p for p in plan.placed if p.op == str(ranked.sharded_log_softmax)]
    assert placed and "loss parallelism" in placed[0].reason


def test_class_weights_gather_the_logits_and_say_why():
    plan = _plan(WithLoss(weight=torch.rand(32)))
    assert ranked.sharded_nll_loss not in _ops(plan)
    reasons = [c.provenance.reason for c in plan.collectives
               if c.mesh_dim == "tp" and c.kind == "all_gather" and c.phase == "forward"]
    assert any("a loss reads every class and every row" in r for r in reasons)


def test_the_preset_splits_the_head_and_says_so():
    placed = spmd.tp.megatron(Transformer(layers=1), loss_parallel=True)
    assert placed["tp"]["head.weight"] == spmd.Shard(0)
    assert placed["tp"]["head.bias"] == spmd.Shard(0)
    assert "loss parallelism" in placed.source["head.weight"]
    assert "head.weight" not in spmd.tp.megatron(Transformer(layers=1))["tp"]


class _Headless(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.o = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.o(self.q(x))


def test_bad_arguments_are_refused():
    with pytest.raises(TypeError, match="loss_parallel must be a bool"):
        spmd.tp.megatron(loss_parallel=1)
    with pytest.raises(ValueError, match="no vocabulary head"):
        spmd.tp.megatron(_Headless(), loss_parallel=True)
