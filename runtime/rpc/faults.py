"""Fault injection, built into the agent so tests exercise retries and timeouts for real.

Faults act on this worker's outgoing messages, chosen by message type (``wire.Kind``
names: ``CALL``, ``REMOTE``, ``FETCH``, ``RREF_FORK``, ``RREF_ACCEPT``, ``RREF_DELETE``,
``RELEASE``, ``AUTOGRAD_BACKWARD``, ``AUTOGRAD_DONE``, ``AUTOGRAD_CLEANUP``, ``SHUTDOWN``,
``RESPONSE``, ``ERROR``). A dropped message is never sent: a retried type goes out again after the
retry interval, any other leaves its caller to time out. A delayed message is sent that
many seconds later from a timer thread, its order with other messages not kept.

Example::

    from spmd.runtime.rpc import faults
    faults.inject(drop={"RREF_DELETE": 2}, delay={"RREF_FORK": 0.5})
    ...
    faults.clear()
"""

from __future__ import annotations

import threading
from typing import Any

from spmd.runtime.rpc.wire import Kind, parse_kind

__all__ = ["inject", "clear", "dropped", "Faults"]


class Faults:
    """The faults of one agent: message types to drop (a count) or delay (seconds)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._drop: dict[Kind, int] = {}
        self._delay: dict[Kind, float] = {}
        self.active = False
        self.dropped: dict[Kind, int] = {}

    def set(self, drop: dict[Any, int] | None, delay: dict[Any, float] | None) -> None:
        drops = {}
        for name, count in (drop or {}).items():
            if not isinstance(count, int) or isinstance(count, bool) or count < 0:
                raise ValueError(f"faults: drop count for {name!r} must be an int >= 0, "
                                 f"got {count!r}")
            drops[parse_kind(name)] = count
        delays = {}
        for name, seconds in (delay or {}).items():
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0:
                raise ValueError(f"faults: delay for {name!r} must be seconds >= 0, "
                                 f"got {seconds!r}")
            delays[parse_kind(name)] = float(seconds)
        with self._lock:
            self._drop.update(drops)
            self._delay.update(delays)
            self.active = bool(self._drop or self._delay)

    def clear(self) -> None:
        with self._lock:
            self._drop.clear()
            self._delay.clear()
            self.active = False

    def decide(self, kind: Kind) -> tuple[bool, float]:
        """(drop this message, seconds to delay it)."""
        with self._lock:
            left = self._drop.get(kind, 0)
            if left > 0:
                self._drop[kind] = left - 1
                self.dropped[kind] = self.dropped.get(kind, 0) + 1
                return True, 0.0
            return False, self._delay.get(kind, 0.0)


def _faults() -> Faults:
    from spmd.runtime.rpc.api import current_agent

    return current_agent("faults").faults


def inject(*, drop: dict[str, int] | None = None, delay: dict[str, float] | None = None) -> None:
    """Drop the next ``drop[type]`` outgoing messages of each type, and delay every outgoing
    message of the types in ``delay`` by that many seconds. Adds to earlier faults.

    Example::

        faults.inject(drop={"RREF_DELETE": 1})   # the first delete is lost, then retried
    """
    _faults().set(drop, delay)


def clear() -> None:
    """Remove every fault of this worker.

    Example::

        faults.clear()   # later messages are sent normally
    """
    _faults().clear()


def dropped() -> dict[str, int]:
    """How many messages of each type this worker's faults have dropped so far.

    Example::

        faults.dropped()   # {'RREF_DELETE': 1}
    """
    return {k.name: n for k, n in _faults().dropped.items()}
