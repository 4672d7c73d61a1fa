"""The names of torch.distributed that training scripts call resolve in spmd.runtime with
torch's meaning; what is deliberately left out is listed here, with why."""

from __future__ import annotations

import socket
import warnings
from datetime import timedelta

import pytest
import torch
import torch.nn as nn

import spmd
from spmd import runtime as dist

# importing torch.distributed.optim warns that torch.jit is deprecated: torch's, not ours
pytestmark = pytest.mark.filterwarnings("ignore:.*torch.jit.*:DeprecationWarning")

# torch.distributed.distributed_c10d.__all__ names not provided, and why
EXCLUDED = {
    "all_gather_single": "new experimental single-tensor API of torch 2.13; all_gather_into_tensor",
    "reduce_scatter_single": "new experimental single-tensor API; reduce_scatter_tensor",
    "split_group": "splits a backend's communicator (NCCL-only internals)",
    "shrink_group": "fault-tolerance internals of torch's own groups",
    "record_comm": "torch's internal communication recorder",
    "get_rank_to_device_map": "torch's internal device map",
    "get_group_rank_to_device_map": "torch's internal device map",
}


def test_every_public_c10d_name_resolves_or_is_listed():
    import torch.distributed.distributed_c10d as c10d

    with warnings.catch_warnings():  # reduce_op is there, with its deprecation warning
        warnings.simplefilter("ignore", FutureWarning)
        missing = sorted(n for n in c10d.__all__ if not hasattr(dist, n) and n not in EXCLUDED)
    assert missing == [], f"torch.distributed names missing from spmd.runtime: {missing}"


def test_torch_meanings():
    assert dist.is_available() and dist.is_gloo_available() == torch.distributed.is_gloo_available()
    assert dist.Backend.GLOO == "gloo" and dist.Backend("NCCL") == "nccl"
    assert dist.get_default_backend_for_device("cpu") == "gloo"
    assert dist.get_default_backend_for_device(torch.device("cuda")) == "nccl"
    assert issubclass(dist.DistBackendError, torch.distributed.DistBackendError)
    assert issubclass(dist.DistBackendError, dist.DistError)
    assert issubclass(dist.DistNetworkError, torch.distributed.DistNetworkError)
    assert dist.GroupMember.WORLD is None  # before init, as in torch
    assert not dist.is_torchelastic_launched()
    with pytest.warns(FutureWarning, match="reduce_op` is deprecated"):
        assert dist.reduce_op.SUM == dist.ReduceOp.SUM
    with pytest.raises(RuntimeError, match="LOCAL_RANK"):
        dist.get_node_local_rank()
    assert dist.get_node_local_rank(fallback_rank=3) == 3


def _groups(rank: int) -> dict:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    out: dict = {"world": dist.group.WORLD is dist.GroupMember.WORLD,
                 "local_rank": dist.get_node_local_rank(),
                 "config": dist.get_backend_config()}
    t = torch.ones(1)
    dist.all_reduce(t, group=dist.group.WORLD)  # the tutorial's spelling
    out["sum"] = t.item()
    mine, subgroups = dist.new_subgroups(group_size=2)
    out["subgroup"] = (mine.ranks, len(subgroups))
    # objects by point-to-point: rank 0 -> 3 by global rank, rank 1 -> group rank 0 of a pair
    if rank == 0:
        dist.send_object_list([{"from": 0}, [1, 2]], dst=3)
    if rank == 3:
        box = [None, None]
        out["sender"] = dist.recv_object_list(box)  # any source
        out["objects"] = box
    pair = dist.new_group([1, 2])
    if rank == 2:
        dist.send_object_list(["hello"], group=pair, group_dst=0)
    if rank == 1:
        box = [None]
        dist.recv_object_list(box, group=pair, group_src=1)
        out["pair"] = box[0]
    out["pg_count"] = dist.get_pg_count()
    dist.destroy_process_group()
    return out


def test_group_names_and_object_point_to_point():
    runs = dist.spawn(_groups, nprocs=4, start_method="forkserver", timeout=60)
    for rank, out in enumerate(runs):
        assert out["world"] and out["sum"] == 4.0 and out["config"] == "cpu:gloo"
        assert out["local_rank"] == rank
        assert out["subgroup"] == ([0, 1] if rank < 2 else [2, 3], 2)
        assert out["pg_count"] == 1 + 2 + 1  # default, two subgroups, the pair
    assert runs[3]["sender"] == 0 and runs[3]["objects"] == [{"from": 0}, [1, 2]]
    assert runs[1]["pair"] == "hello"


def _sync_batchnorm(rank: int) -> str:
    """torch's SyncBatchNorm on our group. Before torch saw our groups it ran as a plain
    BatchNorm here, each rank with its own statistics and no error; now it knows it is
    distributed, and on CPU tensors torch refuses (it synchronises CUDA tensors only)."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        x = torch.randn(8, 3, 4)
        bn = nn.SyncBatchNorm(3)
        try:
            bn(x[rank * 4:(rank + 1) * 4])
        except ValueError as e:
            return str(e)
        return "ran"
    finally:
        dist.destroy_process_group()


def test_sync_batchnorm_is_no_longer_silently_per_rank():
    for out in dist.spawn(_sync_batchnorm, nprocs=2, start_method="forkserver", timeout=60):
        assert "expected input tensor to be on GPU" in out


def test_model_module_is_the_model_as_with_ddp():
    model = spmd.parallelize(nn.Linear(2, 2), mesh=spmd.Mesh.simulated(2))
    assert model.module is model
    assert list(model.module.state_dict()) == ["weight", "bias"]

    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(2, 2)

        def forward(self, x):
            return self.module(x)

    wrapped = spmd.parallelize(Wrapper(), mesh=spmd.Mesh.simulated(2))
    assert isinstance(wrapped.module, nn.Linear)  # the model's own child wins


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("rank_var, size_var", [("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                                                ("PMI_RANK", "PMI_SIZE")])
def test_env_rendezvous_reads_mpi_variables(monkeypatch, rank_var, size_var):
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "OMPI_COMM_WORLD_RANK",
                 "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    monkeypatch.setenv(rank_var, "0")
    monkeypatch.setenv(size_var, "1")
    store, rank, size = dist.rendezvous("env://")
    try:
        assert (rank, size) == (0, 1)
    finally:
        store.close()


def test_bad_arguments_where_torch_raises_runtime_error_are_both():
    """Code written for torch catches RuntimeError; ours stay ValueError/TypeError too."""
    from spmd.runtime.errors import InvalidArgumentError, WrongTypeError

    for cls, base in ((InvalidArgumentError, ValueError), (WrongTypeError, TypeError)):
        assert issubclass(cls, RuntimeError) and issubclass(cls, base)
    with pytest.raises(RuntimeError, match="unknown scheme"):
        dist.rendezvous("gopher://127.0.0.1:1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="not in process group"):
            dist.broadcast(torch.ones(1), src=5)
    finally:
        dist.destroy_process_group()


def _local_groups(rank: int) -> dict:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        out = {}
        if rank in (0, 1):  # only the members call it
            pair = dist.new_group([0, 1], use_local_synchronization=True)
            t = torch.ones(1)
            dist.all_reduce(t, group=pair)
            out["pair"] = (pair.name, t.item())
        evens = dist.new_group([0, 2])  # the ordinary kind still works after it
        if rank in (0, 2):
            t = torch.ones(1)
            dist.all_reduce(t, group=evens)
            out["evens"] = t.item()
        return out
    finally:
        dist.destroy_process_group()


def test_new_group_with_local_synchronization():
    runs = dist.spawn(_local_groups, nprocs=3, start_method="forkserver", timeout=60)
    assert runs[0]["pair"] == ("local:0,1", 2.0) and runs[1]["pair"] == ("local:0,1", 2.0)
    assert "pair" not in runs[2]
    assert runs[0]["evens"] == 2.0 and runs[2]["evens"] == 2.0


def test_rendezvous_is_torchs_iterator_too(tmp_path):
    url = f"file://{tmp_path}/rdzv?rank=0&world_size=1"
    it = dist.rendezvous(url)
    store, rank, size = next(it)
    assert (rank, size) == (0, 1)
    with pytest.raises(StopIteration):
        next(it)
    store.close()
    store, rank, size = dist.rendezvous(f"file://{tmp_path}/rdzv2?rank=0&world_size=1")
    assert (rank, size) == (0, 1)
    store.close()


# torch.distributed.rpc / autograd / optim names not provided, and why
EXCLUDED_SUBMODULES = {
    "rpc": {"AllGatherStates": "internal state of torch's rpc shutdown barrier",
            "method_factory": "internal helper of torch's backend registry",
            "new_method": "internal helper of torch's backend registry",
            "backend_registered": "torch's RPC backend registry (TensorPipe); ours has one transport",
            "register_backend": "torch's RPC backend registry",
            "construct_rpc_backend_options": "torch's RPC backend registry",
            "init_backend": "torch's RPC backend registry",
            "BackendValue": "torch's RPC backend registry"},
    "autograd": {},
    "optim": {"as_functional_optim": "internal helper of torch's functional optimizers"},
}


@pytest.mark.parametrize("module", ["rpc", "autograd", "optim"])
def test_every_public_name_of_rpc_autograd_optim_resolves_or_is_listed(module):
    import importlib

    theirs = importlib.import_module(f"torch.distributed.{module}")
    ours = getattr(dist, module)
    names = getattr(theirs, "__all__", None) or [n for n in dir(theirs) if not n.startswith("_")]
    missing = sorted(n for n in names
                     if not hasattr(ours, n) and n not in EXCLUDED_SUBMODULES[module])
    assert missing == [], f"torch.distributed.{module} names missing: {missing}"


def _zero(rank: int) -> list:
    """torch's ZeroRedundancyOptimizer, from spmd.runtime.optim, on our group."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        model = nn.Linear(4, 4)
        opt = dist.optim.ZeroRedundancyOptimizer(model.parameters(),
                                                 optimizer_class=torch.optim.SGD, lr=0.1)
        x = torch.randn(8, 4)[rank * 4:(rank + 1) * 4]
        model(x).sum().backward()
        for p in model.parameters():  # average, as DDP would
            dist.all_reduce(p.grad)
            p.grad /= 2
        opt.step()
        return [p.detach().clone() for p in model.parameters()]
    finally:
        dist.destroy_process_group()


def test_torchs_zero_redundancy_optimizer_runs_on_our_group():
    runs = dist.spawn(_zero, nprocs=2, start_method="forkserver", timeout=60)
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    x = torch.randn(8, 4)
    (model(x).sum() / 2).backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    for run in runs:
        for got, want in zip(run, model.parameters()):
            assert torch.allclose(got, want, atol=1e-6)


def _group_and_rpc_on_one_address(rank: int, port: int) -> int:
    url = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    rpc = dist.rpc
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(init_method=url))
    try:
        return rpc.rpc_sync(f"w{1 - rank}", max, args=(rank, 7))
    finally:
        rpc.shutdown()
        dist.destroy_process_group()


def test_a_process_group_and_rpc_share_one_tcp_address():
    """torch's multi_tenant: RPC's rendezvous reuses the group's server, no second bind."""
    assert dist.spawn(_group_and_rpc_on_one_address, args=(_free_port(),), nprocs=2,
                      start_method="forkserver", timeout=60) == [7, 7]
