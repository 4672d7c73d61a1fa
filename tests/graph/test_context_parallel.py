"""Context parallelism planned on simulated meshes (no processes): attention becomes ring
attention, the sequence stays split from the embedding to the output, parameter
gradients are summed over "cp" in buckets, activation memory per rank shrinks, and bad
arguments are refused by name. Training equal to one process in float64 is
tests/cpu/test_zoo.py's ``cp``, ``dp x cp``, ``fsdp x cp``, ``cp x tp`` and
``fsdp x cp x tp`` runs; the ring's arithmetic between real ranks is
tests/cpu/test_ring_attention.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import spmd
from spmd.lowering import ranked
from spmd.lowering.annotate import ShardingError
from spmd.plan.roofline import node_flops

from ..models import Transformer, tokens
from ..zoo import entry

LAYERS = 3


RING = object()  # the default: spmd.cp.ring()


def _plan(placements=RING, x=None, shape=(2,), names=("cp",), model=None, **options):
    torch.manual_seed(0)
    x = tokens(rows=1, length=8)[0] if x is None else x
    return spmd.inspect(model or Transformer(layers=LAYERS), x,
                        mesh=spmd.Mesh.simulated(shape, dim_names=names),
                        placements=spmd.cp.ring() if placements is RING else placements,
                        **options)


def _on(plan, dim, phase):
    return [c for c in plan.collectives if c.mesh_dim == dim and c.phase == phase]


def _ring_nodes(plan):
    return [n for g in plan.graphs.values() for n in g.graph.nodes
            if n.target in (ranked.ring_attention, ranked.ring_attention_backward)]


def test_attention_runs_as_a_ring_and_only_the_output_is_gathered():
    plan = _plan()
    forward = _on(plan, "cp", "forward")
    assert sorted(c.kind for c in forward) == ["all_gather"] + ["ring"] * LAYERS
    gather = next(c for c in forward if c.kind == "all_gather")
    assert "the caller receives whole tensors" in gather.provenance.reason
    backward = _on(plan, "cp", "backward")
    assert [c.kind for c in backward].count("ring") == LAYERS
    # every parameter's gradient is this rank's sum over its part of the sequence: summed
    # over "cp", in buckets (not one all-reduce per parameter)
    reduced = [c for c in backward if c.kind == "all_reduce"]
    assert 1 <= len(reduced) <= 2
    summed = {p for c in reduced for p in plan.buckets[c.bucket].params}
    blocks = {n for n, _ in Transformer(layers=LAYERS).named_parameters()
              if n.startswith("layers.")}
    # (where the planner gathers before the last residual add, the values after it, and
    # the gradients computed from them, are whole: nothing to sum)
    assert len(blocks - summed) <= 2 and len(summed) > 40
    assert len(_ring_nodes(plan)) == 2 * LAYERS


def test_the_ring_is_explained_with_its_bytes_and_layout():
    plan = _plan()
    ring = next(c for c in plan.collectives if c.kind == "ring" and c.phase == "forward")
    text = plan.explain(ring.name)
    assert "ring attention in layers.0" in text
    assert "load-balanced" in text and "zigzag" in text
    # one key/value block of 1 x 4 heads x 4 positions x 4 features in float32, twice
    assert ring.bytes == 2 * 4 * 4 * 4 * 4
    contiguous = _plan(spmd.cp.ring(load_balance=False))
    ring = next(c for c in contiguous.collectives if c.kind == "ring")
    assert "zigzag" not in contiguous.explain(ring.name)
    assert all(lookup_spec(n).load_balance is False for n in _ring_nodes(contiguous))


def lookup_spec(node):
    from spmd.lowering.specs import lookup

    return lookup(node.args[-1])


def test_activation_memory_per_rank_shrinks_with_the_ranks():
    x = tokens(rows=1, length=16)[0]
    whole = _plan(None, x=x, shape=(1,), names=("dp",)).memory()
    split = [_plan(x=x, shape=(n,)).memory() for n in (2, 4)]
    assert split[0].activations < whole.activations
    assert split[1].activations < split[0].activations


def test_ring_attention_is_priced_as_each_rank_s_share_of_the_whole():
    plan = _plan(x=tokens(rows=1, length=16)[0], shape=(4,))
    forward = next(n for n in _ring_nodes(plan) if n.target is ranked.ring_attention)
    q = forward.args[0].meta["val"]
    b, h, s, d = q.shape
    assert s == 4  # 16 positions over 4 ranks
    whole = 2 * b * h * (4 * s) * (4 * s) * (d + d)  # scores and the weighted sum
    assert node_flops(forward) == whole // 4 // 2  # a quarter of it, causal halved


def test_composes_with_tensor_parallelism_and_fsdp():
    plan = _plan([spmd.tp.megatron(), spmd.cp.ring()], shape=(2, 2, 2),
                 names=("fsdp", "cp", "tp"), strategy="fsdp")
    kinds = {(c.kind, c.mesh_dim) for c in plan.collectives}
    assert {("ring", "cp"), ("all_reduce", "tp"), ("all_gather", "fsdp"),
            ("reduce_scatter", "fsdp")} <= kinds
    assert ("all_to_all", "cp") not in kinds
    # the ring runs on each rank's heads (split by "tp") and part of the sequence
    q = next(n for n in _ring_nodes(plan) if n.target is ranked.ring_attention).args[0]
    assert tuple(q.meta["val"].shape) == (1, 2, 4, 4)


def test_an_explicit_mask_is_read_whole_by_the_ring():
    e = entry("llama")  # transformers builds its causal mask in the graph
    x, _ = e.make_batch(0, 1)
    plan = spmd.inspect(e.model(), x, mesh=spmd.Mesh.simulated((2,), dim_names=("cp",)),
                        placements=spmd.cp.ring())
    forward = [n for n in _ring_nodes(plan) if n.target is ranked.ring_attention]
    assert forward and all(n.args[3] is not None for n in forward)
    assert not [c for c in plan.collectives if c.kind == "all_to_all"]
    placed = [p for p in plan.placed if p.node == forward[0].name and p.mesh_dim == "cp"]
    assert "explicit mask whole" in placed[0].reason


def test_several_sequences_per_rank_stay_split_through_the_linear_layers():
    """A linear layer's reshape merges the batch with the split sequence
    (``[B, S, D] -> [B * S, D]``): StridedShard(0, split=B) there, split back to Shard(1)
    after the product; nothing is gathered but the caller's output."""
    plan = _plan(x=tokens(rows=2, length=8)[0])
    forward = _on(plan, "cp", "forward")
    assert sorted(c.kind for c in forward) == ["all_gather"] + ["ring"] * LAYERS
    placed = {p.output for p in plan.placed if p.mesh_dim == "cp"}
    assert "StridedShard(0, split=2)" in placed


def test_strided_shard_maps_and_round_trips():
    from spmd.lowering.placements import Replicate, Shard, StridedShard
    from spmd.lowering.redistribute import from_locals, redistribution, simulate, to_locals
    from spmd.lowering.rules.views import strided_map, unstride_map

    assert strided_map([2, 8, 16], [16, 16], 1, 2) == (0, 2)
    assert strided_map([2, 8, 16], [256], 1, 2) == (0, 2)  # inner dimensions merged too
    assert strided_map([6, 8], [2, 24], 1, 2) == (1, 3)
    assert strided_map([1, 8, 16], [8, 16], 1, 2) is None  # a plain Shard there
    p = StridedShard(0, 2)
    assert unstride_map([16, 16], [2, 8, 16], p, 2) == Shard(1)
    assert unstride_map([16, 16], [16, 4, 4], p, 2) == p
    # the strided dimension split from, or merged with, dimensions after it: each rank's
    # part of a block (4 of 8 rows) is whole indices of the new dimension
    assert unstride_map([16, 16], [4, 4, 16], p, 2) == p
    assert unstride_map([16, 2, 16], [32, 16], p, 2) == p  # [T, k, H] -> [T * k, H]
    assert unstride_map([32, 16], [16, 2, 16], p, 2) == p
    assert unstride_map([8, 6], [3, 16], p, 2) is None  # a part of 12 is no whole index
    x = torch.arange(16 * 3.).view(16, 3)
    pieces = to_locals(x, p, 2)
    # rank r: rows r*4 .. r*4+3 of each block of 8
    assert pieces[1][:, 0].tolist() == [12.0, 15.0, 18.0, 21.0, 36.0, 39.0, 42.0, 45.0]
    assert torch.equal(from_locals(pieces, p), x)
    for a, b in ((p, Replicate()), (Replicate(), p)):
        step = redistribution(a, b)
        out = simulate(step, pieces if a == p else [x, x])
        assert torch.equal(from_locals(out, b), x)
    with pytest.raises(ValueError, match="gather it"):
        redistribution(p, Shard(0))


def test_a_sequence_that_does_not_divide_is_refused_by_module():
    with pytest.raises(ShardingError, match=r"output of emb .* Shard\(1\) over the 2 ranks"):
        _plan(x=tokens(rows=1, length=7)[0])


class _NoEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"dim": 3}, TypeError, "dim must be a mesh dimension"),
    ({"sequence_dim": -1}, ValueError, "sequence_dim counts from the front"),
    ({"load_balance": "yes"}, TypeError, "load_balance must be a bool"),
    ({"modules": "emb"}, TypeError, "modules must be a sequence"),
])
def test_bad_arguments_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        spmd.cp.ring(**kwargs)


def test_a_model_without_an_embedding_needs_its_modules_named():
    with pytest.raises(ValueError, match="no nn.Embedding"):
        _plan(model=_NoEmbedding(), x=torch.randn(1, 8, 4))
    plan = _plan(spmd.cp.ring(modules=("proj",)), model=_NoEmbedding(),
                 x=torch.randn(1, 8, 4))
    assert [c.kind for c in _on(plan, "cp", "forward")] == ["all_gather"]


def test_a_dimension_the_mesh_lacks_is_refused():
    with pytest.raises(ValueError, match="'cp'"):
        _plan(shape=(2,), names=("dp",))


def _factorings(total: int, parts: int) -> list[list[int]]:
    if parts == 1:
        return [[total]]
    return [[d, *rest] for d in range(1, total + 1) if total % d == 0
            for rest in _factorings(total // d, parts - 1)]


@pytest.mark.parametrize("src,split", [([16, 16], 2), ([16, 2, 16], 2), ([8, 6], 2),
                                       ([12, 4], 3), ([24, 3, 2], 2)])
def test_a_reshape_of_a_strided_shard_keeps_each_ranks_elements(src, split):
    """Every reshape of every 1-3 dimensional shape that ``unstride_map`` places: each
    rank's piece of the reshaped whole is its piece of the input, reshaped."""
    from spmd.lowering.placements import StridedShard
    from spmd.lowering.redistribute import to_locals
    from spmd.lowering.rules.views import unstride_map

    size, total = 2, math.prod(src)
    x = torch.arange(float(total)).view(src)
    p = StridedShard(0, split)
    placed = 0
    for dst in (d for n in (1, 2, 3) for d in _factorings(total, n)):
        out = unstride_map(src, dst, p, size)
        if out is None:
            continue
        mine, theirs = to_locals(x, p, size), to_locals(x.reshape(dst), out, size)
        for a, b in zip(mine, theirs):
            assert torch.equal(a.reshape(b.shape), b), (src, dst, out)
        placed += 1
    assert placed
