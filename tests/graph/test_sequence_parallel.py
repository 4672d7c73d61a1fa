"""Sequence parallelism planned on simulated meshes (no processes): which collectives
Megatron-SP puts where tensor parallelism all-reduces, what it moves, what it saves, and
what it refuses. Training equal to one process in float64 is tests/cpu/test_zoo.py's
``tp+sp``, ``fsdp x tp+sp`` and ``dp x tp+sp`` runs."""

from __future__ import annotations

import pytest
import torch

import spmd
from spmd.lowering.annotate import ShardingError

from ..models import Transformer, tokens

LAYERS = 3


def _plan(placements, x=None, shape=(2,), names=("tp",), **options):
    torch.manual_seed(0)
    x = tokens(length=8)[0] if x is None else x
    return spmd.inspect(Transformer(layers=LAYERS), x,
                        mesh=spmd.Mesh.simulated(shape, dim_names=names),
                        placements=placements, **options)


def _tp(plan, phase):
    return [c for c in plan.collectives if c.mesh_dim == "tp" and c.phase == phase]


def test_row_parallel_all_reduces_become_reduce_scatters_and_gathers():
    tp = _plan(spmd.tp.megatron())
    sp = _plan(spmd.tp.megatron(sequence_parallel=True))
    assert [c.kind for c in _tp(tp, "forward")] == ["all_reduce"] * 2 * LAYERS
    forward = [c.kind for c in _tp(sp, "forward")]
    # per sublayer: gather the sequence before the column-parallel layers, reduce-scatter
    # the row-parallel output; then one gather before the vocabulary head
    assert forward == ["all_gather", "reduce_scatter"] * 2 * LAYERS + ["all_gather"]
    assert all(c.placements in ("Shard(1) -> Replicate()", "Partial('sum') -> Shard(1)")
               for c in _tp(sp, "forward"))
    # the same bytes on the wire: a ring all-reduce is a reduce-scatter and an all-gather
    # of the same tensor
    scattered = sum(c.bytes for c in _tp(sp, "forward") if c.kind == "reduce_scatter")
    reduced = sum(c.bytes for c in _tp(tp, "forward"))
    assert scattered == reduced


def test_backward_gathers_saved_shards_and_scatters_input_gradients():
    sp = _plan(spmd.tp.megatron(sequence_parallel=True))
    kinds = [c.kind for c in _tp(sp, "backward")]
    assert kinds.count("reduce_scatter") == 2 * LAYERS  # the column-parallel input gradients
    assert kinds.count("all_gather") >= 2 * LAYERS - 1  # saved norm outputs, gathered again
    # the norms' weights saw 1/tp of the sequence: their gradients are summed over "tp",
    # in buckets as they leave the graph (not one all-reduce each)
    summed = [c for c in _tp(sp, "backward") if c.kind == "all_reduce"]
    params = {p for c in summed for p in sp.buckets[c.bucket].params}
    assert {f"layers.{i}.norm{j}.weight" for i in range(LAYERS) for j in (1, 2)} <= params
    assert len(summed) < len(params)


def test_activations_saved_outside_the_split_layers_shrink():
    tp = _plan(spmd.tp.megatron()).memory()
    sp = _plan(spmd.tp.megatron(sequence_parallel=True)).memory()
    assert sp.activations < tp.activations
    tp_layers = {name: size for name, size, _ in tp.saved_by_layer}
    sp_layers = {name: size for name, size, _ in sp.saved_by_layer}
    for layer in ("layers.0", "layers.1", "layers.2"):
        assert sp_layers[layer] < tp_layers[layer]


def test_placements_on_module_outputs_by_name():
    """Plain placements: a pattern that names modules (not parameters) places their
    outputs; the norms and the embedding by hand are Megatron-SP."""
    megatron = spmd.tp.megatron(Transformer(layers=LAYERS))["tp"]
    params = {k: v for k, v in megatron.items() if k.endswith(("weight", "bias"))}
    by_hand = _plan({"tp": {**params, "emb": spmd.Shard(1), "layers.*.norm?": spmd.Shard(1)}})
    preset = _plan(spmd.tp.megatron(sequence_parallel=True))
    assert ([c.kind for c in _tp(by_hand, "forward")][:-1]
            == [c.kind for c in _tp(preset, "forward")][:-1])
    text = by_hand.explain("layers.0.norm1")
    assert "the output of layers.0.norm1 is placed Shard(1)" in text


def test_the_preset_names_its_sources():
    placed = spmd.tp.megatron(Transformer(layers=1), sequence_parallel=True)
    assert placed["tp"]["layers.0.norm1"] == spmd.Shard(1)
    assert placed["tp"]["emb"] == spmd.Shard(1)
    assert "LayerNorm" in placed.source["layers.0.norm1"]
    assert "layers.0.linear1" not in placed["tp"]  # modules, not parameters, of the MLP
    seq0 = spmd.tp.megatron(Transformer(layers=1), sequence_parallel=True, sequence_dim=0)
    assert seq0["tp"]["emb"] == spmd.Shard(0)


def test_a_sequence_that_does_not_divide_is_refused_by_module():
    with pytest.raises(ShardingError, match=r"output of emb .* Shard\(1\) over the 2 ranks"):
        _plan(spmd.tp.megatron(sequence_parallel=True), x=tokens(length=7)[0])


@pytest.mark.parametrize("placements, error, match", [
    ({"tp": {"layers.*.norm1": spmd.Shard(-2)}}, ValueError, "count the dimension"),
    ({"tp": {"layers.*.nothing": spmd.Shard(1)}}, ValueError, "no parameter .* and no module"),
    ({"tp": {"layers.0.norm1": spmd.Partial()}}, TypeError, "Shard"),
])
def test_bad_activation_placements_are_refused_before_anything_runs(placements, error, match):
    with pytest.raises(error, match=match):
        _plan(placements)


def test_bad_preset_arguments():
    with pytest.raises(TypeError, match="sequence_parallel must be a bool"):
        spmd.tp.megatron(sequence_parallel="yes")
    with pytest.raises(ValueError, match="sequence_dim"):
        spmd.tp.megatron(sequence_dim=-1)


def test_composes_with_fsdp_on_another_dimension():
    plan = _plan(spmd.tp.megatron(sequence_parallel=True), shape=(2, 2),
                 names=("fsdp", "tp"), strategy="fsdp")
    kinds = {(c.kind, c.mesh_dim) for c in plan.collectives}
    assert {("reduce_scatter", "tp"), ("all_gather", "tp"), ("all_gather", "fsdp"),
            ("reduce_scatter", "fsdp")} <= kinds
