"""A LLaMA-style model under Megatron's tensor parallelism on a simulated tp=2 mesh (no
processes), in every form its ops come in (tests/llama.py): RMSNorm by hand, as
``F.rms_norm`` and as ``nn.RMSNorm``; rotate-half and complex rotary embeddings;
grouped-query attention by ``enable_gqa``, ``repeat_interleave`` and ``expand``. Every op
has a rule, nothing is gathered on "tp", and each block costs Megatron's two forward
all-reduces (after the attention's and the feed-forward's row-parallel layers)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import spmd
from spmd.lowering.placements import Shard

from ..llama import FORMS, Llama, tokens

aten = torch.ops.aten
LAYERS = 2


def _plan(model: nn.Module):
    return spmd.inspect(model, tokens(), mesh=spmd.Mesh.simulated((2,), dim_names=("tp",)),
                        placements=spmd.tp.megatron())


def _tp(plan, phase: str | None = None) -> list:
    return [c for c in plan.collectives
            if c.mesh_dim == "tp" and (phase is None or c.phase == phase)]


def test_complex_rotary_plans_with_two_all_reduces_per_block():
    """Meta's rotary embeddings (``view_as_complex`` of the heads' pairs times
    ``freqs_cis``, then ``view_as_real(...).flatten(3)``) stay sharded along heads: they
    used to fall back to whole tensors and then fail planning on a view of the gathered
    layout."""
    plan = _plan(Llama(layers=LAYERS, rope="complex"))
    assert [p for p in plan.placed if p.fallback] == []
    forward = _tp(plan, "forward")
    assert [c.kind for c in forward] == ["all_reduce"] * 2 * LAYERS
    assert not [c for c in _tp(plan) if c.kind == "all_gather"]
    ops = {p.op for p in plan.placed}
    assert {"aten.view_as_complex.default", "aten.view_as_real.default"} <= ops


@pytest.mark.parametrize("norm, rope, gqa", FORMS, ids=["-".join(f) for f in FORMS])
def test_every_form_plans_without_fallback_or_gather(norm, rope, gqa):
    plan = _plan(Llama(layers=LAYERS, norm=norm, rope=rope, gqa=gqa))
    assert [p.op for p in plan.placed if p.fallback] == []
    assert not [c for c in _tp(plan) if c.kind == "all_gather"]
    assert len(_tp(plan, "forward")) == 2 * LAYERS
    assert {c.kind for c in _tp(plan)} == {"all_reduce"}


def test_enable_gqa_shards_keys_and_values_on_their_own_heads():
    """4 query heads read 2 key/value heads; at tp=2 rank r holds query heads 2r, 2r+1
    and key/value head r, the one they read. It costs what the expanded form costs."""
    plan = _plan(Llama(layers=1, gqa="enable_gqa"))
    expanded = _plan(Llama(layers=1, gqa="expand"))
    attention = [n for g in plan.graphs.values() for n in g.graph.nodes
                 if n.target in (aten._scaled_dot_product_flash_attention_for_cpu.default,
                                 aten._scaled_dot_product_flash_attention_for_cpu_backward.default)]
    assert len(attention) == 2
    for node in attention:
        choice = node.meta["spmd_tp"]["tp"]
        assert all(p == Shard(1) for p in choice.decision.required(choice.inputs)), choice
        assert "4 query heads read 2 key/value heads" in choice.decision.reason
    key = node.args[2].meta["val"]  # the backward's key, local: one head of two
    assert key.shape[1] == 1
    assert ([(c.kind, c.phase) for c in _tp(plan)]
            == [(c.kind, c.phase) for c in _tp(expanded)])
