"""An in-process store: a dictionary behind a condition variable."""

from __future__ import annotations

import collections
import threading
import time
from datetime import timedelta

from spmd.runtime.errors import QueueEmptyError, StoreTimeoutError
from spmd.runtime.store.base import Store, compare_set_result, describe_missing, parse_counter

__all__ = ["HashStore"]


class HashStore(Store):
    """A thread-safe store inside one process, with the same blocking semantics as the others.

    Useful for ranks that are threads of one process and for tests.

    Example::

        store = HashStore()
        threading.Thread(target=lambda: store.set("ready", b"1")).start()
        store.get("ready")  # blocks until the thread has set it
    """

    def __init__(self, timeout: timedelta | None = None) -> None:
        super().__init__(timeout)
        self._data: dict[str, bytes] = {}
        self._queues: dict[str, collections.deque[bytes]] = {}  # only queues with items
        self._cond = threading.Condition()

    def _set(self, key: str, value: bytes) -> None:
        with self._cond:
            self._data[key] = value
            self._cond.notify_all()

    def _wait_locked(self, keys: list[str], timeout: float, op: str) -> None:
        """Until every key has a value (``get``), or has a value or queued items (``wait``)."""
        deadline = time.monotonic() + timeout
        data = self._data
        queues = {} if op == "get" else self._queues
        while True:
            missing = [k for k in keys if k not in data and k not in queues]
            if not missing:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise StoreTimeoutError(
                    f"HashStore.{op}: timeout: keys {describe_missing(missing)} were not "
                    f"set within {timeout:g}s"
                )
            self._cond.wait(left)

    def _multi_get(self, keys: list[str], timeout: float) -> list[bytes]:
        with self._cond:
            self._wait_locked(keys, timeout, "get")
            return [self._data[k] for k in keys]

    def _wait(self, keys: list[str], timeout: float) -> None:
        with self._cond:
            self._wait_locked(keys, timeout, "wait")

    def _add(self, key: str, amount: int) -> int:
        with self._cond:
            value = parse_counter(self._data.get(key), amount, key)
            self._data[key] = value
            self._cond.notify_all()
            return int(value)

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        with self._cond:
            result, store = compare_set_result(self._data.get(key), expected, desired)
            if store:
                self._data[key] = desired
                self._cond.notify_all()
            return result

    def _check(self, keys: list[str]) -> bool:
        with self._cond:
            return all(k in self._data or k in self._queues for k in keys)

    def _delete_key(self, key: str) -> bool:
        with self._cond:
            return self._data.pop(key, None) is not None

    def _num_keys(self) -> int:
        with self._cond:
            return len(self._data)

    def _multi_set(self, keys: list[str], values: list[bytes]) -> None:
        with self._cond:
            self._data.update(zip(keys, values))
            self._cond.notify_all()

    def _append(self, key: str, value: bytes) -> None:
        with self._cond:
            self._data[key] = self._data.get(key, b"") + value
            self._cond.notify_all()

    def _queue_push(self, key: str, value: bytes) -> None:
        with self._cond:
            self._queues.setdefault(key, collections.deque()).append(value)
            self._cond.notify_all()

    def _queue_pop(self, key: str, timeout: float | None) -> bytes:
        with self._cond:
            if timeout is None and key not in self._queues:
                raise QueueEmptyError(f"HashStore.queue_pop: queue {key!r} is empty")
            deadline = time.monotonic() + (timeout or 0.0)
            while key not in self._queues:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StoreTimeoutError(f"HashStore.queue_pop: timeout: queue {key!r} "
                                            f"stayed empty for {timeout:g}s")
                self._cond.wait(left)
            queue = self._queues[key]
            item = queue.popleft()
            if not queue:
                del self._queues[key]
            return item

    def _queue_len(self, key: str) -> int:
        with self._cond:
            return len(self._queues.get(key, ()))
