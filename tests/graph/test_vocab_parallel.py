"""Vocabulary-parallel embeddings and heads (``spmd.tp.megatron(vocab_parallel=True)``):
the ranks' masked lookups against the whole table, and the plans on simulated meshes.
Training equal to one process in float64 is tests/cpu/test_zoo.py's ``tp+vp`` and
``fsdp x tp+sp+vp`` runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import spmd
from spmd.lowering.ranked import vocab_lookup, vocab_lookup_backward

from ..models import Transformer, tokens

LAYERS = 2


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("padding_idx", [-1, 5])
def test_the_ranks_lookups_add_up_to_the_whole_tables(size, padding_idx):
    g = torch.Generator().manual_seed(size)
    table = torch.randn(32, 8, dtype=torch.float64, generator=g)
    table[3] = float("inf")  # a row outside a rank's range never reaches its output
    indices = torch.randint(0, 32, (4, 6), generator=g)
    indices[0, 0] = 3
    pieces = table.chunk(size)
    parts = [vocab_lookup(r, pieces[r], indices) for r in range(size)]
    assert all(torch.isfinite(p).all() for r, p in enumerate(parts) if r != 0)
    assert torch.equal(sum(parts), torch.nn.functional.embedding(indices, table))
    grad = torch.randn(4, 6, 8, dtype=torch.float64, generator=g)
    whole = torch.ops.aten.embedding_dense_backward(grad, indices, 32, padding_idx, False)
    rows = [vocab_lookup_backward(r, grad, indices, 32 // size, padding_idx)
            for r in range(size)]
    assert torch.allclose(torch.cat(rows), whole, rtol=0, atol=1e-12)


def _plan(**options):
    torch.manual_seed(0)
    return spmd.inspect(Transformer(layers=LAYERS), tokens(length=8)[0],
                        mesh=spmd.Mesh.simulated((2,), dim_names=("tp",)),
                        placements=spmd.tp.megatron(**options))


def _tp(plan, phase):
    return [c for c in plan.collectives if c.mesh_dim == "tp" and c.phase == phase]


def test_one_reduction_per_lookup_and_no_table_traffic():
    plan = _plan(vocab_parallel=True)
    ops = {p.op for p in plan.placed}
    assert {"spmd.vocab_embedding.default", "spmd.vocab_embedding_backward.default"} <= ops
    forward = _tp(plan, "forward")
    # the lookup's partial sums, two per block (the head stays whole)
    assert [c.kind for c in forward] == ["all_reduce"] * (1 + 2 * LAYERS)
    assert "emb" in forward[0].provenance.params  # the lookup's partial sums
    embedding_bytes = 32 * 16 * 4
    assert all(c.bytes != embedding_bytes // 2 for c in plan.collectives)  # no table moved
    backward = _tp(plan, "backward")
    # two per block; the forward's reduced lookup is saved, not reduced again, and the
    # table's gradient is computed by rows where it lives
    assert [c.kind for c in backward] == ["all_reduce"] * (2 * LAYERS)
    assert not any("embedding" in c.provenance.reason for c in backward)


def test_with_sequence_parallelism_the_lookup_is_reduce_scattered():
    plan = _plan(vocab_parallel=True, sequence_parallel=True)
    first = _tp(plan, "forward")[0]
    assert first.kind == "reduce_scatter"
    assert first.placements == "Partial('sum') -> Shard(1)"


def test_the_preset_splits_token_tables_and_heads_not_positions():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1,
                                      n_head=4))
    placed = spmd.tp.megatron(gpt2, vocab_parallel=True)
    assert placed["tp"]["transformer.wte.weight"] == spmd.Shard(0)
    assert "transformer.wpe.weight" not in placed["tp"]
    assert "lm_head.weight" not in placed["tp"]  # tied: the same parameter as wte's
    found = spmd.tp.vocabulary_layers(Transformer())
    assert set(found) == {"emb", "head"}
    assert "head onto 32 tokens" in found["head"]
    placed = spmd.tp.megatron(Transformer(), vocab_parallel=True)
    assert placed["tp"]["emb.weight"] == spmd.Shard(0)
    assert "head.weight" not in placed["tp"]  # its logits would need gathering


def test_bad_arguments():
    with pytest.raises(TypeError, match="vocab_parallel must be a bool"):
        spmd.tp.megatron(vocab_parallel=1)

    class NoTable(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.o = nn.Linear(4, 4), nn.Linear(4, 4)

    with pytest.raises(ValueError, match="no nn.Embedding"):
        spmd.tp.megatron(NoTable(), vocab_parallel=True)
