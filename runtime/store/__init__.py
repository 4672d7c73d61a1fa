"""Key-value stores: where the processes of a job find each other."""

from spmd.runtime.store.base import Store
from spmd.runtime.store.file_store import FileStore
from spmd.runtime.store.hash_store import HashStore
from spmd.runtime.store.prefix_store import PrefixStore
from spmd.runtime.store.tcp_store import TCPStore

__all__ = ["Store", "TCPStore", "FileStore", "PrefixStore", "HashStore"]
