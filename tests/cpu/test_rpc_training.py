"""The canonical RPC training shapes on real worker processes: a parameter server with two
trainers, and a model split across two workers trained with distributed autograd and the
distributed optimizer, equal to the same model trained in one process."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from spmd.runtime import spawn

OPTS = dict(rpc_timeout=20.0, num_worker_threads=4)
TARGET_W, TARGET_B = torch.tensor([[2.0, -1.0]]), torch.tensor([0.5])


def _init(rank: int, world: int):
    from spmd.runtime import rpc

    rpc.init_rpc(f"w{rank}", rank=rank, world_size=world,
                 rpc_backend_options=rpc.RpcBackendOptions(**OPTS))
    return rpc


# -- parameter server ------------------------------------------------------------------

_PS: dict = {}
_PS_LOCK = threading.Lock()


def _ps_model() -> nn.Module:
    # the server's main thread and the RPC threads answering the trainers may ask first at
    # the same time: without the lock two models could be made, the trainers' optimizer
    # stepping one while the forward used the other (seen: a trainer that never learned)
    with _PS_LOCK:
        if "model" not in _PS:
            torch.manual_seed(0)
            _PS["model"] = nn.Linear(2, 1)
        return _PS["model"]


def _ps_forward(x):
    return _ps_model()(x)


def _ps_param_rrefs():
    from spmd.runtime import rpc

    return [rpc.RRef(p) for p in _ps_model().parameters()]


def _parameter_server(rank):
    from spmd.runtime import autograd as dist_autograd
    from spmd.runtime.optim import DistributedOptimizer

    rpc = _init(rank, 3)
    if rank == 0:
        _ps_model()
        rpc.shutdown(timeout=60)  # serves the trainers until both have shut down
        return [p.detach().clone() for p in _ps_model().parameters()]
    params = rpc.rpc_sync("w0", _ps_param_rrefs)
    opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(60):
        x = torch.randn(16, 2, generator=gen)
        y = x @ TARGET_W.T + TARGET_B
        with dist_autograd.context() as cid:
            loss = ((rpc.rpc_sync("w0", _ps_forward, args=(x,)) - y) ** 2).mean()
            dist_autograd.backward(cid, [loss])
            opt.step(cid)
        losses.append(loss.item())
    rpc.shutdown(timeout=60)
    return losses


def test_a_parameter_server_trained_by_two_trainers():
    out = spawn(_parameter_server, nprocs=3, start_method="forkserver", timeout=90)
    (weight, bias), trainers = out[0], out[1:]
    for losses in trainers:  # two trainers update one server in any interleaving: judge
        first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10  # ten batches, not one
        assert last < first / 10, losses
    assert torch.allclose(weight, TARGET_W, atol=0.1) and torch.allclose(bias, TARGET_B, atol=0.1)


# -- a model split across two workers ---------------------------------------------------

STEPS, LR, MOMENTUM = 8, 0.1, 0.9


def _stage1() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh())


def _stage2() -> nn.Module:
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(8, 3), nn.Tanh(), nn.Linear(3, 1))


def _batches():
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(5, 4, generator=gen), torch.randn(5, 1, generator=gen))
            for _ in range(STEPS)]


def _param_rrefs(module_rref):
    from spmd.runtime import rpc

    return [rpc.RRef(p) for p in module_rref.local_value().parameters()]


def _weights(module_rref):
    return [p.detach().clone() for p in module_rref.local_value().parameters()]


def _split(rank):
    from spmd.runtime import autograd as dist_autograd
    from spmd.runtime.optim import DistributedOptimizer

    rpc = _init(rank, 2)
    out = None
    if rank == 0:
        first = _stage1()
        second = rpc.remote("w1", _stage2)  # the second half lives on worker 1
        params = [rpc.RRef(p) for p in first.parameters()]
        params += rpc.rpc_sync("w1", _param_rrefs, args=(second,))
        opt = DistributedOptimizer(torch.optim.SGD, params, lr=LR, momentum=MOMENTUM)
        losses = []
        for x, y in _batches():
            with dist_autograd.context() as cid:
                pred = second.rpc_sync().forward(first(x))
                loss = ((pred - y) ** 2).mean()
                dist_autograd.backward(cid, [loss])
                opt.step(cid)
            losses.append(loss.item())
        weights = [p.detach().clone() for p in first.parameters()]
        out = (losses, weights + rpc.rpc_sync("w1", _weights, args=(second,)))
    rpc.shutdown(timeout=30)
    return out


def test_a_split_model_trains_to_the_weights_of_one_process():
    losses, weights = spawn(_split, nprocs=2, start_method="forkserver", timeout=60)[0]
    model = nn.Sequential(_stage1(), _stage2())
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    expected = []
    for x, y in _batches():
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        expected.append(loss.item())
    # float32, identical operations in a different order of accumulation: 1e-6 absolute
    assert losses == pytest.approx(expected, abs=1e-6)
    reference = list(model.parameters())
    assert len(weights) == len(reference) == 6
    for got, want in zip(weights, reference):
        assert torch.allclose(got, want.detach(), rtol=1e-5, atol=1e-6), (got, want)
    assert not torch.allclose(weights[0], _stage1()[0].weight.detach())  # it did train
