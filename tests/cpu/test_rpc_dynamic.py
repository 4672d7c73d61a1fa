"""Dynamic RPC groups (``init_rpc`` without ``world_size``) on real worker processes:
workers join one by one, are reached by name as soon as they have joined, leave while the
others go on, and a new worker may take a departed one's rank."""

from __future__ import annotations

import pytest
import torch

from spmd import runtime as dist
from spmd.runtime import rpc


def _names() -> list[str]:
    return [w.name for w in rpc.get_all_worker_infos()]


def _dynamic(rank: int, path: str, mixed_path: str) -> dict:
    dist.init_process_group("gloo")  # barriers only: the RPC group has its own store

    def join(name: str, as_rank: int) -> None:
        rpc.init_rpc(name, rank=as_rank, rpc_backend_options=rpc.RpcBackendOptions(
            init_method=f"file://{path}", rpc_timeout=20))

    out: dict = {}
    if rank == 0:
        join("w0", 0)
        out["alone"] = _names()
    dist.barrier()
    if rank == 1:
        join("w1", 1)
        out["1 calls 0"] = rpc.rpc_sync("w0", torch.add, args=(torch.ones(2), 1))
    dist.barrier()
    if rank == 2:
        for name, as_rank in (("w0", 2), ("w2", 1)):  # a taken name, a taken rank
            try:
                join(name, as_rank)
                out[f"took {name}/{as_rank}"] = "joined"
            except ValueError as e:
                out[f"took {name}/{as_rank}"] = str(e)
        join("w2", 2)
    dist.barrier()
    if rank == 0:  # w2 joined after w0: known by name at once
        out["0 calls 2"] = rpc.rpc_sync("w2", torch.mul, args=(torch.ones(2), 3))
        out["all"] = _names()
    dist.barrier()
    if rank == 2:
        rpc.shutdown()  # leaves alone; the others go on
    dist.barrier()
    if rank == 0:
        out["after leave"] = _names()
        try:
            rpc.rpc_sync("w2", torch.add, args=(torch.ones(1), 1))
            out["call the departed"] = "answered"
        except ValueError as e:
            out["call the departed"] = str(e)
        out["0 calls 1"] = rpc.rpc_sync("w1", torch.sub, args=(torch.ones(2), 1))
    dist.barrier()
    if rank == 2:  # a new worker with the departed one's rank
        join("w2b", 2)
        out["2b calls 0"] = rpc.rpc_sync("w0", torch.add, args=(torch.ones(2), 5))
    dist.barrier()
    if rank == 0:
        out["0 calls 2b"] = rpc.rpc_sync("w2b", torch.add, args=(torch.ones(2), 7))
    dist.barrier()
    for leaving in (2, 1, 0):
        if rank == leaving:
            rpc.shutdown()
        dist.barrier()
    # a group is static or dynamic from its first worker on
    if rank == 0:
        rpc.init_rpc("s0", rank=0, world_size=1, rpc_backend_options=rpc.RpcBackendOptions(
            init_method=f"file://{mixed_path}", rpc_timeout=20))
    dist.barrier()
    if rank == 1:
        try:
            rpc.init_rpc("d1", rank=1, rpc_backend_options=rpc.RpcBackendOptions(
                init_method=f"file://{mixed_path}", rpc_timeout=20))
            out["mixed"] = "joined"
        except RuntimeError as e:
            out["mixed"] = str(e)
    dist.barrier()
    if rank == 0:
        rpc.shutdown()
    dist.destroy_process_group()
    return out


def test_workers_join_and_leave_a_dynamic_group(tmp_path):
    out = dist.spawn(_dynamic, args=(str(tmp_path / "rpc"), str(tmp_path / "mixed")),
                     nprocs=3, start_method="forkserver", timeout=110)
    w0, w1, w2 = out
    assert w0["alone"] == ["w0"]
    assert torch.equal(w1["1 calls 0"], torch.full((2,), 2.0))
    assert "already a member" in w2["took w0/2"] and "names must be unique" in w2["took w0/2"]
    assert "rank 1 is taken by worker 'w1'" in w2["took w2/1"]
    assert torch.equal(w0["0 calls 2"], torch.full((2,), 3.0))
    assert w0["all"] == ["w0", "w1", "w2"]
    assert w0["after leave"] == ["w0", "w1"]
    assert "no worker is called 'w2'" in w0["call the departed"]
    assert torch.equal(w0["0 calls 1"], torch.zeros(2))
    assert torch.equal(w2["2b calls 0"], torch.full((2,), 6.0))
    assert torch.equal(w0["0 calls 2b"], torch.full((2,), 8.0))
    assert "mixes statically and dynamically initialized members" in w1["mixed"]


def test_a_dynamic_worker_needs_a_rank(tmp_path):
    opts = rpc.RpcBackendOptions(init_method=f"file://{tmp_path / 'store'}")
    with pytest.raises(ValueError, match="rank parameter missing"):
        rpc.init_rpc("w0", rpc_backend_options=opts)
    with pytest.raises(ValueError, match="rank must be non-negative"):
        rpc.init_rpc("w0", rpc_backend_options=rpc.RpcBackendOptions(
            init_method=f"file://{tmp_path / 'store'}?rank=-2"))
