"""Eager writes to a parameter stored in pieces, through its module attribute: a whole
tensor assigned to ``.data`` reaches this rank's piece; what would be lost or cut wrongly
is refused, naming the parameter (planned on a simulated mesh: this rank's piece is
rank 0's)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import spmd

LAYOUTS = [("fsdp", None), ("zero2", None), ("ddp", {"tp": {"0.weight": spmd.Shard(0)}})]


def _model(strategy: str, placements: dict | None) -> nn.Module:
    mesh = (spmd.Mesh.simulated((2,), ("tp",)) if placements else spmd.Mesh.simulated(2))
    return spmd.parallelize(nn.Sequential(nn.Linear(4, 6)), strategy=strategy, mesh=mesh,
                            placements=placements)


@pytest.mark.parametrize("strategy, placements", LAYOUTS)
def test_assigning_the_whole_tensor_to_data_stores_this_ranks_piece(strategy, placements):
    model = _model(strategy, placements)
    whole = torch.arange(24.0).view(6, 4)
    model[0].weight.data = whole
    assert torch.equal(model[0]._parameters["weight"].detach(), whole[:3])
    assert torch.equal(model[0].weight.detach(), torch.cat([whole[:3]] * 2))


@pytest.mark.parametrize("strategy, placements", LAYOUTS)
def test_a_piece_or_a_view_assigned_to_data_is_refused(strategy, placements):
    model = _model(strategy, placements)
    with pytest.raises(RuntimeError, match=r"0.weight.data = \(3, 4\): a parameter stored in "
                                           r"pieces takes a new value for the whole tensor"):
        model[0].weight.data = torch.ones(3, 4)
    with pytest.raises(RuntimeError, match=r"0.weight.data = \(4,\)"):
        model[0].weight[0].data = torch.ones(4)


def test_a_whole_tensor_put_into_a_stored_shard_is_named_at_the_next_use():
    model = _model("fsdp", None)
    for name, p in model.named_parameters():
        p.data = torch.ones(6, 4) if name.endswith("weight") else torch.ones(6)
    with pytest.raises(ValueError, match=r"0.weight stores a tensor of shape \(6, 4\), where "
                                         r"this rank stores its shard \(3, 4\)"):
        model(torch.randn(2, 4))
