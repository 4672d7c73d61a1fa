"""The tutorial "Combining Distributed DataParallel with Distributed RPC Framework", with
its imports pointed at spmd: an ``EmbeddingBag`` ``RemoteModule`` on a parameter server,
a dense layer data-parallel over the 2 trainers' process group (``spmd.parallelize``, or
torch's own ``DistributedDataParallel`` as in the tutorial), trained inside
``dist_autograd.context()`` with a ``DistributedOptimizer`` over both. The trainers take
their optimizer steps in turn, so the run equals one process that adds both trainers'
embedding gradients and averages the dense ones (the data-parallel average).

Also torch's DDP inside a context against torch's DDP outside one: the context gets
the same averaged gradients, dense and sparse, and ``.grad`` is left alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd
from spmd import runtime as dist

NUM_EMB, DIM, CLASSES, STEPS, LR = 20, 8, 4, 4, 0.05
_HELD: dict = {}


class Hybrid(nn.Module):
    def __init__(self, emb: nn.Module, fc: nn.Module) -> None:
        super().__init__()
        self.emb, self.fc = emb, fc

    def forward(self, indices, offsets):
        return self.fc(self.emb(indices, offsets))


def _batch(step: int, trainer: int):
    g = torch.Generator().manual_seed(step * 10 + trainer)
    indices = torch.randint(0, NUM_EMB, (12,), generator=g)
    return indices, torch.tensor([0, 3, 6, 9]), torch.randint(0, CLASSES, (4,), generator=g)


def _keep(module) -> None:
    _HELD["emb"] = module


def _embedding_weight(module) -> torch.Tensor:
    return module.module_rref.local_value().weight.detach().clone()


def _worker(rank: int, port: int, dense: str) -> dict | None:
    from spmd.runtime import autograd as dist_autograd
    from spmd.runtime import rpc
    from spmd.runtime.optim import DistributedOptimizer

    torch.set_num_threads(1)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=4,
                 rpc_backend_options=rpc.RpcBackendOptions(rpc_timeout=30))
    out = None
    if rank == 3:  # the master builds the remote embedding and hands it to the trainers
        torch.manual_seed(0)
        emb = rpc.RemoteModule("worker2/cpu", nn.EmbeddingBag, args=(NUM_EMB, DIM),
                               kwargs={"mode": "sum"})
        for trainer in (0, 1):
            rpc.rpc_sync(f"worker{trainer}", _keep, args=(emb,))
    elif rank < 2:
        dist.init_process_group("gloo", rank=rank, world_size=2,
                                init_method=f"tcp://127.0.0.1:{port}")
        torch.manual_seed(1)
        if dense == "spmd":
            fc = spmd.parallelize(nn.Linear(DIM, CLASSES))
        else:  # the tutorial's own: torch's DDP, on the group spmd.runtime made
            fc = nn.parallel.DistributedDataParallel(nn.Linear(DIM, CLASSES))
        dist.barrier()
        import time
        while "emb" not in _HELD:
            time.sleep(0.01)
        emb = _HELD["emb"]
        model = Hybrid(emb, fc)
        opt = DistributedOptimizer(torch.optim.SGD,
                                   emb.remote_parameters() + [rpc.RRef(p) for p in
                                                              fc.parameters()], lr=LR)
        out = {"start": rpc.rpc_sync("worker2", _embedding_weight, args=(emb,))}
        for step in range(STEPS):
            indices, offsets, target = _batch(step, rank)
            with dist_autograd.context() as cid:
                loss = F.cross_entropy(model(indices, offsets), target)
                dist_autograd.backward(cid, [loss])
                dist.barrier()  # both forwards read the same embedding
                for turn in (0, 1):  # then the trainers step in turn
                    if turn == rank:
                        opt.step(cid)
                    dist.barrier()
        out["fc"] = [p.detach().clone() for p in fc.parameters()]
        out["emb"] = rpc.rpc_sync("worker2", _embedding_weight, args=(emb,))
        out["refused"] = ""
        try:
            emb.parameters()
        except ValueError as e:
            out["refused"] = str(e)
        dist.destroy_process_group()
    rpc.shutdown()
    return out


def _reference(start_emb: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    emb = nn.EmbeddingBag(NUM_EMB, DIM, mode="sum")
    with torch.no_grad():
        emb.weight.copy_(start_emb)
    torch.manual_seed(1)
    fc = nn.Linear(DIM, CLASSES)
    for step in range(STEPS):
        losses = [F.cross_entropy(fc(emb(*_batch(step, t)[:2])), _batch(step, t)[2])
                  for t in (0, 1)]
        emb_grad, = torch.autograd.grad(sum(losses), [emb.weight], retain_graph=True)
        fc_grads = torch.autograd.grad(sum(losses) / 2, list(fc.parameters()))
        with torch.no_grad():
            emb.weight -= LR * emb_grad
            for p, g in zip(fc.parameters(), fc_grads):
                p -= LR * g
    return [p.detach() for p in fc.parameters()], emb.weight.detach()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dense", ["spmd", "torch_ddp"])
def test_ddp_with_rpc_tutorial_trains_like_one_process(dense):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    runs = dist.spawn(_worker, args=(port, dense), nprocs=4, start_method="forkserver", timeout=110)
    trainers = runs[:2]
    want_fc, want_emb = _reference(trainers[0]["start"])
    for run in trainers:
        for got, want in zip(run["fc"], want_fc):
            assert torch.allclose(got, want, atol=1e-5)
        assert torch.allclose(run["emb"], want_emb, atol=1e-5)
        assert "not supported for RemoteModule" in run["refused"]


def _compare(rank: int, port: int, rpc_port: int) -> dict:
    from spmd.runtime import autograd as dist_autograd
    from spmd.runtime import rpc

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2,
                 rpc_backend_options=rpc.RpcBackendOptions(
                     init_method=f"tcp://127.0.0.1:{rpc_port}", rpc_timeout=30))
    torch.manual_seed(rank)  # different inputs and, before DDP's broadcast, weights
    dense = nn.parallel.DistributedDataParallel(nn.Linear(4, 3))
    sparse = nn.parallel.DistributedDataParallel(nn.EmbeddingBag(10, 3, sparse=True))
    x, idx, offsets = torch.randn(5, 4), torch.randint(0, 10, (8,)), torch.tensor([0, 3])
    out = {}
    for name, model, args in (("dense", dense, (x,)), ("sparse", sparse, (idx, offsets))):
        params = list(model.module.parameters())
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, [model(*args).pow(2).sum()])
            grads = dist_autograd.get_gradients(cid)
            out[f"{name}_context"] = [grads[p].to_dense() for p in params]
        out[f"{name}_grad_untouched"] = all(p.grad is None for p in params)
        model(*args).pow(2).sum().backward()
        out[f"{name}_local"] = [p.grad.to_dense() for p in params]
        out[f"{name}_own"] = [g.to_dense() for g in torch.autograd.grad(
            model.module(*args).pow(2).sum(), params)]
    rpc.shutdown()
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(120)
def test_torch_ddp_inside_a_context_averages_as_outside():
    import socket

    with socket.socket() as s, socket.socket() as r:
        s.bind(("127.0.0.1", 0))
        r.bind(("127.0.0.1", 0))
        ports = (s.getsockname()[1], r.getsockname()[1])
    runs = dist.spawn(_compare, args=ports, nprocs=2, start_method="forkserver", timeout=110)
    for name in ("dense", "sparse"):
        for run in runs:
            assert run[f"{name}_grad_untouched"]
            for got, want in zip(run[f"{name}_context"], run[f"{name}_local"]):
                assert torch.allclose(got, want, atol=1e-6)
        for a, b in zip(runs[0][f"{name}_context"], runs[1][f"{name}_context"]):
            assert torch.allclose(a, b, atol=1e-6)  # averaged: the same on both ranks
        # and not what one rank's own data gives
        assert not all(torch.allclose(a, b, atol=1e-6)
                       for a, b in zip(runs[0][f"{name}_context"], runs[0][f"{name}_own"]))
