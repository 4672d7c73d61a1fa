"""Views of a Plan on hand-built and captured plans, planned for simulated meshes (no
process group anywhere in this file)."""

from __future__ import annotations

import networkx as nx
import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

import spmd
from spmd.lowering.cost_model import CostModel
from spmd.lowering.options import Options
from spmd.lowering.passes import Provenance
from spmd.plan.plan import Bucket, Collective, Fallback, Plan

from ..models import MODELS, batch


@pytest.fixture(scope="module")
def captured():
    x, _ = batch("encoder")
    return spmd.inspect(MODELS["encoder"](), x, mesh=spmd.Mesh.simulated(64), bucket_cap_mb=0.004)


def hand_built() -> Plan:
    graph = fx.Graph()
    a = graph.placeholder("a")
    graph.output(graph.call_function(torch.ops.aten.neg.default, (a,)))
    why = Provenance(params=("w",), pass_name="bucketing", reason="by hand")
    model = CostModel.default("gloo", 4)
    plan = Plan(strategy="ddp", world_size=4, group="g", options=Options(), cost_model=model,
                graphs={"g0.backward": fx.GraphModule(torch.nn.Module(), graph)},
                fallbacks=[Fallback(param="v", reason="eager code")], frozen=["f"])
    plan.buckets.append(Bucket(index=0, graph="g0", params=("w",), dtype=torch.float32,
                               wire_dtype=torch.bfloat16, numel=10, bytes=20, kernel="torch",
                               predicted_seconds=model.seconds("all_reduce", 20),
                               collective="all_reduce_0"))
    plan.collectives.append(Collective(name="all_reduce_0", kind="all_reduce", bytes=20,
                                       group="g", group_ranks=(0, 1, 2, 3), bucket=0, graph="g0",
                                       provenance=why, predicted_seconds=1e-3, mesh_dim="dp",
                                       placements="Partial('avg') -> Replicate()"))
    plan.compute["g0"] = (1e-3, 2e-3)
    return plan


def test_to_networkx_holds_every_node_with_attributes(captured):
    g = captured.to_networkx()
    expected = sum(len(gm.graph.nodes) for gm in captured.graphs.values())
    assert g.number_of_nodes() == expected
    assert nx.is_directed_acyclic_graph(g)
    comm = [n for n, d in g.nodes(data=True) if d["kind"] == "communication"]
    assert len(comm) == len(captured.collectives)
    for n in comm:
        assert {"bytes", "bucket", "predicted_seconds", "provenance"} <= set(g.nodes[n])
    assert {d["kind"] for _, d in g.nodes(data=True)} >= {"compute", "communication", "wait",
                                                          "io"}


def test_same_buckets_whatever_the_number_of_ranks():
    x, _ = batch("encoder")
    plans = {n: spmd.inspect(MODELS["encoder"](), x, mesh=spmd.Mesh.simulated(n))
             for n in (2, 16, 1024)}
    layouts = {n: [b.params for b in p.buckets] for n, p in plans.items()}
    assert layouts[2] == layouts[16] == layouts[1024]
    comm = [plans[n].predicted_communication_seconds() for n in (2, 16, 1024)]
    assert comm[0] < comm[1] < comm[2]  # only the predicted communication changes


@pytest.mark.parametrize("name", ["mlp", "batchnorm"])  # buffers: nobody to broadcast to
def test_inspect_with_example_inputs_leaves_the_model_alone(name):
    model = MODELS[name]()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = spmd.inspect(model, batch(name)[0], mesh=spmd.Mesh.simulated(8))
    assert plan.world_size == 8 and plan.buckets
    assert not hasattr(model, "_spmd") and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_inspect_a_step_function_without_running_it():
    @spmd.parallelize
    def step(model, x, y, opt):
        F.mse_loss(model(x), y).backward()
        opt.step()

    model = MODELS["mlp"]()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    before = [p.clone() for p in model.parameters()]
    plan = spmd.inspect(step, model, *batch("mlp"), opt, mesh=spmd.Mesh.simulated(32))
    assert list(plan.graphs) == ["step0.step"] and plan.world_size == 32
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_predicted_timeline_lanes(captured):
    tl = captured.predicted_timeline()
    assert {s.lane for s in tl.spans} <= {"compute", "communication", "exposed"}
    assert len(tl.lane("communication")) == len(captured.collectives)
    assert tl.step_seconds >= sum(s.seconds for s in tl.lane("compute"))
    starts = [s.start for s in tl.lane("communication")]
    assert starts == sorted(starts)  # buckets are served in issue order


def test_timeline_figure_has_three_lanes(captured):
    fig = captured.timeline()
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_yticklabels()] == ["compute", "communication",
                                                             "exposed"]
    assert "predicted" in ax.get_title(loc="left")


@pytest.mark.parametrize("plan_kind", ["captured", "hand-built"])
def test_explain_each_kind_of_object(captured, plan_kind):
    plan = captured if plan_kind == "captured" else hand_built()
    first = plan.collectives[0]
    by_name = plan.explain(first.name)
    assert first.name in by_name and "Partial('avg') -> Replicate()" in by_name
    assert "µs predicted" in by_name and str(first.bytes) in by_name.replace(",", "")
    assert plan.explain(0) == by_name == plan.explain(plan.buckets[0])
    param = plan.buckets[0].params[0]
    assert f"parameter {param!r}" in plan.explain(param)
    with pytest.raises(KeyError, match="neither a collective"):
        plan.explain("no.such.parameter")
    with pytest.raises(KeyError, match="no bucket 99"):
        plan.explain(99)
    with pytest.raises(TypeError):
        plan.explain(3.5)


def test_explain_fallback_and_frozen_on_a_hand_built_plan():
    plan = hand_built()
    assert "eager safety net" in plan.explain("v")
    assert "frozen" in plan.explain("f")
    assert "sent as torch.bfloat16" in plan.explain(0)


@pytest.mark.parametrize("plan_kind", ["captured", "hand-built"])
def test_html_has_the_table_and_a_drawing(captured, plan_kind):
    plan = captured if plan_kind == "captured" else hand_built()
    page = plan._repr_html_()
    assert "<table>" in page and "<svg" in page
    assert page.count("<tr>") == len(plan.buckets) + 1


def test_collective_repr_names_its_provenance(captured):
    text = repr(captured.collectives[0])
    assert "bucketing" in text and "cap" in text and captured.collectives[0].graph in text
    summary = captured.summary()
    assert "collective" in summary and "why" in summary
