"""torch.distributed sees the groups spmd.runtime makes: torch code in the same program
runs on them (same backend instance, no second rendezvous), and destroying ours tears
torch's view down too."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from spmd import runtime as dist


def _shared(rank: int) -> dict:
    import torch.distributed as tdist
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.utils.data import DistributedSampler

    out: dict = {"before": tdist.is_initialized()}
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    out["rank"], out["size"] = tdist.get_rank(), tdist.get_world_size()
    t = torch.full((3,), float(rank + 1))
    tdist.all_reduce(t)  # torch's call, our backend
    out["sum"] = t.tolist()
    out["sampler"] = list(DistributedSampler(list(range(10)), shuffle=False))
    # new groups and meshes: members see them in torch too
    odd = dist.new_group([1, 3])
    if rank in (1, 3):
        t = torch.ones(1)
        tdist.all_reduce(t, group=odd.to_torch())
        odd.allreduce([t]).wait()  # torch's ProcessGroup method, on the same backend
        out["odd"] = t.item()
        # torch's DDP on a subgroup spmd made
        torch.manual_seed(rank)
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 1),
                                                        process_group=odd.to_torch())
        ddp(torch.randn(4, 3) * (rank + 1)).sum().backward()
        out["ddp"] = [p.grad.clone() for p in ddp.module.parameters()]
        out["ddp_weight"] = ddp.module.weight.detach().clone()
        # torch's view of our group is taken wherever ours is
        view = odd.to_torch()
        t = torch.ones(1) * rank
        dist.all_reduce(t, group=view)
        out["view"] = (t.item(), dist.get_rank(view), dist.get_world_size(view),
                       dist.get_process_group_ranks(view), dist.get_global_rank(view, 1),
                       dist.Mesh.from_group(view).get_group() is odd)
    out["torch's default"] = dist.get_rank(tdist.group.WORLD)
    mesh = dist.Mesh((2, 2), dim_names=("dp", "tp"))
    device_mesh = mesh.to_torch()
    out["mesh"] = (device_mesh.mesh.tolist(), device_mesh.mesh_dim_names)
    x = torch.arange(16.0).view(4, 4)
    d = distribute_tensor(x, device_mesh, [Shard(0), Shard(1)])
    out["local"] = d.to_local().tolist()
    out["full"] = torch.equal(d.full_tensor(), x)
    # the backend is the one spmd made: a torch collective and ours interleave in order
    a, b = torch.ones(1) * rank, torch.ones(1) * rank
    work = tdist.all_reduce(a, async_op=True)
    dist.all_reduce(b)
    work.wait()
    out["interleaved"] = (a.item(), b.item())
    dist.destroy_process_group()
    out["after"] = tdist.is_initialized()
    # and again: a second init shares again
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    out["again"] = tdist.get_world_size()
    dist.destroy_process_group()
    return out


def test_torch_distributed_sees_our_groups():
    runs = dist.spawn(_shared, nprocs=4, start_method="forkserver", timeout=100)
    for rank, out in enumerate(runs):
        assert not out["before"] and not out["after"]
        assert (out["rank"], out["size"]) == (rank, 4)
        assert out["sum"] == [10.0] * 3
        padded = list(range(10)) + [0, 1]  # DistributedSampler pads to a multiple of 4
        assert out["sampler"] == padded[rank::4]
        if rank in (1, 3):
            assert out["odd"] == 4.0
            assert out["view"] == (4.0, (rank - 1) // 2, 2, [1, 3], 3, True)
        assert out["torch's default"] == rank
        assert out["mesh"] == ([[0, 1], [2, 3]], ("dp", "tp"))
        x = torch.arange(16.0).view(4, 4)
        i, j = divmod(rank, 2)
        assert out["local"] == x[2 * i:2 * i + 2, 2 * j:2 * j + 2].tolist()
        assert out["full"]
        assert out["interleaved"] == (6.0, 6.0)
        assert out["again"] == 4
    xs = []
    for r in (1, 3):  # each member's batch, drawn as it drew it
        torch.manual_seed(r)
        torch.nn.Linear(3, 1)
        xs.append(torch.randn(4, 3) * (r + 1))
    want = [(xs[0].sum(0, keepdim=True) + xs[1].sum(0, keepdim=True)) / 2, torch.tensor([4.0])]
    for r in (1, 3):  # the gradient of sum(x @ w.T + b), averaged over the pair
        for got, expected in zip(runs[r]["ddp"], want):
            assert torch.allclose(got, expected, atol=1e-6)
    assert torch.equal(runs[1]["ddp_weight"], runs[3]["ddp_weight"])  # DDP's broadcast


def _torch_first(rank: int, port: int) -> dict:
    import torch.distributed as tdist

    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                             world_size=2)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    out = {}
    try:
        dist.new_group([0, 1]).to_torch()
    except RuntimeError as e:
        out["error"] = str(e)
    try:  # torch's own group is not one of ours
        dist.all_reduce(torch.ones(1), group=tdist.group.WORLD)
    except TypeError as e:
        out["theirs"] = str(e)
    t = torch.ones(1)
    tdist.all_reduce(t)  # torch's own group still works
    out["sum"] = t.item()
    dist.destroy_process_group()
    out["torch_still"] = tdist.is_initialized()  # its own default group is not ours to end
    tdist.destroy_process_group()
    return out


def _free_port() -> int:
    """A port the OS just handed out (not MASTER_PORT + 1, which another process's
    ephemeral socket may hold)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_program_that_initialized_torch_first_keeps_its_own_groups():
    for out in dist.spawn(_torch_first, args=(_free_port(),), nprocs=2,
                          start_method="forkserver", timeout=60):
        assert "not known to torch.distributed" in out["error"]
        assert "default group is not shared" in out["error"]
        assert "a torch.distributed ProcessGroup that spmd.runtime did not make" in out["theirs"]
        assert out["sum"] == 2.0 and out["torch_still"]


def test_thread_ranks_are_not_shared_and_say_why():
    import torch.distributed as tdist

    def job(rank):
        dist.init_process_group("gloo", timeout=timedelta(seconds=30))
        try:
            with pytest.raises(RuntimeError, match="threads of one process"):
                dist.new_group([0, 1]).to_torch()
            return tdist.is_initialized()
        finally:
            dist.destroy_process_group()

    assert dist.spawn(job, nprocs=2, start_method="thread", timeout=60) == [False, False]


def test_torch_process_group_methods_run_on_our_groups():
    """``pg.allreduce``, ``pg.broadcast``, ``pg.monitored_barrier`` as on torch's groups,
    also where torch.distributed does not hold the group (thread ranks)."""
    def job(rank):
        dist.init_process_group("gloo", timeout=timedelta(seconds=30))
        group = dist.new_group([0, 1])
        t = torch.ones(2) * (rank + 1)
        group.allreduce([t]).wait()
        b = torch.full((1,), float(rank))
        group.broadcast(b, 1).wait()  # torch's (tensor, root) form
        group.monitored_barrier(timedelta(seconds=10))
        dist.destroy_process_group(group)
        try:
            group.allreduce([t])
            after = ""
        except RuntimeError as e:
            after = str(e)
        dist.destroy_process_group()
        return t.tolist(), b.item(), after

    for got, b, after in dist.spawn(job, nprocs=2, start_method="thread", timeout=60):
        assert got == [3.0, 3.0] and b == 1.0
        assert "ProcessGroup.allreduce" in after and "destroyed" in after
    with pytest.raises(AttributeError, match="no attribute 'allreduce_all'"):
        dist.ProcessGroup.__getattr__(object.__new__(dist.ProcessGroup), "allreduce_all")
