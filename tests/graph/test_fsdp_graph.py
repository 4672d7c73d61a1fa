"""The structure of sharded plans, on simulated meshes (no processes): every parameter use
is preceded by exactly one gather in the same graph, every gradient leaves by exactly one
reduce-scatter, gathered buffers die after their last use, and the schedule prefetches."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import spmd
from spmd.lowering import ops
from spmd.lowering.graph import collective_nodes, is_wait
from spmd.lowering.placements import Replicate, Shard

from ..models import SHARDED_MODELS, batch


class Deep(nn.Module):
    """8 transformer layers: enough that sharding's memory effects show."""

    def __init__(self, layers: int = 8, width: int = 32) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(width, nhead=2, dim_feedforward=2 * width,
                                           dropout=0.0, batch_first=True, bias=False)
        self.embed = nn.Linear(8, width)
        self.layers = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        return self.head(self.layers(self.embed(x).unsqueeze(1).expand(-1, 4, -1)).mean(1))


def _planned(model: nn.Module, name: str, ranks: int = 4, **options):
    torch.manual_seed(0)
    model = spmd.parallelize(model, mesh=spmd.Mesh.simulated(ranks), strategy="fsdp",
                             **options)
    x, y = batch(name)
    F.mse_loss(model(x), y).backward()
    return model, spmd.inspect(model)


def _graph(plan, phase: str) -> fx.GraphModule:
    (gm,) = [g for n, g in plan.graphs.items() if n.endswith(phase)]
    return gm


def _gathered_params(gm: fx.GraphModule) -> list[str]:
    return [p for c in collective_nodes(gm) if c.target is ops.bucket_all_gather
            for p in c.meta["spmd_collective"].params]


def _whole_values(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.target is operator.getitem
            and n.args[0].target is ops.unpack_gathered]


@pytest.mark.parametrize("name", ["mlp", "encoder", "cnn", "tied"])
def test_each_parameter_is_gathered_exactly_once_before_its_uses(name):
    model, plan = _planned(SHARDED_MODELS[name](), name)
    fw = _graph(plan, "forward")
    params = [n for n, _ in model.named_parameters()]
    assert sorted(_gathered_params(fw)) == sorted(params)  # tied weights: once
    order = {n: i for i, n in enumerate(fw.graph.nodes)}
    wholes = _whole_values(fw)
    assert wholes, "no gathered parameter is unpacked in the forward"
    for whole in wholes:
        wait = whole.args[0].args[0]
        assert is_wait(wait)
        assert all(order[use] > order[wait] for use in whole.users)
    # a parameter input is read by its gather only (and saved whole for backward's gather)
    for node in fw.graph.nodes:
        if node.op == "placeholder" and any(u.target is ops.bucket_all_gather
                                            for u in node.users):
            assert all(u.target is ops.bucket_all_gather or u.op == "output"
                       for u in node.users), node.name
    assert not any(n.target is ops.shard_gather for n in fw.graph.nodes)


@pytest.mark.parametrize("name", ["mlp", "encoder", "tied"])
def test_each_gradient_leaves_by_exactly_one_reduce_scatter(name):
    model, plan = _planned(SHARDED_MODELS[name](), name)
    bw = _graph(plan, "backward")
    scattered = [p for c in collective_nodes(bw) if c.target is ops.bucket_reduce_scatter
                 for p in c.meta["spmd_collective"].params]
    assert sorted(scattered) == sorted(n for n, p in model.named_parameters())
    assert not any(n.target is ops.shard_reduce for n in bw.graph.nodes)
    kinds = {c.meta["spmd_collective"].kind for c in collective_nodes(bw)}
    assert "all_reduce" not in kinds
    for c in collective_nodes(bw):
        if c.target is ops.bucket_reduce_scatter:
            info = c.meta["spmd_collective"]
            assert (info.src, info.dst) == (spmd.Partial("avg"), Shard(0))


def test_reshard_after_forward_saves_shards_and_gathers_again_in_backward():
    _, plan = _planned(Deep(), "mlp")
    fw, bw = _graph(plan, "forward"), _graph(plan, "backward")
    saved = {n.name for n in bw.graph.nodes if n.op == "placeholder"}
    outputs = [a for a in fw.graph.output_node().all_input_nodes if a.name in saved]
    for value in outputs:  # nothing gathered is kept from forward to backward
        node = value
        while node.op == "call_function" and len(node.all_input_nodes) == 1:
            assert node.target is not ops.unpack_gathered, value.name
            node = node.all_input_nodes[0]
    resharded = [n for n in bw.graph.nodes if n.meta.get("spmd_resharded")]
    assert resharded and _gathered_params(bw)


def test_keeping_gathered_parameters_means_no_backward_gathers():
    _, plan = _planned(Deep(), "mlp", reshard_after_forward=False)
    assert _gathered_params(_graph(plan, "backward")) == []
    kept = plan.memory().activations
    _, resharded = _planned(Deep(), "mlp")
    assert kept > resharded.memory().activations  # the gathered weights it keeps


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_the_next_bucket_is_gathered_before_this_one_is_waited_on(phase):
    _, plan = _planned(Deep(), "mlp", bucket_cap_mb=0.01)
    gm = _graph(plan, phase)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    gathers = [c for c in collective_nodes(gm) if c.target is ops.bucket_all_gather]
    waits = [next(u for u in c.users if is_wait(u)) for c in gathers]
    pairs = sorted(zip(waits, gathers), key=lambda p: order[p[0]])
    assert len(pairs) >= 4
    for (wait, _), (_, following) in zip(pairs, pairs[1:]):
        assert order[following] < order[wait]  # issued one bucket ahead
    for (previous_wait, _), (_, following) in zip(pairs, pairs[2:]):
        assert order[following] > order[previous_wait]  # but no further


def test_one_reduce_scatter_in_flight():
    _, plan = _planned(Deep(), "mlp", bucket_cap_mb=0.01)
    bw = _graph(plan, "backward")
    order = {n: i for i, n in enumerate(bw.graph.nodes)}
    scatters = [c for c in collective_nodes(bw) if c.target is ops.bucket_reduce_scatter]
    assert len(scatters) >= 3
    for coll, following in zip(scatters, scatters[1:]):
        wait = next(u for u in coll.users if is_wait(u))
        assert order[wait] < order[following]


def test_gathered_buckets_are_a_fraction_of_the_model_and_die_after_use():
    # width 256: an eighth of the model is above the cost model's latency floor
    _, plan = _planned(Deep(layers=8, width=256), "mlp")
    memory = plan.memory()
    assert memory.peak_gathered < memory.unsharded_params / 2
    fw = _graph(plan, "forward")
    sizes = [c.meta["spmd_collective"].bytes for c in collective_nodes(fw)]
    largest = max(full for _, full, _ in plan.parameters.values())
    assert len(sizes) >= 8 and max(sizes) <= memory.unsharded_params // 8 + largest


def test_memory_view_shrinks_with_ranks():
    views = {}
    for ranks in (1, 2, 4, 8):
        _, plan = _planned(Deep(), "mlp", ranks=ranks)
        views[ranks] = plan.memory("adamw")
    whole = views[1].persistent
    for ranks, view in views.items():
        padding = 4 * ranks * len(list(Deep().parameters())) * 64  # rows padded, generously
        assert view.persistent <= whole / ranks + padding, ranks
        assert view.params * 4 == view.persistent - view.buffers  # params+grads+2 states
    assert views[8].peak < views[2].peak < views[1].peak
    text = str(views[4])
    assert "predicted peak" in text and "optimizer state" in text
    with pytest.raises(ValueError, match="optimizer must be one of"):
        views and _planned(Deep(), "mlp")[1].memory("lion")


def test_plan_says_which_parameters_are_shards_and_why_each_collective_exists():
    _, plan = _planned(SHARDED_MODELS["mlp"](), "mlp", bucket_cap_mb=0)
    assert plan.sharded == sorted(n for n, _ in SHARDED_MODELS["mlp"]().named_parameters())
    kinds = {(c.kind, c.phase) for c in plan.collectives}
    assert kinds == {("all_gather", "forward"), ("all_gather", "backward"),
                     ("reduce_scatter", "backward")}
    for c in plan.collectives:
        assert c.provenance.pass_name == "shard_params" and c.provenance.params
    text = plan.summary()
    assert "all-gather" in text and "reduce-scatter" in text and "dim-0 shards" in text


def test_uneven_rows_are_padded_and_placement_tells_the_global_shape():
    model, _ = _planned(SHARDED_MODELS["mlp"](), "mlp", ranks=3)
    weight = dict(model.named_parameters())["fc1.weight"]  # whole (16, 8): 6 rows a rank
    placed = spmd.placement_of(weight)
    assert placed.shape == (16, 8) and placed.local_shape == (6, 8) == tuple(weight.shape)
    assert placed.sharding.placements == (Shard(0),)
    assert placed.rows == 6 and placed.padding == 0  # rank 0 of a simulated mesh


def test_a_whole_step_plans_gathers_reduce_scatters_and_the_fused_optimizer_on_copies():
    def step(model, x, y, opt):
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    model = SHARDED_MODELS["mlp"]()
    opt = torch.optim.AdamW(model.parameters())
    x, y = batch("mlp")
    plan = spmd.inspect(step, model, x, y, opt, mesh=spmd.Mesh.simulated(4), strategy="fsdp")
    assert {c.kind for c in plan.collectives} == {"all_gather", "reduce_scatter"}
    assert list(plan.optimizer.values())[0].startswith("fused")
    # inspect planned on copies: the model and its optimizer are untouched
    assert tuple(model.fc1.weight.shape) == (16, 8)
    assert opt.param_groups[0]["params"][0] is model.fc1.weight


def test_a_step_reading_sharded_gradients_is_refused_by_name():
    def step(model, x, y, opt):
        F.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # would see shards only
        opt.step()

    model = SHARDED_MODELS["mlp"]()
    with pytest.raises(RuntimeError, match="each rank holds only its shard"):
        spmd.inspect(step, model, *batch("mlp"), torch.optim.SGD(model.parameters(), lr=0.1),
                     mesh=spmd.Mesh.simulated(2), strategy="fsdp")


def test_a_model_parallelized_as_a_module_is_refused_by_a_sharded_step():
    def step(model, x, y, opt):
        F.mse_loss(model(x), y).backward()
        opt.step()

    model = spmd.parallelize(SHARDED_MODELS["mlp"](), mesh=spmd.Mesh.simulated(2))
    with pytest.raises(ValueError, match="already parallelized as a module"):
        spmd.parallelize(step, strategy="fsdp", mesh=spmd.Mesh.simulated(2))(
            model, *batch("mlp"), torch.optim.SGD(model.parameters(), lr=0.1))


def test_hsdp_shards_along_fsdp_and_splits_the_batch_along_both():
    mesh = spmd.Mesh.simulated((2, 4), ("dp", "fsdp"))
    model = spmd.parallelize(SHARDED_MODELS["mlp"](), mesh=mesh, strategy="hsdp")
    x, y = batch("mlp")
    F.mse_loss(model(x), y).backward()
    plan = spmd.inspect(model)
    assert {c.mesh_dim for c in plan.collectives} == {"fsdp"}
    weight = dict(model.named_parameters())["fc1.weight"]
    assert spmd.placement_of(weight).sharding.placements == (Replicate(), Shard(0))
    assert tuple(weight.shape) == (4, 8)
    fw = _graph(plan, "forward")
    inputs = [n.meta["sharding"].placements for n in fw.graph.nodes if n.op == "placeholder"]
    assert (Shard(0), Shard(0)) in inputs  # the batch


def test_the_predicted_timeline_shows_gathers_beside_the_forward_compute():
    _, plan = _planned(Deep(), "mlp", bucket_cap_mb=0.01)
    timeline = plan.predicted_timeline()
    forward = [sp for sp in timeline.lane("compute") if "forward" in sp.label]
    gathers = [sp for sp in timeline.lane("communication") if sp.label.startswith("all_gather")]
    forward_end = max(sp.end for sp in forward)
    early = [g for g in gathers if g.start < forward_end]
    assert len(early) >= 4  # the forward's gathers run during the forward, one ahead
    assert any(g.start > min(sp.start for sp in forward) for g in early)
