"""What a user configures: backend options, worker identities, timeouts, and the errors.

``RpcBackendOptions`` mirrors ``torch.distributed.rpc.TensorPipeRpcBackendOptions`` (the
name is exported under both), so programs written for PyTorch keep their option objects.
It is mutable, as PyTorch's is, because ``set_device_map`` adds to it after construction.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass, field
from typing import Any

from spmd.runtime.errors import DistError, InvalidArgumentError

__all__ = ["RpcBackendOptions", "TensorPipeRpcBackendOptions", "BackendType", "WorkerInfo",
           "RemoteError", "UNSET_RPC_TIMEOUT", "resolve_timeout"]

UNSET_RPC_TIMEOUT = -1.0  # "use the agent's default", as in PyTorch
_NAME = re.compile(r"^[A-Za-z0-9_\-:.]{1,128}$")


class RemoteError(DistError):
    """A remote exception whose type could not be rebuilt here; the message carries the
    remote type name and traceback."""


class BackendType(enum.Enum):
    """The RPC backends. ``TENSORPIPE`` is accepted so PyTorch programs run unchanged;
    both mean this library's ZeroMQ agent."""

    ZMQ = "zmq"
    TENSORPIPE = "zmq"


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A worker's identity: its unique ``name`` and its ``id`` (the rank).

    Example::

        rpc.get_worker_info("trainer1")  # -> WorkerInfo(name='trainer1', id=1)
    """

    name: str
    id: int

    def __post_init__(self) -> None:
        check_name(self.name)


def _check_device(device: Any, what: str) -> str:
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{what}: {device!r} is not a device") from None
    if dev.type == "cpu":
        raise ValueError(f"{what}: device maps map accelerator devices; got {device!r} "
                         f"(CPU tensors always arrive on the CPU)")
    return str(dev)


@dataclass(slots=True)
class RpcBackendOptions:
    """How this worker's RPC agent runs.

    Args:
        init_method: where workers meet (``tcp://``, ``file://``, ``env://``); None uses
            ``env://`` (``MASTER_ADDR``/``MASTER_PORT``), or the store of the default
            process group when ``init_process_group`` ran first.
        rpc_timeout: default seconds an RPC may take (60, as PyTorch). Must be positive:
            there are no infinite timeouts here.
        num_worker_threads: threads that run incoming calls.
        device_maps: ``{worker name: {local device: remote device}}`` for accelerator
            tensors; without an entry, accelerator tensors arrive on the CPU.
        devices: accepted for PyTorch compatibility (the devices this worker uses).
        _transports, _channels: TensorPipe's transport choices, accepted so PyTorch code
            runs; the ZeroMQ agent picks its own (TCP, or shared memory on one host).

    Example::

        opts = RpcBackendOptions(rpc_timeout=20, num_worker_threads=8)
        opts.set_device_map("worker1", {"cuda:0": "cuda:1"})
    """

    init_method: str | None = None
    rpc_timeout: float = 60.0
    num_worker_threads: int = 16
    device_maps: dict[str, dict[str, str]] = field(default_factory=dict)
    devices: list[Any] | None = None
    _transports: list[str] | None = None
    _channels: list[str] | None = None

    def __post_init__(self) -> None:
        if self.init_method is not None and not isinstance(self.init_method, str):
            raise TypeError(f"init_method must be a str URL, got {type(self.init_method).__name__}")
        self.rpc_timeout = _positive(self.rpc_timeout, "rpc_timeout")
        n = self.num_worker_threads
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"num_worker_threads must be a positive int, got {n!r}")
        maps, self.device_maps = self.device_maps or {}, {}
        if not isinstance(maps, dict):
            raise TypeError(f"device_maps must be a dict, got {type(maps).__name__}")
        for to, mapping in maps.items():
            self.set_device_map(to, mapping)

    def set_device_map(self, to: str, device_map: dict[Any, Any]) -> None:
        """Tensors on a local device in ``device_map`` arrive at worker ``to`` on the mapped
        device (responses come back through the inverse map).

        Example::

            opts.set_device_map("worker1", {0: 1})  # cuda:0 here -> cuda:1 there
        """
        if not isinstance(to, str):
            raise TypeError(f"set_device_map: to must be a worker name, got {type(to).__name__}")
        if not isinstance(device_map, dict):
            raise TypeError(f"set_device_map: device_map must be a dict, got "
                            f"{type(device_map).__name__}")
        entry = dict(self.device_maps.get(to, {}))
        for src, dst in device_map.items():
            src = _check_device(f"cuda:{src}" if isinstance(src, int) else src, "set_device_map")
            dst = _check_device(f"cuda:{dst}" if isinstance(dst, int) else dst, "set_device_map")
            entry[src] = dst
        if len(set(entry.values())) != len(entry):
            raise ValueError(f"set_device_map: two local devices map to one device on {to!r}: "
                             f"{entry}")
        self.device_maps[to] = entry


TensorPipeRpcBackendOptions = RpcBackendOptions


def _positive(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number of seconds, got {type(value).__name__}")
    if not value > 0 or math.isinf(value):
        raise ValueError(f"{what} must be a positive, finite number of seconds, got {value!r} "
                         f"(spmd has no infinite timeouts; pass a large number)")
    return float(value)


def resolve_timeout(timeout: Any, default: float, what: str) -> float:
    """A call's timeout in seconds: ``-1`` (unset) means the agent's ``default``."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"{what}: timeout must be a number of seconds, got "
                        f"{type(timeout).__name__}")
    if timeout == UNSET_RPC_TIMEOUT:
        return default
    return _positive(timeout, f"{what}: timeout")


def check_name(name: Any) -> str:
    """A worker name: 1-128 characters of letters, digits, ``_ - : .``."""
    if not isinstance(name, str):
        raise TypeError(f"init_rpc: name must be a str, got {type(name).__name__}")
    if not name:
        raise InvalidArgumentError("worker name must be non-empty")
    if len(name) > 128:
        raise InvalidArgumentError(f"worker name of {len(name)} characters: it must be "
                                   f"shorter than 128")
    if not _NAME.match(name):
        raise InvalidArgumentError(
            f"worker name {name!r} must be 1-128 characters of letters, digits, '_', '-', ':' "
            f"or '.' (Worker name must match ^[A-Za-z0-9_\\-:.]{{1,128}}$)")
    return name
