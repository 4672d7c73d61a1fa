"""``init_rpc``, the calls (``rpc_sync``, ``rpc_async``, ``remote``) and worker lookup.

The agent of a worker lives in its rank context (``spmd.runtime.context``), so thread
ranks (``spawn(start_method="thread")``) each have their own.
"""

from __future__ import annotations

import atexit
import ipaddress
import json
import logging
import socket
import time
import weakref
from datetime import timedelta
from typing import Any, Callable
from urllib.parse import urlsplit

import torch

from spmd.runtime import context
from spmd.runtime.autograd.contexts import current_context
from spmd.runtime.errors import DistError, InvalidArgumentError
from spmd.runtime.rendezvous import _rendezvous
from spmd.runtime import config
from spmd.runtime.rpc.agent import RpcAgent, rpc_timeout_error
from spmd.runtime.rpc.internal import RPCExecMode, _build_rpc_profiling_key
from spmd.runtime.rpc.membership import Membership, claim_mode
from spmd.runtime.rpc.options import (UNSET_RPC_TIMEOUT, BackendType, RpcBackendOptions,
                                      WorkerInfo, _positive, check_name, resolve_timeout)
from spmd.runtime.rpc.wire import Kind
from spmd.runtime.store.prefix_store import PrefixStore

__all__ = ["init_rpc", "rpc_sync", "rpc_async", "remote", "get_worker_info",
           "get_all_worker_infos", "get_rpc_timeout", "current_agent", "wait_sync"]

log = logging.getLogger("spmd.runtime.rpc")
_STATE_KEY = "rpc"
_live: "weakref.WeakSet[RpcAgent]" = weakref.WeakSet()


def current_agent(op: str) -> RpcAgent:
    """This worker's agent; ``RuntimeError`` before ``init_rpc``."""
    agent = context.current().state.get(_STATE_KEY)
    if agent is None:
        raise RuntimeError(f"RPC has not been initialized on this worker ({op}); call "
                           f"spmd.runtime.rpc.init_rpc() first (Current RPC agent is not "
                           f"set! Did you initialize the RPC framework?)")
    return agent


def _route_to(host: str) -> str:
    """The local IPv4 address the OS would use to reach ``host`` (no reverse lookups)."""
    try:
        ip = str(ipaddress.ip_address(host))
    except ValueError:
        try:
            ip = socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]  # forward only
        except OSError:
            log.warning("rpc: cannot resolve %r; binding 127.0.0.1 (set SPMD_RPC_HOST)", host)
            return "127.0.0.1"
    if ipaddress.ip_address(ip).is_loopback:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((ip, 9))  # a UDP connect sends nothing; it picks the route
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def _meet(init_method: str | None, rank: int | None, world_size: int | None,
          timeout: float) -> tuple[Any, int, int | None, str, bool]:
    """(store, rank, world size, host to route towards, whether the store is ours). The
    world size is None for a dynamic group: ``init_method`` given (or no process group)
    and no world size from the arguments, the URL or the environment."""
    world = context.current().state.get("world")
    if init_method is None and world is not None:  # reuse the process group's store
        if rank is not None and rank != world.rank:
            raise ValueError(f"init_rpc: rank={rank} but the default process group says "
                             f"{world.rank}")
        if world_size is not None and world_size != world.size:
            raise ValueError(f"init_rpc: world_size={world_size} but the default process "
                             f"group has {world.size}")
        host = world.master_host or context.getenv("MASTER_ADDR") or "127.0.0.1"
        return world.store, world.rank, world.size, host, False
    url = init_method or "env://"
    store, rank, world_size = _rendezvous(url, rank, world_size, timedelta(seconds=timeout),
                                          need_world_size=False)
    parts = urlsplit(url)
    if parts.scheme == "tcp":
        host = parts.hostname or "127.0.0.1"
    elif parts.scheme == "env":
        host = context.getenv("MASTER_ADDR") or "127.0.0.1"
    else:
        host = "127.0.0.1"
    return store, rank, world_size, host, True


def init_rpc(name: str, backend: BackendType | None = None, rank: int = -1,
             world_size: int | None = None,
             rpc_backend_options: RpcBackendOptions | None = None) -> None:
    """Start this worker's RPC agent and meet the others; returns when all have joined.

    Without a world size from the argument, the ``init_method`` URL or ``WORLD_SIZE`` (and
    with an ``init_method`` of its own, or no process group), the group is dynamic, as
    torch's is: this worker joins at once, whoever is there, and the others may join and
    leave later (see ``spmd.runtime.rpc.membership``). A group is static or dynamic from
    its first worker on; mixing the two raises ``RuntimeError``.

    Args:
        name: this worker's unique name (letters, digits, ``_ - : .``).
        backend: ``BackendType.ZMQ`` or None (``BackendType.TENSORPIPE`` is accepted).
        rank: this worker's id in ``[0, world_size)`` (any unused id >= 0 in a dynamic
            group); -1 reads ``RANK``.
        world_size: the number of workers; None reads ``WORLD_SIZE`` (or the URL), and
            without either the group is dynamic.
        rpc_backend_options: timeouts, threads, ``init_method``, device maps.

    Raises:
        ValueError/TypeError: bad arguments, or two workers with one name or rank.
        RuntimeError: a static worker in a dynamic group, or the other way round.
        DistTimeoutError: the others did not join within ``rpc_timeout``.

    Example::

        rpc.init_rpc("trainer0", rank=0, world_size=2)   # MASTER_ADDR/MASTER_PORT set
        rpc.rpc_sync("ps", torch.add, args=(torch.ones(2), 1))
        rpc.shutdown()
    """
    check_name(name)
    if backend is not None and not isinstance(backend, BackendType):
        raise TypeError(f"init_rpc: backend must be an rpc.BackendType or None, got {backend!r}")
    if not isinstance(rank, int) or isinstance(rank, bool):
        raise TypeError(f"init_rpc: rank must be an int, got {type(rank).__name__}")
    if world_size is not None and (not isinstance(world_size, int) or isinstance(world_size, bool)):
        raise TypeError(f"init_rpc: world_size must be an int, got {type(world_size).__name__}")
    options = rpc_backend_options or RpcBackendOptions()
    if not isinstance(options, RpcBackendOptions):
        raise TypeError(f"init_rpc: rpc_backend_options must be RpcBackendOptions, got "
                        f"{type(options).__name__}")
    ctx = context.current()
    if ctx.state.get(_STATE_KEY) is not None:
        raise RuntimeError("init_rpc: RPC is already initialized on this worker; call "
                           "shutdown() first")
    base, rank, world_size, host, own = _meet(options.init_method, None if rank < 0 else rank,
                                              world_size, options.rpc_timeout)
    try:
        claim_mode(base, "static" if world_size is not None else "dynamic")
    except BaseException:
        if own:
            base.close()
        raise
    agent = RpcAgent(name=name, rank=rank, world_size=world_size, options=options,
                     host=config.rpc_bind_host() or _route_to(host), rank_ctx=ctx)
    if world_size is None:
        _join(agent, base, own, ctx)
    else:
        _meet_all(agent, base, own, ctx, world_size, options)
    if not own:
        base.retain()  # the process group's store: it stays open while either needs it
    agent.store = base  # released when the agent stops; the last user closes it
    _live.add(agent)
    ctx.on_close(lambda: _stop_local(agent, 0.0))


def _join(agent: RpcAgent, base: Any, own: bool, ctx: Any) -> None:
    """A dynamic group: publish this worker, start, learn the members there are."""
    members = agent.members = Membership(agent, base)
    record = agent.record()
    try:
        members.join(record)
        ctx.state[_STATE_KEY] = agent
        agent.start({agent.rank: record})
        members.refresh()
    except BaseException:
        ctx.state.pop(_STATE_KEY, None)
        members.withdraw()
        agent.stop()
        if own:
            base.close()
        raise


def _meet_all(agent: RpcAgent, base: Any, own: bool, ctx: Any, world_size: int,
              options: RpcBackendOptions) -> None:
    """A static group: every worker publishes its record, then all start together."""
    rank = agent.rank
    generation = base.add(f"rpc/generation/{rank}", 1)  # init_rpc again after shutdown
    store = PrefixStore(f"rpc/{generation}", base)
    try:
        store.set(f"worker/{rank}", json.dumps(agent.record()))
        raw = store.multi_get([f"worker/{r}" for r in range(world_size)])
        records = {r: json.loads(v) for r, v in enumerate(raw)}
        names: dict[str, int] = {}
        for r, rec in records.items():
            if rec["name"] in names:
                raise InvalidArgumentError(
                    f"init_rpc: ranks {names[rec['name']]} and {r} are both called "
                    f"{rec['name']!r}; worker names must be unique (the name is not unique)")
            names[rec["name"]] = r
        ctx.state[_STATE_KEY] = agent  # before start: a peer's first call may come at once
        agent.start(records)
        if store.add("joined", 1) == world_size:
            store.set("all_joined", b"1")
        store.wait(["all_joined"], timedelta(seconds=options.rpc_timeout))
    except BaseException:
        ctx.state.pop(_STATE_KEY, None)
        agent.stop()
        if own:
            base.close()
        raise


@atexit.register
def _stop_all() -> None:  # a worker that never called shutdown() exits without hanging
    for agent in list(_live):
        try:
            agent.stop()
        except Exception:
            pass


class BadDestinationError(TypeError, ValueError):
    """``to`` that is no worker name, rank or WorkerInfo (a float rank, say): a
    ``TypeError``, and the ``ValueError`` torch raises for it."""


def _resolve(agent: RpcAgent, to: Any, op: str) -> int:
    try:
        return _lookup(agent, to, op)
    except InvalidArgumentError:
        if agent.members is None:
            raise
    agent.members.refresh()  # a dynamic group: one that joined since we last looked
    return _lookup(agent, to, op)


def _lookup(agent: RpcAgent, to: Any, op: str) -> int:
    if isinstance(to, WorkerInfo):
        known = agent.infos.get(to.id)
        if known != to:
            raise InvalidArgumentError(f"{op}: unknown worker {to}")
        return to.id
    if isinstance(to, str):
        info = agent.by_name.get(to)
        if info is None:
            raise InvalidArgumentError(f"{op}: no worker is called {to!r} (could not find "
                             f"destination); workers are "
                             f"{sorted(agent.by_name)}")
        return info.id
    if isinstance(to, int) and not isinstance(to, bool):
        if to not in agent.infos:
            raise InvalidArgumentError(f"{op}: no worker has rank {to}; ranks are "
                                       f"{sorted(agent.infos)}")
        return to
    raise BadDestinationError(f"{op}: to must be a worker name, rank or WorkerInfo, got "
                              f"{type(to).__name__}")


def _check_call(func: Any, args: Any, kwargs: Any, op: str) -> tuple[tuple, dict]:
    if not callable(func):
        raise TypeError(f"{op}: func must be callable, got {type(func).__name__}")
    if args is None:
        args = ()
    elif isinstance(args, list):
        args = tuple(args)
    elif not isinstance(args, tuple):
        raise TypeError(f"{op}: args must be a tuple or list, got {type(args).__name__}")
    if kwargs is None:
        kwargs = {}
    elif not isinstance(kwargs, dict):
        raise TypeError(f"{op}: kwargs must be a dict, got {type(kwargs).__name__}")
    return args, kwargs


def _prepare(op: str, to: Any, func: Any, args: Any, kwargs: Any,
             timeout: float) -> tuple[RpcAgent, int, tuple, dict, float]:
    """(agent, destination rank, args, kwargs, timeout in seconds) of a checked call."""
    agent = current_agent(op)
    dest = _resolve(agent, to, op)
    args, kwargs = _check_call(func, args, kwargs, op)
    return agent, dest, args, kwargs, resolve_timeout(timeout, agent.timeout, op)


def _call(op: str, to: Any, func: Callable, args: Any, kwargs: Any, timeout: float,
          sync: bool, kind: Kind = Kind.CALL) -> Any:
    agent, dest, args, kwargs, seconds = _prepare(op, to, func, args, kwargs, timeout)
    span = _profile_span(RPCExecMode.SYNC if sync else RPCExecMode.ASYNC, func, agent, dest)
    try:
        entry = agent.request(dest, kind, func, args, kwargs, timeout=seconds, sync=sync,
                              what=lambda: f"{op} to {agent.describe(dest)} calling "
                                           f"{_name(func)}",
                              ctx=current_context(agent))
    except DistError as e:
        _end_span(span)
        if sync or agent.stopped:
            raise
        # as torch's: rpc_async to a worker that is gone (known, or found on connecting)
        # returns a failed future
        failed: torch.futures.Future = torch.futures.Future()
        failed.set_exception(e)
        return failed
    except BaseException:
        _end_span(span)
        raise
    if sync:
        try:
            return wait_sync(agent, entry)
        finally:
            _end_span(span)
    return entry.future if span is None else span._call_end_callbacks_on_future(entry.future)


def _profile_span(mode: RPCExecMode, func: Any, agent: RpcAgent, dest: int) -> Any:
    """Under torch's legacy autograd profiler, a span named as torch names the call
    (``rpc_async#add(w0 -> w1)``), entered; None otherwise (torch records RPCs under
    that profiler only)."""
    if not torch.autograd._profiler_enabled():
        return None
    from torch._C._profiler import ActiveProfilerType

    if torch._C._autograd._profiler_type() != ActiveProfilerType.LEGACY:
        return None
    name = getattr(func, "__qualname__", None) or _name(func)
    key = _build_rpc_profiling_key(mode, name, agent.name, agent.infos[dest].name)
    span = torch.autograd.profiler.record_function(key)
    span.__enter__()
    return span


def _end_span(span: Any) -> None:
    if span is not None:
        span.__exit__(None, None, None)


def _name(func: Any) -> str:
    module = getattr(func, "__module__", None)
    name = getattr(func, "__qualname__", None) or repr(func)
    return f"{module}.{name}" if module else name


def wait_sync(agent: RpcAgent, entry: Any) -> Any:
    """Wait for a ``sync`` request's answer (the caller unpickles it); its deadline holds."""
    if not entry.waiter.acquire(timeout=max(entry.deadline - time.monotonic(), 0.0)):
        if agent.pending.pop(entry.rid, None) is entry:
            raise rpc_timeout_error(entry.what, entry.timeout)
        if not entry.waiter.acquire(timeout=10.0):  # answered at the deadline: imminent
            raise DistError(f"{entry.what}: lost its answer")
    return agent.finish(entry)


def rpc_sync(to: str | int | WorkerInfo, func: Callable, args: tuple | None = None,
             kwargs: dict | None = None, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
    """Run ``func(*args, **kwargs)`` on worker ``to`` and return its result.

    Args:
        to: the worker's name, rank or ``WorkerInfo``.
        func: a picklable callable (module-level function, builtin, class).
        timeout: seconds; -1 uses ``rpc_timeout``.

    Raises:
        TypeError/ValueError: bad arguments or an unpicklable call (nothing is sent).
        DistTimeoutError: no answer within ``timeout``.
        DistError: the worker is gone (named). The remote exception, re-raised with
            its type and the remote traceback in its message, when ``func`` raised.

    Example::

        rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 3))  # tensor([4., 4.])
    """
    return _call("rpc_sync", to, func, args, kwargs, timeout, sync=True)


def rpc_async(to: str | int | WorkerInfo, func: Callable, args: tuple | None = None,
              kwargs: dict | None = None,
              timeout: float = UNSET_RPC_TIMEOUT) -> torch.futures.Future:
    """Like ``rpc_sync``, but returns at once a ``torch.futures.Future`` of the result
    (``wait()``, ``value()``, ``done()``, ``then()``, ``add_done_callback()``); errors and
    timeouts are raised by ``wait()``.

    Example::

        futs = [rpc.rpc_async("worker1", torch.add, args=(t, i)) for i in range(4)]
        torch.futures.wait_all(futs)
    """
    return _call("rpc_async", to, func, args, kwargs, timeout, sync=False)


def remote(to: str | int | WorkerInfo, func: Callable, args: tuple | None = None,
           kwargs: dict | None = None, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
    """Run ``func`` on ``to`` and keep the result there; returns an ``RRef`` to it at once.

    Errors of ``func`` and a creation that exceeds ``timeout`` surface on the RRef's
    next use (``to_here()``), as in PyTorch.

    Example::

        rref = rpc.remote("ps", torch.zeros, args=(3,))
        rref.to_here()  # tensor([0., 0., 0.])
    """
    from spmd.runtime.rpc.rref import RRef, _owner_run_remote

    agent, dest, args, kwargs, seconds = _prepare("remote", to, func, args, kwargs, timeout)
    rc = agent.rrefs
    rref_id = rc.new_id()
    if dest == agent.rank:
        rec = rc.pin(rref_id)
        handle, fork_id = RRef._make(agent, rref_id, dest, None, rec), None
    else:
        fork_id = rc.new_id()
        handle = RRef._make(agent, rref_id, dest, fork_id, None)
        rc.pending_users[fork_id] = handle  # alive until the owner confirms
    span = _profile_span(RPCExecMode.REMOTE, func, agent, dest)
    try:
        entry = agent.request(
            dest, Kind.REMOTE, _owner_run_remote, (func, args, kwargs, rref_id, fork_id), {},
            timeout=seconds, sync=False, ctx=current_context(agent),
            what=lambda: f"remote to {agent.describe(dest)} calling {_name(func)}")
    except BaseException:
        _end_span(span)
        if fork_id is None:
            rc._release(rref_id, None, unpin=True)
        else:
            rc.pending_users.pop(fork_id, None)
            handle._deleted = True
        raise
    handle._created = entry.future
    if span is not None:  # ends when the owner has made the value (torch's rule)
        handle._profiling_future = span._call_end_callbacks_on_future(entry.future)
    if fork_id is not None:
        def confirmed(done: torch.futures.Future) -> None:
            user = rc.pending_users.pop(fork_id, None)
            if user is None:
                return
            try:
                done.value()
                user._confirmed = True
            except BaseException as e:
                log.info("rpc: %s failed: %s", entry.what,
                         str(e).splitlines()[0] if str(e) else e)
            rc.users[fork_id] = user

        entry.future.add_done_callback(confirmed)
    return handle


def get_worker_info(worker_name: str | None = None) -> WorkerInfo:
    """The ``WorkerInfo`` of ``worker_name``, or of this worker when None.

    Example::

        rpc.get_worker_info()            # WorkerInfo(name='trainer0', id=0)
    """
    agent = current_agent("get_worker_info")
    if worker_name is None:
        return agent.infos[agent.rank]
    return agent.infos[_resolve(agent, worker_name, "get_worker_info")]


def get_all_worker_infos() -> list[WorkerInfo]:
    """Every worker's ``WorkerInfo``, by rank.

    Example::

        [w.name for w in rpc.get_all_worker_infos()]   # ['ps', 'trainer1', 'trainer2']
    """
    agent = current_agent("get_all_worker_infos")
    if agent.members is not None:
        agent.members.refresh()
    return [agent.infos[r] for r in sorted(agent.infos)]


def get_rpc_timeout() -> float:
    """This worker's default RPC timeout in seconds (``rpc_timeout`` of its options, or
    what ``_set_rpc_timeout`` set since)."""
    return current_agent("get_rpc_timeout").timeout


def _set_rpc_timeout(rpc_timeout: float) -> None:
    """Change this worker's default RPC timeout (seconds, positive), as torch's private
    ``rpc._set_rpc_timeout`` does; calls already sent keep theirs."""
    current_agent("_set_rpc_timeout").timeout = _positive(rpc_timeout, "rpc_timeout")


def debug_info() -> dict[str, int]:
    """Counts of this worker's RPC state (owned RRefs, forks in flight, pending calls...).

    Example::

        rpc.api.debug_info()["owner_rrefs"]   # values this worker keeps for others
    """
    agent = current_agent("debug_info")
    rc = agent.rrefs
    return {"owner_rrefs": len(rc.owners), "pending_users": len(rc.pending_users),
            "pending_children": len(rc.pending_children), "user_rrefs": len(rc.users),
            "pending_requests": len(agent.pending), "lent_buffers": len(agent.lent),
            "autograd_contexts": len(agent.contexts), "outstanding": agent.outstanding()}


def _stop_local(agent: RpcAgent, linger: float) -> None:
    ctx = agent.rank_ctx  # the rank's, whichever thread stops it (a close hook too)
    try:
        agent.stop(linger)
    finally:
        if ctx.state.get(_STATE_KEY) is agent:
            del ctx.state[_STATE_KEY]
        _live.discard(agent)

