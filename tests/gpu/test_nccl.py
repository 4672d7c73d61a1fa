"""The NCCL backend for real at world size 1, when a GPU is present (skipped otherwise)."""

from __future__ import annotations

import pytest
import torch

from spmd import runtime as dist
from spmd.runtime import HashStore

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and torch.distributed.is_nccl_available()),
                       reason="needs CUDA and a torch build with NCCL"),
]


@pytest.fixture
def nccl():
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_default_backend_is_nccl_with_cuda(nccl):
    assert dist.get_backend() == "nccl"


def test_collectives_on_one_gpu(nccl):
    t = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    assert torch.equal(t, torch.arange(1 << 20, device="cuda", dtype=torch.float32))
    dist.broadcast(t, src=0)
    out = torch.empty(1 << 20, device="cuda")
    dist.all_gather_into_tensor(out, t)
    assert torch.equal(out, t)
    rs = torch.empty(1 << 20, device="cuda")
    dist.reduce_scatter_tensor(rs, t)
    assert torch.equal(rs, t)
    work = dist.all_reduce(t, async_op=True)
    assert work.wait() is True
    dist.barrier()
    torch.cuda.synchronize()


def test_cpu_tensor_on_nccl_is_rejected(nccl):
    with pytest.raises(ValueError, match="NCCL, which takes CUDA tensors"):
        dist.all_reduce(torch.ones(2))


def test_gloo_rejects_cuda_tensors():
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="Gloo, which takes CPU tensors"):
            dist.all_reduce(torch.ones(2, device="cuda"))
    finally:
        dist.destroy_process_group()
