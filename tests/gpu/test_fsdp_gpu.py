"""Parameter sharding on a GPU (skipped without CUDA): module mode through Inductor (the
shard ops inside CUDA graphs Inductor compiles; fsdp, zero1, zero2) and whole-step mode (AdamW's Triton
kernel on the shards), each against plain torch; and an NCCL group that torch sees.

One GPU allows one NCCL rank, so the mesh has one rank: every parameter is its own
shard, and the gathers and reduce-scatters run their local arithmetic (the planned
graph is the same as with more ranks, its collectives a copy)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import spmd
from spmd import runtime as dist
from spmd.runtime import HashStore

from .test_parallelize_gpu import OPTIMIZERS, assert_same, batches, make_model, reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MESH = dict(mesh=spmd.Mesh.simulated(1), strategy="fsdp")


def test_fsdp_module_on_cuda_through_inductor_trains_like_torch():
    data = batches()
    model = spmd.parallelize(make_model(), bucket_cap_mb=0.05, **MESH)
    opt = OPTIMIZERS["adamw"](model.parameters())
    for x, y in data:
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    plan = spmd.inspect(model)
    assert all(path.startswith("inductor") for path in plan.compute_paths.values())
    assert {c.kind for c in plan.collectives} == {"all_gather", "reduce_scatter"}
    assert_same(model, reference(data, "adamw"))


def test_fsdp_whole_step_on_cuda_runs_adamw_on_the_shards():
    @spmd.parallelize(bucket_cap_mb=0.05, **MESH)
    def train_step(model, x, y, opt):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    data = batches()
    model = make_model()
    opt = OPTIMIZERS["adamw"](model.parameters())
    for x, y in data:
        train_step(model, x, y, opt)
    plan = spmd.inspect(train_step)
    assert list(plan.optimizer.values())[0].startswith("fused")
    assert_same(model, reference(data, "adamw"))


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_zero_module_on_cuda_through_inductor_trains_like_torch(strategy):
    """Gathered parameters kept between steps inside graphs Inductor compiled (handed out
    as copies, so Inductor's buffer reuse cannot touch what is kept): two half-batch
    backward passes per step, the second forward reading the kept gather, equal torch's
    one pass over the whole batch."""
    data = batches()
    model = spmd.parallelize(make_model(), bucket_cap_mb=0.05, mesh=spmd.Mesh.simulated(1),
                             strategy=strategy)
    opt = OPTIMIZERS["adamw"](model.parameters())
    for x, y in data:
        for half in (slice(0, 8), slice(8, 16)):
            (F.mse_loss(model(x[half]), y[half]) / 2).backward()
        opt.step()
        opt.zero_grad()
    plan = spmd.inspect(model)
    assert all(path.startswith("inductor") for path in plan.compute_paths.values())
    assert_same(model, reference(data, "adamw"))


@pytest.mark.skipif(not torch.distributed.is_nccl_available(), reason="needs NCCL")
def test_an_nccl_group_is_shared_with_torch_distributed():
    import torch.distributed as tdist

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=HashStore(), rank=0, world_size=1)
    try:
        assert tdist.is_initialized() and tdist.get_backend() == "nccl"
        t = torch.arange(8.0, device="cuda")
        tdist.all_reduce(t)  # torch's call, our NCCL backend
        torch.cuda.synchronize()
        assert torch.equal(t, torch.arange(8.0, device="cuda"))
        mesh = spmd.Mesh.from_group(dist.new_group([0]), "fsdp").to_torch()
        assert mesh.device_type == "cuda"
    finally:
        dist.destroy_process_group()
    assert not tdist.is_initialized()
