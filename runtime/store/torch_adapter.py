"""Bridges between our stores and PyTorch's ``torch.distributed.Store``.

``to_torch_store`` hands one of our stores to PyTorch's c10d backends (Gloo, NCCL), which
exchange their connection details through a store: the process groups of the next layer
are built this way. ``TorchStore`` goes the other way, for the one case where the store
is PyTorch's own: under ``torchrun``, whose agent already serves a store on MASTER_PORT.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as _dist

from spmd.runtime.errors import DistStoreError, StoreTimeoutError
from spmd.runtime.store.base import Store

__all__ = ["to_torch_store", "TorchStore"]


class _AsTorchStore(_dist.Store):
    """A ``torch.distributed.Store`` whose every call goes to one of our stores.

    Our exceptions pass through C++ unchanged, so a Gloo rendezvous that times out raises
    ``DistTimeoutError`` naming the key it waited for.
    """

    def __init__(self, store: Store) -> None:
        super().__init__()
        self.spmd_store = store

    def set(self, key: str, value: Any) -> None:
        self.spmd_store.set(key, value)

    def get(self, key: str) -> bytes:
        return self.spmd_store.get(key)

    def add(self, key: str, amount: int) -> int:
        return self.spmd_store.add(key, amount)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self.spmd_store.compare_set(key, expected, desired)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is not None and timeout <= timedelta(0):
            timeout = None  # c10d's "no timeout": ours always has one, the store's
        self.spmd_store.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return self.spmd_store.check(keys)

    def delete_key(self, key: str) -> bool:
        return self.spmd_store.delete_key(key)

    def num_keys(self) -> int:
        return self.spmd_store.num_keys()

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self.spmd_store.multi_get(keys)

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self.spmd_store.multi_set(keys, values)

    def append(self, key: str, value: Any) -> None:
        self.spmd_store.append(key, value)

    def set_timeout(self, timeout: timedelta) -> None:
        self.spmd_store.set_timeout(timeout)


def to_torch_store(store: Store) -> _dist.Store:
    """``store`` as a ``torch.distributed.Store``, for PyTorch's c10d backends.

    Example::

        pg = torch.distributed.ProcessGroupGloo(to_torch_store(store), rank, world_size)
    """
    if not isinstance(store, Store):
        raise TypeError(f"to_torch_store takes an spmd.runtime store, got {type(store).__name__}")
    if isinstance(store, TorchStore):
        return store.torch_store
    return _AsTorchStore(store)


class TorchStore(Store):
    """One of PyTorch's stores (e.g. torchrun's agent store) behind our interface.

    Errors are translated: PyTorch's store timeouts become ``DistTimeoutError``, its
    other failures ``DistStoreError``.
    """

    def __init__(self, torch_store: _dist.Store) -> None:
        if not isinstance(torch_store, _dist.Store):
            raise TypeError(f"TorchStore wraps a torch.distributed.Store, got {type(torch_store)}")
        super().__init__(torch_store.timeout)
        self.torch_store = torch_store

    def set_timeout(self, timeout: timedelta) -> None:
        super().set_timeout(timeout)
        self.torch_store.set_timeout(self.timeout)

    def _run(self, op: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as e:  # torch raises DistStoreError / RuntimeError subclasses
            text = str(e)
            if "timeout" in text.lower() or "timed out" in text.lower():
                said = text if "timeout" in text else f"timeout: {text}"
                raise StoreTimeoutError(f"torch store {op}: {said}") from e
            raise DistStoreError(f"torch store {op}: {text}") from e

    def _set(self, key: str, value: bytes) -> None:
        self._run("set", self.torch_store.set, key, value)

    def _multi_get(self, keys: list[str], timeout: float) -> list[bytes]:
        self._wait(keys, timeout)
        return self._run("multi_get", self.torch_store.multi_get, keys)

    def _add(self, key: str, amount: int) -> int:
        return self._run("add", self.torch_store.add, key, amount)

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self._run("compare_set", self.torch_store.compare_set, key, expected, desired)

    def _wait(self, keys: list[str], timeout: float) -> None:
        self._run("wait", self.torch_store.wait, keys, timedelta(seconds=timeout))

    def _check(self, keys: list[str]) -> bool:
        return self._run("check", self.torch_store.check, keys)

    def _delete_key(self, key: str) -> bool:
        return self._run("delete_key", self.torch_store.delete_key, key)

    def _num_keys(self) -> int:
        return self._run("num_keys", self.torch_store.num_keys)

    def _multi_set(self, keys: list[str], values: list[bytes]) -> None:
        self._run("multi_set", self.torch_store.multi_set, keys, values)

    def _append(self, key: str, value: bytes) -> None:
        self._run("append", self.torch_store.append, key, value)
