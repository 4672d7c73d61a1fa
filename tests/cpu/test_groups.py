"""Process groups and meshes: init in every way, subgroups, non-members, destroy, re-init."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from spmd import runtime as dist
from spmd.runtime import HashStore, Mesh


def subgroups(rank: int) -> dict:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    out: dict = {}
    evens = dist.new_group([0, 2])
    odds = dist.new_group([1, 3])
    everyone = dist.new_group()
    mine = evens if rank % 2 == 0 else odds
    out["ranks"] = dist.get_process_group_ranks(mine)
    out["group rank"] = dist.get_rank(mine)
    out["other rank"] = dist.get_rank(odds if rank % 2 == 0 else evens)
    out["other size"] = dist.get_world_size(odds if rank % 2 == 0 else evens)
    try:
        dist.get_backend(odds if rank % 2 == 0 else evens)
    except ValueError as e:
        out["other backend"] = str(e)
    out["group size"] = dist.get_world_size(mine)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mine)
    out["sum"] = t.item()
    b = torch.tensor([float(rank)])
    dist.broadcast(b, src=mine.ranks[-1], group=mine)  # src is a global rank
    out["bcast"] = b.item()
    out["global of 1"] = dist.get_global_rank(mine, 1)
    out["group of me"] = dist.get_group_rank(mine, rank)
    try:
        dist.all_reduce(torch.ones(1), group=odds if rank % 2 == 0 else evens)
    except RuntimeError as e:
        out["non-member"] = str(e)
    e = torch.ones(1)
    dist.all_reduce(e, group=everyone)
    out["everyone"] = e.item()
    dist.destroy_process_group(mine)
    try:
        dist.all_reduce(torch.ones(1), group=mine)
    except RuntimeError as err:
        out["destroyed"] = str(err)
    mesh = Mesh((2, 2), ("dp", "tp"))
    out["coord"] = mesh.coordinate()
    tp = torch.tensor([float(rank)])
    dist.all_reduce(tp, group=mesh.get_group("tp"))
    dp = torch.tensor([float(rank)])
    dist.all_reduce(dp, group=mesh.get_group("dp"))
    out["mesh sums"] = (dp.item(), tp.item())
    out["mesh groups"] = (mesh.get_group("dp").ranks, mesh.get_group(1).ranks)
    sub = Mesh(2, ranks=[1, 3])
    out["sub coord"] = sub.coordinate() if rank in (1, 3) else None
    dist.destroy_process_group()
    # a second life in the same rank: init again, by tcp:// this time
    port = int(dist_env("MASTER_PORT")) + 1
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=4, timeout=timedelta(seconds=60))
    again = torch.ones(1)
    dist.all_reduce(again)
    out["reinit"] = again.item()
    dist.destroy_process_group()
    return out


def dist_env(name: str) -> str:
    from spmd.runtime.context import getenv

    value = getenv(name)
    assert value is not None
    return value


@pytest.fixture(scope="module")
def runs():
    return dist.spawn(subgroups, nprocs=4, start_method="thread", timeout=100)


def test_subgroup_identity(runs):
    for rank, r in enumerate(runs):
        assert r["ranks"] == ([0, 2] if rank % 2 == 0 else [1, 3])
        assert r["group rank"] == rank // 2 and r["other rank"] == -1 and r["group size"] == 2
        assert r["other size"] == -1  # a non-member's view, as in torch
        assert "invalid process group" in r["other backend"]
        assert r["global of 1"] == r["ranks"][1]
        assert r["group of me"] == rank // 2


def test_subgroup_collectives_use_global_ranks(runs):
    for rank, r in enumerate(runs):
        assert r["sum"] == (2.0 if rank % 2 == 0 else 4.0)
        assert r["bcast"] == (2.0 if rank % 2 == 0 else 3.0)
        assert r["everyone"] == 4.0


def test_non_member_and_destroyed_handles_refuse(runs):
    for rank, r in enumerate(runs):
        assert f"rank {rank} is not a member of process group" in r["non-member"]
        assert "has been destroyed" in r["destroyed"]


def test_mesh_slices(runs):
    for rank, r in enumerate(runs):
        assert r["coord"] == (rank // 2, rank % 2)
        dp_sum = float(sum(k for k in range(4) if k % 2 == rank % 2))
        tp_sum = float(sum(k for k in range(4) if k // 2 == rank // 2))
        assert r["mesh sums"] == (dp_sum, tp_sum)
        assert r["mesh groups"] == ([rank % 2, rank % 2 + 2], [rank // 2 * 2, rank // 2 * 2 + 1])
        assert r["sub coord"] == ({1: (0,), 3: (1,)}.get(rank))


def test_destroy_then_init_again(runs):
    assert all(r["reinit"] == 4.0 for r in runs)


def test_single_rank_group_over_a_given_store():
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        t = torch.ones(2)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        assert t.tolist() == [1.0, 1.0]
        assert dist.is_initialized() and dist.get_rank() == 0 and dist.get_world_size() == 1
        with pytest.raises(RuntimeError, match="already initialized"):
            dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()


def test_completed_works_are_let_go():
    """Every operation's backend work is held until two later operations started after
    it completed. Gloo's reduce-scatter work never reports itself complete: held on that
    alone, each one's tensors stayed referenced for good and every call scanned them all
    (quadratic). Works whose wait returned are let go too."""
    import weakref

    from spmd.runtime import process_group

    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        first = torch.ones(4)
        watch = weakref.ref(first)
        dist.reduce_scatter_tensor(torch.empty(4), first)
        del first
        for _ in range(200):
            dist.reduce_scatter_tensor(torch.empty(4), torch.ones(4))
        work = dist.reduce_scatter_tensor(torch.empty(4), torch.ones(4), async_op=True)
        work.wait()
        dist.all_reduce(torch.ones(1))
        assert len(process_group._held) <= 2 and len(process_group._waited) <= 2
        assert watch() is None  # the first call's input is no longer referenced
    finally:
        dist.destroy_process_group()


def test_file_init_method(tmp_path):
    url = f"file://{tmp_path}/pg"
    out = dist.spawn(_file_init, args=(url,), nprocs=2, start_method="forkserver", timeout=60)
    assert out == [3.0, 3.0]


def _file_init(rank, url):
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=2)
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item()


def test_simulated_mesh_geometry():
    mesh = Mesh.simulated((4, 256), ("dp", "tp"))
    assert mesh.size() == 1024 and mesh.size("tp") == 256 and mesh.ndim == 2
    assert mesh.coordinate_of(300) == (1, 44) and mesh.rank_at((1, 44)) == 300
    assert len(mesh.slices("dp")) == 256 and mesh.slices("dp")[0] == [0, 256, 512, 768]
    with pytest.raises(RuntimeError, match="simulated"):
        mesh.get_group("dp")
    with pytest.raises(RuntimeError, match="simulated"):
        mesh.coordinate()
    assert Mesh.simulated(8) == Mesh.simulated(8, ("dp",))
    import spmd

    assert spmd.Mesh is Mesh


@pytest.mark.parametrize(
    "args, exc, match",
    [
        (((0,),), ValueError, "positive"),
        (((2, 2), ("a",)), ValueError, "1 names for 2 dimensions"),
        (((2, 2), ("a", "a")), ValueError, "unique"),
        (("big",), TypeError, "tuple of ints"),
    ],
)
def test_bad_mesh_arguments(args, exc, match):
    with pytest.raises(exc, match=match):
        Mesh.simulated(*args)
    with pytest.raises(ValueError, match="no dimension 'zz'"):
        Mesh.simulated(4).size("zz")


def _twice_on_one_port(rank):
    out = []
    for _ in range(2):  # the second init meets on the same MASTER_PORT as the first
        dist.init_process_group("gloo", timeout=timedelta(seconds=30))
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        out.append(t.item())
        dist.destroy_process_group()
    return out


def test_init_destroy_init_on_the_same_port():
    out = dist.spawn(_twice_on_one_port, nprocs=3, start_method="forkserver", timeout=60)
    assert out == [[6.0, 6.0]] * 3


def _group_then_rpc(rank):
    from spmd.runtime import rpc

    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2)  # shares the group's store
    dist.destroy_process_group()  # the store must outlive the group: RPC still uses it
    total = rpc.rpc_sync(f"w{1 - rank}", torch.add, args=(torch.ones(1), rank))
    rpc.shutdown()
    return total.item()


def test_a_destroyed_group_leaves_the_store_to_rpc():
    # rank r asks the other worker for 1 + r
    assert dist.spawn(_group_then_rpc, nprocs=2, start_method="forkserver", timeout=60) == [
        1.0, 2.0]
