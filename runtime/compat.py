"""The rest of ``torch.distributed``'s public names that training scripts call, with torch's
meaning, so a program runs after changing its import.

Where the meaning is torch's own and independent of whose groups run (``Backend``,
``DebugLevel``, the option structs, ``is_gloo_available``), the name is torch's object.
Where it concerns groups (``group.WORLD``, ``GroupMember``, ``new_subgroups``,
``send_object_list``), it is ours, per rank context like every group of this runtime.
"""

from __future__ import annotations

import pickle
import warnings
from datetime import timedelta
from typing import Any, Sequence

import torch
import torch.distributed as _tdist

from spmd.runtime import config, groups
from spmd.runtime.context import getenv
from spmd.runtime.errors import DistError

__all__ = [
    "is_available", "is_gloo_available", "is_nccl_available", "is_mpi_available",
    "is_ucc_available", "is_xccl_available", "is_backend_available", "Backend",
    "BackendConfig", "DebugLevel", "get_debug_level", "set_debug_level",
    "set_debug_level_from_env", "GroupMember", "group", "DistBackendError",
    "DistNetworkError", "get_node_local_rank", "is_torchelastic_launched",
    "send_object_list", "recv_object_list", "new_subgroups", "new_subgroups_by_enumeration",
    "default_pg_timeout", "supports_complex", "get_backend_config",
    "get_default_backend_for_device", "get_pg_count", "all_reduce_coalesced",
    "all_gather_coalesced", "AllreduceOptions", "AllreduceCoalescedOptions",
    "AllToAllOptions", "BarrierOptions", "BroadcastOptions", "GatherOptions",
    "ReduceOptions", "ReduceScatterOptions", "ScatterOptions", "GroupName", "RankType",
    "ProcessGroupGloo", "DeviceMesh", "init_device_mesh",
]

# torch's own objects, the same meaning whoever runs the groups
Backend = _tdist.Backend
BackendConfig = _tdist.BackendConfig
DebugLevel = _tdist.DebugLevel
get_debug_level = _tdist.get_debug_level
set_debug_level = _tdist.set_debug_level
set_debug_level_from_env = _tdist.set_debug_level_from_env
is_available = _tdist.is_available
is_gloo_available = _tdist.is_gloo_available
is_nccl_available = _tdist.is_nccl_available
is_mpi_available = _tdist.is_mpi_available
is_ucc_available = _tdist.is_ucc_available
is_xccl_available = _tdist.is_xccl_available
is_backend_available = _tdist.is_backend_available
supports_complex = _tdist.supports_complex
AllreduceOptions = _tdist.AllreduceOptions
AllreduceCoalescedOptions = _tdist.AllreduceCoalescedOptions
AllToAllOptions = _tdist.AllToAllOptions
BarrierOptions = _tdist.BarrierOptions
BroadcastOptions = _tdist.BroadcastOptions
GatherOptions = _tdist.GatherOptions
ReduceOptions = _tdist.ReduceOptions
ReduceScatterOptions = _tdist.ReduceScatterOptions
ScatterOptions = _tdist.ScatterOptions
GroupName = _tdist.GroupName
RankType = _tdist.RankType
ProcessGroupGloo = _tdist.ProcessGroupGloo
DeviceMesh = _tdist.DeviceMesh  # DTensor's; runs on our groups (torch sees them)
init_device_mesh = _tdist.init_device_mesh

default_pg_timeout: timedelta = config.process_group_timeout()


class DistBackendError(DistError, _tdist.DistBackendError):
    """A backend (Gloo, NCCL) failed: ``torch.distributed.DistBackendError`` too, so code
    catching torch's class catches ours."""


class DistNetworkError(DistError, _tdist.DistNetworkError):
    """A network failure: ``torch.distributed.DistNetworkError`` too."""


class _GroupMember:
    """``GroupMember.WORLD``: this rank's default group (None before
    ``init_process_group``); ``NON_GROUP_MEMBER``: what torch returns to non-members."""

    NON_GROUP_MEMBER = _tdist.GroupMember.NON_GROUP_MEMBER

    @property
    def WORLD(self) -> Any:  # noqa: N802 (torch's name)
        return groups.world().default if groups.is_initialized() else None

    def __repr__(self) -> str:
        return "GroupMember"


GroupMember = _GroupMember()
group = GroupMember  # ``dist.group.WORLD``, as in torch


def get_node_local_rank(fallback_rank: int | None = None) -> int:
    """This process's rank on its machine: ``LOCAL_RANK`` (set by torchrun and ``spawn``),
    else ``fallback_rank``; ``RuntimeError`` when neither is there."""
    value = getenv("LOCAL_RANK")
    if value is not None:
        return int(value)
    if fallback_rank is not None:
        return int(fallback_rank)
    raise RuntimeError("LOCAL_RANK is not in the environment; launch with torchrun or "
                       "spmd.runtime.spawn, or pass fallback_rank")


def is_torchelastic_launched() -> bool:
    """Whether torchrun (torchelastic) started this process."""
    return getenv("TORCHELASTIC_RUN_ID") is not None


def _resolve(group: Any, rank: int | None, group_rank: int | None, what: str) -> int:
    """A global rank from ``rank`` or a group-relative one (torch's ``group_src``/
    ``group_dst``); exactly one of them."""
    if (rank is None) == (group_rank is None):
        raise ValueError(f"{what}: pass exactly one of the global rank and group_{what}")
    if group_rank is None:
        return rank  # type: ignore[return-value]
    pg = groups.resolve_group(group, what)
    return pg.global_rank(group_rank)


def send_object_list(object_list: list, dst: int | None = None, group: Any = None,
                     device: Any = None, group_dst: int | None = None) -> None:
    """Send picklable objects to ``dst`` (a blocking send of their sizes, then their
    bytes), as torch's ``send_object_list``."""
    from spmd.runtime.p2p import send

    if not isinstance(object_list, list):
        raise TypeError(f"send_object_list: object_list must be a list, got "
                        f"{type(object_list).__name__}")
    peer = _resolve(group, dst, group_dst, "dst")
    blobs = [pickle.dumps(obj) for obj in object_list]
    sizes = torch.tensor([len(b) for b in blobs], dtype=torch.long)
    send(sizes, peer, group)
    if blobs:
        send(torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8), peer, group)


def recv_object_list(object_list: list, src: int | None = None, group: Any = None,
                     device: Any = None, group_src: int | None = None) -> int:
    """Receive ``len(object_list)`` objects into it from ``src`` (None and no
    ``group_src``: any rank); returns the sender's global rank."""
    from spmd.runtime.p2p import recv

    if not isinstance(object_list, list):
        raise TypeError(f"recv_object_list: object_list must be a list, got "
                        f"{type(object_list).__name__}")
    peer = None if src is None and group_src is None else _resolve(group, src, group_src,
                                                                   "src")
    sizes = torch.empty(len(object_list), dtype=torch.long)
    sender = recv(sizes, peer, group)
    if object_list:
        data = torch.empty(int(sizes.sum()), dtype=torch.uint8)
        recv(data, sender, group)
        raw, offset = data.numpy().tobytes(), 0
        for i, size in enumerate(sizes.tolist()):
            object_list[i] = pickle.loads(raw[offset:offset + size])
            offset += size
    return sender


def new_subgroups_by_enumeration(ranks_per_subgroup_list: Sequence[Sequence[int]],
                                 timeout: timedelta | None = None, backend: str | None = None,
                                 pg_options: Any = None, group_desc: str | None = None
                                 ) -> tuple[Any, list]:
    """One group per list of global ranks (every rank creates them all, in order); this
    rank's group (None if it is in none) and all of them."""
    lists = [list(r) for r in ranks_per_subgroup_list]
    seen: set[int] = set()
    for ranks in lists:
        overlap = seen.intersection(ranks)
        if overlap:
            raise ValueError(f"new_subgroups_by_enumeration: rank {min(overlap)} is in more "
                             f"than one subgroup")
        seen.update(ranks)
    me = groups.get_rank()
    subgroups, mine = [], None
    for ranks in lists:
        pg = groups.new_group(ranks, timeout=timeout, backend=backend)
        subgroups.append(pg)
        if me in ranks:
            mine = pg
    return mine, subgroups


def new_subgroups(group_size: int | None = None, group: Any = None,
                  timeout: timedelta | None = None, backend: str | None = None,
                  pg_options: Any = None, group_desc: str | None = None) -> tuple[Any, list]:
    """Consecutive subgroups of ``group_size`` ranks each (default: the GPUs of a machine,
    as in torch); this rank's and all of them."""
    if group_size is None:
        if not torch.cuda.is_available():
            raise ValueError("new_subgroups: the default group_size is the number of CUDA "
                             "devices, and there are none; pass group_size")
        group_size = torch.cuda.device_count()
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0:
        raise ValueError(f"new_subgroups: group_size must be a positive int, got {group_size!r}")
    base = groups.resolve_group(group, "new_subgroups")
    ranks = list(base.ranks)
    if len(ranks) % group_size:
        raise ValueError(f"new_subgroups: the group's {len(ranks)} ranks do not divide into "
                         f"subgroups of {group_size}")
    lists = [ranks[i:i + group_size] for i in range(0, len(ranks), group_size)]
    return new_subgroups_by_enumeration(lists, timeout=timeout, backend=backend)


def get_backend_config(group: Any = None) -> str:
    """``"cpu:gloo"`` or ``"cuda:nccl"``: the device and backend of ``group``."""
    name = groups.get_backend(group)
    device = "cuda" if name == "nccl" else "cpu"
    return f"{device}:{name}"


def get_default_backend_for_device(device: Any) -> str:
    """The backend for a device type: ``"nccl"`` for CUDA, ``"gloo"`` for the CPU."""
    kind = torch.device(device).type
    if kind == "cuda":
        return "nccl"
    if kind == "cpu":
        return "gloo"
    raise ValueError(f"get_default_backend_for_device: no backend of ours for {kind!r}")


def get_pg_count() -> int:
    """How many process groups this rank has made (the default one included)."""
    return len(groups.world("get_pg_count").groups)


def all_reduce_coalesced(tensors: list[torch.Tensor], op: Any = None, group: Any = None,
                         async_op: bool = False) -> Any:
    """All-reduce several tensors as one flat buffer (torch's deprecated API)."""
    from spmd.runtime.collectives import all_reduce
    from spmd.runtime.reduction import ReduceOp

    warnings.warn("all_reduce_coalesced is deprecated in torch.distributed; it runs as one "
                  "all_reduce of a flat buffer here", FutureWarning, stacklevel=2)
    flat = torch.cat([t.reshape(-1) for t in tensors])
    all_reduce(flat, op=ReduceOp.SUM if op is None else op, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
    return None


def all_gather_coalesced(output_tensor_lists: list[list[torch.Tensor]],
                         input_tensor_list: list[torch.Tensor], group: Any = None,
                         async_op: bool = False) -> Any:
    """One all-gather per input tensor (torch's deprecated API)."""
    from spmd.runtime.collectives import all_gather

    warnings.warn("all_gather_coalesced is deprecated in torch.distributed; it runs as one "
                  "all_gather per tensor here", FutureWarning, stacklevel=2)
    for i, t in enumerate(input_tensor_list):
        all_gather([out[i] for out in output_tensor_lists], t, group=group)
    return None
