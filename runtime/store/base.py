"""The one interface every key-value store implements.

Processes meet in a store: they publish addresses, count arrivals and wait for each
other. The semantics are PyTorch's (``torch.distributed.Store``): keys are ``str``,
values are ``bytes`` (a ``str`` value is stored UTF-8 encoded), ``get`` and ``wait``
block until the key exists or the store's timeout passes.

Subclasses implement the underscored methods; the public methods here check every
argument first, so a bad call raises ``TypeError``/``ValueError`` before any I/O.
"""

from __future__ import annotations

import abc
import re
import time
from datetime import timedelta
from typing import Any, Iterable, Sequence, Union

from spmd.runtime import config
from spmd.runtime.errors import DistStoreError, QueueEmptyError, StoreTimeoutError

__all__ = ["Store", "Value"]

Value = Union[bytes, bytearray, memoryview, str]


def _key(key: object, what: str = "key") -> str:
    if not isinstance(key, str):
        raise TypeError(f"store {what} must be a str, got {type(key).__name__}")
    return key


def _keys(keys: object) -> list[str]:
    if isinstance(keys, (str, bytes)):
        raise TypeError(
            f"store keys must be a list of str, got a single {type(keys).__name__} "
            f"({keys!r}); pass [{keys!r}]"
        )
    try:
        items = list(keys)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(f"store keys must be a list of str, got {type(keys).__name__}") from None
    for item in items:
        _key(item, "key in the list")
    return items


def _value(value: object, what: str = "value") -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"store {what} must be bytes or str, got {type(value).__name__}")


def as_seconds(timeout: object, what: str = "timeout") -> float:
    """A positive timeout in seconds from a ``timedelta`` or a number of seconds."""
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"{what} must be a datetime.timedelta, got {type(timeout).__name__}")
    if not seconds > 0:
        raise ValueError(f"{what} must be positive, got {timeout!r}")
    return seconds


def _as_bytes(value: Any) -> bytes:
    """A Python store's answer as bytes (str encoded, bytes-like copied)."""
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class Store(abc.ABC):
    """A key-value store shared by the processes of a job.

    Every blocking method gives up after a timeout and raises
    :class:`~spmd.runtime.DistTimeoutError` naming the keys it waited for.

    Example::

        store = HashStore()
        store.set("addr/0", "127.0.0.1:29500")
        store.add("arrived", 1)          # -> 1
        store.wait(["addr/0"])
        store.get("addr/0")              # -> b"127.0.0.1:29500"
    """

    def __init__(self, timeout: timedelta | float | None = None) -> None:
        self._timeout = as_seconds(config.store_timeout() if timeout is None else timeout)

    # -- timeout ---------------------------------------------------------------------

    @property
    def timeout(self) -> timedelta:
        """How long blocking calls wait before raising ``DistTimeoutError``."""
        return timedelta(seconds=self._timeout)

    def set_timeout(self, timeout: timedelta) -> None:
        """Change the timeout of every later blocking call on this store object."""
        self._timeout = as_seconds(timeout)

    # -- public API: argument checks, then the implementation ------------------------

    def set(self, key: str, value: Value) -> None:
        """Store ``value`` under ``key``, replacing any previous value."""
        self._set(_key(key), _value(value))

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting up to the store's timeout for it to be set."""
        return self._multi_get([_key(key)], self._timeout)[0]

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the counter at ``key`` (0 when missing); the new value.

        The counter is kept as decimal ASCII, so ``get`` reads it as e.g. ``b"3"``.
        A value that is not a decimal integer raises ``DistStoreError``.
        """
        _key(key)
        if not isinstance(amount, int) or isinstance(amount, bool):
            raise TypeError(f"add amount must be an int, got {type(amount).__name__}")
        return self._add(key, amount)

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        """Atomically replace ``expected`` by ``desired``; returns the value now stored.

        When the key is missing and ``expected`` is empty, ``desired`` is stored; when it
        is missing and ``expected`` is not empty, nothing changes and ``expected`` is
        returned (PyTorch's semantics).
        """
        return self._compare_set(
            _key(key), _value(expected, "expected value"), _value(desired, "desired value")
        )

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        """Block until every key exists; ``timeout=None`` means the store's timeout."""
        seconds = self._timeout if timeout is None else as_seconds(timeout)
        self._wait(_keys(keys), seconds)

    def check(self, keys: Sequence[str]) -> bool:
        """True when every key exists right now (never blocks)."""
        return self._check(_keys(keys))

    def delete_key(self, key: str) -> bool:
        """Remove ``key``; False when it did not exist."""
        return self._delete_key(_key(key))

    def num_keys(self) -> int:
        """How many keys users have set (internal bookkeeping is never counted)."""
        return self._num_keys()

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """The values of all ``keys``, waiting (one timeout for all) until each exists."""
        return self._multi_get(_keys(keys), self._timeout)

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        """Set several keys at once (atomically where the store can)."""
        ks = _keys(keys)
        if isinstance(values, (str, bytes)):
            raise TypeError("multi_set values must be a list of bytes or str")
        vs = [_value(v) for v in values]
        if len(ks) != len(vs):
            raise ValueError(f"multi_set got {len(ks)} keys but {len(vs)} values")
        self._multi_set(ks, vs)

    def append(self, key: str, value: Value) -> None:
        """Atomically append ``value`` to the value at ``key`` (created when missing)."""
        self._append(_key(key), _value(value))

    # -- queues (torch's ``queue_push``/``queue_pop``/``queue_len``) --------------------
    #
    # Our stores keep queues beside the keys, as torch's TCPStore and HashStore do:
    # ``check`` and ``wait`` count a queue that holds items as an existing key; ``get``,
    # ``delete_key`` and ``num_keys`` do not see queues.

    def queue_push(self, key: str, value: Value) -> None:
        """Append ``value`` to the queue ``key``."""
        self._queue_push(_key(key), _value(value))

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """Remove and return the queue's first item. ``block``: wait up to the store's
        timeout for one (``DistTimeoutError``); else ``QueueEmptyError`` at once."""
        if not isinstance(block, bool):
            raise TypeError(f"queue_pop block must be a bool, got {type(block).__name__}")
        return self._queue_pop(_key(key), self._timeout if block else None)

    def queue_len(self, key: str) -> int:
        """How many items the queue ``key`` holds now."""
        return self._queue_len(_key(key))

    def clone(self) -> "Store":
        """Another handle on the same store, for another thread or component (torch's
        ``Store.clone``): a new client connection for a TCPStore, a new file handle for
        a FileStore; an in-process store is its own clone."""
        return self

    def has_extended_api(self) -> bool:
        """Whether ``append``, ``multi_get`` and ``multi_set`` work on this store.

        Always for this library's stores. A store written in Python (torch's way, by
        overriding public methods) has them when it overrides them, or overrides ``get``
        and ``compare_set``, from which they are built; a subclass that overrides none of
        these has not, as in torch."""
        if self._overridden("_multi_get"):  # one of ours (or a wrapper of one)
            return True
        return any(map(self._overridden, ("append", "multi_get", "multi_set"))) or \
            (self._overridden("get") and self._overridden("compare_set"))

    def close(self) -> None:
        """Release the store's resources (connections, files). Idempotent."""

    def retain(self) -> "Store":
        """Record one more user of this store object (a second component sharing it)."""
        self._users = getattr(self, "_users", 1) + 1
        return self

    def release(self) -> bool:
        """Record that one user is done; True when it was the last (time to close)."""
        self._users = getattr(self, "_users", 1) - 1
        return self._users <= 0

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- implementation --------------------------------------------------------------
    #
    # Our stores implement these. A store written in Python the way torch's
    # ``torch.distributed.Store`` is subclassed (overriding the public ``set``, ``get``,
    # ``add``, ``compare_set``, ``wait``, ``check``, ``delete_key``, ``num_keys``) gets
    # them from its overrides, so every other method (``multi_get``, ``append``, the
    # queues, ``wait`` by polling ``check``) and everything built on stores (process
    # groups, PrefixStore, rendezvous) works on it.

    def _own(self, name: str) -> Any:
        """The subclass's override of public method ``name``; ``NotImplementedError``
        naming it when there is none."""
        if not self._overridden(name):
            raise NotImplementedError(f"Not implemented: {type(self).__name__} does not "
                                      f"implement {name}(); a Store subclass overrides "
                                      f"{name}() (or _{name}())")
        return getattr(self, name)

    def _overridden(self, name: str) -> bool:
        """Whether this store's class replaces Store's method ``name``."""
        return getattr(type(self), name) is not getattr(Store, name)

    def _set(self, key: str, value: bytes) -> None:
        self._own("set")(key, value)

    def _multi_get(self, keys: list[str], timeout: float) -> list[bytes]:
        if self._overridden("multi_get"):  # reached through a PrefixStore around this one
            return [_as_bytes(v) for v in self.multi_get(keys)]
        get = self._own("get")
        return [_as_bytes(get(k)) for k in keys]

    def _add(self, key: str, amount: int) -> int:
        return int(self._own("add")(key, amount))

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return _as_bytes(self._own("compare_set")(key, expected, desired))

    def _wait(self, keys: list[str], timeout: float) -> None:
        if type(self).wait is not Store.wait:
            self.wait(keys, timedelta(seconds=timeout))
            return
        deadline = time.monotonic() + timeout
        while not self._check(keys):
            if time.monotonic() >= deadline:
                raise StoreTimeoutError(f"{type(self).__name__}: timeout: keys {keys} not "
                                        f"set within {timeout:g} s")
            time.sleep(0.005)

    def _check(self, keys: list[str]) -> bool:
        return bool(self._own("check")(keys))

    def _delete_key(self, key: str) -> bool:
        return bool(self._own("delete_key")(key))

    def _num_keys(self) -> int:
        return int(self._own("num_keys")())

    def _multi_set(self, keys: list[str], values: list[bytes]) -> None:
        if self._overridden("multi_set"):
            self.multi_set(keys, values)
            return
        for key, value in zip(keys, values):
            self._set(key, value)

    # A store written in Python gets queues built on its ``add`` and ``compare_set``: a
    # queue ``q`` is two counters (``q/head``, ``q/tail``) and one key per item
    # (``q/<index>``), so producers and consumers may be in any processes (torch's Python
    # stores have no queues at all). Ours override these three.

    def _queue_push(self, key: str, value: bytes) -> None:
        index = self._add(f"{key}/tail", 1) - 1
        self._set(f"{key}/{index}", value)

    def _queue_pop(self, key: str, timeout: float | None) -> bytes:
        """``timeout``: seconds to wait for an item; None: do not wait."""
        deadline = time.monotonic() + (timeout or 0.0)
        delay = 0.001
        while True:
            head = self._add(f"{key}/head", 0)
            if head < self._add(f"{key}/tail", 0):
                # claim index ``head``; another consumer may have claimed it first
                won = self._compare_set(f"{key}/head", str(head).encode(),
                                        str(head + 1).encode())
                if won == str(head + 1).encode():
                    item = f"{key}/{head}"
                    value = self._multi_get([item], max(deadline - time.monotonic(), 0.001))[0]
                    self._delete_key(item)
                    return value
                continue
            if timeout is None:
                raise QueueEmptyError(f"queue_pop: queue {key!r} is empty")
            if time.monotonic() >= deadline:
                raise StoreTimeoutError(f"queue_pop: timeout: queue {key!r} stayed empty for "
                                        f"{timeout:g}s")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def _queue_len(self, key: str) -> int:
        return self._add(f"{key}/tail", 0) - self._add(f"{key}/head", 0)

    def _append(self, key: str, value: bytes) -> None:
        if self._overridden("append"):
            self.append(key, value)
            return
        while True:  # atomic through compare_set: retried if another writer came first
            current = self._multi_get([key], self._timeout)[0] if self._check([key]) else b""
            desired = current + value
            if self._compare_set(key, current, desired) == desired:
                return


_COUNTER = re.compile(rb"[ \t\n\r\f\v]*[+-]?[0-9]+[ \t\n\r\f\v]*")


def parse_counter(current: bytes | None, amount: int, key: str) -> bytes:
    """The new decimal value of a counter; ``DistStoreError`` naming the key otherwise."""
    if current is None:
        return str(amount).encode()
    # ASCII whitespace and one decimal integer, as C's strtoll reads it (Python's own
    # int() would also take other whitespace, such as b"\x1c", and digit underscores)
    if not _COUNTER.fullmatch(current):
        shown = current[:40]
        raise DistStoreError(
            f"add({key!r}): the value at this key is {shown!r}, not a decimal integer"
        )
    return str(int(current) + amount).encode()


def compare_set_result(
    current: bytes | None, expected: bytes, desired: bytes
) -> tuple[bytes, bool]:
    """PyTorch's compare_set rule: (value to return, whether to store ``desired``)."""
    if current is None:
        return (desired, True) if expected == b"" else (expected, False)
    if current == expected:
        return desired, True
    return current, False


def describe_missing(keys: Iterable[str], limit: int = 5) -> str:
    missing = list(keys)
    shown = ", ".join(repr(k) for k in missing[:limit])
    more = f" and {len(missing) - limit} more" if len(missing) > limit else ""
    return shown + more
