"""Remote references, with PyTorch's reference-counting protocol.

The owner keeps a value; every other worker holds *forks* of it, each with a unique id.
The owner keeps a record of the value while any fork is registered and drops it (and,
once its local handles are gone too, the value) when the last one is deleted. A fork is
never lost in flight:

- owner -> user: the owner registers the child's fork before sending it;
- user -> user: the parent keeps its own fork alive ("pending child") until the child
  has registered its fork with the owner (RREF_FORK) and said so (RREF_ACCEPT);
- user -> owner: the owner needs no fork; it tells the parent (RREF_ACCEPT).

A user fork made by ``remote()`` is confirmed by the owner's answer; a user handle that
dies sends RREF_DELETE. These control messages are retried until answered (wire.RETRIED).
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch

from spmd.runtime.errors import InvalidArgumentError, WrongTypeError
from spmd.runtime.rpc.agent import rpc_timeout_error
from spmd.runtime.rpc.futures import AsyncResult, done_within, is_async, not_a_future_error
from spmd.runtime.rpc.options import UNSET_RPC_TIMEOUT, WorkerInfo, resolve_timeout
from spmd.runtime.rpc.serialize import loading
from spmd.runtime.rpc.wire import Kind

__all__ = ["RRef", "RRefContext"]

log = logging.getLogger("spmd.runtime.rpc")
T = TypeVar("T")


class _Record:
    """The owner's side of one RRef: the value (a future) and the registered forks."""

    __slots__ = ("rref_id", "future", "forks", "pins")

    def __init__(self, rref_id: tuple[int, int]) -> None:
        self.rref_id = rref_id
        self.future: torch.futures.Future = torch.futures.Future()
        self.forks: set[tuple[int, int]] = set()
        self.pins = 0


class RRefContext:
    """The RRef bookkeeping of one agent."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.lock = threading.Lock()
        self.owners: dict[tuple[int, int], _Record] = {}
        self.pending_users: dict[tuple[int, int], RRef] = {}
        self.pending_children: dict[tuple[int, int], RRef] = {}
        self.users: "weakref.WeakValueDictionary[tuple[int, int], RRef]" = \
            weakref.WeakValueDictionary()
        self._ids = itertools.count(1)

    def new_id(self) -> tuple[int, int]:
        return (self.agent.rank, next(self._ids))

    def in_flight(self) -> int:
        return len(self.pending_users) + len(self.pending_children)

    def _get_locked(self, rref_id: tuple[int, int], rec: _Record | None = None) -> _Record:
        """The record of ``rref_id``; when there is none, ``rec`` (or a new one) becomes it."""
        found = self.owners.get(rref_id)
        if found is None:
            found = self.owners[rref_id] = rec if rec is not None else _Record(rref_id)
        return found

    def record(self, rref_id: tuple[int, int]) -> _Record:
        with self.lock:
            return self._get_locked(rref_id)

    def pin(self, rref_id: tuple[int, int]) -> _Record:
        """The record of a ``remote()`` to this worker, kept until the call picks it up."""
        with self.lock:
            rec = self._get_locked(rref_id)
            rec.pins += 1
            return rec

    def add_fork(self, rref_id: tuple[int, int], fork_id: tuple[int, int],
                 rec: _Record | None = None) -> None:
        """Register a fork; ``rec``, an owner handle's record, is put back if it was dropped."""
        with self.lock:
            self._get_locked(rref_id, rec).forks.add(fork_id)

    def _release(self, rref_id: tuple[int, int], fork_id: tuple[int, int] | None,
                 unpin: bool = False) -> None:
        with self.lock:
            rec = self.owners.get(rref_id)
            if rec is None:
                return
            if fork_id is not None:
                rec.forks.discard(fork_id)
            if unpin:
                rec.pins -= 1
            if not rec.forks and rec.pins <= 0:
                del self.owners[rref_id]

    def delete_fork(self, rref_id: tuple[int, int], fork_id: tuple[int, int]) -> None:
        self._release(rref_id, fork_id)

    def send_delete(self, owner: int, rref_id: tuple[int, int], fork_id: tuple[int, int]) -> None:
        self._control(owner, Kind.RREF_DELETE, _owner_delete_fork, (rref_id, fork_id),
                      f"deleting a fork of RRef {rref_id}")

    def send_accept(self, parent: int, fork_id: tuple[int, int]) -> None:
        self._control(parent, Kind.RREF_ACCEPT, _child_accepted, (fork_id,),
                      f"accepting fork {fork_id}")

    def _control(self, dest: int, kind: Kind, func: Any, args: tuple, what: str) -> Any:
        agent = self.agent
        try:
            return agent.request(dest, kind, func, args, {}, timeout=agent.timeout, sync=False,
                                 what=f"{what} on {agent.describe(dest)}").future
        except Exception as e:
            log.warning("rpc: %s on %s failed: %s", what, agent.describe(dest), e)
            return None

    def fork_to_owner(self, handle: "RRef", parent: int) -> None:
        """A user fork from a user parent: register with the owner, then tell the parent."""
        fork_id = handle._fork_id
        self.pending_users[fork_id] = handle
        settled: torch.futures.Future = torch.futures.Future()
        state = loading.state
        if state is not None and state.pending is not None:
            state.pending.append(settled)  # the request that carried it runs once settled
        future = self._control(handle._owner, Kind.RREF_FORK, _owner_add_fork,
                               (handle._rref_id, fork_id), f"registering fork {fork_id}")

        def registered(done: torch.futures.Future | None) -> None:
            user = self.pending_users.pop(fork_id, None)
            try:
                if done is not None:
                    done.value()
                    if user is not None:
                        user._confirmed = True
            except Exception as e:
                log.warning("rpc: the owner did not register fork %s: %s", fork_id, e)
            if user is not None:
                self.users[fork_id] = user
            self.send_accept(parent, fork_id)
            settled.set_result(None)

        if future is None:
            registered(None)
        else:
            future.add_done_callback(registered)

    def sweep_users(self) -> int:
        """Delete every confirmed user fork still alive here (graceful shutdown)."""
        count = 0
        for fork_id, handle in list(self.users.items()):
            if not handle._deleted:
                handle._deleted = True
                self.send_delete(handle._owner, handle._rref_id, fork_id)
                count += 1
        return count


def _wait(future: torch.futures.Future, timeout: float, what: Callable[[], str]) -> Any:
    if not done_within(future, timeout):
        raise rpc_timeout_error(what, timeout)
    return future.wait()


class RRef(Generic[T]):
    """A reference to a value that lives on one worker (its owner).

    ``RRef(value)`` makes this worker the owner of ``value``; ``remote()`` returns an
    RRef to a value another worker owns. RRefs travel as arguments and results of RPCs,
    nested in lists and dicts too, and keep the value alive on its owner while any of
    them exists anywhere.

    Example::

        rref = rpc.remote("ps", torch.zeros, args=(4,))
        rref.to_here()                      # tensor([0., 0., 0., 0.])
        rref.rpc_sync().add(1)              # runs value.add(1) on the owner
        local = RRef(torch.ones(2))         # owned here
    """

    def __init__(self, value: T, type_hint: Any = None) -> None:
        from spmd.runtime.rpc.api import current_agent

        agent = current_agent("RRef")
        rec = _Record(agent.rrefs.new_id())
        rec.future.set_result(value)
        self._init(agent, rec.rref_id, agent.rank, None, rec)

    def _init(self, agent: Any, rref_id: tuple[int, int], owner: int,
              fork_id: tuple[int, int] | None, record: _Record | None) -> None:
        self._agent = agent
        self._rref_id = rref_id
        self._owner = owner
        self._fork_id = fork_id
        self._record = record
        self._confirmed = record is not None
        self._created: torch.futures.Future | None = None
        self._deleted = False

    @classmethod
    def _make(cls, agent: Any, rref_id: tuple[int, int], owner: int,
              fork_id: tuple[int, int] | None, record: _Record | None) -> "RRef":
        handle = cls.__new__(cls)
        handle._init(agent, rref_id, owner, fork_id, record)
        return handle

    # -- queries ---------------------------------------------------------------------------

    def owner(self) -> WorkerInfo:
        """The owner's ``WorkerInfo``."""
        return self._agent.infos[self._owner]

    def owner_name(self) -> str:
        """The owner's worker name."""
        return self.owner().name

    def is_owner(self) -> bool:
        """Whether this worker owns the value."""
        return self._record is not None

    def confirmed_by_owner(self) -> bool:
        """Whether the owner knows of this reference (always true on the owner)."""
        return self._confirmed

    def local_value(self) -> T:
        """The value itself; only on the owner (elsewhere an error that is a ``ValueError``
        and, as in torch, a ``RuntimeError``)."""
        if self._record is None:
            raise InvalidArgumentError(f"local_value() of an RRef owned by "
                                       f"{self.owner_name()!r} called on {self._agent.name!r}: "
                                       f"call it on the owner, or use to_here()")
        return _wait(self._record.future, self._agent.timeout,
                     lambda: f"local_value() of RRef {self._rref_id}")

    def _get_type(self, timeout: float = UNSET_RPC_TIMEOUT,
                  blocking: bool = True) -> "type | torch.futures.Future":
        """The type of the value, as torch's: asked of the owner once (one RPC, even
        when called again meanwhile), then kept. ``blocking=False`` returns a future of
        it (the same future every time)."""
        if not isinstance(blocking, bool):
            raise TypeError(f"RRef._get_type: blocking must be a bool, got {blocking!r}")
        future = getattr(self, "_type_future", None)
        if future is None:
            if self._record is not None:
                future = torch.futures.Future()
                future.set_result(type(self.local_value()))
            else:
                from spmd.runtime.rpc import api

                future = api.rpc_async(self.owner(), _rref_typeof_on_owner, args=(self,),
                                       timeout=timeout)
            self._type_future = future
        return future.wait() if blocking else future

    def _get_profiling_future(self) -> torch.futures.Future:
        """Completes once the ``remote()`` that made this RRef is recorded in the profile
        that was active (at once when none was)."""
        future = getattr(self, "_profiling_future", None) or self._created
        if future is None:
            future = torch.futures.Future()
            future.set_result(None)
        return future

    def _attributes(self, timeout: float = UNSET_RPC_TIMEOUT) -> frozenset[str]:
        """The names the value's type defines (asked of the owner once, then kept): a
        proxy call to a method the value lacks fails at the call, not on the owner. The
        owner answers once the value exists, so a proxy's timeout covers that wait, as
        torch's proxies do."""
        found = getattr(self, "_type_names", None)
        if found is None:
            if self._record is not None:
                found = _type_names(self)
            else:
                from spmd.runtime.rpc import api

                found = api.rpc_sync(self.owner(), _type_names, args=(self,), timeout=timeout)
            self._type_names = found
        return found

    def backward(self, dist_autograd_ctx_id: int = -1, retain_graph: bool = False) -> None:
        """Run the backward pass with the value (a scalar tensor) as its root, on the
        owner: in distributed-autograd context ``dist_autograd_ctx_id`` (its gradients
        stay in the context), or, with -1, plain autograd (into ``.grad``), as torch's."""
        if not isinstance(dist_autograd_ctx_id, int):
            raise TypeError(f"RRef.backward: dist_autograd_ctx_id must be an int, got "
                            f"{type(dist_autograd_ctx_id).__name__}")
        if self._record is not None:
            _owner_backward(self, dist_autograd_ctx_id, retain_graph)
            return
        from spmd.runtime.rpc import api

        api.rpc_sync(self.owner(), _owner_backward,
                     args=(self, dist_autograd_ctx_id, retain_graph))

    def to_here(self, timeout: float = UNSET_RPC_TIMEOUT) -> T:
        """A copy of the value fetched from the owner (the value itself on the owner)."""
        seconds = resolve_timeout(timeout, self._agent.timeout, "to_here")

        def what() -> str:  # built only for a message
            return f"to_here() of RRef {self._rref_id} owned by {self._agent.describe(self._owner)}"

        if self._record is not None:
            return _wait(self._record.future, seconds, what)
        if self._created is not None and self._created.done():
            self._created.wait()  # a failed or timed-out creation raises its error here
        from spmd.runtime.autograd.contexts import current_context
        from spmd.runtime.rpc.api import wait_sync

        # inside a distributed-autograd context the fetch is part of the graph, as torch's
        # is: the value arrives attached to the owner's graph (which reaches the tensors
        # remote() sent), so backward flows through it instead of stopping at a leaf
        entry = self._agent.request(self._owner, Kind.FETCH, _owner_fetch, (self._rref_id,), {},
                                    timeout=seconds, sync=True, what=what,
                                    ctx=current_context(self._agent))

        return wait_sync(self._agent, entry)

    def _get_future(self) -> torch.futures.Future:
        """Completes when the owner has created the value (``remote()``), with None."""
        if self._created is None:
            done: torch.futures.Future = torch.futures.Future()
            done.set_result(None)
            return done
        return self._created

    # -- proxies ---------------------------------------------------------------------------

    def rpc_sync(self, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
        """``rref.rpc_sync().method(*args)`` runs ``value.method(*args)`` on the owner."""
        return _Proxy(self, "rpc_sync", timeout)

    def rpc_async(self, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
        """``rref.rpc_async().method(*args)``: the same, returning a Future."""
        return _Proxy(self, "rpc_async", timeout)

    def remote(self, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
        """``rref.remote().method(*args)``: the same, the result an RRef on the owner."""
        return _Proxy(self, "remote", timeout)

    # -- pickling and lifetime -------------------------------------------------------------

    def _rpc_reduce_(self, state: Any) -> Any:
        agent = state.agent
        if agent is not self._agent:
            raise TypeError("an RRef can only be sent by the worker that holds it")
        rc = agent.rrefs
        fork_id = rc.new_id()
        rref_id = self._rref_id
        if self._record is not None:
            rc.add_fork(rref_id, fork_id, self._record)  # registered before it leaves
            state.rollbacks.append(lambda: rc.delete_fork(rref_id, fork_id))
        else:
            rc.pending_children[fork_id] = self  # kept alive until the child is known
            state.rollbacks.append(lambda: rc.pending_children.pop(fork_id, None))
        return _rebuild_rref, (rref_id, fork_id, self._owner, agent.rank)

    def __reduce__(self) -> Any:
        raise WrongTypeError("an RRef can only be pickled inside an RPC (as an argument or "
                             "result): Can not pickle rref in python pickler")

    def __del__(self) -> None:
        try:
            if self._fork_id is None or self._deleted or self._agent.stopped:
                return
            self._deleted = True
            rc = self._agent.rrefs
            self._agent.pool.put((rc.send_delete, (self._owner, self._rref_id, self._fork_id)))
        except Exception:
            pass  # interpreter shutdown

    def __repr__(self) -> str:
        kind = "OwnerRRef" if self.is_owner() else "UserRRef"
        fork = "" if self._fork_id is None else f", fork_id={self._fork_id}"
        return f"{kind}(rref_id={self._rref_id}{fork}, owner={self.owner_name()!r})"


class _Proxy:
    def __init__(self, rref: RRef, mode: str, timeout: float) -> None:
        self._rref, self._mode, self._timeout = rref, mode, timeout

    def __getattr__(self, name: str) -> Any:
        from spmd.runtime.rpc import api

        call = getattr(api, self._mode)
        rref, timeout = self._rref, self._timeout

        @functools.wraps(call)
        def invoke(*args: Any, **kwargs: Any) -> Any:
            if name not in rref._attributes(timeout):  # a method the value lacks: raise now
                raise AttributeError(f"the value of {rref!r} has no attribute {name!r}")
            return call(rref.owner(), _local_invoke, args=(rref, name, args, kwargs),
                        timeout=timeout)

        return invoke


def _rref_typeof_on_owner(rref: RRef) -> type:  # torch's name: profiles show it
    return type(rref.local_value())


def _type_names(rref: RRef) -> frozenset[str]:
    value = rref.local_value()
    return frozenset(dir(type(value))) | frozenset(getattr(value, "__dict__", {}))


def _owner_backward(rref: RRef, context_id: int, retain_graph: bool) -> None:
    root = rref.local_value()
    if not isinstance(root, torch.Tensor) or root.numel() != 1 or not root.requires_grad:
        why = ("RRef should contain a tensor for .backward()" if not isinstance(root, torch.Tensor)
               else "tensors does not require grad and does not have a grad_fn"
               if not root.requires_grad
               else "the value is not a scalar (grad can be implicitly created only for "
                    "scalar outputs)")
        raise InvalidArgumentError(
            f"RRef.backward: {why}; the value must be a scalar tensor that requires grad, got "
            f"{type(root).__name__}" + (f" of shape {tuple(root.shape)}"
                                         if isinstance(root, torch.Tensor) else ""))
    if context_id == -1:
        root.backward(retain_graph=retain_graph)
        return
    from spmd.runtime.autograd import backward

    backward(context_id, [root], retain_graph=retain_graph)


def _local_invoke(rref: RRef, name: str, args: tuple, kwargs: dict) -> Any:
    method = getattr(rref.local_value(), name)
    result = method(*args, **kwargs)
    return AsyncResult(result) if is_async(method) else result


def _rebuild_rref(rref_id: tuple[int, int], fork_id: tuple[int, int], owner: int,
                  parent: int) -> RRef:
    state = loading.state
    if state is None:
        raise TypeError("an RRef can only be unpickled inside an RPC")
    agent = state.agent
    rc = agent.rrefs
    if owner == agent.rank:
        rec = rc.record(rref_id)
        handle = RRef._make(agent, rref_id, owner, None, rec)
        if parent == agent.rank:
            rc.delete_fork(rref_id, fork_id)  # registered when it left; not needed here
        else:
            rc.send_accept(parent, fork_id)
        return handle
    handle = RRef._make(agent, rref_id, owner, fork_id, None)
    if parent == owner:
        handle._confirmed = True  # the owner registered it before sending
        rc.users[fork_id] = handle
    else:
        rc.fork_to_owner(handle, parent)
    return handle


# -- what runs on the owner and the parent (sent as control messages) ---------------------

def _agent() -> Any:
    from spmd.runtime.rpc.api import current_agent

    return current_agent("rref")


def _owner_add_fork(rref_id: tuple[int, int], fork_id: tuple[int, int]) -> None:
    _agent().rrefs.add_fork(rref_id, fork_id)


def _owner_delete_fork(rref_id: tuple[int, int], fork_id: tuple[int, int]) -> None:
    _agent().rrefs.delete_fork(rref_id, fork_id)


def _child_accepted(fork_id: tuple[int, int]) -> None:
    _agent().rrefs.pending_children.pop(fork_id, None)


def _owner_fetch(rref_id: tuple[int, int]) -> AsyncResult:
    return AsyncResult(_agent().rrefs.record(rref_id).future)


def _owner_run_remote(func: Any, args: tuple, kwargs: dict, rref_id: tuple[int, int],
                      fork_id: tuple[int, int] | None) -> Any:
    rc = _agent().rrefs
    rec = rc.record(rref_id)
    if fork_id is not None:
        rc.add_fork(rref_id, fork_id, rec)
    else:
        rc._release(rref_id, None, unpin=True)  # remote() to itself: the handle holds rec
    try:
        result = func(*args, **kwargs)
    except BaseException as e:
        if not rec.future.done():
            rec.future.set_exception(e)
        raise
    if isinstance(result, AsyncResult) or is_async(func):
        inner = result.future if isinstance(result, AsyncResult) else result
        if not isinstance(inner, torch._C.Future):  # the RRef gets the error, not a hang
            error = not_a_future_error(func, inner)
            rec.future.set_exception(error)
            raise error
        ack: torch.futures.Future = torch.futures.Future()

        def settle(done: torch.futures.Future) -> None:
            try:
                value = done.value()
            except BaseException as e:
                rec.future.set_exception(e)
                ack.set_exception(e)
                return
            rec.future.set_result(value)
            ack.set_result(None)

        inner.add_done_callback(settle)
        return AsyncResult(ack)
    rec.future.set_result(result)
    return None
