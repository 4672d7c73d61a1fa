"""The backward passes on hand-built graphs, no process group: invariants, not only outputs.

A graph here looks like an AOTAutograd backward graph: placeholders, compute, and an
output tuple whose i-th entry is the gradient of forward input i. With a simulated mesh
(no group) the collectives pack and unpack without communicating, so running the
emitted code must give back exactly the gradients the unlowered graph computes.
"""

from __future__ import annotations


import torch
import torch.fx as fx
from hypothesis import given, settings, strategies as st

from spmd.lowering.capture import BACKWARD_PASSES
from spmd.lowering.collectives import collective_nodes
from spmd.lowering.context import InputInfo, LoweringContext
from spmd.lowering.cost_model import CostModel
from spmd.lowering.emit import emit
from spmd.lowering.graph import dependency_graph, is_wait
from spmd.lowering.options import Options
from spmd.lowering.passes import run_passes
from spmd.lowering.schedule import check_schedule

aten = torch.ops.aten


def backward_like(shapes: list[tuple[int, ...]], dtypes: list[torch.dtype], order: list[int],
                  frozen: frozenset[int] = frozenset()) -> tuple[fx.GraphModule, tuple]:
    """Gradient i = 2·x_i + x_(i-1).sum(), computed in ``order``; one data input at the end."""
    graph = fx.Graph()
    xs = [graph.placeholder(f"x{i}") for i in range(len(shapes))]
    data = graph.placeholder("data")
    grads: dict[int, fx.Node] = {}
    for i in order:
        g = graph.call_function(aten.mul.Tensor, (xs[i], 2.0))
        if i:
            g = graph.call_function(aten.add.Tensor, (g, graph.call_function(
                aten.sum.default, (xs[i - 1],))))
        grads[i] = g
    outs = [None if i in frozen else grads[i] for i in range(len(shapes))]
    graph.output(tuple(outs + [graph.call_function(aten.neg.default, (data,))]))
    infos = tuple(InputInfo(kind="param", name=f"p{i}", shape=s, dtype=d,
                            requires_grad=i not in frozen)
                  for i, (s, d) in enumerate(zip(shapes, dtypes)))
    infos += (InputInfo(kind="data", name="data", shape=(3,), dtype=torch.float32),)
    return fx.GraphModule(torch.nn.Module(), graph), infos


def lower(gm: fx.GraphModule, infos: tuple, **options) -> fx.GraphModule:
    ctx = LoweringContext(group=None, world_size=4, options=Options(**options),
                          cost_model=CostModel.default("gloo", 4), inputs=infos)
    return run_passes(gm, ctx, BACKWARD_PASSES)


def inputs_for(infos: tuple) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(i.shape, generator=gen).to(i.dtype) for i in infos]


def buckets(gm: fx.GraphModule) -> list[tuple[str, ...]]:
    return [n.meta["spmd"]["spec"].params for n in collective_nodes(gm)]


def assert_invariants(gm: fx.GraphModule, infos: tuple, cap: int | None) -> None:
    trainable = [i.name for i in infos if i.kind == "param" and i.requires_grad]
    members = [p for b in buckets(gm) for p in b]
    assert sorted(members) == sorted(trainable), "every gradient in exactly one bucket"
    by_name = {i.name: i for i in infos}
    for node in collective_nodes(gm):
        meta = node.meta["spmd"]
        params = meta["spec"].params
        assert len({by_name[p].dtype for p in params}) == 1, "one dtype per bucket"
        if cap and len(params) > 1:
            assert meta["bytes"] <= cap, "bucket within the cap unless one parameter exceeds it"
        waits = [u for u in node.users if is_wait(u)]
        assert len(waits) == 1, "one wait per collective"
    check_schedule(gm)  # every node (each wait) after its inputs, acyclic
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in collective_nodes(gm):
        (wait,) = [u for u in node.users if is_wait(u)]
        assert order[wait] > order[node]


def test_unlowered_and_lowered_graphs_compute_the_same_gradients():
    shapes = [(4, 3), (5,), (2, 2, 2), (7,)]
    gm, infos = backward_like(shapes, [torch.float32] * 4, [3, 1, 0, 2])
    expected = gm(*inputs_for(infos))
    lowered = lower(gm, infos, bucket_cap_mb=64 / 2**20)
    got = emit(lowered)(inputs_for(infos))
    for a, b in zip(expected, got):
        assert (a is None and b is None) or torch.equal(a, b)


def test_bucketing_counts_and_order():
    shapes = [(16,)] * 6  # 64 bytes each
    gm, infos = backward_like(shapes, [torch.float32] * 6, [5, 4, 3, 2, 1, 0])
    assert len(collective_nodes(lower(gm, infos, bucket_cap_mb=0))) == 6  # bucketing off
    gm, infos = backward_like(shapes, [torch.float32] * 6, [5, 4, 3, 2, 1, 0])
    lowered = lower(gm, infos, bucket_cap_mb=128 / 2**20)
    assert buckets(lowered) == [("p5", "p4"), ("p3", "p2"), ("p1", "p0")]  # readiness order
    assert_invariants(lowered, infos, 128)


def test_a_parameter_larger_than_the_cap_gets_its_own_bucket():
    gm, infos = backward_like([(4,), (1000,), (4,)], [torch.float32] * 3, [0, 1, 2])
    lowered = lower(gm, infos, bucket_cap_mb=100 / 2**20)
    assert buckets(lowered) == [("p0",), ("p1",), ("p2",)]


def test_one_dtype_per_bucket_and_wire_dtype():
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.bfloat16]
    gm, infos = backward_like([(8,)] * 4, dtypes, [0, 1, 2, 3])
    lowered = lower(gm, infos, bucket_cap_mb=1.0, reduce_dtype=torch.bfloat16)
    assert sorted(buckets(lowered)) == [("p0", "p2"), ("p1", "p3")]
    for node in collective_nodes(lowered):
        assert node.meta["spmd"]["wire_dtype"] == torch.bfloat16
    out = emit(lowered)(inputs_for(infos))
    assert [t.dtype for t in out[:4]] == dtypes  # cast back to each parameter's dtype


def test_frozen_parameters_are_in_no_bucket():
    gm, infos = backward_like([(4,)] * 3, [torch.float32] * 3, [0, 1, 2], frozen=frozenset({1}))
    lowered = lower(gm, infos, bucket_cap_mb=1.0)
    assert buckets(lowered) == [("p0", "p2")]


def test_overlap_places_waits_late_and_no_overlap_right_after_the_issue():
    gm, infos = backward_like([(4,)] * 4, [torch.float32] * 4, [0, 1, 2, 3])
    early = lower(gm, infos, bucket_cap_mb=0)
    nodes = list(early.graph.nodes)
    first_wait = min(i for i, n in enumerate(nodes) if is_wait(n))
    last_issue = max(nodes.index(n) for n in collective_nodes(early))
    assert first_wait > last_issue  # every collective is in flight before the first wait
    gm, infos = backward_like([(4,)] * 4, [torch.float32] * 4, [0, 1, 2, 3])
    sync = lower(gm, infos, bucket_cap_mb=0, overlap=False)
    for node in collective_nodes(sync):
        assert is_wait(node.next)


def test_collective_issued_right_after_its_last_gradient():
    gm, infos = backward_like([(4,)] * 3, [torch.float32] * 3, [2, 0, 1])
    lowered = lower(gm, infos, bucket_cap_mb=0)
    for node in collective_nodes(lowered):
        grads = node.args[0]
        assert node.prev in grads


def test_dependency_graph_marks_communication():
    gm, infos = backward_like([(4,)] * 2, [torch.float32] * 2, [0, 1])
    g = dependency_graph(lower(gm, infos, bucket_cap_mb=1.0).graph)
    kinds = {d["kind"] for _, d in g.nodes(data=True)}
    assert {"communication", "wait", "compute", "io"} <= kinds


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_invariants_hold_on_random_graphs(data):
    n = data.draw(st.integers(1, 12))
    shapes = [tuple(data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
              for _ in range(n)]
    dtypes = [data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
              for _ in range(n)]
    order = data.draw(st.permutations(range(n)))
    frozen = frozenset(data.draw(st.sets(st.integers(0, n - 1), max_size=n // 2)))
    cap = data.draw(st.sampled_from([0, 16, 64, 256, 100000]))
    overlap = data.draw(st.booleans())
    gm, infos = backward_like(shapes, dtypes, list(order), frozen)
    expected = gm(*inputs_for(infos))
    lowered = lower(gm, infos, bucket_cap_mb=cap / 2**20, overlap=overlap)
    assert_invariants(lowered, infos, cap)
    if cap == 0:
        assert len(collective_nodes(lowered)) == n - len(frozen)
    got = emit(lowered)(inputs_for(infos))
    for a, b in zip(expected, got):
        assert (a is None and b is None) or torch.equal(a, b)


def test_emitted_code_frees_values_after_last_use():
    gm, infos = backward_like([(4,)] * 3, [torch.float32] * 3, [0, 1, 2])
    source = emit(lower(gm, infos, bucket_cap_mb=1.0)).spmd_source
    assert source.count("del ") >= 3 and "args.clear()" in source
