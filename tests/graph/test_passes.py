"""The passes on hand-built graphs, no process group: invariants, not only outputs."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from hypothesis import given, settings, strategies as st

import spmd
from spmd.lowering.specs import lookup

from spmd.lowering.emit import emit
from spmd.lowering.graph import collective_nodes, dependency_graph, is_wait
from spmd.lowering.schedule import check_schedule

from .lowering_helpers import backward_like, buckets, inputs_for, lower


def assert_invariants(gm: fx.GraphModule, infos: tuple, cap: int | None) -> None:
    trainable = [i.name for i in infos if i.kind == "param" and i.requires_grad]
    members = [p for b in buckets(gm) for p in b]
    assert sorted(members) == sorted(trainable), "every gradient in exactly one bucket"
    by_name = {i.name: i for i in infos}
    collectives = collective_nodes(gm)
    assert bool(collectives) == bool(trainable), "a collective exactly when there is a gradient"
    for node in collectives:
        info = node.meta["spmd_collective"]
        assert len({by_name[p].dtype for p in info.params}) == 1, "one dtype per bucket"
        if cap and len(info.params) > 1:
            assert info.bytes <= cap, "bucket within the cap unless one parameter exceeds it"
        waits = [u for u in node.users if is_wait(u)]
        assert len(waits) == 1, "one wait per collective"
    check_schedule(gm)  # every node (each wait) after its inputs, acyclic
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in collectives:
        (wait,) = [u for u in node.users if is_wait(u)]
        assert order[wait] > order[node]


def test_unplanned_and_planned_graphs_compute_the_same_gradients():
    shapes = [(4, 3), (5,), (2, 2, 2), (7,)]
    gm, infos = backward_like(shapes, [torch.float32] * 4, [3, 1, 0, 2])
    expected = gm(*inputs_for(infos))
    planned = lower(gm, infos, bucket_cap_mb=64 / 2**20)
    got = emit(planned)(inputs_for(infos))
    assert len(got) == len(expected) == len(shapes) + 1  # a gradient per parameter, the data's
    for a, b in zip(expected, got):
        assert (a is None and b is None) or torch.equal(a, b)


def test_bucketing_counts_and_order():
    shapes = [(16,)] * 6  # 64 bytes each
    gm, infos = backward_like(shapes, [torch.float32] * 6, [5, 4, 3, 2, 1, 0])
    assert len(collective_nodes(lower(gm, infos, bucket_cap_mb=0))) == 6  # bucketing off
    gm, infos = backward_like(shapes, [torch.float32] * 6, [5, 4, 3, 2, 1, 0])
    planned = lower(gm, infos, bucket_cap_mb=128 / 2**20)
    assert buckets(planned) == [("p5", "p4"), ("p3", "p2"), ("p1", "p0")]  # readiness order
    assert_invariants(planned, infos, 128)


def test_a_parameter_larger_than_the_cap_gets_its_own_bucket():
    gm, infos = backward_like([(4,), (1000,), (4,)], [torch.float32] * 3, [0, 1, 2])
    planned = lower(gm, infos, bucket_cap_mb=100 / 2**20)
    assert buckets(planned) == [("p0",), ("p1",), ("p2",)]


@pytest.mark.parametrize("ranks", [2, 4])
def test_one_dtype_per_bucket_and_wire_dtype(ranks):
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.bfloat16]
    gm, infos = backward_like([(8,)] * 4, dtypes, [0, 1, 2, 3])
    planned = lower(gm, infos, mesh=spmd.Mesh.simulated(ranks), bucket_cap_mb=1.0,
                    reduce_dtype=torch.bfloat16)
    assert sorted(buckets(planned)) == [("p0", "p2"), ("p1", "p3")]
    for node in collective_nodes(planned):
        info = node.meta["spmd_collective"]
        spec = lookup(info.handle)
        assert info.wire_dtype == torch.bfloat16
        if ranks == 2:  # the backend's all-reduce on the bfloat16 buffer
            assert spec.algorithm == "native" and node.meta["val"].dtype == torch.bfloat16
        else:  # packed in the gradients' dtype, sent in bfloat16, added in float32
            assert spec.algorithm == "fp32" and spec.compress == torch.bfloat16
            assert node.meta["val"].dtype == info.dtype
    out = emit(planned)(inputs_for(infos))
    assert [t.dtype for t in out[:4]] == dtypes  # cast back to each parameter's dtype


def test_frozen_parameters_are_in_no_bucket():
    gm, infos = backward_like([(4,)] * 3, [torch.float32] * 3, [0, 1, 2], frozen=frozenset({1}))
    planned = lower(gm, infos, bucket_cap_mb=1.0)
    assert buckets(planned) == [("p0", "p2")]


def test_collective_issued_right_after_its_last_gradient():
    gm, infos = backward_like([(4,)] * 3, [torch.float32] * 3, [2, 0, 1])
    planned = lower(gm, infos, bucket_cap_mb=0)
    collectives = collective_nodes(planned)
    assert len(collectives) == 3  # bucketing off: one per gradient
    for node in collectives:
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
    planned = lower(gm, infos, bucket_cap_mb=cap / 2**20, overlap=overlap)
    assert_invariants(planned, infos, cap)
    if cap == 0:
        assert len(collective_nodes(planned)) == n - len(frozen)
    got = emit(planned)(inputs_for(infos))
    assert len(got) == len(expected) == n + 1
    for a, b in zip(expected, got):
        assert (a is None and b is None) or torch.equal(a, b)


def test_emitted_code_frees_values_after_last_use():
    gm, infos = backward_like([(4,)] * 3, [torch.float32] * 3, [0, 1, 2])
    source = emit(lower(gm, infos, bucket_cap_mb=1.0)).spmd_source
    assert source.count("del ") >= 3 and "args.clear()" in source


def test_a_graph_with_nothing_to_reduce_is_left_as_it_was():
    gm, infos = backward_like([(4,)] * 2, [torch.float32] * 2, [0, 1], frozen=frozenset({0, 1}))
    before = [n.target for n in gm.graph.nodes]
    planned = lower(gm, infos)
    assert [n.target for n in planned.graph.nodes] == before


def _scatter_sum(kind: str, spans: list) -> fx.GraphModule:
    """sum of g_i scattered into zeros of (3, 4, 5) along dim 1 (select: index; slice:
    start, end); output the sum and, to keep it honest, one piece's own use."""
    aten = torch.ops.aten
    graph = fx.Graph()
    total = None
    for i, span in enumerate(spans):
        g = graph.placeholder(f"g{i}")
        if kind == "select":
            piece = graph.call_function(aten.select_backward.default, (g, [3, 4, 5], 1, span))
        else:
            piece = graph.call_function(aten.slice_backward.default,
                                        (g, [3, 4, 5], 1, span[0], span[1], 1))
        total = piece if total is None else graph.call_function(aten.add.Tensor, (total, piece))
    graph.output((total,))
    return fx.GraphModule(torch.nn.Module(), graph)


@pytest.mark.parametrize("kind,spans,fused", [
    ("select", [0, 1, 2, 3], "stack"),
    ("select", [2, -1, 0, 1], "stack"),  # any order, negative indices
    ("slice", [(0, 1), (1, 3), (3, 9223372036854775807)], "cat"),
    ("select", [0, 1, 2], None),  # index 3 missing: zeros there, left as it is
    ("select", [0, 1, 1, 3], None),  # one index twice: a real sum
    ("slice", [(0, 2), (1, 4)], None),  # overlapping
])
def test_scattered_pieces_that_cover_a_dimension_are_stacked(kind, spans, fused):
    gm = _scatter_sum(kind, spans)
    inputs = []
    for span in spans:
        width = 1 if kind == "select" else min(span[1], 4) - span[0]
        shape = (3, 5) if kind == "select" else (3, width, 5)
        inputs.append(torch.randn(shape, dtype=torch.float64))
    expected = gm(*inputs)[0]
    run = emit(gm)
    got = run(list(inputs))[0]
    assert torch.equal(got, expected)
    source = run.spmd_source
    if fused:
        assert f"# {fused}" in source and "_backward" not in source
    else:
        assert "# stack" not in source and "# cat" not in source


def test_scattered_pieces_of_a_dynamic_graph_are_left_alone():
    """A graph Dynamo made dynamic (a module compiled again at another size, in the same
    process) carries symbolic positions: nodes, not ints, where the stacking compares
    them (the sweep's laguna crashed there after another family's compile)."""
    aten = torch.ops.aten
    graph = fx.Graph()
    n = graph.placeholder("n")  # a symbolic split point
    g0, g1 = graph.placeholder("g0"), graph.placeholder("g1")
    first = graph.call_function(aten.slice_backward.default, (g0, [3, 4], 1, 0, n, 1))
    second = graph.call_function(aten.slice_backward.default, (g1, [3, 4], 1, n, 4, 1))
    graph.output((graph.call_function(aten.add.Tensor, (first, second)),))
    run = emit(fx.GraphModule(torch.nn.Module(), graph))
    a, b = torch.randn(3, 1, dtype=torch.float64), torch.randn(3, 3, dtype=torch.float64)
    assert torch.equal(run([1, a, b])[0], torch.cat([a, b], 1))
    assert "# cat" not in run.spmd_source
