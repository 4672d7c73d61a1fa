"""Every step of the redistribution table inserted into a graph and run through its op on
real ranks over Gloo: each rank's result equals what the table's arithmetic
(``simulate``) gives that rank, and the op's fake value had the real result's shape."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.fx as fx

from spmd import runtime as dist
from spmd.lowering.context import LoweringContext
from spmd.lowering.cost_model import CostModel
from spmd.lowering.collectives import insert_redistribution
from spmd.lowering.emit import emit
from spmd.lowering.options import Options
from spmd.lowering.passes import Provenance
from spmd.lowering.placements import Partial, Replicate, Shard, Sharding
from spmd.lowering.redistribute import redistribution, simulate, to_locals
from spmd.lowering.strategy import resolve_strategy
from spmd.program.setup import resolve_mesh

PAIRS = [(Partial("sum"), Replicate()), (Partial("avg"), Replicate()),
         (Partial("sum"), Shard(1)), (Partial("avg"), Shard(0)), (Shard(0), Replicate()),
         (Shard(1), Replicate()), (Shard(0), Shard(1)), (Shard(1), Shard(0)),
         (Replicate(), Shard(1)), (Replicate(), Partial("sum")), (Partial("avg"), Partial("sum"))]


def run_pair(rank: int, ctx: LoweringContext, src, dst, local: torch.Tensor) -> tuple:
    from torch._subclasses.fake_tensor import FakeTensorMode

    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = FakeTensorMode().from_tensor(local)
    x.meta["sharding"] = Sharding.on(ctx.mesh, {"dp": src})
    graph.output((x,))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    step = redistribution(src, dst)
    step = type(step)(src=step.src, dst=step.dst, kind=step.kind, mesh_dim="dp")
    out = insert_redistribution(gm, ctx, x, step, Provenance(params=(), pass_name="test",
                                                               reason="test"))
    graph.output_node().args = ((out,),)
    gm.recompile()
    fake_shape = tuple(out.meta["val"].shape)
    (result,) = emit(gm)([local.clone()])
    return result, fake_shape


def job(rank: int) -> dict:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    mesh = resolve_mesh(None, "test")  # the default group as a 1-D mesh "dp"
    ctx = LoweringContext(strategy=resolve_strategy("ddp", mesh, "test"), options=Options(),
                          cost_model=CostModel.default("gloo", 2), inputs=(), role="forward")
    out = {}
    n = dist.get_world_size()
    for src, dst in PAIRS:
        value = torch.arange(6 * 8, dtype=torch.float32).view(6, 8)
        local = to_locals(value, src, n, torch.Generator().manual_seed(0))[rank]
        out[(repr(src), repr(dst))] = run_pair(rank, ctx, src, dst, local)
    dist.destroy_process_group()
    return out


def test_every_step_runs_through_its_op_over_gloo():
    runs = dist.spawn(job, nprocs=2, start_method="forkserver", timeout=100)
    n = len(runs)
    for src, dst in PAIRS:
        value = torch.arange(6 * 8, dtype=torch.float32).view(6, 8)
        locals_ = to_locals(value, src, n, torch.Generator().manual_seed(0))
        want = simulate(redistribution(src, dst), locals_)
        for rank, r in enumerate(runs):
            got, fake_shape = r[(repr(src), repr(dst))]
            assert tuple(got.shape) == fake_shape == tuple(want[rank].shape), (src, dst)
            assert torch.allclose(got, want[rank], atol=1e-5), (src, dst, rank)
