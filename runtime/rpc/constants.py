"""The defaults torch.distributed.rpc.constants names, with this library's values."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

from spmd.runtime.rpc.options import UNSET_RPC_TIMEOUT, RpcBackendOptions

__all__ = ["DEFAULT_RPC_TIMEOUT_SEC", "DEFAULT_INIT_METHOD", "DEFAULT_NUM_WORKER_THREADS",
           "DEFAULT_SHUTDOWN_TIMEOUT", "DEFAULT_PROCESS_GROUP_TIMEOUT", "UNSET_RPC_TIMEOUT"]

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RpcBackendOptions)}
DEFAULT_RPC_TIMEOUT_SEC: float = _DEFAULTS["rpc_timeout"]
DEFAULT_INIT_METHOD = "env://"  # what init_method=None means
DEFAULT_NUM_WORKER_THREADS: int = _DEFAULTS["num_worker_threads"]
# seconds a graceful shutdown waits for the others; 0 is torch's "no limit", which here
# means the SPMD_RPC_SHUTDOWN_TIMEOUT default (nothing waits forever)
DEFAULT_SHUTDOWN_TIMEOUT = 0
DEFAULT_PROCESS_GROUP_TIMEOUT = timedelta(minutes=30)
