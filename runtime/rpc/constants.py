"""The defaults torch.distributed.rpc.constants names, with this library's values."""

from __future__ import annotations

from datetime import timedelta

from spmd.runtime.rpc.options import UNSET_RPC_TIMEOUT

__all__ = ["DEFAULT_RPC_TIMEOUT_SEC", "DEFAULT_INIT_METHOD", "DEFAULT_NUM_WORKER_THREADS",
           "DEFAULT_SHUTDOWN_TIMEOUT", "DEFAULT_PROCESS_GROUP_TIMEOUT", "UNSET_RPC_TIMEOUT"]

DEFAULT_RPC_TIMEOUT_SEC = 60.0
DEFAULT_INIT_METHOD = "env://"
DEFAULT_NUM_WORKER_THREADS = 16
# seconds a graceful shutdown waits for the others; 0 is torch's "no limit", which here
# means the SPMD_RPC_SHUTDOWN_TIMEOUT default (nothing waits forever)
DEFAULT_SHUTDOWN_TIMEOUT = 0
DEFAULT_PROCESS_GROUP_TIMEOUT = timedelta(minutes=30)
