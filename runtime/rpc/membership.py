"""Dynamic RPC groups: ``init_rpc`` without ``world_size``, as torch's TensorPipe agent
allows. Workers join and leave at any time; each knows the others by their records in
the store that ``init_method`` names, which every member shares:

    rpc/mode                "static" or "dynamic": the first worker decides, and a worker
                            of the other kind is refused (torch's rule)
    rpc/dynamic/ranks       every rank that ever joined, appended ("0,2,1,")
    rpc/dynamic/worker/R    R's record while it is a member (compare_set: one owner)
    rpc/dynamic/name/N      the rank called N while it is a member (names stay unique)

A member learns of a worker that joined when it first needs to: a name or rank it does
not know (``rpc_sync("new", ...)``, ``get_worker_info``), a connection from an unknown
rank, or ``get_all_worker_infos()``, each of which reads the records again. A worker
that leaves (``shutdown()``) first finishes its own outstanding work and deletes its
user RRefs, then removes its records and tells every member it knows, so its
connection closing is expected there and its name stops resolving. The store must
outlive the group: with ``tcp://``, rank 0 serves it, so rank 0 leaves last.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from spmd.runtime.errors import InvalidArgumentError

__all__ = ["Membership", "claim_mode", "MixedGroupError"]

log = logging.getLogger("spmd.runtime.rpc")

_MODE = "rpc/mode"
_RANKS = "rpc/dynamic/ranks"
_ABSENT = b"\x00absent"  # compare_set(key, _ABSENT, _ABSENT) reads a key without waiting


class MixedGroupError(RuntimeError):
    """A worker with ``world_size`` joining workers without it, or the other way round."""


def claim_mode(store: Any, mode: str) -> None:
    """Record that this group is ``"static"`` or ``"dynamic"``; ``MixedGroupError`` when
    its first members were of the other kind."""
    got = store.compare_set(_MODE, "", mode).decode()
    if got != mode:
        given = "without" if mode == "dynamic" else "with"
        raise MixedGroupError(
            f"init_rpc: this worker was started {given} world_size ({mode}), but the "
            f"workers already in this group were not ({got}): RPC group mixes statically "
            f"and dynamically initialized members which is not supported.")


def _read(store: Any, key: str) -> bytes | None:
    """``key``'s value, or None when it is missing, without waiting for it."""
    value = store.compare_set(key, _ABSENT, _ABSENT)
    return None if value == _ABSENT else value


class Membership:
    """One worker's view of its dynamic group."""

    def __init__(self, agent: Any, store: Any) -> None:
        self.agent = agent
        self.store = store
        self.lock = threading.Lock()
        self.joined = False

    def _worker_key(self, rank: int) -> str:
        return f"rpc/dynamic/worker/{rank}"

    def join(self, record: dict) -> None:
        """Publish this worker's record; ``ValueError`` when its rank or name is taken."""
        agent, store = self.agent, self.store
        text = json.dumps(record, sort_keys=True)
        got = store.compare_set(self._worker_key(agent.rank), "", text).decode()
        if got != text:
            other = json.loads(got).get("name", "?")
            raise InvalidArgumentError(
                f"init_rpc: rank {agent.rank} is taken by worker {other!r}, a member of "
                f"this dynamic group; give each worker its own rank")
        claimed = store.compare_set(f"rpc/dynamic/name/{agent.name}", "",
                                    str(agent.rank)).decode()
        if claimed != str(agent.rank):
            store.delete_key(self._worker_key(agent.rank))
            raise InvalidArgumentError(
                f"init_rpc: a worker called {agent.name!r} (rank {claimed}) is already a "
                f"member of this dynamic group; worker names must be unique")
        store.append(_RANKS, f"{agent.rank},")
        self.joined = True

    def refresh(self, wanted: int | None = None) -> bool:
        """Read the members' records again: learn who joined, forget who left. True when
        ``wanted`` (a rank) is a member now."""
        agent, store = self.agent, self.store
        with self.lock:
            try:
                raw = _read(store, _RANKS) or b""
                ranks = sorted({int(r) for r in raw.decode().split(",") if r} - {agent.rank})
                now = {}
                for r in ranks:
                    value = _read(store, self._worker_key(r))
                    if value is not None:
                        now[r] = json.loads(value)
            except Exception as e:  # the store is gone: keep what we know
                log.warning("rpc: could not read the dynamic group's members: %s", e)
                return wanted in agent.infos
            for r, rec in now.items():
                if agent.records.get(r) != rec:
                    agent.add_peer(r, rec)
            for r in list(agent.infos):
                if r != agent.rank and r not in now:
                    agent.remove_peer(r)
        return wanted is not None and wanted in now

    def left(self, rank: int) -> None:
        """Member ``rank`` says it leaves."""
        with self.lock:
            self.agent.remove_peer(rank)

    def leave(self, graceful: bool, timeout: float) -> None:
        """Leave the group: remove this worker's records and (graceful) tell the members
        it knows. ``shutdown`` has finished this worker's own work first."""
        agent = self.agent
        deadline = time.monotonic() + timeout
        self.withdraw()
        if not graceful:
            return
        from spmd.runtime.rpc.api import wait_sync
        from spmd.runtime.rpc.wire import Kind

        for peer in [r for r in list(agent.infos) if r != agent.rank]:
            try:
                entry = agent.request(peer, Kind.SHUTDOWN, _member_left, (agent.rank,), {},
                                      timeout=max(min(deadline - time.monotonic(), 5.0), 0.1),
                                      sync=True, what=f"shutdown: telling "
                                                      f"{agent.describe(peer)} this worker leaves")
                wait_sync(agent, entry)
            except Exception as e:  # it left too, or died: nothing to tell
                log.debug("rpc: %s", e)

    def withdraw(self) -> None:
        """Remove this worker's records from the store (best effort: it may be gone)."""
        if not self.joined:
            return
        self.joined = False
        try:
            self.store.delete_key(self._worker_key(self.agent.rank))
            self.store.delete_key(f"rpc/dynamic/name/{self.agent.name}")
        except Exception as e:
            log.debug("rpc: could not remove this worker's records: %s", e)


def _member_left(rank: int) -> None:
    from spmd.runtime.rpc.api import current_agent

    members = current_agent("shutdown").members
    if members is not None:
        members.left(rank)
