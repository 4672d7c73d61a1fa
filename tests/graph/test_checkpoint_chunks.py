"""Where each rank's stored part lies in the whole tensor, for checkpoints: the chunks of
``spmd.checkpoint.chunks_of`` hold exactly what ``TPSpec.piece`` then ``ShardSpec.shard_of``
put in the part, and every rank's chunks tile the whole once (replicas alike), padding
left out. No process group: each rank's view is made with a stand-in group."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

import spmd
from spmd.checkpoint import ChunkedTensor, chunks_of
from spmd.lowering.placements import Sharding
from spmd.lowering.specs import ShardSpec, TPSpec


def _group(rank: int) -> SimpleNamespace:
    return SimpleNamespace(rank=lambda: rank)


# (whole shape, tensor-parallel placement or None, tp size, fsdp size, fsdp dim)
CASES = [
    ((11, 8), None, 1, 2, 0),                        # fsdp, padded
    ((3, 5), None, 1, 4, 0),                         # fsdp, a rank with nothing
    ((8, 6), None, 1, 2, 1),                         # shard_placement_fn's Shard(1)
    ((16, 16), spmd.Shard(0), 2, 2, 0),              # fsdp x tp on one dimension
    ((11, 8), spmd.Shard(1), 2, 2, 0),               # fsdp x tp, padded rows
    ((12, 4), spmd.StridedShard(0, 3), 2, 1, 0),     # fused qkv under tp
    ((12, 4), spmd.StridedShard(0, 3), 2, 3, 0),     # and fsdp across its blocks
    ((6,), spmd.Shard(0), 3, 1, 0),                  # tp alone
    ((), None, 1, 2, 0),                             # a 0-dim parameter
]


def _parts(shape, placement, tp, fsdp, dim):
    """Every (tp rank, fsdp rank): (stored part, chunks)."""
    whole = torch.arange(1, max(1, torch.Size(shape).numel()) + 1).reshape(shape)
    out = {}
    mesh = spmd.Mesh.simulated((tp, fsdp), ("tp", "fsdp"))
    placed = {} if placement is None else {"tp": placement}
    for t, f in itertools.product(range(tp), range(fsdp)):
        piece = None if placement is None else TPSpec(
            param="w", shape=shape, sharding=Sharding.on(mesh, placed), dims=("tp",),
            groups={"tp": _group(t)})
        value = whole if piece is None else piece.piece(whole)
        shard = None
        if fsdp > 1:
            rows = value.shape[dim] if value.dim() else 1
            shard = ShardSpec(param="w", shape=tuple(value.shape), dtype=value.dtype,
                              sharding=Sharding.on(mesh, {**placed, "fsdp": spmd.Shard(dim)}),
                              rows=-(-rows // fsdp), group=_group(f), size=fsdp,
                              mesh_dim="fsdp", dim=dim)
            value = shard.shard_of(value)
        out[t, f] = value, chunks_of(shape, shard, piece)
    return whole, out


def _block(t, offsets, sizes):
    for d, (at, n) in enumerate(zip(offsets, sizes)):
        t = t.narrow(d, at, n)
    return t


@pytest.mark.parametrize("case", CASES, ids=[str(c[:2]) for c in CASES])
def test_chunks_hold_what_the_part_holds_and_tile_the_whole(case):
    whole, parts = _parts(*case)
    seen = torch.zeros_like(whole)
    for part, chunks in parts.values():
        held = 0
        for local_at, at, sizes in chunks:
            if not sizes:  # 0-dim: the one row
                assert part.reshape(-1)[0] == whole
                seen += 1
                held += 1
                continue
            assert torch.equal(_block(part, local_at, sizes), _block(whole, at, sizes))
            _block(seen, at, sizes).add_(1)
            held += torch.Size(sizes).numel()
        assert held == int((part != 0).sum())  # everything but the padding
    assert torch.equal(seen, torch.ones_like(whole))  # once each: no gap, no overlap


def test_a_shard_of_a_piece_is_one_block_at_its_true_offset():
    # the case: a (16, 16) weight, tp Shard(0) then fsdp Shard(0) on a 2x2 mesh
    _, parts = _parts((16, 16), spmd.Shard(0), 2, 2, 0)
    assert parts[1, 0][1] == (((0, 0), (8, 0), (4, 16)),)
    assert parts[0, 1][1] == (((0, 0), (4, 0), (4, 16)),)


def test_a_chunked_tensor_is_the_whole_shape_and_refuses_to_compute():
    _, parts = _parts((11, 8), None, 1, 2, 0)
    part, chunks = parts[0, 1]
    t = ChunkedTensor(part, (11, 8), chunks)
    assert t.shape == (11, 8) and t.to_local() is part
    assert "chunks=1" in repr(t)
    with pytest.raises(RuntimeError, match="set_state_dict"):
        t + 1


def test_a_model_planned_on_a_simulated_mesh_is_refused():
    model = spmd.parallelize(torch.nn.Linear(4, 4).double(), strategy="fsdp",
                             mesh=spmd.Mesh.simulated(2))
    with pytest.raises(RuntimeError, match="simulated mesh"):
        spmd.checkpoint.get_state_dict(model)
