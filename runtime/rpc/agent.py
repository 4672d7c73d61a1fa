"""The RPC agent of one worker: requests out, requests in, responses, timers, retries.

Threads and hand-offs (see ``transport`` for who owns which socket):

- a caller pickles its call and sends it on the peer's DEALER itself;
- the I/O thread receives everything. A response for ``rpc_sync`` goes straight to the
  waiting caller, which unpickles it (one hop); any other response, and every request,
  goes to the worker pool, so no user code (a future's callbacks, a function) ever runs
  on the I/O thread;
- a pool thread runs the call and sends the response on the caller's DEALER.

Every request is in ``pending`` until its response, its deadline, or its peer's loss
completes it exactly once (``dict.pop`` is atomic). Control messages (``wire.RETRIED``)
are sent again every retry interval until answered; their receiver answers duplicates
without running them twice.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import queue
import threading
import time
import traceback
from typing import Any, Callable

import torch

from spmd.runtime.context import RankContext, rank_context
from spmd.runtime.errors import (DistError, DistTimeoutError, WrongTypeError,
                                  also_runtime_error)
from spmd.runtime import config
from spmd.runtime.rpc import cma
from spmd.runtime.rpc.faults import Faults
from spmd.runtime.rpc.futures import AsyncResult, is_async, not_a_future_error
from spmd.runtime.rpc.inbox import Inboxes, run_task
from spmd.runtime.rpc.options import RpcBackendOptions, WorkerInfo
from spmd.runtime.rpc.serialize import (DumpState, Encoded, LoadState, decode, encode,
                                        pack_exception, unpack_exception)
from spmd.runtime.rpc.transport import Transport
from spmd.runtime.rpc.wire import (FLAG_LENT, HEADER, LENT_HEAD, LENT_ITEM, REQUESTS, RETRIED,
                                   ROUTED, UNCOUNTED, VERSION, Kind)

__all__ = ["RpcAgent"]

log = logging.getLogger("spmd.runtime.rpc")
_SEEN_KEEP = 600.0  # seconds a retried request's id is remembered (retries stop far sooner)


class _Entry:
    __slots__ = ("rid", "kind", "dest", "_what", "future", "waiter", "reply", "error",
                 "deadline", "timeout", "resend", "gap", "route")

    def __init__(self, rid: int, kind: Kind, dest: int, what: str | Callable[[], str],
                 deadline: float, timeout: float, sync: bool) -> None:
        self.rid, self.kind, self.dest, self._what = rid, kind, dest, what
        self.deadline, self.timeout = deadline, timeout
        self.waiter = threading.Lock() if sync else None
        if self.waiter is not None:
            self.waiter.acquire()
        self.future: torch.futures.Future | None = None if sync else torch.futures.Future()
        self.reply: tuple | None = None
        self.error: BaseException | None = None
        self.resend: tuple | None = None  # (header, encoded) of a retried message
        self.gap = 0.0
        self.route = -1  # the context whose waiting thread takes the answer (rpc.inbox)

    @property
    def what(self) -> str:
        """What the request was, for messages (built only when one is needed)."""
        if callable(self._what):
            self._what = self._what()
        return self._what


class RpcAgent:
    """One worker's agent. Built by ``init_rpc``; everything else goes through the API."""

    def __init__(self, *, name: str, rank: int, world_size: int | None,
                 options: RpcBackendOptions, host: str, rank_ctx: RankContext) -> None:
        from spmd.runtime.rpc.rref import RRefContext

        self.name, self.rank, self.world_size = name, rank, world_size
        self.options = options
        self.timeout = options.rpc_timeout
        self.rank_ctx = rank_ctx
        self.infos: dict[int, WorkerInfo] = {rank: WorkerInfo(name, rank)}
        self.by_name: dict[str, WorkerInfo] = {name: self.infos[rank]}
        self.records: dict[int, dict] = {}
        self.pending: dict[int, _Entry] = {}
        self.lent: dict[int, tuple[int, list]] = {}
        self.seen: dict[tuple[int, int], float] = {}
        self.lost: dict[int, str] = {}
        self.closing: set[int] = set()
        self.faults = Faults()
        self.rrefs = RRefContext(self)
        self.contexts: dict[int, Any] = {}  # distributed autograd contexts (autograd owns them)
        self.contexts_lock = threading.Lock()
        self.autograd_lock = threading.Lock()  # one local backward pass at a time
        self.shutdown_state: Any = None
        self.store: Any = None  # the store init_rpc met in, perhaps shared with the group
        self.stopped = False
        self._ids = itertools.count(1)
        self._timers: queue.SimpleQueue = queue.SimpleQueue()
        self._heap: list[tuple[float, int, int, bool]] = []
        self._next_purge = time.monotonic() + _SEEN_KEEP
        self._cma_from: dict[int, bool] = {}  # we can read this peer's memory
        self._maps_from: dict[int, dict[str, str]] = {}  # a caller's device map, inverted
        self._cma_threshold = config.rpc_cma_threshold()
        self.probe = cma.Probe()
        self.pool: queue.SimpleQueue = queue.SimpleQueue()
        self.inboxes = Inboxes(self.pool)  # a context's messages for its waiting thread
        self.members: Any = None  # a dynamic group's membership (rpc.membership)
        self.transport = Transport(rank=rank, host=host, token=config.rpc_auth_token(),
                                   describe=self.describe, grant_cma=self._grant_cma,
                                   discover=self._discover,
                                   on_message=self._on_message, on_peer_lost=self._peer_lost,
                                   on_tick=self._tick, rank_ctx=rank_ctx)
        self._threads = [threading.Thread(target=self._work, name=f"spmd-rpc-{rank}-{i}",
                                          daemon=True)
                         for i in range(options.num_worker_threads)]

    # -- start-up --------------------------------------------------------------------------

    def record(self) -> dict:
        """What this worker publishes in the store for its peers."""
        return {"name": self.name, "rank": self.rank, "address": self.transport.address,
                "pid": os.getpid(), "host": cma.host_key(),
                "probe": [self.probe.address, self.probe.content.hex()],
                "device_maps": self.options.device_maps}

    def start(self, records: dict[int, dict]) -> None:
        for rank, rec in records.items():
            self.add_peer(rank, rec)
        self.transport.start({r: rec["address"] for r, rec in records.items()})
        for t in self._threads:
            t.start()

    def add_peer(self, rank: int, rec: dict) -> None:
        """Know worker ``rank`` by its published record (at start, or when it joins a
        dynamic group)."""
        before = self.records.get(rank)
        if before is not None and before["address"] != rec["address"]:
            self.transport.forget(rank)  # a new worker with a departed one's rank
        self.records[rank] = rec
        info = WorkerInfo(rec["name"], rank)
        old = self.infos.get(rank)
        if old is not None and old.name != info.name:
            self.by_name.pop(old.name, None)
        self.infos[rank] = info
        self.by_name[rec["name"]] = info
        self.lost.pop(rank, None)
        self.closing.discard(rank)
        theirs = rec.get("device_maps", {}).get(self.name)
        if theirs:
            self._maps_from[rank] = {v: k for k, v in theirs.items()}
        if config.rpc_cma_enabled() and cma.available() and rec["host"] == cma.host_key():
            address, content = rec["probe"]
            self._cma_from[rank] = cma.can_read(rec["pid"], address, bytes.fromhex(content))
        self.transport.addresses[rank] = rec["address"]

    def remove_peer(self, rank: int) -> None:
        """Forget worker ``rank``, which left a dynamic group: its connection closing is
        expected, and its name and rank stop resolving. (The connection itself stays
        until a worker with that rank joins: the answer to its goodbye still uses it.)"""
        self.closing.add(rank)
        info = self.infos.pop(rank, None)
        if info is not None and self.by_name.get(info.name) == info:
            del self.by_name[info.name]

    def _discover(self, peer: int) -> bool:
        """A worker connects: in a dynamic group, read the members again, since it may
        have joined (or taken a departed worker's rank) since we last looked (the I/O
        thread asks, once per connection; a store read)."""
        return self.members is not None and self.members.refresh(peer)

    def _grant_cma(self, peer: int) -> bool:
        return self._cma_from.get(peer, False)

    def describe(self, rank: int) -> str:
        info = self.infos.get(rank)
        return f"worker {info.name!r} (rank {rank})" if info else f"rank {rank}"

    # -- sending ---------------------------------------------------------------------------

    def request(self, dest: int, kind: Kind, func: Callable, args: tuple, kwargs: dict, *,
                timeout: float, sync: bool, what: str | Callable[[], str],
                ctx: Any = None, route: int = -1) -> _Entry:
        """Pickle and send a request; its entry (``.future`` or, with ``sync``, ``.waiter``).
        ``route``: the context id a ``ROUTED`` request is for (``rpc.inbox``).

        Raises TypeError when the call cannot be pickled (nothing is sent), DistError
        when the peer is gone or the agent is shut down.
        """
        if self.stopped or dest in self.lost:
            label = what() if callable(what) else what
            if self.stopped:
                raise DistError(f"{label}: RPC is shut down on this worker")
            raise DistError(f"{label}: {self.describe(dest)} is gone ({self.lost[dest]})")
        state = DumpState(self, self.device_map_to(dest), ctx is not None)
        try:
            enc = encode((func, args, kwargs), state)
        except TypeError as e:
            label = what() if callable(what) else what
            raise WrongTypeError(f"{label}: {e}") from e.__cause__
        ctx_id, grad_msg = route, -1
        if ctx is not None:
            ctx_id = ctx.context_id
            grad_msg = ctx.record_send(dest, state.grad_tensors)
        rid = next(self._ids)
        entry = _Entry(rid, kind, dest, what, time.monotonic() + timeout, timeout, sync)
        entry.route = route
        header = HEADER.pack(VERSION, kind, 0, 0, rid, ctx_id, grad_msg)
        self.pending[rid] = entry
        if kind in RETRIED:
            entry.resend, entry.gap = (header, enc), config.rpc_retry_interval()
            self._timers.put((time.monotonic() + entry.gap, rid, True))
        if not sync:
            self._timers.put((entry.deadline, rid, False))
        try:
            self._transmit(dest, kind, header, enc, entry.deadline)
        except BaseException:
            if self.pending.pop(rid, None) is not None:
                state.rollback()
            raise
        return entry

    def _transmit(self, dest: int, kind: Kind, header: bytes, enc: Encoded,
                  deadline: float) -> None:
        if self.faults.active:
            drop, delay = self.faults.decide(kind)
            if drop:
                log.info("rpc fault injection: dropped a %s message to %s", kind.name,
                         self.describe(dest))
                return
            if delay > 0:
                timer = threading.Timer(delay, self._transmit_late,
                                        args=(dest, header, enc, deadline + delay))
                timer.daemon = True
                timer.start()
                return
        self._send(dest, header, enc, deadline)

    def _transmit_late(self, dest: int, header: bytes, enc: Encoded, deadline: float) -> None:
        try:
            self._send(dest, header, enc, deadline)
        except Exception as e:
            rid = HEADER.unpack(header)[4]
            entry = self.pending.pop(rid, None) if HEADER.unpack(header)[1] in REQUESTS else None
            if entry is not None:
                self._fail(entry, e)
            else:
                log.warning("rpc: a delayed message to %s was lost: %s", self.describe(dest), e)

    def _send(self, dest: int, header: bytes, enc: Encoded, deadline: float) -> None:
        lend_id = next(self._ids) if enc.buffers else 0

        def build(link: Any) -> list:
            threshold = self._cma_threshold if link.reads_us else None
            frames, lent = enc.frames(header, lend_id, threshold)
            if lent:
                self.lent[lend_id] = (dest, lent)
            return frames

        try:
            self.transport.send(dest, [], deadline, build)
        except BaseException:
            self.lent.pop(lend_id, None)
            raise

    def respond(self, peer: int, rid: int, value: Any, error: BaseException | None,
                ctx: Any = None) -> None:
        """Send the answer to request ``rid`` of ``peer`` (from a pool thread)."""
        kind = Kind.RESPONSE
        state = DumpState(self, self.device_map_from(peer), ctx is not None)
        if error is None:
            try:
                enc = encode(value, state)
            except TypeError as e:
                error = WrongTypeError(f"the result of the call cannot be sent back: {e}")
        if error is not None:
            kind = Kind.ERROR
            state = DumpState(self, None, False)
            enc = encode(pack_exception(error), state)
        ctx_id = grad_msg = -1
        if ctx is not None:
            ctx_id = ctx.context_id
            grad_msg = ctx.record_send(peer, state.grad_tensors)
        header = HEADER.pack(VERSION, kind, 0, 0, rid, ctx_id, grad_msg)
        try:
            self._transmit(peer, kind, header, enc, time.monotonic() + self.timeout)
        except Exception as e:
            log.warning("rpc: could not answer %s: %s", self.describe(peer), e)

    # -- receiving (I/O thread) --------------------------------------------------------------

    def _on_message(self, peer: int, first: bytes, rest: list) -> None:
        """One message: ``first`` its first frame, ``rest`` the others (zmq Frames)."""
        if len(first) < HEADER.size or (rest and len(first) != HEADER.size):
            log.warning("rpc: dropped a message from %s with a %d-byte header",
                        self.describe(peer), len(first))
            return
        version, kind, flags, _, rid, ctx_id, grad_msg = HEADER.unpack_from(first)
        if version != VERSION or not (kind in REQUESTS or kind in _ANSWERS):
            log.warning("rpc: dropped a message from %s: version %d, type %d",
                        self.describe(peer), version, kind)
            return
        frames = (first, rest)
        if kind in REQUESTS:
            task = (self._serve, (peer, kind, flags, rid, ctx_id, grad_msg, frames))
            if kind not in ROUTED or not self.inboxes.route(ctx_id, task):
                self.pool.put(task)
            return
        entry = self.pending.get(rid)
        if entry is None or entry.dest != peer or self.pending.pop(rid, None) is None:
            log.debug("rpc: a response from %s came after its request ended", self.describe(peer))
            if flags & FLAG_LENT and len(rest) > 1 and len(rest[1]) >= LENT_HEAD.size:
                lend_id = LENT_HEAD.unpack_from(rest[1].buffer)[0]  # unread, but released
                self.pool.put((self._release, (peer, lend_id)))
            return
        entry.reply = (kind, flags, ctx_id, grad_msg, frames)
        if entry.waiter is not None:
            entry.waiter.release()
        elif not self.inboxes.route(entry.route, (self._complete, (entry,))):
            self.pool.put((self._complete, (entry,)))

    def _fail(self, entry: _Entry, error: BaseException) -> None:
        entry.error = error
        if entry.waiter is not None:
            entry.waiter.release()
        elif self.stopped:
            _set_exception(entry.future, error)
        else:
            self.pool.put((_set_exception, (entry.future, error)))

    def _tick(self) -> float:
        now = time.monotonic()
        while not self._timers.empty():
            heapq.heappush(self._heap, self._timers.get())
        while self._heap and self._heap[0][0] <= now:
            _, rid, retry = heapq.heappop(self._heap)
            entry = self.pending.get(rid)
            if entry is None:
                continue
            if retry:
                if now < entry.deadline:
                    entry.gap *= 1.5
                    heapq.heappush(self._heap, (now + entry.gap, rid, True))
                    self.pool.put((self._resend, (entry,)))
            elif self.pending.pop(rid, None) is entry:
                self._fail(entry, rpc_timeout_error(entry.what, entry.timeout))
        if now >= self._next_purge:
            self._next_purge = now + _SEEN_KEEP
            self.seen = {k: t for k, t in self.seen.items() if now - t < _SEEN_KEEP}
        return self._heap[0][0] - now if self._heap else 1.0

    def _resend(self, entry: _Entry) -> None:
        if entry.rid in self.pending and entry.resend is not None:
            log.info("rpc: no answer to %s yet; sending it again", entry.what)
            try:
                self._transmit(entry.dest, entry.kind, *entry.resend, entry.deadline)
            except Exception as e:
                log.debug("rpc: resending %s failed: %s", entry.what, e)

    def _peer_lost(self, peer: int, reason: str) -> None:
        if self.stopped or peer in self.closing or peer in self.lost:
            return
        self.lost[peer] = reason
        log.warning("rpc: %s is gone (%s)", self.describe(peer), reason)
        for rid, entry in list(self.pending.items()):
            if entry.dest == peer and self.pending.pop(rid, None) is entry:
                self._fail(entry, DistError(f"{entry.what} failed: {self.describe(peer)} is "
                                            f"gone ({reason})"))
        for lend_id, (dest, _) in list(self.lent.items()):
            if dest == peer:
                self.lent.pop(lend_id, None)
        if self.shutdown_state is not None:  # it completes futures: not on this thread
            self.pool.put((self.shutdown_state.peer_lost, (peer, reason)))

    # -- the worker pool -------------------------------------------------------------------

    def _work(self) -> None:
        with rank_context(self.rank_ctx):
            while True:
                task = self.pool.get()
                if task is None:
                    return
                run_task(task)
                # an idle thread must not keep its last task's arguments (RRefs among
                # them) alive while it waits for the next
                del task

    def _serve(self, peer: int, kind: int, flags: int, rid: int, ctx_id: int, grad_msg: int,
               frames: tuple) -> None:
        if kind in RETRIED:
            key = (peer, rid)
            if key in self.seen:  # a retry of a request that already ran: answer again
                self.respond(peer, rid, None, None)
                return
            self.seen[key] = time.monotonic()
        ctx = None
        pending: list = []
        try:
            if ctx_id >= 0 and kind not in ROUTED:
                ctx = _autograd().join_context(self, ctx_id, peer)
            func, args, kwargs = self._load(peer, flags, frames, ctx, grad_msg, pending)
        except Exception as e:
            log.warning("rpc: could not unpickle a %s request from %s: %s", Kind(kind).name,
                        self.describe(peer), e)
            if isinstance(e, (AttributeError, ImportError)):  # a name the callee lacks
                e = also_runtime_error(e, f" (on {self.describe(self.rank)}: the RPC pickler "
                                          f"does not serialize function code; what a call "
                                          f"refers to must be importable on the callee too)")
            self.respond(peer, rid, None, e)
            return
        if pending:  # as torch: the call runs once the owners registered the RRefs it got
            torch.futures.collect_all(pending).add_done_callback(
                lambda _: self.pool.put((self._run, (peer, rid, func, args, kwargs, ctx))))
            return
        self._run(peer, rid, func, args, kwargs, ctx)

    def _run(self, peer: int, rid: int, func: Any, args: Any, kwargs: Any, ctx: Any) -> None:
        try:
            if ctx is None:
                result = func(*args, **kwargs)
            else:
                with _autograd().running_in(ctx):
                    result = func(*args, **kwargs)
        except BaseException as e:
            if not getattr(e, "_spmd_remote", False):  # raised here, not passed along
                # as torch's agent: the callee's log shows it too, where it happened (on
                # stderr when the program configured no logging)
                log.warning("On %s:\n%r\n%s", self.infos.get(self.rank, self.name), e,
                            traceback.format_exc())
            self.respond(peer, rid, None, e)
            return
        if isinstance(result, AsyncResult):
            future = result.future
        elif is_async(func):
            future = result
        else:
            self.respond(peer, rid, result, None, ctx)
            return
        if not isinstance(future, torch._C.Future):
            self.respond(peer, rid, None, not_a_future_error(func, future))
            return

        def answer(done: torch.futures.Future) -> None:
            try:
                value = done.value()
            except BaseException as e:
                self.respond(peer, rid, None, e)
                return
            self.respond(peer, rid, value, None, ctx)

        future.add_done_callback(answer)

    def _load(self, peer: int, flags: int, frames: tuple, ctx: Any, grad_msg: int,
              pending: list | None = None) -> Any:
        first, rest = frames
        state = LoadState(self, peer, ctx, grad_msg, pending)
        if not rest:  # header and payload in one frame
            return decode(memoryview(first)[HEADER.size:], [], state)
        if not flags & FLAG_LENT:
            return decode(rest[0].buffer, [f.buffer for f in rest[1:]], state)
        desc = rest[1].bytes
        lend_id, count = LENT_HEAD.unpack_from(desc)
        if len(desc) != LENT_HEAD.size + count * LENT_ITEM.size:
            raise ValueError("malformed lent-buffer description")
        inline = iter(rest[2:])
        buffers = []
        try:
            pid = self.records[peer]["pid"]
            for i in range(count):
                where, address, nbytes = LENT_ITEM.unpack_from(desc, LENT_HEAD.size
                                                               + i * LENT_ITEM.size)
                buffers.append(next(inline).buffer if where == 0
                               else cma.read(pid, address, nbytes))
        finally:
            self._release(peer, lend_id)
        return decode(rest[0].buffer, buffers, state)

    def _release(self, peer: int, lend_id: int) -> None:
        try:
            self.request(peer, Kind.RELEASE, _release_lent, (lend_id,), {}, timeout=self.timeout,
                         sync=False, what=f"releasing buffers of {self.describe(peer)}")
        except Exception as e:
            log.debug("rpc: could not release buffers of %s: %s", self.describe(peer), e)

    def _complete(self, entry: _Entry) -> None:
        try:
            value = self.finish(entry)
        except BaseException as e:
            entry.future.set_exception(e)
            return
        entry.future.set_result(value)

    def finish(self, entry: _Entry) -> Any:
        """The result of a completed entry, unpickled here; raises its error."""
        if entry.error is not None:
            raise entry.error
        kind, flags, ctx_id, grad_msg, frames = entry.reply
        ctx = _autograd().find_context(self, ctx_id) if ctx_id >= 0 else None
        value = self._load(entry.dest, flags, frames, ctx, grad_msg)
        if kind == Kind.ERROR:
            raise unpack_exception(value, f"on {self.describe(entry.dest)}, in {entry.what}")
        return value

    # -- device maps -----------------------------------------------------------------------

    def device_map_to(self, dest: int) -> dict[str, str] | None:
        return self.options.device_maps.get(self.infos[dest].name) or None

    def device_map_from(self, caller: int) -> dict[str, str] | None:
        return self._maps_from.get(caller)

    # -- activity and teardown -------------------------------------------------------------

    def outstanding(self) -> int:
        """Requests in flight (not counting shutdown's own), lent buffers, RRef forks."""
        calls = sum(1 for e in list(self.pending.values()) if e.kind not in UNCOUNTED)
        return calls + len(self.lent) + self.rrefs.in_flight()

    def stop(self, linger: float = 0.0) -> None:
        """Fail whatever is pending, stop the threads, close the sockets."""
        if self.stopped:
            return
        self.stopped = True
        self.closing.update(self.infos)
        for rid in list(self.pending):
            entry = self.pending.pop(rid, None)
            if entry is not None:
                self._fail(entry, DistError(f"{entry.what}: RPC was shut down"))
        for _ in self._threads:
            self.pool.put(None)
        me = threading.current_thread()
        end = time.monotonic() + 5.0
        for t in self._threads:
            if t is not me and t.is_alive():
                t.join(max(0.0, end - time.monotonic()))
        self.transport.close(linger)
        self.lent.clear()
        self.drop_store()

    def drop_store(self) -> None:
        """Release the store; close it only when no one else (a process group) uses it."""
        if self.store is not None and self.store.release():
            self.store.close()
        self.store = None


_ANSWERS = frozenset({Kind.RESPONSE, Kind.ERROR})


def rpc_timeout_error(what: str | Callable[[], str], seconds: float) -> DistTimeoutError:
    """The error of a call that ran past its timeout (torch's phrase included, for code
    that matches it)."""
    label = what() if callable(what) else what
    return DistTimeoutError(f"{label} timed out after {seconds:g}s (RPC ran for more than "
                            f"{seconds * 1000:g} ms, its timeout)")


_autograd_module: Any = None


def _autograd() -> Any:
    global _autograd_module
    if _autograd_module is None:
        import importlib

        _autograd_module = importlib.import_module("spmd.runtime.autograd.contexts")
    return _autograd_module


def _set_exception(future: torch.futures.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


def _release_lent(lend_id: int) -> None:
    from spmd.runtime.rpc.api import current_agent

    current_agent("release").lent.pop(lend_id, None)
