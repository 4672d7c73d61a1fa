"""Tensor-parallel plans on simulated meshes (no processes): what the compiler inserts for
Megatron's placements, what it refuses, and what it says about ops it has no rule for."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn

import spmd
from spmd.lowering.annotate import ShardingError

from ..models import Cumulative, Transformer, tokens


def _plan(model: nn.Module, *inputs, shape=(2,), names=("tp",), placements=None, **options):
    torch.manual_seed(0)
    if "fsdp" in names:
        options.setdefault("strategy", "hsdp" if "dp" in names else "fsdp")
    return spmd.inspect(model, *inputs, mesh=spmd.Mesh.simulated(shape, dim_names=names),
                        placements=placements or spmd.tp.megatron(), **options)


def test_megatron_transformer_collectives_per_layer():
    plan = _plan(Transformer(layers=3), tokens()[0])
    tp = [c for c in plan.collectives if c.mesh_dim == "tp"]
    assert [c.kind for c in tp] == ["all_reduce"] * 12
    assert sum(c.phase == "forward" for c in tp) == 6  # attention and MLP, 3 layers
    assert all(c.placements == "Partial('sum') -> Replicate()" for c in tp)
    # gradients of split parameters stay pieces: nothing gathers them
    assert not [c for c in plan.collectives if c.kind == "all_gather"]
    assert not [p for p in plan.placed if p.fallback]


def test_every_op_of_the_test_models_has_a_rule():
    """The ops of a transformer block with torch's own layers (nn.TransformerEncoderLayer's
    fused attention split by head groups, its MLP by Megatron's layout) all have rules."""
    layer = nn.TransformerEncoderLayer(16, nhead=2, dim_feedforward=32, dropout=0.0,
                                       batch_first=True)
    plan = _plan(layer, torch.randn(2, 4, 16))
    assert not [p for p in plan.placed if p.fallback]
    assert sum(c.phase == "forward" for c in plan.collectives) == 2  # attention's, MLP's
    plan = _plan(Transformer(), tokens()[0])
    ops = {p.op for p in plan.placed}
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in ops


def test_an_op_without_a_rule_is_replicated_and_listed():
    plan = _plan(Cumulative(), torch.randn(4, 8))
    missing = {p.op for p in plan.placed if p.fallback}
    assert "aten.cumsum.default" in missing
    assert missing <= {"aten.cumsum.default", "aten.flip.default"}  # flip: cumsum's backward
    assert "replicated for want of a sharding rule: aten.cumsum.default" in plan.summary()
    # the outputs stay right: replicating is always correct
    gathers = [c for c in plan.collectives if c.kind == "all_gather" and c.phase == "forward"]
    assert gathers and "no sharding rule for aten.cumsum.default" in gathers[0].provenance.reason


def test_explain_names_the_rule_and_the_placements():
    plan = _plan(Transformer(layers=1), tokens()[0])
    text = plan.explain("layers.0.linear2")
    assert "parameter layers.0.linear2.weight: tp: Shard(1)" in text
    assert "Partial('sum') -> Replicate()" in text
    assert "contraction dimension sharded" in text
    assert plan.explain("layers.0.linear2.weight").split("\n")[1:] == text.split("\n")[1:]


@pytest.mark.parametrize("placements, error, match", [
    ({"tp": {"layers.*.linear1.weight": spmd.Shard(0)}}, ValueError, "does not divide"),
    ({"mp": {"layers.*.linear1.weight": spmd.Shard(0)}}, ValueError, "dimension 'mp'"),
    ({"tp": {"layers.*.nothing": spmd.Shard(0)}}, ValueError, "matches no parameter"),
    ({"tp": {"layers.*.linear1.weight": spmd.Partial()}}, TypeError, "Shard"),
    ({"tp": {"layers.*.linear1.weight": spmd.Shard(2)}}, ValueError, "out of range"),
    ({"tp": ["layers.0.q.weight"]}, TypeError, "must map"),
    ({"tp": {"layers.0.q.*": spmd.Shard(0), "layers.0.q.weight": spmd.Shard(1)}}, ValueError,
     "two patterns"),
])
def test_bad_placements_are_refused_before_anything_runs(placements, error, match):
    with pytest.raises(error, match=match):
        _plan(Transformer(), tokens()[0], shape=(3,) if "divide" in match else (2,),
              placements=placements)


def test_a_sharding_strategy_needs_a_data_dimension():
    with pytest.raises(ValueError, match="every dimension of mesh"):
        spmd.inspect(Transformer(), tokens()[0], strategy="fsdp",
                     mesh=spmd.Mesh.simulated((2,), dim_names=("tp",)),
                     placements=spmd.tp.megatron())


def test_whole_steps_with_placements_are_refused():
    with pytest.raises(NotImplementedError, match="applies to models"):
        spmd.parallelize(lambda model, x: model(x).sum().backward(),
                         placements=spmd.tp.megatron())


def test_hsdp_composes_with_tensor_parallelism():
    plan = _plan(Transformer(layers=1), tokens()[0], shape=(2, 2, 2),
                 names=("dp", "fsdp", "tp"))
    kinds = {(c.kind, c.mesh_dim) for c in plan.collectives}
    assert {("all_reduce", "tp"), ("all_gather", "fsdp"), ("reduce_scatter", "fsdp")} <= kinds


def test_a_layout_the_op_cannot_run_on_is_an_error_naming_it():
    """A rule that is wrong (here: made wrong on purpose) is caught by the local-shape
    check and named, never run."""
    from spmd.lowering import rules
    from spmd.lowering.placements import Shard

    target = torch.ops.aten.gelu.default
    original = rules._RULES[target]
    rules._RULES[target] = lambda node, inputs, size: [rules.Decision(output=Shard(0))]
    try:
        with pytest.raises(ShardingError, match=r"aten.gelu.default \(gelu in layers.0\).*Shard\(2\)"):
            _plan(Transformer(layers=1), tokens()[0])
    finally:
        rules._RULES[target] = original


class _Flattened(nn.Module):
    """A column-parallel layer whose output's last two dimensions are merged by a view
    (``[B, T, H] -> [B, T * H]``): the merge splits the pieces of the sharded features,
    so the value is gathered first, and the gathered tensor comes back laid out along the
    gathered dimension first, where the traced ``view`` cannot view it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 8)

    def forward(self, x):
        return self.fc(x).view(x.shape[0], -1)


def test_a_view_the_local_layout_cannot_take_runs_as_a_reshape():
    from spmd.lowering.tensor_parallel import viewable

    plan = _plan(_Flattened(), torch.randn(2, 3, 4),
                 placements={"tp": {"fc.weight": spmd.Shard(0), "fc.bias": spmd.Shard(0)}})
    assert [(c.kind, c.phase) for c in plan.collectives] == [("all_gather", "forward")]
    forward = plan.graphs["graph0.forward"].graph
    merged = [n for n in forward.nodes if n.op == "call_function"
              and tuple(n.meta["val"].shape) == (2, 24)]
    assert [n.target for n in merged] == [torch.ops.aten.reshape.default]
    assert not viewable(merged[0].args[0].meta["val"], [2, 24])
    # views the layout allows stay views
    assert torch.ops.aten.view.default in {n.target for n in forward.nodes}


def test_megatron_preset_resolves_names():
    placed = spmd.tp.megatron(Transformer(layers=1))["tp"]
    assert placed["layers.0.q.weight"] == spmd.Shard(0)
    assert placed["layers.0.q.bias"] == spmd.Shard(0)
    assert placed["layers.0.o.weight"] == spmd.Shard(1)
    assert "layers.0.o.bias" not in placed and "head.weight" not in placed
    assert placed["layers.0.linear2.weight"] == spmd.Shard(1)
    with pytest.raises(ValueError, match="no column-parallel layer"):
        spmd.tp.megatron(nn.Sequential(nn.Linear(2, 2)))


def test_planning_a_wide_mesh_is_quick():
    """Planning for 8 x 128 simulated ranks costs what planning for 2 does: placements are
    per mesh dimension, not per rank."""
    model = Transformer(layers=2, dim=256, vocab=256)
    for block in model.layers:
        block.heads = 128
    start = time.perf_counter()
    plan = spmd.inspect(model, tokens(rows=8, vocab=256)[0],
                        mesh=spmd.Mesh.simulated((8, 128), dim_names=("dp", "tp")),
                        placements=spmd.tp.megatron())
    elapsed = time.perf_counter() - start
    assert sum(c.mesh_dim == "tp" for c in plan.collectives) == 8
    assert elapsed < 60
