"""spmd.runtime.rpc: remote calls, remote references, for work that is not SPMD.

The API of ``torch.distributed.rpc`` over a ZeroMQ agent: a program written for PyTorch
runs after changing its imports (``spmd.runtime.rpc``, ``spmd.runtime.autograd``,
``spmd.runtime.optim``). Importing this package imports torch and pyzmq; ``import
spmd.runtime`` alone does not.

Example::

    from spmd.runtime import rpc

    def main(rank):
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
        if rank == 0:
            rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))
        rpc.shutdown()
"""

from spmd.runtime.rpc import backend_registry, constants, faults, functions
from spmd.runtime.rpc.api import (_set_rpc_timeout, debug_info, get_all_worker_infos,  # noqa: F401
                                  get_rpc_timeout, get_worker_info, init_rpc, remote, rpc_async,
                                  rpc_sync)
from spmd.runtime.rpc.options import (UNSET_RPC_TIMEOUT, BackendType, RemoteError,
                                      RpcBackendOptions, TensorPipeRpcBackendOptions,
                                      WorkerInfo)
from spmd.runtime.rpc.remote_module import RemoteModule
from spmd.runtime.rpc.rref import RRef
from spmd.runtime.rpc.shutdown import shutdown

__all__ = [
    "init_rpc", "shutdown", "rpc_sync", "rpc_async", "remote", "get_worker_info",
    "get_all_worker_infos", "get_rpc_timeout", "debug_info", "is_available", "RRef", "WorkerInfo",
    "RpcBackendOptions", "TensorPipeRpcBackendOptions", "BackendType", "RemoteError",
    "UNSET_RPC_TIMEOUT", "functions", "faults", "RemoteModule", "backend_registry",
    "constants",
]


def is_available() -> bool:
    """True: this RPC needs only torch and pyzmq."""
    return True
