"""Fused query-key-value projections split by head groups, planned on simulated meshes:
GPT-2's ``c_attn`` (Conv1D, weight ``(in, 3 * out)``) and torch's
``nn.MultiheadAttention.in_proj_weight`` are placed ``StridedShard(out, 3)`` by
``spmd.tp.megatron()``: each rank its heads of each of q, k and v. The attention then costs
Megatron's one all-reduce each way, the weight is never gathered, and the pieces stored
are each rank's part of each block. Training equal to one process in float64 is
tests/cpu/test_zoo.py's tp runs of ``gpt2`` and ``encoder``."""

from __future__ import annotations

import pytest
import torch

import spmd
from spmd.lowering.placements import Sharding, StridedShard
from spmd.lowering.redistribute import to_locals
from spmd.lowering.specs import TPSpec

from ..zoo import entry

pytest.importorskip("transformers")


def _plan(name: str, placements=None):
    e = entry(name)
    x, _ = e.make_batch(0, 2)
    return spmd.inspect(e.model(), x, mesh=spmd.Mesh.simulated((2,), dim_names=("tp",)),
                        placements=placements or spmd.tp.megatron())


@pytest.mark.parametrize("name, fused, placement", [
    ("gpt2", "hf.transformer.h.0.attn.c_attn.weight", StridedShard(1, 3)),
    ("encoder", "encoder.layers.0.self_attn.in_proj_weight", StridedShard(0, 3)),
])
def test_the_fused_projection_is_split_by_head_groups(name, fused, placement):
    placed = spmd.tp.megatron(entry(name).model())
    assert placed["tp"][fused] == placement
    assert "split by head groups" in placed.source[fused]
    plan = _plan(name)
    on_tp = [c for c in plan.collectives if c.mesh_dim == "tp"]
    # two blocks, attention and MLP each: one all-reduce forward, one backward
    assert sorted((c.phase, c.kind) for c in on_tp) == (
        [("backward", "all_reduce")] * 4 + [("forward", "all_reduce")] * 4)
    assert plan.tp_placements[fused]["tp"] == placement


def test_a_piece_is_each_rank_s_part_of_every_block():
    w = torch.arange(12 * 2.).view(12, 2)
    p = StridedShard(0, 3)

    class Rank:
        def __init__(self, r: int) -> None:
            self.r = r

        def rank(self) -> int:
            return self.r

    placed = Sharding.on(spmd.Mesh.simulated((2,), ("tp",)), {"tp": p})
    pieces = [TPSpec(param="w", shape=(12, 2), sharding=placed, dims=("tp",),
                     groups={"tp": Rank(r)}).piece(w) for r in range(2)]
    # blocks of 4 rows (q, k, v): rank 0 rows 0-1, 4-5, 8-9; rank 1 rows 2-3, 6-7, 10-11
    assert pieces[0][:, 0].tolist() == [0.0, 2.0, 8.0, 10.0, 16.0, 18.0]
    assert all(torch.equal(a, b) for a, b in zip(pieces, to_locals(w, p, 2)))


def test_bad_strided_placements_are_refused_before_anything_runs():
    name = "hf.transformer.h.*.attn.c_attn.weight"
    with pytest.raises(ValueError, match="does not divide into 5 blocks"):
        _plan("gpt2", {"tp": {name: spmd.StridedShard(1, 5)}})
    with pytest.raises(TypeError, match="places module outputs"):
        _plan("gpt2", {"tp": {"hf.transformer.h.*.ln_1": spmd.StridedShard(1, 2)}})
