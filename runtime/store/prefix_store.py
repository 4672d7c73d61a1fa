"""A namespace inside another store."""

from __future__ import annotations

from datetime import timedelta

from spmd.runtime.store.base import Store

__all__ = ["PrefixStore"]


class PrefixStore(Store):
    """Every key of ``store`` seen through ``prefix + "/"``.

    Process groups use it so that two groups sharing one store never collide. The
    timeout is the wrapped store's; ``num_keys`` counts the wrapped store's keys, as
    PyTorch's PrefixStore does.

    Example::

        base = HashStore()
        PrefixStore("pg1", base).set("x", b"1")
        base.get("pg1/x")  # -> b"1"
    """

    def __init__(self, prefix: str, store: Store) -> None:
        if not isinstance(prefix, str):
            raise TypeError(f"PrefixStore prefix must be a str, got {type(prefix).__name__}")
        if not isinstance(store, Store):
            raise TypeError(
                f"PrefixStore wraps an spmd.runtime store, got {type(store).__name__}"
            )
        self._prefix = prefix
        self._store = store

    def clone(self) -> "PrefixStore":
        """The same namespace over a clone of the underlying store."""
        return PrefixStore(self._prefix, self._store.clone())

    @property
    def underlying_store(self) -> Store:
        """The wrapped store."""
        return self._store

    @property
    def prefix(self) -> str:
        return self._prefix

    @property
    def _timeout(self) -> float:  # type: ignore[override]
        return self._store._timeout

    @property
    def timeout(self) -> timedelta:
        return self._store.timeout

    def set_timeout(self, timeout: timedelta) -> None:
        self._store.set_timeout(timeout)

    def has_extended_api(self) -> bool:
        """The wrapped store's answer."""
        return self._store.has_extended_api()

    def _k(self, key: str) -> str:
        return f"{self._prefix}/{key}"

    def _set(self, key: str, value: bytes) -> None:
        self._store._set(self._k(key), value)

    def _multi_get(self, keys: list[str], timeout: float) -> list[bytes]:
        return self._store._multi_get([self._k(k) for k in keys], timeout)

    def _add(self, key: str, amount: int) -> int:
        return self._store._add(self._k(key), amount)

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self._store._compare_set(self._k(key), expected, desired)

    def _wait(self, keys: list[str], timeout: float) -> None:
        self._store._wait([self._k(k) for k in keys], timeout)

    def _check(self, keys: list[str]) -> bool:
        return self._store._check([self._k(k) for k in keys])

    def _delete_key(self, key: str) -> bool:
        return self._store._delete_key(self._k(key))

    def _num_keys(self) -> int:
        return self._store._num_keys()

    def _multi_set(self, keys: list[str], values: list[bytes]) -> None:
        self._store._multi_set([self._k(k) for k in keys], values)

    def _append(self, key: str, value: bytes) -> None:
        self._store._append(self._k(key), value)

    def _queue_push(self, key: str, value: bytes) -> None:
        self._store._queue_push(self._k(key), value)

    def _queue_pop(self, key: str, timeout: float | None) -> bytes:
        return self._store._queue_pop(self._k(key), timeout)

    def _queue_len(self, key: str) -> int:
        return self._store._queue_len(self._k(key))
