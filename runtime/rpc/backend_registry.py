"""torch.distributed.rpc.backend_registry: the backend names and building their options.

There is one agent (ZeroMQ); ``BackendType.TENSORPIPE`` names it too, so code that builds
options through the registry, as PyTorch's own tests do, keeps working.

Example::

    opts = rpc.backend_registry.construct_rpc_backend_options(
        rpc.BackendType.TENSORPIPE, rpc_timeout=20, init_method="tcp://127.0.0.1:29500")
"""

from __future__ import annotations

from typing import Any

from spmd.runtime.rpc import constants
from spmd.runtime.rpc.options import BackendType, RpcBackendOptions

__all__ = ["BackendType", "backend_registered", "construct_rpc_backend_options",
           "register_backend"]


def backend_registered(backend_name: str) -> bool:
    """Whether ``backend_name`` is a backend this runtime has."""
    return backend_name in BackendType.__members__


def construct_rpc_backend_options(backend: BackendType,
                                  rpc_timeout: float = constants.DEFAULT_RPC_TIMEOUT_SEC,
                                  init_method: str = constants.DEFAULT_INIT_METHOD,
                                  **kwargs: Any) -> RpcBackendOptions:
    """The options object for ``backend``: ``rpc_timeout``, ``init_method`` and the
    keyword arguments ``RpcBackendOptions`` takes (TensorPipe's ``_transports`` and
    ``_channels`` are accepted and mean nothing to the ZeroMQ agent)."""
    if not isinstance(backend, BackendType):
        raise TypeError(f"construct_rpc_backend_options: backend must be an rpc.BackendType, "
                        f"got {backend!r}")
    return RpcBackendOptions(rpc_timeout=rpc_timeout, init_method=init_method, **kwargs)


def register_backend(backend_name: str, construct_rpc_backend_options_handler: Any,
                     init_backend_handler: Any) -> BackendType:
    """Refused: agents are not pluggable here (torch's takes a C++ agent factory)."""
    if backend_registered(backend_name):
        raise RuntimeError(f"RPC backend {backend_name}: already registered")
    raise NotImplementedError(f"register_backend({backend_name!r}): this runtime has one agent "
                              f"(ZeroMQ); third-party RPC backends cannot be registered")
