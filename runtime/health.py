"""Heartbeats, and naming the rank that broke a collective.

Gloo reports a dead peer as a socket address ("Connection closed by peer
[10.0.0.3]:41234") and a missing one as a bare timeout. To name the rank instead, every
member of a group publishes ``hb/<group rank> = "<beat>:<seq>"`` in the group's store
once per ``SPMD_HEARTBEAT_INTERVAL`` (0.5 s): a beat counter that stops when the process
dies, and the sequence number of the last collective it entered. When an operation fails,
:func:`diagnose` reads them: ranks whose sequence is behind never joined the operation;
otherwise it reads again a few intervals later, and ranks whose beat did not move are
gone.

One daemon thread per process beats for every group of every rank in it; the hot path
only increments an integer.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING, Iterable

from spmd.runtime.config import heartbeat_interval
from spmd.runtime.errors import DistError

if TYPE_CHECKING:
    from spmd.runtime.process_group import ProcessGroup

__all__ = ["register", "unregister", "diagnose"]

log = logging.getLogger("spmd.runtime.health")


class _Monitor:
    def __init__(self) -> None:
        self.groups: "weakref.WeakSet[ProcessGroup]" = weakref.WeakSet()
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.thread: threading.Thread | None = None
        self.pid = os.getpid()

    def ensure_running(self) -> None:
        if self.thread is not None and self.thread.is_alive() and self.pid == os.getpid():
            return
        self.pid = os.getpid()
        self.thread = threading.Thread(target=self.run, name="spmd-heartbeat", daemon=True)
        self.thread.start()

    def run(self) -> None:
        while True:
            with self.lock:
                if not self.groups:
                    self.thread = None
                    return
            self._beat_all()
            self.wake.wait(heartbeat_interval())
            self.wake.clear()

    def _beat_all(self) -> None:
        """One beat per group, holding each only while it beats. A group owns a c10d
        backend: the thread that drops the last reference runs the backend's C++
        destructor, which releases the GIL, and a daemon thread that is inside it when
        the interpreter exits is killed there, aborting the process. This thread used
        to keep the groups of its last beat while it slept, so it could be that one."""
        with self.lock:
            refs = [weakref.ref(g) for g in self.groups]
        for ref in refs:
            group = ref()
            if group is not None:
                group._beat()
            del group


_monitor = _Monitor()


def register(group: "ProcessGroup") -> None:
    """Start beating for ``group`` (and publish its first beat now)."""
    group._beat()
    with _monitor.lock:
        _monitor.groups.add(group)
        _monitor.ensure_running()


def unregister(group: "ProcessGroup") -> None:
    with _monitor.lock:
        _monitor.groups.discard(group)


def _read(group: "ProcessGroup", ranks: Iterable[int]) -> dict[int, tuple[int, int]]:
    """(beat, seq) of each group rank that has published one."""
    out = {}
    store = group._store
    for r in ranks:
        key = f"hb/{r}"
        if store.check([key]):
            beat, _, seq = store.get(key).decode().partition(":")
            out[r] = (int(beat), int(seq))
    return out


def diagnose(group: "ProcessGroup", op: str, seq: int | None, peers: Iterable[int] | None,
             timed_out: bool = False) -> str:
    """Which ranks broke ``op``: gone (no heartbeat) or absent (never entered it).

    ``seq`` is the operation's collective sequence number (None for point-to-point);
    ``peers`` the group ranks it involved (None: all). Returns a sentence naming global
    ranks, or an empty string when nothing can be said.
    """
    me = group.rank()
    ranks = [r for r in (range(group.size()) if peers is None else peers) if r != me]
    if not ranks:
        return ""
    wait = 2.5 * heartbeat_interval()
    try:
        first = _read(group, ranks)
        # After a timeout every live rank has long published its progress, so a rank still
        # behind never entered the collective. Otherwise wait until beats must have moved.
        absent = [r for r in ranks if seq is not None and r in first and first[r][1] < seq]
        gone: list[int] = []
        if not (absent and timed_out):
            time.sleep(wait)
            second = _read(group, ranks)
            gone = [r for r in ranks if r not in second or second[r][0] == first.get(r, (-1,))[0]]
            absent = [r for r in ranks
                      if r not in gone and seq is not None and second[r][1] < seq]
            first = second
    except DistError as e:
        host = group._store_host_rank
        who = f"; rank {host}, which serves the store, is probably gone" if host is not None else ""
        return f"the store is unreachable ({e}){who}"
    parts = []
    if gone:
        names = ", ".join(str(group.ranks[r]) for r in gone)
        parts.append(f"rank {names} {'is' if len(gone) == 1 else 'are'} gone (no heartbeat "
                     f"for {wait:.1f}s: the process died or hangs outside Python)")
    if absent:
        names = ", ".join(f"{group.ranks[r]} (at collective {first[r][1]})" for r in absent)
        parts.append(f"rank {names} did not take part in collective {seq}")
    return "; ".join(parts)
