"""Expert parallelism's ops (``spmd::ep_route``, ``ep_scatter``, ``grouped_mm``,
``ep_gather`` and the backward's ``grouped_mm_weight``, ``grouped_sum``) on a
tensor-parallel dimension: every decision of their rules (``lowering/rules/experts.py``)
checked against running the ops on real shards, on real routing (the plan verifier's
random values are no routing, so it leaves these ops to this test), the same harness as
every other rule's (``test_tp_rules.py``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from spmd.lowering import experts as X
from spmd.lowering.placements import Partial, Replicate, Shard, StridedShard
from spmd.lowering.rules import experts as expert_rules
from spmd.lowering.specs import Handles

from .test_tp_rules import DTYPE, SEEDS, check_graph, trace

OPS = [X.ep_route, X.ep_scatter, X.grouped_mm, X.ep_gather, X.grouped_mm_weight,
       X.grouped_sum]


def _layer(handle: int, k: int, transposed: bool):
    def layer(x, idx, w, gu, dn, b, grad):
        order, send, recv, offs = X.ep_route(idx, handle)
        rows = X.ep_scatter(x.repeat_interleave(k, 0), order, send, recv,
                            X.bound_rows(1, x.shape[0], k), handle)
        gate, up = X.grouped_mm(rows, gu, offs, b, transposed, 1.0).chunk(2, -1)
        ys = X.grouped_mm(F.silu(gate) * up, dn, offs, None, transposed, 0.5)
        out = (X.ep_gather(ys, order, send, recv, handle).view(x.shape[0], k, -1)
               * w.unsqueeze(-1)).sum(1)
        return torch.autograd.grad(out, (x, gu, dn, b), grad)
    return layer


@settings(max_examples=10, deadline=None)
@given(size=st.sampled_from([2, 3]), tokens=st.sampled_from([3, 5]),
       experts=st.sampled_from([1, 3]), transposed=st.booleans(), seed=SEEDS)
def test_expert_ops_on_real_shards(size, tokens, experts, transposed, seed):
    k, hidden, inter = 2, 6, 6
    gen = torch.Generator().manual_seed(seed)
    handles = Handles()
    handle = handles.add(X.ExpertsSpec(module="experts", num_experts=experts, size=1))
    idx = torch.randint(0, experts, (tokens, k), generator=gen)
    x = torch.randn(tokens, hidden, dtype=DTYPE, generator=gen, requires_grad=True)
    w = torch.rand(tokens, k, dtype=DTYPE, generator=gen)
    gu_shape, dn_shape = ((experts, hidden, 2 * inter), (experts, inter, hidden)) if transposed \
        else ((experts, 2 * inter, hidden), (experts, hidden, inter))
    gu = torch.randn(*gu_shape, dtype=DTYPE, generator=gen, requires_grad=True)
    dn = torch.randn(*dn_shape, dtype=DTYPE, generator=gen, requires_grad=True)
    b = torch.randn(experts, 2 * inter, dtype=DTYPE, generator=gen, requires_grad=True)
    grad = torch.randn(tokens, hidden, dtype=DTYPE, generator=gen)
    gm, values = trace(_layer(handle, k, transposed), x, idx, w, gu, dn, b, grad)
    check_graph(gm, values, size, seed, OPS)


def test_expert_tensor_parallelism_is_column_then_row_parallel():
    """A packed gate_up split by its output features (each rank its part of the gate and
    of the up projection) gives the rows' features split; the down projection split by
    its input features then gives partial sums, moved back as they are: no gather of any
    expert weight."""
    handles = Handles()
    handle = handles.add(X.ExpertsSpec(module="experts", num_experts=2, size=1))
    gm, _ = trace(_layer(handle, 2, False), torch.randn(4, 6, dtype=DTYPE, requires_grad=True),
                  torch.randint(0, 2, (4, 2)), torch.rand(4, 2, dtype=DTYPE),
                  *(torch.randn(*s, dtype=DTYPE, requires_grad=True)
                    for s in ((2, 12, 6), (2, 6, 6), (2, 12))),
                  torch.randn(4, 6, dtype=DTYPE))
    first, second = [n for n in gm.graph.nodes if n.target is X.grouped_mm][:2]
    R = Replicate()
    column = expert_rules.grouped_mm(first, (R, StridedShard(1, 2), R, StridedShard(1, 2)), 2)
    assert column[0].output == StridedShard(1, 2), column
    row = expert_rules.grouped_mm(second, (Shard(1), Shard(2), R), 2)
    assert row[0].output == Partial("sum"), row
    gather = [n for n in gm.graph.nodes if n.target is X.ep_gather][0]
    moved = expert_rules._moves(gather, (Partial("sum"), R, R, R), 2)
    assert moved[0].output == Partial("sum") and moved[0].inputs[0] == Partial("sum")
    # rows are never split along themselves: the offsets index them
    assert all(d.inputs[0] == R for d in expert_rules._moves(gather, (Shard(0), R, R, R), 2))
