"""``rpc.RemoteModule``: a module built on another worker, called like a local one, and
shared through its module RRef (``init_from_module_rref``), as torch's."""

from __future__ import annotations

import torch
from torch import nn

from spmd.runtime import spawn


def _init(rank: int, world: int):
    from spmd.runtime import rpc

    torch.set_num_threads(1)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=world,
                 rpc_backend_options=rpc.RpcBackendOptions(rpc_timeout=30))
    return rpc


def _share(remote_device, module_rref):
    from spmd.runtime.rpc import RemoteModule

    return RemoteModule.init_from_module_rref(remote_device, module_rref)


def _forward_through(module, x):
    return module(x)


def _params_of(module_rref):
    linear = module_rref.local_value()
    return linear.weight.detach().clone(), linear.bias.detach().clone()


def _remote_module_rank(rank):
    rpc = _init(rank, 3)
    out = {}
    if rank == 0:
        torch.manual_seed(0)
        x = torch.randn(5, 4)
        module = rpc.RemoteModule("w1/cpu", nn.Linear, args=(4, 2))
        weight, bias = rpc.rpc_sync("w1", _params_of, args=(module.get_module_rref(),))
        out["forward"] = (module(x), module.forward_async(x).wait(), x @ weight.T + bias)
        # shared from w2: a handle to the same module on w1, not a copy
        shared = rpc.rpc_sync("w2", _share, args=("w2/cpu", module.get_module_rref()))
        out["shared"] = (shared.on, shared.get_module_rref().owner_name(),
                         rpc.rpc_sync("w2", _forward_through, args=(shared, x)), module(x))
        for name, call in (("not an rref", lambda: rpc.RemoteModule.init_from_module_rref(
                                "w1/cpu", module)),
                           ("interface", lambda: rpc.RemoteModule.init_from_module_rref(
                               "w1/cpu", module.get_module_rref(), object)),
                           ("parameters", lambda: module.parameters())):
            try:
                call()
            except (TypeError, ValueError) as e:
                out[name] = (type(e).__name__, str(e))
    rpc.shutdown(timeout=30)
    return out


def test_remote_module_runs_remotely_and_shares_through_its_rref():
    out = spawn(_remote_module_rank, nprocs=3, start_method="forkserver", timeout=90)[0]
    sync, async_, local = out["forward"]
    assert torch.equal(sync, async_) and torch.allclose(sync, local, atol=1e-6)
    on, owner, through_w2, direct = out["shared"]
    assert on == "w1" and owner == "w1"  # calls go to the module's owner
    assert torch.equal(through_w2, direct)
    assert out["not an rref"][0] == "TypeError" and "must be an RRef" in out["not an rref"][1]
    assert out["interface"][0] == "ValueError" and "TorchScript" in out["interface"][1]
    assert "Please use ``remote_parameters`` instead" in out["parameters"][1]
