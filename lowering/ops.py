"""The collectives of a planned graph, as ``torch.library`` ops in the ``spmd`` namespace.

An async collective is a pair of nodes:

    flat = spmd.bucket_all_reduce([g0, g1, ...], handle)   # pack, start the all-reduce
    ...                                                    # compute overlaps here
    flat = spmd.wait(flat)                                 # block where the value is needed

``bucket_all_reduce`` packs its gradients into one flat buffer (scaled by 1/world size
and cast to the wire dtype in the same pass, through ``spmd.kernels.pack``), starts the
all-reduce on it and returns it at once; ``wait`` blocks on that buffer's pending work
and returns the same tensor (an alias, as PyTorch's own ``wait_tensor`` does). Moving the
``wait`` is how the scheduler overlaps. Both ops have fake (meta) implementations, so the
graphs stay ordinary fx graphs for make_fx, Dynamo and Inductor.

``handle`` names a :class:`CollectiveSpec` in a registry: the group, the scale, the wire
dtype and the owner's sync switch live there, not in the graph.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["CollectiveSpec", "SyncState", "register_spec", "bucket_all_reduce", "wait"]


@dataclass(eq=False)
class SyncState:
    """The switch a parallelized model flips for ``no_sync()``, and what a step reduced.

    While ``track`` is on, ``reduced`` maps the storage of every flat buffer reduced since
    the last :meth:`begin_step` to its spec and the buffer, so the eager safety net can
    tell a gradient a graph already averaged from one it must still average. A whole-step
    graph has no safety net and turns ``track`` off: no lock per bucket, and no flat
    buffer kept alive until the next step.
    """

    enabled: bool = True
    track: bool = True
    profiler: Any = None  # set while a profile records this model's steps
    reduced: dict[int, tuple["CollectiveSpec", torch.Tensor]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def begin_step(self) -> None:
        with self.lock:
            self.reduced.clear()


@dataclass(frozen=True, eq=False, kw_only=True)
class CollectiveSpec:
    """What one ``bucket_all_reduce`` node does when it runs.

    Attributes:
        group: the process group (an ``spmd.runtime.ProcessGroup``), None to plan only.
        world_size: the group's size (gradients are pre-divided by it).
        wire_dtype: the dtype on the wire, None for the gradients' own.
        params: the parameter names whose gradients the bucket carries, in order.
        sync: the owner's switch; while it is off the op packs without reducing.
    """

    group: Any
    world_size: int
    wire_dtype: torch.dtype | None
    params: tuple[str, ...]
    sync: SyncState
    name: str = ""


_SPECS: dict[int, CollectiveSpec] = {}
_IDS = itertools.count(1)
_PENDING: dict[int, Any] = {}  # storage address of a flat buffer -> its runtime Work
_PENDING_LOCK = threading.Lock()


def register_spec(s: CollectiveSpec) -> int:
    """Register ``s``; the integer handle graph nodes carry."""
    handle = next(_IDS)
    _SPECS[handle] = s
    return handle


_lib = torch.library.Library("spmd", "DEF")
_lib.define("bucket_all_reduce(Tensor[] grads, int handle) -> Tensor")
_lib.define("wait(Tensor(a) tensor) -> Tensor(a)")


def _bucket_all_reduce(grads: list[torch.Tensor], handle: int) -> torch.Tensor:
    s = _SPECS[handle]
    active = s.sync.enabled and s.group is not None and s.world_size > 1
    from spmd.lowering.flat import pack

    flat = pack(list(grads), scale=1.0 / s.world_size if active else 1.0, dtype=s.wire_dtype)
    if active:
        from spmd.runtime.collectives import all_reduce

        profiler = s.sync.profiler
        issued = time.perf_counter() if profiler is not None else 0.0  # before the launch
        work = all_reduce(flat, group=s.group, async_op=True)
        if profiler is not None:
            work.spmd_profiler, work.spmd_name = profiler, s.name
            profiler.event("issue", s.name, issued)
            work._inner.get_future().add_done_callback(lambda _: profiler.event("done", s.name))
        key = flat.untyped_storage().data_ptr()
        with _PENDING_LOCK:
            _PENDING[key] = work
        if s.sync.track:
            with s.sync.lock:
                s.sync.reduced[key] = (s, flat)
    return flat


def _wait(tensor: torch.Tensor) -> torch.Tensor:
    with _PENDING_LOCK:
        work = _PENDING.pop(tensor.untyped_storage().data_ptr(), None)
    if work is None:
        return tensor
    profiler = getattr(work, "spmd_profiler", None)
    if profiler is None:
        work.wait()
        return tensor
    profiler.event("wait_start", work.spmd_name)
    work.wait()
    profiler.event("wait_end", work.spmd_name)
    return tensor


def _fake_bucket_all_reduce(grads: list[torch.Tensor], handle: int) -> torch.Tensor:
    s = _SPECS[handle]
    numel = sum(g.numel() for g in grads)
    return grads[0].new_empty((numel,), dtype=s.wire_dtype or grads[0].dtype)


def _fake_wait(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


_lib.impl("bucket_all_reduce", _bucket_all_reduce, "CompositeExplicitAutograd")
_lib.impl("wait", _wait, "CompositeExplicitAutograd")
torch.library.register_fake("spmd::bucket_all_reduce", _fake_bucket_all_reduce, lib=_lib)
torch.library.register_fake("spmd::wait", _fake_wait, lib=_lib)

bucket_all_reduce = torch.ops.spmd.bucket_all_reduce.default
wait = torch.ops.spmd.wait.default
