"""``torch.distributed.rpc.internal``'s public-facing pieces: how an RPC is named in a
profile.

Under torch's legacy autograd profiler (``torch.autograd.profiler_legacy.profile``),
each ``rpc_sync``, ``rpc_async`` and ``remote`` is recorded on the caller as a span
named by :func:`_build_rpc_profiling_key`, as torch's agent records it
(``rpc_async#add(worker0 -> worker1)``). The remote side's events are not added: torch
adds them through its C++ profiler, which has no Python entry point.
"""

from __future__ import annotations

import collections
from enum import Enum

__all__ = ["RPCExecMode", "PythonUDF"]

# torch's record of a Python call (what its pickler sends); torch's tests import it
PythonUDF = collections.namedtuple("PythonUDF", ["func", "args", "kwargs"])


class RPCExecMode(Enum):
    SYNC = "sync"
    ASYNC = "async"
    ASYNC_JIT = "async_jit"
    REMOTE = "remote"


def _build_rpc_profiling_key(exec_type: RPCExecMode, func_name: str, current_worker_name: str,
                             dst_worker_name: str) -> str:
    """torch's name for one RPC in a profile."""
    return f"rpc_{exec_type.value}#{func_name}({current_worker_name} -> {dst_worker_name})"
