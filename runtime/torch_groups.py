"""torch.distributed sees our process groups: the same backend instance, registered in
torch's world, so torch code in the same program (``torch.distributed.get_rank()``,
``DistributedSampler``, ``nn.SyncBatchNorm``, DTensor, ``torch.distributed.checkpoint``)
runs on the groups ``spmd.runtime`` made, with no second rendezvous and no second set of
Gloo or NCCL connections.

``init_process_group`` shares the default group (it becomes torch's default group),
``new_group`` and ``Mesh`` share theirs, ``destroy_process_group`` tears torch's view
down with ours. Sharing is skipped, with a log line saying why, where torch's
process-wide state cannot hold our groups: ranks that are threads of one process (each
would need its own default group), or a program that initialized torch.distributed
itself first (its default group stays; ours are then not shared).

Registering a group means filling the tables ``torch.distributed`` keeps per process
(``distributed_c10d._world``) as its own ``new_group`` does; that is internal API, so
a torch whose tables differ gets a warning and no sharing, never a failure of ours.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("spmd.runtime")

__all__ = ["share", "unshare", "unshare_all", "torch_group", "ours"]

_PREFIX = "spmd:"  # torch's registry of group names is process-wide: ours are tagged
_OURS: dict[Any, str] = {}  # torch ProcessGroup -> our group's name (pybind objects take no attributes)


def _skip(group: Any, default: bool) -> str:
    """Why ``group`` cannot be shared with torch.distributed ('' when it can)."""
    import torch.distributed as tdist

    if group._threaded:
        return "ranks are threads of one process, and torch keeps one default group per process"
    if group._backend is None or group._backend_store is None:
        return "the group has no backend of torch's"
    if default and tdist.is_initialized():
        return "torch.distributed was initialized by the program itself"
    if not default and _torch_default() not in _OURS:
        return "the default group is not shared"
    return ""


def _torch_default() -> Any:
    import torch.distributed.distributed_c10d as c10d

    return c10d._world.default_pg


def share(group: Any, *, default: bool) -> Any | None:
    """Register ``group`` (a member's) with torch.distributed; its torch
    ``ProcessGroup``, or None where it is not shared (see the module doc)."""
    why = _skip(group, default)
    if why:
        log.debug("spmd: process group %r not shared with torch.distributed: %s",
                  group.name, why)
        return None
    try:
        return _register(group, default)
    except Exception as e:  # torch's internal tables changed: ours still work
        for pg in [pg for pg, name in _OURS.items() if name == group.name]:
            _forget(pg)
            if default:
                import torch.distributed.distributed_c10d as c10d

                c10d._update_default_pg(None)
        group._torch = None
        log.warning("spmd: torch.distributed cannot see process group %r (%s: %s); torch code "
                    "needs its own init_process_group", group.name, type(e).__name__, e)
        return None


def _register(group: Any, default: bool) -> Any:
    import torch
    import torch.distributed.distributed_c10d as c10d
    from torch._C._distributed_c10d import ProcessGroup as TorchProcessGroup

    kinds = {"gloo": (TorchProcessGroup.BackendType.GLOO, "cpu"),
             "nccl": (TorchProcessGroup.BackendType.NCCL, "cuda")}
    if group.backend not in kinds:
        raise ValueError(f"backend {group.backend!r} is not one torch's tables take here")
    kind, device = kinds[group.backend]
    name = _PREFIX + group.name
    pg = TorchProcessGroup(group._backend_store, group.rank(), group.size())
    pg._set_default_backend(kind)
    pg._register_backend(torch.device(device), kind, group._backend)
    pg._set_group_name(name)
    pg._set_group_desc(name)
    _OURS[pg] = group.name
    world = c10d._world
    world.pg_map[pg] = (group.backend, group._backend_store)
    world.pg_names[pg] = name
    world.pg_backend_config[pg] = f"{device}:{group.backend}"
    world.pg_group_ranks[pg] = {g: i for i, g in enumerate(group.ranks)}
    tag = f"ptd:{name}"
    world.tags_to_pg.setdefault(tag, []).append(pg)
    world.tags_to_pg.setdefault("", []).append(pg)
    world.pg_to_tag[pg] = tag
    c10d._register_process_group(name, pg)
    if default:
        c10d._update_default_pg(pg)
    group._torch = pg
    group._shared = True
    return pg


def torch_group(group: Any) -> Any:
    """``group``'s torch.distributed ``ProcessGroup``; ``RuntimeError`` saying why when
    it is not shared."""
    pg = getattr(group, "_torch", None)
    if pg is None:
        why = _skip(group, group.name == "default") or "it was not registered"
        raise RuntimeError(f"process group {group.name!r} is not known to torch.distributed: "
                           f"{why}")
    return pg


def ours(pg: Any) -> Any | None:
    """Our group that torch ProcessGroup ``pg`` is the view of (None when it is not)."""
    name = _OURS.get(pg)
    if name is None:
        return None
    from spmd.runtime import context

    state = context.current().state.get("world")
    return None if state is None else state.groups.get(name)


def _forget(pg: Any) -> None:
    import torch.distributed.distributed_c10d as c10d

    world = c10d._world
    _OURS.pop(pg, None)
    name = world.pg_names.pop(pg, None)
    world.pg_map.pop(pg, None)
    world.pg_backend_config.pop(pg, None)
    world.pg_group_ranks.pop(pg, None)
    tag = world.pg_to_tag.pop(pg, None)
    for key in (tag, ""):
        members = world.tags_to_pg.get(key)
        if members and pg in members:
            members.remove(pg)
    if name is not None:
        try:
            c10d._unregister_process_group(name)
        except Exception:  # already gone from torch's registry
            pass


def unshare(group: Any) -> None:
    """Forget one non-default group we shared."""
    pg, group._torch = group._torch, None
    if pg is not None:
        _forget(pg)


def unshare_all() -> None:
    """Forget every group we shared, and torch's default if it is ours (the backends
    are ours to shut down)."""
    import torch.distributed.distributed_c10d as c10d

    world = c10d._world
    default = world.default_pg
    ours = default in _OURS
    for pg in list(_OURS):
        _forget(pg)
    if ours:
        c10d._update_default_pg(None)
