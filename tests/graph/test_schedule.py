"""The schedule pass owns where collectives and waits go: without it (switched off by
name, or ``overlap=False``) each wait sits right after its collective; with it, each
collective follows its last input and each wait precedes the first reader of its result,
also when that reader is in the middle of the graph."""

from __future__ import annotations

import torch
import torch.fx as fx
from hypothesis import given, settings, strategies as st

from spmd.lowering.context import InputInfo
from spmd.lowering.emit import emit
from spmd.lowering.graph import collective_nodes, is_wait

from .lowering_helpers import backward_like, inputs_for, lower

aten = torch.ops.aten


def read_mid_graph() -> tuple[fx.GraphModule, tuple]:
    """g0 = 2·x0; v = 3·x1; u = -g0 (reads a gradient mid-graph); g1 = v + 1.
    Outputs: (g0, g1, u)."""
    graph = fx.Graph()
    x0, x1, _data = graph.placeholder("x0"), graph.placeholder("x1"), graph.placeholder("data")
    g0 = graph.call_function(aten.mul.Tensor, (x0, 2.0), name="g0")
    v = graph.call_function(aten.mul.Tensor, (x1, 3.0), name="v")
    u = graph.call_function(aten.neg.default, (g0,), name="u")
    g1 = graph.call_function(aten.add.Tensor, (v, 1.0), name="g1")
    graph.output((g0, g1, u))
    infos = (InputInfo(kind="param", name="p0", shape=(4,), dtype=torch.float32,
                       requires_grad=True),
             InputInfo(kind="param", name="p1", shape=(4,), dtype=torch.float32,
                       requires_grad=True),
             InputInfo(kind="data", name="data", shape=(4,), dtype=torch.float32))
    return fx.GraphModule(torch.nn.Module(), graph), infos


def chain_of(gm: fx.GraphModule, coll: fx.Node) -> list[fx.Node]:
    return [n for n in gm.graph.nodes
            if n.meta.get("spmd_role") is not None and n.meta["spmd_role"].collective == coll.name]


def names(gm: fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes if n.op == "call_function"]


def test_without_schedule_every_wait_and_its_unpacking_follow_the_collective():
    for disabled, options in [(("schedule",), {}), (None, {"overlap": False})]:
        gm, infos = read_mid_graph()
        planned = lower(gm, infos, disabled=disabled, bucket_cap_mb=0, **options)
        collectives = collective_nodes(planned)
        assert len(collectives) == 2, (disabled, options)  # bucketing off: one per gradient
        for coll in collectives:
            node = coll
            chain = chain_of(planned, coll)
            assert chain and is_wait(chain[0]), (disabled, options, coll.name)
            for member in chain:
                assert member is node.next, (disabled, options, member.name)
                node = member


def test_schedule_moves_each_wait_to_just_before_the_first_reader():
    gm, infos = read_mid_graph()
    planned = lower(gm, infos, bucket_cap_mb=0)
    order = names(planned)
    c0, c1 = collective_nodes(planned)
    assert c0.args[0] == [planned.graph.find_nodes(op="call_function", target=aten.mul.Tensor)[0]]
    # g0's all-reduce starts right after g0; v is computed while it is in flight; its
    # wait and unpacking come right before u, the first reader, which reads the reduced g0
    assert order.index(c0.name) == order.index("g0") + 1
    assert order.index("v") < order.index(chain_of(planned, c0)[0].name)
    assert chain_of(planned, c0)[-1].next.name == "u"
    (reduced,) = [n for n in planned.graph.find_nodes(op="call_function", target=aten.neg.default)]
    assert reduced.args[0] is chain_of(planned, c0)[-1]
    # g1's all-reduce follows g1; nothing reads it but the output: its wait ends the graph
    assert c1.prev.name == "g1"
    assert chain_of(planned, c1)[-1].next.op == "output"


def test_schedule_visibly_changes_the_graph_and_not_the_result():
    gm, infos = read_mid_graph()
    expected = gm(*inputs_for(infos))
    on = lower(gm, infos, bucket_cap_mb=0)
    gm, infos = read_mid_graph()
    off = lower(gm, infos, disabled=("schedule",), bucket_cap_mb=0)
    assert names(on) != names(off) and sorted(names(on)) == sorted(names(off))
    for planned in (on, off):
        got = emit(planned)(inputs_for(infos))
        assert len(got) == len(expected) == 3  # (g0, g1, u)
        for a, b in zip(expected, got):
            assert torch.equal(a, b)


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_on_random_graphs_collectives_follow_inputs_and_waits_precede_readers(data):
    n = data.draw(st.integers(1, 8))
    order = data.draw(st.permutations(range(n)))
    cap = data.draw(st.sampled_from([0, 32, 100000]))
    gm, infos = backward_like([(4,)] * n, [torch.float32] * n, list(order))
    planned = lower(gm, infos, bucket_cap_mb=cap / 2**20)
    position = {node: i for i, node in enumerate(planned.graph.nodes)}
    collectives = collective_nodes(planned)
    assert len(collectives) == n if cap == 0 else 1 <= len(collectives) <= n  # every gradient
    for coll in collectives:
        assert coll.prev is max(coll.all_input_nodes, key=position.__getitem__)
        chain = chain_of(planned, coll)
        assert is_wait(chain[0])
        readers = [u for m in chain for u in m.users if u not in chain]
        first = min(readers, key=position.__getitem__)
        nodes = list(planned.graph.nodes)
        between = nodes[position[chain[-1]] + 1:position[first]]
        # only other collectives' waits and unpacking (waiting for the same reader) between
        assert all(n.meta.get("spmd_role") is not None for n in between)
