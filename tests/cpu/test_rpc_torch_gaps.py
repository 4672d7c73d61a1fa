"""What PyTorch's own RPC tests expect and spmd first lacked: functions decorated with
torch's ``@rpc.functions.async_execution``, tensors arriving with their strides,
``rref.remote().missing()`` failing at the call, and ``RRef.backward``."""

from __future__ import annotations

import torch
import torch.distributed.rpc as torch_rpc

from spmd.runtime import spawn

_STATE: dict = {}


@torch_rpc.functions.async_execution
def _torch_async(x: torch.Tensor) -> torch.futures.Future:
    """Decorated with torch's own decorator: answered when the future completes."""
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(x + 1)
    return future


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _strides(x: torch.Tensor) -> tuple:
    return tuple(x.stride()), x.is_contiguous()


class _Counter:
    def __init__(self) -> None:
        self.n = 0

    def add(self, k: int) -> int:
        self.n += k
        return self.n


def _loss() -> torch.Tensor:
    weight = _STATE.setdefault("weight", torch.nn.Parameter(torch.tensor([1.0, 2.0])))
    return (weight * weight).sum()


def _weight_grads(context_id: int) -> list:
    from spmd.runtime import autograd as dist_autograd

    weight = _STATE["weight"]
    in_context = dist_autograd.get_gradients(context_id).get(weight)
    return [None if in_context is None else in_context.clone(),
            None if weight.grad is None else weight.grad.clone()]


def _weight_grad() -> torch.Tensor:
    return _STATE["weight"].grad.clone()


def _worker(rank: int) -> dict | None:
    from spmd.runtime import autograd as dist_autograd
    from spmd.runtime import rpc

    torch.set_num_threads(1)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2,
                 rpc_backend_options=rpc.RpcBackendOptions(rpc_timeout=20))
    out = None
    if rank == 0:
        out = {"async": rpc.rpc_sync("w1", _torch_async, args=(torch.ones(2),))}
        x = torch.arange(24.0).view(2, 3, 4)
        for name, t in (("transposed", x.transpose(0, 2)), ("permuted", x.permute(1, 2, 0)),
                        ("sliced", x[:, :, ::2]), ("narrowed", torch.rand(5, 5).narrow(1, 2, 2)),
                        ("expanded", torch.arange(3.0).expand(4, 3))):
            back = rpc.rpc_sync("w1", _identity, args=(t,))
            out[name] = (torch.equal(back, t), tuple(back.stride()), tuple(t.stride()),
                         rpc.rpc_sync("w1", _strides, args=(t,)))
        counter = rpc.remote("w1", _Counter)
        out["method"] = counter.remote().add(3).to_here()
        try:
            counter.remote().missing(1)
        except AttributeError as e:
            out["missing"] = str(e)
        loss = rpc.remote("w1", _loss)
        with dist_autograd.context() as cid:
            loss.backward(cid)
            out["in context"] = rpc.rpc_sync("w1", _weight_grads, args=(cid,))
        loss.backward()  # plain autograd on the owner: into .grad
        out["plain"] = rpc.rpc_sync("w1", _weight_grad)
    rpc.shutdown()
    return out


def test_torch_rpc_behaviours():
    out = spawn(_worker, nprocs=2, start_method="forkserver", timeout=90)[0]
    assert torch.equal(out["async"], torch.full((2,), 2.0))
    # permuted, gapped and overlapping views arrive with their strides, and come back so
    for name in ("transposed", "permuted", "sliced", "narrowed", "expanded"):
        equal, back, sent, remote = out[name]
        assert equal and back == sent and remote == (sent, False), (name, out[name])
    assert out["method"] == 3
    assert "has no attribute 'missing'" in out["missing"]
    in_context, grad = out["in context"]
    assert torch.equal(in_context, torch.tensor([2.0, 4.0])) and grad is None
    assert torch.equal(out["plain"], torch.tensor([2.0, 4.0]))
