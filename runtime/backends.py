"""Construct PyTorch's c10d backends (Gloo, NCCL, MPI) over one of our stores.

The data plane is always an existing engine; what we own is how it is set up. Gloo is
pinned to loopback when every rank is on this machine, so it never resolves the host's
name (a reverse lookup that can stall for seconds on some machines), to the address on
the route to the master when the job spans hosts, and to ``GLOO_SOCKET_IFNAME`` when set.
"""

from __future__ import annotations

import ipaddress
import os
from datetime import timedelta

import torch
import torch.distributed as _dist

from spmd.runtime.store.base import Store
from spmd.runtime.store.torch_adapter import to_torch_store
from spmd.runtime.topology import local_address

__all__ = ["BACKENDS", "available", "default_backend", "make_backend"]

BACKENDS = ("gloo", "nccl", "mpi")


def available(name: str) -> bool:
    if name == "gloo":
        return _dist.is_gloo_available()
    if name == "nccl":
        return _dist.is_nccl_available() and torch.cuda.is_available()
    if name == "mpi":
        return _dist.is_mpi_available()
    return False


def default_backend() -> str:
    """NCCL when CUDA is usable, else Gloo (as torch.distributed chooses)."""
    return "nccl" if available("nccl") else "gloo"


def check_backend(name: object) -> str:
    if not isinstance(name, str):
        raise TypeError(f"backend must be a str ('gloo', 'nccl', 'mpi'), got {type(name).__name__}")
    lowered = name.lower()
    if lowered not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; expected one of {', '.join(BACKENDS)}")
    if not available(lowered):
        why = {
            "gloo": "this build of torch has no Gloo",
            "nccl": "NCCL needs a CUDA build of torch and a visible GPU",
            "mpi": "this build of torch was not built with MPI",
        }[lowered]
        raise ValueError(f"backend {lowered!r} is not available: {why}")
    return lowered


def _is_local(host: str | None) -> bool:
    if host is None:
        return True
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _gloo_device(master_host: str | None) -> object:
    gloo = _dist.ProcessGroupGloo
    iface = os.environ.get("GLOO_SOCKET_IFNAME")
    if iface:
        return gloo.create_device(interface=iface.split(",")[0])
    if _is_local(master_host):
        return gloo.create_device(hostname="127.0.0.1")
    # this host's address on the route to the master: what the other hosts reach it by
    # (Gloo's default device resolves the host's own name, which may map to loopback, or
    # stall for seconds on a reverse lookup)
    return gloo.create_device(hostname=local_address(master_host))


def make_backend(
    name: str, store: Store, rank: int, size: int, timeout: timedelta,
    master_host: str | None, global_ranks: list[int], group_name: str,
) -> tuple[object, object]:
    """A c10d backend for ``size`` ranks exchanging set-up through ``store``, and the
    ``torch.distributed.Store`` it was given, which the caller must keep alive as long as
    the backend: c10d holds only the C++ half of a Python store, and NCCL first uses it
    at the first collective, when a collected adapter would answer "Not implemented".

    ``master_host`` is the rendezvous address (None when every rank is in this process
    or machine); it decides which network device Gloo uses.
    """
    c10d_store = to_torch_store(store)
    if name == "gloo":
        opts = _dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [_gloo_device(master_host)]
        opts.global_ranks_in_group = list(global_ranks)
        opts.group_name = group_name
        return _dist.ProcessGroupGloo(c10d_store, rank, size, opts), c10d_store
    if name == "nccl":
        opts = _dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        opts.global_ranks_in_group = list(global_ranks)
        opts.group_name = group_name
        return _dist.ProcessGroupNCCL(c10d_store, rank, size, opts), c10d_store
    if name == "mpi":
        return _dist.ProcessGroupMPI.create(list(global_ranks)), c10d_store
    raise ValueError(f"unknown backend {name!r}")
