"""spmd.runtime: stores, rendezvous, process groups, collectives, launching.

Usable on its own as a ``torch.distributed``-shaped package
(``from spmd import runtime as dist``); it imports nothing from the compiler layers above
it. Names that need torch are resolved on first use, so the stores alone stay light.
"""

from __future__ import annotations

import importlib
from typing import Any

from spmd.runtime.context import RankContext
from spmd.runtime.errors import (DistError, DistStoreError, DistTimeoutError, QueueEmptyError,
                                 StoreTimeoutError)
from spmd.runtime.launch import SpawnContext, SpawnError, spawn
from spmd.runtime.rendezvous import rendezvous
from spmd.runtime.store import FileStore, HashStore, PrefixStore, Store, TCPStore

# name -> module, imported when first used (these import torch)
_LAZY = {
    "to_torch_store": "spmd.runtime.store.torch_adapter",
    "ReduceOp": "spmd.runtime.reduction",
    "ProcessGroup": "spmd.runtime.process_group",
    "Work": "spmd.runtime.process_group",
    "Mesh": "spmd.runtime.mesh",
    "Topology": "spmd.runtime.topology",
    "get_topology": "spmd.runtime.topology",
    **{name: "spmd.runtime.groups" for name in (
        "init_process_group", "destroy_process_group", "is_initialized", "get_rank",
        "get_world_size", "get_backend", "new_group", "get_process_group_ranks",
        "get_group_rank", "get_global_rank")},
    **{name: "spmd.runtime.collectives" for name in (
        "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "gather",
        "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
        "all_to_all_single", "barrier")},
    "all_reduce_compressed": "spmd.runtime.compressed",
    **{name: "spmd.runtime.hierarchical" for name in (
        "all_reduce_hierarchical", "all_gather_hierarchical", "reduce_scatter_hierarchical",
        "hierarchy", "Hierarchy", "HierarchicalWork")},
    "CompressedWork": "spmd.runtime.compressed",
    **{name: "spmd.runtime.p2p" for name in (
        "send", "recv", "isend", "irecv", "P2POp", "batch_isend_irecv")},
    **{name: "spmd.runtime.objects" for name in (
        "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
        "monitored_barrier")},
    **{name: "spmd.runtime.compat" for name in (
        "is_available", "is_gloo_available", "is_nccl_available", "is_mpi_available",
        "is_ucc_available", "is_xccl_available", "is_backend_available", "Backend",
        "BackendConfig", "DebugLevel", "get_debug_level", "set_debug_level",
        "set_debug_level_from_env", "GroupMember", "group", "DistBackendError",
        "DistNetworkError", "get_node_local_rank", "is_torchelastic_launched",
        "send_object_list", "recv_object_list", "new_subgroups",
        "new_subgroups_by_enumeration", "default_pg_timeout", "supports_complex",
        "get_backend_config", "get_default_backend_for_device", "get_pg_count",
        "all_reduce_coalesced", "all_gather_coalesced", "AllreduceOptions",
        "AllreduceCoalescedOptions", "AllToAllOptions", "BarrierOptions", "BroadcastOptions",
        "GatherOptions", "ReduceOptions", "ReduceScatterOptions", "ScatterOptions",
        "GroupName", "RankType", "ProcessGroupGloo", "DeviceMesh", "init_device_mesh")},
}

__all__ = [
    "DistError", "DistTimeoutError", "DistStoreError", "StoreTimeoutError", "QueueEmptyError",
    "Store", "TCPStore", "FileStore", "PrefixStore", "HashStore",
    "rendezvous", "spawn", "SpawnContext", "SpawnError", "RankContext",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in ("rpc", "autograd", "optim"):  # subpackages, imported on first use
        return importlib.import_module(f"spmd.runtime.{name}")
    if name == "reduce_op":  # torch's deprecated alias, with torch's warning
        import warnings

        warnings.warn("`torch.distributed.reduce_op` is deprecated, please use "
                      "`torch.distributed.ReduceOp` instead", FutureWarning, stacklevel=2)
        return __getattr__("ReduceOp")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'spmd.runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
