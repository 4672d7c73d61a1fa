"""spmd.runtime: stores, rendezvous, process groups, collectives, RPC.

Usable on its own as a ``torch.distributed``-shaped package; it imports nothing from the
compiler layers above it.
"""

from spmd.runtime.errors import DistError, DistStoreError, DistTimeoutError
from spmd.runtime.context import RankContext
from spmd.runtime.launch import SpawnContext, SpawnError, spawn
from spmd.runtime.rendezvous import rendezvous
from spmd.runtime.store import FileStore, HashStore, PrefixStore, Store, TCPStore

__all__ = [
    "DistError",
    "DistTimeoutError",
    "DistStoreError",
    "Store",
    "TCPStore",
    "FileStore",
    "PrefixStore",
    "HashStore",
    "rendezvous",
    "to_torch_store",
    "spawn",
    "SpawnContext",
    "SpawnError",
    "RankContext",
]


def __getattr__(name: str) -> object:
    # Resolved on first use: the adapter imports torch, which the stores alone never need.
    if name == "to_torch_store":
        from spmd.runtime.store.torch_adapter import to_torch_store

        return to_torch_store
    raise AttributeError(f"module 'spmd.runtime' has no attribute {name!r}")
