"""The IR of a planned graph: every value node carries a typed sharding on the planning
mesh and a fake value; passes hand typed records to each other; meshes of several
dimensions are planned per dimension or refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

import spmd
from spmd.lowering.graph import collective_nodes, is_wait
from spmd.lowering.placements import Partial, Replicate, Shard, Sharding, Varying
from spmd.lowering.propagate import propagate
from spmd.lowering.state import Boundary, Buckets, PassOrderError, find
from spmd.lowering.strategy import resolve_strategy

from ..models import MODELS, batch
from .lowering_helpers import backward_like, context, lower


def shardings(value):
    return list(value) if isinstance(value, tuple) else [value]


def assert_typed(gm: fx.GraphModule, mesh: spmd.Mesh) -> None:
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        assert "val" in node.meta, node.name
        specs = shardings(node.meta.get("sharding"))
        assert specs and all(isinstance(s, Sharding) and s.mesh == mesh for s in specs), node.name
        assert all(len(s.placements) == mesh.ndim for s in specs)


def test_hand_built_graph_every_node_typed_and_gradients_partial_until_reduced():
    mesh = spmd.Mesh.simulated(4)
    gm, infos = backward_like([(4, 3), (5,)], [torch.float32] * 2, [1, 0])
    planned = lower(gm, infos, mesh=mesh, bucket_cap_mb=1.0)
    assert_typed(planned, mesh)
    boundary = find(planned, Boundary)
    assert [g.param for g in boundary.gradients] == ["p1", "p0"]  # in graph order
    nodes = {n.name: n for n in planned.graph.nodes}
    for g in boundary.gradients:
        assert nodes[g.node].meta["sharding"]["dp"] == Partial("avg")
    placeholders = [n for n in planned.graph.nodes if n.op == "placeholder"]
    assert [p.meta["sharding"]["dp"] for p in placeholders] == [Replicate(), Replicate(),
                                                                Shard(0)]
    (coll,) = collective_nodes(planned)
    assert coll.meta["sharding"]["dp"] == Partial("avg")
    assert coll.meta["val"].shape == (4 * 3 + 5,)  # the flat bucket
    (wait,) = [u for u in coll.users if is_wait(u)]
    assert wait.meta["sharding"]["dp"] == Replicate()
    for out in planned.graph.output_node().args[0][:2]:  # the reduced gradients
        assert out.meta["sharding"]["dp"] == Replicate()
    neg = planned.graph.output_node().args[0][2]  # computed from the batch: each rank's own
    assert neg.meta["sharding"]["dp"] == Varying()
    assert find(planned, Buckets).cap == 1 << 20


def test_captured_module_and_step_graphs_are_typed_on_a_2d_mesh():
    mesh = spmd.Mesh.simulated((4, 1), dim_names=("dp", "tp"))
    x, y = batch("encoder")
    plan = spmd.inspect(MODELS["encoder"](), x, mesh=mesh, bucket_cap_mb=0.004)
    assert set(plan.graphs) == {"graph0.forward", "graph0.backward"}
    for gm in plan.graphs.values():
        assert_typed(gm, mesh)
    backward = plan.graphs["graph0.backward"]
    saved = [n for n in backward.graph.nodes if n.op == "placeholder"]
    kinds = {n.meta["sharding"]["dp"] for n in saved}
    assert kinds == {Replicate(), Varying(), Shard(0)}  # weights, activations, the batch
    assert all(n.meta["sharding"]["tp"] == Replicate() for n in saved)

    def step(model, x, y, opt):
        F.mse_loss(model(x), y).backward()
        opt.step()

    model = MODELS["mlp"]()
    xs, ys = batch("mlp")
    plan = spmd.inspect(step, model, xs, ys, torch.optim.SGD(model.parameters(), lr=0.1),
                        mesh=mesh)
    (gm,) = plan.graphs.values()
    assert_typed(gm, mesh)
    assert plan.optimizer == {"step0": "fused (sgd runs from each reduced bucket)"}


def test_a_pass_without_the_result_it_needs_names_the_missing_pass():
    gm, infos = backward_like([(4,)], [torch.float32], [0])
    with pytest.raises(PassOrderError, match="'propagate' needs the result of pass 'annotate'"):
        propagate(gm, context(infos))


@pytest.mark.parametrize("shape, names, match", [
    ((2, 2), ("dp", "tp"), "mesh dimension 'tp' \\(size 2\\) is not used by strategy 'ddp'"),
    ((2, 3), ("x", "y"), "splits the batch along a mesh dimension named 'dp'"),
])
def test_a_mesh_dimension_the_strategy_cannot_use_is_refused_by_name(shape, names, match):
    mesh = spmd.Mesh.simulated(shape, dim_names=names)
    with pytest.raises(ValueError, match=match):
        resolve_strategy("ddp", mesh, "parallelize")
    with pytest.raises(ValueError, match=match):
        spmd.parallelize(MODELS["mlp"](), mesh=mesh)
    with pytest.raises(ValueError, match=match):
        spmd.parallelize(mesh=mesh)(lambda model, x: model(x))  # the decorator too
    x, _ = batch("mlp")
    with pytest.raises(ValueError, match=match):
        spmd.inspect(MODELS["mlp"](), x, mesh=mesh)


def test_a_one_dimensional_mesh_of_any_name_is_the_data_dimension():
    strategy = resolve_strategy("ddp", spmd.Mesh.simulated(8, dim_names=("batch",)), "test")
    assert strategy.data_dim == "batch" and strategy.data_size == 8


def test_sharding_specs_are_frozen_hashable_and_checked():
    mesh = spmd.Mesh.simulated((2, 4), dim_names=("dp", "tp"))
    a = Sharding.on(mesh, {"tp": Shard(1)})
    assert a.placements == (Replicate(), Shard(1)) and a["tp"] == Shard(1) and a[0] == Replicate()
    assert hash(a) == hash(Sharding(mesh=mesh, placements=(Replicate(), Shard(1))))
    with pytest.raises(ValueError, match="2 dimensions"):
        Sharding(mesh=mesh, placements=(Replicate(),))
    with pytest.raises(ValueError, match="no dimension 'pp'"):
        Sharding.on(mesh, {"pp": Shard(0)})
    with pytest.raises(AttributeError):
        a.placements = ()  # type: ignore[misc]
