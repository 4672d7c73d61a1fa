"""The default process group and its relatives: init, destroy, new_group, who am I.

State lives in the calling rank's context (``spmd.runtime.context``), not in the
process, so ranks that are threads of one process each have their own default group.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any, Sequence

import torch.distributed as _dist

from spmd.runtime import backends, config, context, topology, torch_groups
from spmd.runtime.process_group import ProcessGroup
from spmd.runtime.rendezvous import rendezvous
from spmd.runtime.store.base import Store, as_seconds
from spmd.runtime.store.hash_store import HashStore
from spmd.runtime.store.prefix_store import PrefixStore
from spmd.runtime.store.tcp_store import TCPStore

log = logging.getLogger("spmd.runtime")

__all__ = [
    "init_process_group", "destroy_process_group", "is_initialized", "get_rank",
    "get_world_size", "get_backend", "new_group", "get_process_group_ranks",
    "get_group_rank", "get_global_rank", "resolve_group", "world", "standalone_group",
]

_DEBUG_LEVELS = ("off", "detail")


class _World:
    """Everything ``init_process_group`` set up for one rank."""

    def __init__(self, store: Store, rank: int, size: int, backend: str, timeout: timedelta,
                 debug: bool, master_host: str | None, store_host_rank: int | None,
                 own_store: bool = False) -> None:
        self.store = store
        self.own_store = own_store  # made by our rendezvous (not passed in): ours to close
        self.rank = rank
        self.size = size
        self.backend = backend
        self.timeout = timeout
        self.debug = debug
        self.master_host = master_host
        self.store_host_rank = store_host_rank
        self.groups: dict[str, ProcessGroup] = {}
        self.default: ProcessGroup | None = None
        self.counter = 0  # new_group() calls, for names
        self.meshes = 0  # Mesh() calls, for names
        self.topology: Any = None  # spmd.runtime.topology.get_topology(), once read


def _debug_level(debug: object) -> bool:
    if isinstance(debug, bool):
        return debug
    if debug is not None and not isinstance(debug, str):
        raise TypeError(f"debug must be a bool or one of {_DEBUG_LEVELS}, got {debug!r}")
    return "detail" in config.debug_levels(debug)


def world(op: str = "this call") -> _World:
    """This rank's state; ``RuntimeError`` when ``init_process_group`` has not run."""
    state = context.current().state.get("world")
    if state is None:
        raise RuntimeError(
            f"{op}: the default process group is not initialized; call "
            f"spmd.runtime.init_process_group() first")
    return state


def as_ours(group: Any, op: str) -> ProcessGroup:
    """``group`` as this runtime's ``ProcessGroup``: None is the default group, and
    torch's view of one of ours (``group.to_torch()``, ``dist.group.WORLD`` of torch,
    ``DeviceMesh.get_group()`` of a mesh built from ours) is that group. Unlike
    ``resolve_group``, a non-member's handle is fine (its rank is -1)."""
    if group is None:
        pg = world(op).default
        assert pg is not None
        return pg
    if isinstance(group, ProcessGroup):
        return group
    if isinstance(group, _dist.ProcessGroup):
        ours = torch_groups.ours(group)
        if ours is None:
            raise TypeError(f"{op}: group is a torch.distributed ProcessGroup that "
                            f"spmd.runtime did not make (torch's own new_group, say); pass "
                            f"one of ours, or torch's view of one (group.to_torch())")
        return ours
    raise TypeError(f"{op}: group must be a ProcessGroup or None, got {type(group).__name__}")


def resolve_group(group: ProcessGroup | None, op: str) -> ProcessGroup:
    """The group an operation runs on (None: the default), checked usable."""
    pg = group if type(group) is ProcessGroup else as_ours(group, op)
    pg.require(op)
    return pg


def is_initialized() -> bool:
    """True when this rank has a default process group."""
    return context.current().state.get("world") is not None


def _store_host(store: Store, master_host: str | None) -> tuple[str | None, int | None]:
    if isinstance(store, TCPStore):
        return store.host, 0
    if isinstance(store, HashStore):
        return None, None
    return master_host, None


def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: timedelta | None = None,
    world_size: int = -1,
    rank: int = -1,
    store: Store | None = None,
    group_name: str = "",
    *,
    debug: bool | str | None = None,
) -> None:
    """Join the job: rendezvous, then build the default process group over the store.

    Args:
        backend: ``"gloo"``, ``"nccl"``, ``"mpi"`` or None (NCCL with CUDA, else Gloo).
        init_method: ``env://`` (default), ``tcp://host:port`` or ``file:///path``.
        timeout: how long any operation may take before ``DistTimeoutError``
            (default ``SPMD_TIMEOUT``, 30 minutes).
        world_size, rank: required with ``store``; otherwise they override the URL and
            the environment. -1 means "not given".
        store: a store every rank can reach, instead of ``init_method``.
        group_name: the default group's name (``"default"`` when empty).
        debug: compare every collective's fingerprint across ranks before running it
            (``SPMD_DEBUG=detail``); a mismatch raises on every rank.

    Example::

        dist.init_process_group("gloo")   # under spawn or torchrun
        dist.all_reduce(torch.ones(3))
    """
    if is_initialized():
        raise RuntimeError("init_process_group: this rank is already initialized; call "
                           "destroy_process_group() first")
    name = backends.check_backend(backend) if backend is not None else backends.default_backend()
    for arg, value in (("world_size", world_size), ("rank", rank)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"init_process_group: {arg} must be an int, got {type(value).__name__}")
    if not isinstance(group_name, str):
        raise TypeError(f"init_process_group: group_name must be a str, got {group_name!r}")
    pg_timeout = config.process_group_timeout() if timeout is None else timedelta(
        seconds=as_seconds(timeout, "timeout"))
    debug_on = _debug_level(debug)
    if store is not None:
        if init_method is not None:
            raise ValueError("init_process_group: pass either store or init_method, not both")
        if not isinstance(store, Store):
            raise TypeError(f"init_process_group: store must be an spmd.runtime Store, got "
                            f"{type(store).__name__}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"init_process_group: with a store, pass world_size >= 1 and rank "
                             f"in [0, world_size); got world_size={world_size}, rank={rank}")
        base, me, size = store, rank, world_size
    else:
        url = "env://" if init_method is None else init_method
        base, me, size = rendezvous(url, rank if rank >= 0 else None,
                                    world_size if world_size > 0 else None, pg_timeout)
    master_host, host_rank = _store_host(base, context.getenv("MASTER_ADDR"))
    topology.publish(base, me)  # where this rank runs; get_topology() reads them all
    state = _World(base, me, size, name, pg_timeout, debug_on, master_host, host_rank,
                   own_store=store is None)
    group = _make_group(state, group_name or "default", list(range(size)), name, pg_timeout)
    state.default = group
    torch_groups.share(group, default=True)  # torch.distributed sees it too
    ctx = context.current()
    ctx.state["world"] = state
    ctx.on_close(lambda: is_initialized() and destroy_process_group())


def _make_group(state: _World, name: str, ranks: list[int], backend: str,
                timeout: timedelta) -> ProcessGroup:
    store = PrefixStore(f"pg/{name}", state.store)
    inner = torch_store = None
    if state.rank in ranks:
        me = ranks.index(state.rank)
        inner, torch_store = backends.make_backend(backend, store, me, len(ranks), timeout,
                                                   state.master_host, ranks, name)
    group = ProcessGroup(name=name, backend_name=backend, backend=inner, store=store,
                         backend_store=torch_store,
                         ranks=ranks, global_rank=state.rank, timeout=timeout,
                         debug=state.debug, store_host_rank=state.store_host_rank)
    state.groups[name] = group
    return group


def standalone_group(store: Store, rank: int, world_size: int, *, backend: str = "gloo",
                     timeout: timedelta | None = None, name: str = "standalone",
                     master_host: str | None = None) -> ProcessGroup:
    """A process group of ``world_size`` ranks set up through ``store``, apart from this
    rank's default group (as building torch's ``ProcessGroupGloo(store, rank, size)``
    directly is): ``spmd.runtime.ft`` joins the replicas of a step with one, next to
    each replica's own job. Its ranks are ``0..world_size-1``; pass it as ``group=`` to
    any collective, and ``destroy_process_group(group)`` (or ``group._destroy()``) when
    done. ``master_host``: the address the ranks meet at (it picks Gloo's device; by
    default the store's host)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"standalone_group: rank {rank} is not in [0, {world_size})")
    timeout = timeout or config.process_group_timeout()
    host = master_host if master_host is not None else _store_host(_unwrap(store), None)[0]
    ranks = list(range(world_size))
    inner, torch_store = backends.make_backend(backend, store, rank, world_size, timeout,
                                               host, ranks, name)
    return ProcessGroup(name=name, backend_name=backend, backend=inner, store=store,
                        backend_store=torch_store, ranks=ranks, global_rank=rank,
                        timeout=timeout)


def _unwrap(store: Store) -> Store:
    """The store under prefixes (whose host is the one to reach)."""
    while isinstance(store, PrefixStore):
        store = store._store
    return store


def new_group(
    ranks: Sequence[int] | None = None,
    timeout: timedelta | None = None,
    backend: str | None = None,
    pg_options: object = None,
    use_local_synchronization: bool = False,
    group_desc: str | None = None,
    device_id: object = None,
    *,
    group_name: str | None = None,
) -> ProcessGroup:
    """A process group of ``ranks`` (global ranks; None: all). Every rank must call it,
    unless ``use_local_synchronization=True`` (as in torch: only the members call it, and
    the group is named after its ranks).

    Only members build a backend; a non-member gets a handle whose operations raise.
    Groups are named in call order, so every rank must create groups in the same order.
    ``pg_options`` is accepted for torch's signature and must be None; ``group_desc`` and
    ``device_id`` (torch's description and eager-init device) are accepted and unused.

    Example::

        evens = dist.new_group([0, 2])
        if dist.get_rank() in (0, 2):
            dist.all_reduce(t, group=evens)
    """
    state = world("new_group")
    if ranks is None:
        members = list(range(state.size))
    else:
        if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
            raise TypeError(f"new_group: ranks must be a list of ints, got {type(ranks).__name__}")
        members = list(ranks)
        for r in members:
            if not isinstance(r, int) or isinstance(r, bool):
                raise TypeError(f"new_group: ranks must be ints, got {r!r}")
            if not 0 <= r < state.size:
                raise ValueError(f"new_group: rank {r} is outside the world [0, {state.size})")
        if len(set(members)) != len(members):
            raise ValueError(f"new_group: ranks contain duplicates: {members}")
        if not members:
            raise ValueError("new_group: ranks is empty")
        members = sorted(members)
    name_backend = state.backend if backend is None else backends.check_backend(backend)
    pg_timeout = state.timeout if timeout is None else timedelta(seconds=as_seconds(timeout))
    if pg_options is not None:
        raise ValueError("new_group: pg_options are not supported; pass timeout= and backend=")
    if not isinstance(use_local_synchronization, bool):
        raise TypeError(f"new_group: use_local_synchronization must be a bool, got "
                        f"{type(use_local_synchronization).__name__}")
    if group_name is None and use_local_synchronization:  # only members call: name by ranks
        if state.rank not in members:
            raise ValueError(f"new_group: with use_local_synchronization=True only members call "
                             f"it; rank {state.rank} is not in {members}")
        name = "local:" + ",".join(map(str, members))
    elif group_name is None:  # named in call order, which every rank shares
        state.counter += 1
        name = f"group{state.counter}"
    elif not isinstance(group_name, str) or not group_name:
        raise ValueError(f"new_group: group_name must be a non-empty str, got {group_name!r}")
    else:
        name = group_name
    if name in state.groups:
        raise ValueError(f"new_group: a group named {name!r} already exists")
    group = _make_group(state, name, members, name_backend, pg_timeout)
    if group.is_member:
        torch_groups.share(group, default=False)
    return group


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    """Destroy ``group``, or with None every group of this rank (then re-init is possible)."""
    ctx = context.current()
    state = world("destroy_process_group")
    if group is None:
        if any(g._torch is not None for g in state.groups.values()):
            torch_groups.unshare_all()
        for g in list(state.groups.values()):
            g._destroy()
        state.groups.clear()
        ctx.state.pop("world", None)
        if state.own_store and state.store.release():
            _leave(state)
        return
    group = as_ours(group, "destroy_process_group")
    if group is state.default:
        destroy_process_group(None)
        return
    if group._torch is not None:
        torch_groups.unshare(group)
    group._destroy()
    state.groups.pop(group.name, None)


def _leave(state: _World) -> None:
    """Close the store we made. The rank serving it first waits (briefly) for the others
    to leave, so nobody loses it early; the others wait until the server is gone, so a
    later init on the same port cannot reach the old one."""
    store = state.store
    try:
        if isinstance(store, TCPStore) and state.size > 1:
            wait = min(30.0, state.timeout.total_seconds())
            if store.add("spmd/left", 1) >= state.size:
                store.set("spmd/all_left", b"1")
            if store.is_master:
                store.wait(["spmd/all_left"], timedelta(seconds=wait))
            else:  # no request after the add: the server may close as soon as all have left
                store.wait_closed(wait)
    except Exception as e:  # a rank that died never leaves: close anyway, and say so
        log.warning("destroy_process_group: not every rank left the store cleanly: %s", e)
    store.close()


def get_rank(group: ProcessGroup | None = None) -> int:
    """This rank in ``group`` (the global rank for the default group; -1 if not a member)."""
    return as_ours(group, "get_rank").rank()


def get_world_size(group: ProcessGroup | None = None) -> int:
    """Ranks in ``group`` (-1 for a rank that is not a member, as in torch)."""
    pg = as_ours(group, "get_world_size")
    return pg.size() if pg.is_member else -1


def get_backend(group: ProcessGroup | None = None) -> str:
    """``group``'s backend name; ``ValueError`` for a rank that is not a member (torch's
    "Invalid process group specified")."""
    pg = as_ours(group, "get_backend")
    if not pg.is_member:
        raise ValueError(f"get_backend: invalid process group specified: rank "
                         f"{pg._global_rank} is not a member of {pg.name!r}")
    return pg.backend


def get_process_group_ranks(group: ProcessGroup | None) -> list[int]:
    """The global ranks of ``group``'s members, in group order."""
    return list(as_ours(group, "get_process_group_ranks").ranks)


def get_group_rank(group: ProcessGroup, global_rank: int) -> int:
    """``global_rank``'s index in ``group``."""
    return as_ours(group, "get_group_rank").group_rank(global_rank, "global_rank")


def get_global_rank(group: ProcessGroup, group_rank: int) -> int:
    """The global rank of ``group``'s member number ``group_rank``."""
    return as_ours(group, "get_global_rank").global_rank(group_rank)
