"""ProcessGroup and Work: our handle on a c10d backend, and on one operation in flight.

A ``ProcessGroup`` owns a backend (Gloo, NCCL, MPI) built over its own namespace of the
job's store, the global ranks of its members, its timeout and its collective sequence
number. Every operation goes through :meth:`ProcessGroup._launch`, which is where
failures become errors that name ranks (see ``health``) and where the debug mode
compares what each rank called.
"""

from __future__ import annotations

import collections
import re
import threading
from datetime import timedelta
from typing import Any, Callable, Iterable, Sequence

import torch

from spmd.runtime import config as _config
from spmd.runtime import context as _context
from spmd.runtime import health, sizecheck
from spmd.runtime.errors import DistError, DistTimeoutError, InvalidArgumentError
from spmd.runtime.store.base import Store

__all__ = ["ProcessGroup", "Work"]

_TIMEOUT_WORDS = ("timed out", "timeout")

# torch.distributed.ProcessGroup's operations, which a group forwards to its backend
_TORCH_METHODS = frozenset({
    "allreduce", "allreduce_coalesced", "broadcast", "allgather", "allgather_coalesced",
    "allgather_into_tensor_coalesced", "_allgather_base", "gather", "scatter", "reduce",
    "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced", "alltoall",
    "alltoall_base", "barrier", "monitored_barrier", "send", "recv", "recv_anysource",
})


class ProcessGroup:
    """A set of ranks that run collectives together.

    Created by ``init_process_group`` (the default group) and ``new_group``. Ranks given
    to operations are global ranks; :meth:`rank` and :meth:`size` are within the group,
    as in ``torch.distributed``. A rank that is not a member holds a handle whose every
    operation raises ``RuntimeError``.
    """

    def __init__(
        self, *, name: str, backend_name: str, backend: Any, store: Store | None,
        ranks: Sequence[int], global_rank: int, timeout: timedelta, debug: bool = False,
        store_host_rank: int | None = None, backend_store: Any = None,
    ) -> None:
        self.name = name
        self.backend = backend_name
        self._backend = backend
        self._backend_store = backend_store  # the backend's store adapter, kept alive
        self._torch: Any = None  # this group as torch.distributed knows it, if shared
        self._shared = False  # ever shared: torch objects may still hold its backend
        self.join_log: list[dict] | None = None  # collectives recorded for spmd.Join
        self._store = store
        self.ranks = list(ranks)
        self._global_rank = global_rank
        self._group_rank = {g: i for i, g in enumerate(self.ranks)}
        self._me = self._group_rank.get(global_rank, -1)
        self.timeout = timeout
        self.debug = debug
        self._store_host_rank = store_host_rank
        self._seq = 0
        self._checks = 0  # size-check headers exchanged (the same count on every rank)
        self._pending: list[Work] = []  # deferred size-check rows (sizecheck.settle)
        self._rows: tuple | None = None  # the size check's buffers for synchronous calls
        # every collective's sizes are compared before its data moves (spmd.runtime.sizecheck)
        self.size_check = len(self.ranks) > 1 and _config.size_check()
        self._barrier_seq = 0  # the last monitored_barrier that passed (its answer's key)
        self._beats = 0
        self._destroyed = False
        self._poisoned = False  # a thread-rank's backend with an operation it abandoned
        ctx = _context.current()
        self._threaded = ctx is not _context._process_context
        self._context = ctx
        if self.is_member and backend is not None:
            health.register(self)

    # -- identity ---------------------------------------------------------------------

    @property
    def is_member(self) -> bool:
        return self._me >= 0

    @property
    def store(self) -> Store | None:
        """The group's own key-value store (a namespace of the job's store, shared by its
        members), for agreeing on things outside the data plane: measured figures,
        plan fingerprints. None for a group made without one."""
        return self._store

    def to_torch(self) -> Any:
        """This group as ``torch.distributed`` knows it (a ``torch.distributed.ProcessGroup``
        over the same backend), for torch APIs that take a group: DTensor's
        ``DeviceMesh.from_group``, ``torch.distributed.checkpoint``, torch's DDP.
        ``RuntimeError`` saying why when torch does not know it (thread ranks, or a
        program that initialized torch.distributed itself first)."""
        from spmd.runtime.torch_groups import torch_group

        return torch_group(self)

    def __getattr__(self, name: str) -> Any:
        """torch's ``ProcessGroup`` methods (``pg.allreduce([t])``, ``pg.barrier()``,
        ``pg.monitored_barrier(timeout)``, ...): torch's own, on this group's backend
        (through torch's view of the group when it has one), returning torch's ``Work``.
        They are torch's calls, so this runtime's debug-mode comparison and its errors
        naming a dead rank do not cover them; ``spmd.runtime.all_reduce`` and the other
        functions do."""
        if name in _TORCH_METHODS:
            self.require(f"ProcessGroup.{name}")
            target = self._torch if self._torch is not None else self._backend
            return getattr(target, name)
        raise AttributeError(f"'ProcessGroup' object has no attribute {name!r}")

    def rank(self) -> int:
        """This rank's index in the group (-1 when not a member)."""
        return self._me

    def size(self) -> int:
        return len(self.ranks)

    def __repr__(self) -> str:
        member = "" if self.is_member else ", not a member"
        return f"ProcessGroup({self.name!r}, {self.backend}, ranks={self.ranks}{member})"

    def group_rank(self, global_rank: int, what: str = "rank") -> int:
        """The group index of ``global_rank``; ``ValueError`` naming the group otherwise."""
        if not isinstance(global_rank, int) or isinstance(global_rank, bool):
            raise TypeError(f"{what} must be an int (a global rank), got "
                            f"{type(global_rank).__name__}")
        index = self._group_rank.get(global_rank)
        if index is None:
            raise InvalidArgumentError(f"{what} {global_rank} is not in process group "
                                       f"{self.name!r} (global ranks {self.ranks})")
        return index

    def global_rank(self, group_rank: int) -> int:
        if not 0 <= group_rank < len(self.ranks):
            raise ValueError(f"group rank {group_rank} is outside [0, {len(self.ranks)}) "
                             f"in process group {self.name!r}")
        return self.ranks[group_rank]

    # -- lifetime ---------------------------------------------------------------------

    def require(self, op: str) -> None:
        if self._destroyed:
            raise RuntimeError(f"{op}: process group {self.name!r} has been destroyed")
        if not self.is_member:
            raise RuntimeError(
                f"{op}: rank {self._global_rank} is not a member of process group "
                f"{self.name!r} (global ranks {self.ranks})")

    def _left_peers(self, seq: int | None) -> list[int]:
        """Global ranks of members that left this group (``destroy_process_group``) before
        entering collective ``seq`` (one that entered it may have left after its part)."""
        store = self._store
        if store is None or seq is None:
            return []
        try:
            if store.add("left", 0) == 0:
                return []
            gone = []
            for r, g in enumerate(self.ranks):
                if r != self._me and store.check([f"left/{r}"]):
                    if int(store.get(f"left/{r}").decode()) < seq:
                        gone.append(g)
            return gone
        except Exception:  # the store itself is gone: the operation's own error will say
            return []

    def _announce_leave(self) -> None:
        """Tell the other members this rank leaves (their waits stop waiting for it)."""
        if self._store is None or not self.is_member or self._destroyed:
            return
        try:
            self._store.set(f"left/{self._me}", str(self._seq))
            self._store.add("left", 1)
        except Exception:  # a store already gone: nobody left to tell
            pass

    def _destroy(self) -> None:
        if self._destroyed:
            return
        self._announce_leave()
        self._destroyed = True
        health.unregister(self)
        runner = self.__dict__.pop("_hier_runner", None)  # spmd.runtime.hierarchical's thread
        if runner is not None:
            runner.close()
        backend, self._backend = self._backend, None
        if self._poisoned or (self._shared and backend is not None):
            # shared with torch: a torch object (DDP's C++ Reducer) may hold the backend
            # after us, and dropping the last reference there destroys Gloo's backend with
            # the GIL held: its destructor joins its worker threads, one of which may be
            # freeing a finished work's tensors and need the GIL (a hang, 1 in ~15 runs
            # of torch's DDP-under-distributed-autograd test). Kept referenced instead.
            _bury(backend)
            return
        if backend is not None and hasattr(backend, "shutdown"):
            try:
                backend.shutdown()
            except Exception:
                pass

    def _beat(self) -> None:
        """Publish liveness and progress (called by the heartbeat thread)."""
        if self._destroyed or self._store is None:
            return
        self._beats += 1
        try:
            self._store.set(f"hb/{self._me}", f"{self._beats}:{self._seq}")
        except Exception:  # the store is gone; diagnose() will say so when it matters
            pass

    # -- running operations -----------------------------------------------------------

    def _begin(self, op: str, fingerprint: Callable[[], str] | None,
               header: list[int] | None = None) -> int:
        """Take the next collective sequence number; in debug mode compare calls first,
        otherwise compare ``header`` (``sizecheck.header``: what moves) across ranks unless
        a compiled graph has checked it already. Callers have checked the group with
        ``require`` (``resolve_group`` does). A compiled graph's deferred row is settled
        first: nothing runs on the group past a disagreement."""
        if self._pending:
            sizecheck.settle(self)
        self._seq += 1
        if self.join_log is not None:  # spmd.Join: what a joined rank must shadow
            self.join_log.append({"op": op})
        if self.debug and fingerprint is not None:
            self._compare(self._seq, f"{op}({fingerprint()})")
        elif header is not None and sizecheck.checking(self):
            sizecheck.exchange(self, op, header, fingerprint)
        return self._seq

    def _compare(self, seq: int, call: str) -> None:
        """Every rank publishes its call for ``seq``; any difference raises everywhere."""
        store, me = self._store, self._me
        assert store is not None
        store.set(f"fp/{seq}/{me}", call)
        keys = [f"fp/{seq}/{r}" for r in range(self.size())]
        try:  # one blocking round trip: a rank that exits right after cannot strand us
            calls = [c.decode() for c in store._multi_get(keys, self.timeout.total_seconds())]
        except DistTimeoutError:
            missing = [self.ranks[r] for r, k in enumerate(keys) if not store.check([k])]
            raise DistTimeoutError(
                f"{call.split('(')[0]} on process group {self.name!r} (collective {seq}, debug "
                f"mode): rank {', '.join(map(str, missing))} never called collective {seq} "
                f"within the group's {self.timeout.total_seconds():g}s timeout") from None
        if seq > 2:
            store.delete_key(f"fp/{seq - 2}/{me}")  # everyone has read it by now
        if len(set(calls)) > 1:
            lines = "\n".join(f"  rank {self.ranks[r]}: {c}" for r, c in enumerate(calls))
            raise DistError(
                f"collective mismatch on process group {self.name!r} at collective {seq}; "
                f"each rank called:\n{lines}")

    def _launch(
        self, op: str, seq: int | None, start: Callable[[], Any], async_op: bool,
        post: Callable[[], Any] | None = None, peers: Iterable[int] | None = None,
        result: Callable[[Any], Any] | None = None,
    ) -> "Work | Any":
        """Start an operation; wait for it unless ``async_op``; run ``post`` once done."""
        try:
            inner = start()
        except Exception as e:  # refused before any byte moved: no rank to blame
            where = f"{op} on process group {self.name!r}"
            raise DistError(f"{where}: the backend refused the call: {e}") from e
        _hold(inner)
        if async_op or self._threaded:
            work = Work(self, inner, op, seq, post, peers, result)
            if async_op:
                return work
            work.wait()
            return work._result
        try:  # the common case, kept lean: a synchronous call on a process-rank
            inner.wait()
        except Exception as e:
            raise self._failure(op, seq, peers, e) from e
        _waited_on(inner)
        if post is not None:
            post()
        return None if result is None else result(inner)

    def _failure(self, op: str, seq: int | None, peers: Iterable[int] | None,
                 cause: BaseException) -> DistError:
        """The error to raise for a failed operation, naming the ranks at fault."""
        text = _backend_text(cause)
        where = f"{op} on process group {self.name!r}" + (
            f" (collective {seq})" if seq is not None else "")
        if self._context.aborted:
            return DistError(f"{where} was aborted: {self._context.aborted}")
        timed_out = any(w in text.lower() for w in _TIMEOUT_WORDS)
        if isinstance(cause, DistError) and not timed_out:
            return cause
        why = health.diagnose(self, op, seq, peers, timed_out)
        detail = f": {why}" if why else ""
        if timed_out:
            return DistTimeoutError(
                f"{where} timed out after {self.timeout.total_seconds():g}s (the group's "
                f"timeout){detail} [backend: {text}]")
        return DistError(f"{where} failed{detail} [backend: {text}]")


_held: collections.deque = collections.deque()  # backend works not yet seen complete
_held_ids: set[int] = set()  # their ids (see _waited_on)
_finished: list[Any] = []  # those seen complete by the latest operation: the next drops them
_waited: set[int] = set()  # ids of held works whose wait returned (see _waited_on)
_held_lock = threading.Lock()
_LOOK = 4  # running works _hold looks at past the completed ones, per operation


def _hold(inner: Any) -> None:
    """Keep the backend work ``inner`` referenced until at least two later operations have
    started after it completed.

    Destroying a Gloo work releases its tensors' Python objects, which takes the GIL. When
    the backend's worker thread holds the last reference, it does that just after the
    work completes; if the program is exiting by then (the last collective before exit
    returned, or an ``async_op`` one nobody waited for finished), that thread waits for
    the GIL across the start of interpreter shutdown, is stopped inside the work's C++
    destructor, and the process aborts: "terminate called without an active exception".
    Held here, the last reference is Python's: dropped by a Python thread, or at exit when
    c10d no longer calls back into Python. Not by the very next operation: that one may
    start while the backend's thread is still letting go of the work it just completed.
    The cost: the tensors of the latest two operations stay referenced a little longer.

    A work counts as complete when its wait returned (:func:`_waited_on`) or the backend
    says so: Gloo's ``_reduce_scatter_base`` works never report ``is_completed()``, and
    held on that alone every reduce-scatter's tensors stayed referenced for good, each
    call scanning all of them (measured: 192 µs a call on one rank against torch's 44).

    Each operation looks at the held works from the front, drops every completed one it
    meets, and moves at most ``_LOOK`` running ones to the back: works complete in about
    the order they started, so the front is where the completed ones are, and a work
    that completes out of order is still looked at within a few operations. Looking at
    all of them every time cost a scan of every work in flight per operation (244
    unbucketed all-reduces in flight: 30,000 ``is_completed`` calls a step).
    """
    global _finished
    with _held_lock:
        finished, running = [], 0
        while _held and running < _LOOK:
            work = _held.popleft()
            if id(work) in _waited or work.is_completed():
                finished.append(work)
                _waited.discard(id(work))
                _held_ids.discard(id(work))
            else:
                _held.append(work)
                running += 1
                if running >= len(_held):
                    break  # every held work is running: looked at them all
        _held.append(inner)
        _held_ids.add(id(inner))
        _finished = finished  # the works seen complete last time go now


def _waited_on(inner: Any) -> None:
    """``inner``'s wait returned: the next operation may count it complete (a work no
    longer held is not recorded: its id may be reused). Takes no lock: it runs right
    after a wait, where a backend thread may hold the work's own lock while ``_hold``,
    holding ours, asks that work whether it is complete; the sets' updates are atomic."""
    if id(inner) in _held_ids:
        _waited.add(id(inner))


_graveyard: list[Any] = []
_keeper: threading.Thread | None = None


def _bury(*objects: Any) -> None:
    """Keep backend objects referenced until the process exits: broken ones, and those
    shared with torch (see ``_destroy``).

    Gloo cannot cancel a pending operation: it runs until its timeout, and destroying its
    backend meanwhile (or at interpreter exit) fails inside a C++ destructor, which ends
    the process with std::terminate. Thread-ranks that were aborted therefore leave their
    backends here, referenced from a daemon thread that interpreter shutdown never
    unwinds, so no destructor ever runs on them.
    """
    global _keeper
    _graveyard.extend(objects)
    if _keeper is None:
        _keeper = threading.Thread(target=_keep, args=(_graveyard,), name="spmd-graveyard",
                                   daemon=True)
        _keeper.start()


def _keep(objects: list[Any]) -> None:
    threading.Event().wait()


def _backend_text(cause: BaseException) -> str:
    """The backend's message without its source path and boilerplate advice."""
    text = str(cause).strip().splitlines()[0] if str(cause).strip() else repr(cause)
    text = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", text)
    return text.split(". This is typically")[0].rstrip(".")


class Work:
    """One operation in flight (``async_op=True``), as ``torch.distributed`` returns it.

    ``wait(timeout=None)`` blocks until the operation is done (``DistTimeoutError`` after
    ``timeout`` seconds or ``timedelta``; the group's timeout always applies) and returns
    True; ``is_completed()``, ``exception()`` and ``get_future()`` as in PyTorch.
    """

    def __init__(self, group: ProcessGroup, inner: Any, op: str, seq: int | None,
                 post: Callable[[], Any] | None, peers: Iterable[int] | None,
                 result: Callable[[Any], Any] | None = None) -> None:
        self._group = group
        self._inner = inner
        self._op = op
        self._seq = seq
        self._post = post
        self._peers = peers
        self._result_fn = result
        self._result: Any = None
        self._done = False
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        state = "done" if self._done else ("failed" if self._error else "pending")
        return f"Work({self._op}, {state})"

    def _complete(self, limit: timedelta | None = None, finished: Any = None) -> None:
        """Wait for the backend (at most ``limit``), then post-process exactly once.

        ``finished``: the backend's completed future, when called from its callback
        (waiting there again would deadlock on the future's own lock). The wait itself
        holds no lock: the backend may run a ``get_future()`` callback, which completes
        this work too, before its own ``wait`` returns.
        """
        if self._done:
            return
        if self._error is not None:
            raise self._error
        try:
            if finished is not None:
                finished.value()  # raises the backend's error, if any
            elif limit is not None:
                self._inner.wait(limit)
            elif self._group._threaded:
                self._wait_abortable()
            else:
                self._wait_watching()
        except Exception as e:
            with self._lock:
                if self._error is None:
                    if self._group._threaded:
                        self._group._poisoned = True
                        _bury(self._inner)
                    self._error = self._group._failure(self._op, self._seq, self._peers, e)
            raise self._error from e
        if finished is None:  # not from the backend's callback, which holds the future's
            _waited_on(self._inner)  # lock: _hold takes ours, then asks the backend
        with self._lock:
            if self._done:
                return
            if self._post is not None:
                self._post()
            if self._result_fn is not None:
                self._result = self._result_fn(self._inner)
            self._done = True

    def _finished_event(self) -> Callable[[float], bool] | None:
        """A ``wait(seconds) -> done`` from the backend's future; None when it has none
        (Gloo's send and recv: they only progress inside their own blocking wait)."""
        try:
            future = self._inner.get_future()
        except RuntimeError:
            return None
        finished = threading.Event()
        future.add_done_callback(lambda _: finished.set())
        return finished.wait

    def _wait_abortable(self) -> None:
        """Thread-ranks: wait in slices so an aborted rank context stops the wait."""
        finished = self._finished_event()
        ctx = self._group._context
        waited = 0.0
        while finished is not None and not finished(0.05):
            if ctx.aborted:
                self._group._poisoned = True
                _bury(self._inner)
                raise DistError(f"aborted: {ctx.aborted}")
            waited += 0.05
            if waited >= 1.0:
                waited = 0.5
                self._check_left()
        self._inner.wait()

    def _wait_watching(self) -> None:
        """Wait for the backend. Past a second, check every half second whether a peer
        has left the group (``destroy_process_group``): this operation would otherwise
        wait for it until the group's timeout (a rank that ran out of inputs, say)."""
        if self._inner.is_completed():
            self._inner.wait()
            return
        finished = self._finished_event()
        if finished is not None and not finished(1.0):
            while not finished(0.5):
                self._check_left()
        self._inner.wait()

    def _check_left(self) -> None:
        left = self._group._left_peers(self._seq)
        if left:
            names = ", ".join(map(str, left))
            raise DistError(
                f"{self._op} on process group {self._group.name!r}"
                + (f" (collective {self._seq})" if self._seq is not None else "")
                + f": rank {names} left the group (destroy_process_group) without joining "
                  f"this operation; a rank that runs out of inputs before the others can "
                  f"shadow their collectives under model.join() (spmd.Join)")

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        if timeout is not None:
            seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
            finished = self._finished_event()
            if finished is None:
                self._complete(timedelta(seconds=seconds))
                return True
            if not finished(seconds):
                raise DistTimeoutError(
                    f"{self._op} on process group {self._group.name!r}: not complete after "
                    f"wait(timeout={seconds:g}s); it is still running")
        self._complete()
        return True

    def is_completed(self) -> bool:
        return self._done or bool(self._inner.is_completed())

    def is_success(self) -> bool:
        return self.is_completed() and self.exception() is None

    def exception(self) -> BaseException | None:
        """The operation's error once it has finished (None while running or on success)."""
        if self._error is not None or not self._inner.is_completed():
            return self._error
        try:
            self._complete()
        except BaseException as e:
            return e
        return None

    def get_future(self) -> torch.futures.Future:
        """A future that completes with the operation's result after post-processing."""
        fut: torch.futures.Future = torch.futures.Future()

        def done(finished: Any) -> None:
            try:
                self._complete(finished=finished)
                fut.set_result(self._result)
            except BaseException as e:
                fut.set_exception(e)

        self._inner.get_future().add_done_callback(done)
        return fut

    def result(self) -> Any:
        """The operation's output (e.g. the sender of a recv), after waiting."""
        self.wait()
        return self._result

    def _source_rank(self) -> int:
        """The sender of a receive from any source (torch's ``Work._source_rank``)."""
        value = self.result()
        if not isinstance(value, int):
            raise RuntimeError("_source_rank: this work is not a receive")
        return value
