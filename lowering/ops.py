"""The collectives of a planned graph, as ``torch.library`` ops in the ``spmd`` namespace.

An async collective is a pair of nodes:

    flat = spmd.bucket_all_reduce([g0, g1, ...], handle)   # pack, start the all-reduce
    ...                                                    # compute overlaps here
    flat = spmd.wait(flat, handle)                         # block where the value is needed

``bucket_all_reduce`` packs its gradients into one flat buffer (scaled by 1/world size
and cast to the wire dtype in the same pass, through ``spmd.kernels.pack``), starts the
all-reduce on it and returns it at once; ``wait`` blocks on that buffer's pending work
and returns the same tensor (an alias, as PyTorch's own ``wait_tensor`` does), and
``wait_cast`` also casts the result back to the gradients' dtype. ``all_gather``,
``reduce_scatter`` and ``all_to_all`` realise the rest of the redistribution table the
same way, along dimension 0 of a staging buffer (the pass around them moves the sharded
dimension there and back); ``local_redistribute`` does the table's local steps. Moving
the ``wait`` is how the scheduler overlaps. Every op has a fake (meta) implementation,
so the graphs stay ordinary fx graphs for make_fx, Dynamo and Inductor.

``handle`` names a :class:`CollectiveSpec` (group, scale, wire dtype, the owner's sync
switch, the work in flight). Specs belong to the parallelized model or step that planned
them (its :class:`Handles`); the process-wide table only maps handles to specs weakly,
so a model that is collected takes its specs, groups and optimizers with it.
"""

from __future__ import annotations

import contextlib
import math
import itertools
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from spmd.lowering import redistribute as table
from spmd.lowering import reduction
from spmd.lowering.flat import pack_planned
from spmd.runtime import collectives

__all__ = ["CollectiveSpec", "ShardSpec", "SyncState", "Handles", "lookup", "bucket_all_reduce",
           "wait", "wait_cast", "all_gather", "reduce_scatter", "all_to_all",
           "local_redistribute", "shard_gather", "shard_reduce", "bucket_all_gather",
           "unpack_gathered", "bucket_reduce_scatter"]

_IDS = itertools.count(1)
_DRY = threading.local()


@contextlib.contextmanager
def dry_run() -> Iterator[None]:
    """In this block, this thread's collectives act as on a simulated mesh: the same
    local arithmetic, nothing sent. For timing a graph's compute on one rank alone (the
    planner measures on the group's first rank and shares the figure)."""
    previous = getattr(_DRY, "on", False)
    _DRY.on = True
    try:
        yield
    finally:
        _DRY.on = previous


def _sending() -> bool:
    return not getattr(_DRY, "on", False)
_LIVE: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()


class Handles:
    """The objects one model's (or step's) graphs refer to by handle: collective specs,
    optimizers. Owned by that model; :func:`lookup` finds them while it lives."""

    def __init__(self) -> None:
        self._owned: list[Any] = []

    def add(self, obj: Any) -> int:
        handle = next(_IDS)
        self._owned.append(obj)
        _LIVE[handle] = obj
        return handle


def lookup(handle: int) -> Any:
    try:
        return _LIVE[handle]
    except KeyError:
        raise RuntimeError(f"spmd: graph handle {handle} refers to a spec whose model was "
                           f"collected; a compiled graph outlived its parallelized model") from None


@dataclass(eq=False)
class SyncState:
    """The switch a parallelized model flips for ``no_sync()``, and what a step reduced.

    While ``track`` is on, ``reduced`` maps the storage of every reduced buffer the
    gradients are views of (since the last :meth:`begin_step`) to its spec and the buffer,
    so the eager safety net can tell a gradient a graph already averaged from one it must
    still average. A whole-step graph has no safety net and turns ``track`` off: no lock
    per bucket, and no buffer kept alive until the next step.
    """

    enabled: bool = True
    track: bool = True
    profiler: Any = None  # set while a profile records this model's steps
    comm_hook: Any = None  # a torch DDP communication hook: hook(state, bucket) -> Future
    comm_state: Any = None
    reduced: dict[int, tuple["CollectiveSpec", torch.Tensor]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def begin_step(self) -> None:
        with self.lock:
            self.reduced.clear()

    def record(self, spec: "CollectiveSpec", buffer: torch.Tensor) -> None:
        if self.track:
            with self.lock:
                self.reduced[buffer.untyped_storage().data_ptr()] = (spec, buffer)


@dataclass(eq=False, kw_only=True)
class CollectiveSpec:
    """What one collective node does when it runs (the runtime half of the plan).

    Attributes:
        step: the redistribution this collective realises (kind, placements).
        group: the process group of its mesh dimension; None plans only (a simulated
            mesh), and the op then runs the table's arithmetic on this rank's value as if
            every rank held it.
        size: ranks along the dimension.
        params: the parameters whose values it carries, in order.
        wire_dtype: the dtype on the wire (all-reduce buckets), None for the values' own.
        result_dtype: the dtype ``wait_cast`` returns.
        sync: the owner's switch (gradient reductions only); while off, packs without
            reducing.
        name: ``"<graph>:<node>"``, for profiles and errors.
    """

    step: table.Step
    group: Any
    size: int
    params: tuple[str, ...] = ()
    wire_dtype: torch.dtype | None = None
    result_dtype: torch.dtype | None = None
    sync: SyncState | None = None
    name: str = ""
    algorithm: str = "native"  # "native" or "fp32" (spmd.lowering.reduction)
    compress: torch.dtype | None = None  # the "fp32" algorithm's wire dtype
    index: int = 0  # a gradient bucket's index, for communication hooks
    last: bool = False  # the graph's last gradient bucket
    pending: dict[int, tuple[Any, Any]] = field(default_factory=dict)  # storage -> work
    lock: threading.Lock = field(default_factory=threading.Lock)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def live(self) -> bool:
        return self.group is not None and self.size > 1 and _sending()

    @property
    def active(self) -> bool:
        return self.live and (self.sync is None or self.sync.enabled)

    def buffer(self, role: str, numel: int, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor | None:
        """Last step's ``role`` buffer when nothing else holds it any more, else None (a new
        one is made and kept for the next step by :meth:`keep`).

        A bucket's gradients are views of its buffer until the optimizer has used them
        and ``zero_grad`` dropped them; reusing it then, rather than allocating a fresh
        one every step, spares the page faults of fresh memory (measured here: packing a
        12.5 MiB bucket into new memory took 15 ms a step, into the same buffer 0.7 ms;
        DDP keeps its buckets for the same reason).
        """
        old = self.buffers.get(role)
        if old is None or old.numel() != numel or old.dtype != dtype or old.device != device:
            return None
        return old if _alone(old) else None

    def keep(self, role: str, buffer: torch.Tensor) -> torch.Tensor:
        self.buffers[role] = buffer
        return buffer

    def started(self, buffer: torch.Tensor, work: Any, issued: float) -> None:
        """Remember ``work`` (launched at ``issued``) as the pending operation producing
        ``buffer``."""
        profiler = self.sync.profiler if self.sync is not None else None
        if profiler is not None:
            profiler.event("issue", self.name, issued)
            try:
                future = work.get_future()
            except RuntimeError:  # Gloo's reduce-scatter has none: the wait's end marks it
                future = None
            if future is not None:
                future.add_done_callback(lambda _: profiler.event("done", self.name))
        with self.lock:
            self.pending[buffer.untyped_storage().data_ptr()] = (work, profiler)

    def finish(self, buffer: torch.Tensor) -> None:
        with self.lock:
            work, profiler = self.pending.pop(buffer.untyped_storage().data_ptr(), (None, None))
        if work is None:
            return
        if profiler is not None:
            profiler.event("wait_start", self.name)
        work.wait()
        if profiler is not None:
            profiler.event("wait_end", self.name)


@dataclass(eq=False, kw_only=True)
class ShardSpec:
    """One parameter stored as its dim-0 shard (``strategy="fsdp"``/``"hsdp"``).

    The global tensor of shape ``shape`` is cut along dim 0 into ``size`` pieces of
    ``rows`` rows each, the last ones padded with zeros where dim 0 does not divide (as
    FSDP2 does); a 0-dim parameter is one row. Each rank stores its piece, shape
    :attr:`local_shape`. The parameter's uses read :func:`shard_gather` of the shard (the
    whole tensor, in ``param_dtype``); its gradient leaves through :func:`shard_reduce`
    (the average over the ranks' batches, reduce-scattered in ``reduce_dtype``, and with
    ``replicate_group`` also averaged across the replicas: hybrid sharding).

    Attributes:
        param: the parameter's name in the model.
        shape: its global shape; ``dtype``: the dtype it is stored and stepped in.
        rows: rows of dim 0 per rank (padded).
        group, size: the process group the shards are spread over (None: a simulated
            mesh) and its size; ``mesh_dim`` its name.
        replicate_group, replicate_size, replicate_dim: hybrid sharding's other dimension.
        param_dtype: the dtype it is gathered and computed in (None: ``dtype``).
        reduce_dtype: the dtype its gradient is reduced in (None: the gradient's).
    """

    param: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    rows: int
    group: Any
    size: int
    mesh_dim: str
    replicate_group: Any = None
    replicate_size: int = 1
    replicate_dim: str = ""
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    eager: bool = False  # gathered outside any planned graph at least once

    @property
    def live(self) -> bool:
        return self.group is not None and self.size > 1 and _sending()

    @property
    def local_shape(self) -> tuple[int, ...]:
        return (self.rows, *self.shape[1:])

    @property
    def rows_global(self) -> int:
        """Rows of dim 0 of the whole tensor (1 for a 0-dim parameter)."""
        return self.shape[0] if self.shape else 1

    @property
    def gather_dtype(self) -> torch.dtype:
        return self.param_dtype or self.dtype

    @property
    def local_numel(self) -> int:
        return math.prod(self.local_shape)

    def rank(self) -> int:
        return self.group.rank() if self.live else 0

    def valid_rows(self) -> int:
        """How many of this rank's shard rows hold the parameter (the rest is padding)."""
        return max(0, min(self.rows, self.rows_global - self.rank() * self.rows))

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's padded piece of the whole tensor ``full`` (a new tensor)."""
        flat = full.detach().reshape(self.rows_global, *self.shape[1:])
        start = self.rank() * self.rows
        piece = flat[start:start + self.rows]
        out = flat.new_zeros(self.local_shape)
        out[:piece.shape[0]] = piece
        return out

    def whole(self, padded: torch.Tensor) -> torch.Tensor:
        """The parameter's tensor from the ``size * rows`` gathered rows (padding cut)."""
        return padded[:self.rows_global].view(self.shape)

    def padded(self, grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``grad`` (the whole tensor's) as ``size * rows`` rows of ``dtype``, zero padded."""
        rows = grad.reshape(self.rows_global, *self.shape[1:])
        total = self.size * self.rows
        if total == self.rows_global:
            return rows if rows.dtype == dtype else rows.to(dtype)
        out = rows.new_zeros((total, *self.shape[1:]), dtype=dtype)
        out[:self.rows_global] = rows
        return out


@dataclass(eq=False, kw_only=True)
class ShardBucketSpec(CollectiveSpec):
    """A bucket of sharded parameters gathered, or of their gradients reduce-scattered,
    by one collective (the compiled path's form of :func:`shard_gather` and
    :func:`shard_reduce`). ``shards`` are the parameters' specs, in bucket order."""

    shards: tuple[ShardSpec, ...] = ()

    @property
    def total(self) -> int:
        return sum(s.local_numel for s in self.shards)

    def finish(self, buffer: torch.Tensor) -> None:
        """Wait for the collective; a reduce-scatter of hybrid sharding then averages the
        shards across the replicas (blocking, on the replicate dimension's group)."""
        CollectiveSpec.finish(self, buffer)
        first = self.shards[0]
        if (self.step.kind == "reduce_scatter" and first.replicate_group is not None
                and first.replicate_size > 1 and _sending()):
            collectives.all_reduce(buffer, group=first.replicate_group)
            buffer.mul_(1.0 / first.replicate_size)


def _alone(t: torch.Tensor) -> bool:
    """No tensor but ``t`` itself uses its memory (no view of it is alive anywhere)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:  # a torch without it: never reuse
        return False
    return use_count(t.untyped_storage()._cdata) <= 2  # ``t`` and the storage just made


def _dim0(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` with ``dim`` moved to the front, contiguous: the layout collectives send."""
    return (x if dim == 0 else x.movedim(dim, 0)).contiguous()


def _split_front(x: torch.Tensor, dim: int, parts: int) -> torch.Tensor:
    """``x`` cut into ``parts`` along ``dim``, the pieces stacked in front, contiguous."""
    shape = list(x.shape)
    shape[dim:dim + 1] = [parts, shape[dim] // parts]
    return x.reshape(shape).movedim(dim, 0).contiguous()


_lib = torch.library.Library("spmd", "DEF")
_lib.define("bucket_all_reduce(Tensor[] grads, int handle) -> Tensor")
_lib.define("wait(Tensor(a) tensor, int handle) -> Tensor(a)")
_lib.define("wait_cast(Tensor tensor, int handle) -> Tensor")
_lib.define("all_gather(Tensor x, int handle) -> Tensor")
_lib.define("reduce_scatter(Tensor x, int handle) -> Tensor")
_lib.define("all_to_all(Tensor x, int handle) -> Tensor")
_lib.define("local_redistribute(Tensor x, int handle) -> Tensor")
_lib.define("shard_gather(Tensor shard, int handle) -> Tensor")
_lib.define("shard_reduce(Tensor grad, int handle) -> Tensor")
_lib.define("bucket_all_gather(Tensor[] shards, int handle) -> Tensor")
_lib.define("unpack_gathered(Tensor flat, int handle) -> Tensor[]")
_lib.define("bucket_reduce_scatter(Tensor[] grads, int handle) -> Tensor")


def _bucket_all_reduce(grads: list[torch.Tensor], handle: int) -> torch.Tensor:
    s: CollectiveSpec = lookup(handle)
    active = s.active
    hook = s.sync.comm_hook if s.sync is not None else None
    # averaged by pre-dividing, then summing; a communication hook gets the sums and
    # averages itself, as torch's DDP hooks do
    average = active and s.step.src.reduce_op == "avg" and hook is None
    dtype = s.wire_dtype or grads[0].dtype
    if hook is not None:
        dtype = grads[0].dtype  # the hook chooses what goes on the wire
    numel = sum(g.numel() for g in grads)
    out = s.buffer("flat", numel, dtype, grads[0].device)
    flat = s.keep("flat", pack_planned(grads, 1.0 / s.size if average else 1.0, dtype, out))
    if active:
        issued = time.perf_counter()
        s.started(flat, reduction.start_bucket(s, flat, grads), issued)
        if s.result_dtype is None and s.sync is not None:
            s.sync.record(s, flat)
    return flat


def _wait(tensor: torch.Tensor, handle: int) -> torch.Tensor:
    lookup(handle).finish(tensor)
    return tensor


def _wait_cast(tensor: torch.Tensor, handle: int) -> torch.Tensor:
    s: CollectiveSpec = lookup(handle)
    s.finish(tensor)
    old = s.buffer("cast", tensor.numel(), s.result_dtype, tensor.device)
    out = s.keep("cast", old.copy_(tensor) if old is not None else tensor.to(s.result_dtype))
    if s.active and s.sync is not None:
        s.sync.record(s, out)
    return out


def _all_gather(x: torch.Tensor, handle: int) -> torch.Tensor:
    s: CollectiveSpec = lookup(handle)
    src = _dim0(x, s.step.src.dim)
    if not s.live:
        return torch.cat([src] * s.size)
    from spmd.runtime.collectives import all_gather_into_tensor

    out = src.new_empty((src.shape[0] * s.size, *src.shape[1:]))
    issued = time.perf_counter()
    s.started(out, all_gather_into_tensor(out, src, group=s.group, async_op=True), issued)
    return out


def _reduce_scatter(x: torch.Tensor, handle: int) -> torch.Tensor:
    s: CollectiveSpec = lookup(handle)
    src = _dim0(x, s.step.dst.dim)
    if not s.live:
        piece = src.chunk(s.size)[0]
        return piece.clone() if s.step.src.reduce_op == "avg" else piece * s.size
    from spmd.runtime.collectives import ReduceOp, reduce_scatter_tensor

    out = src.new_empty((src.shape[0] // s.size, *src.shape[1:]))
    op = ReduceOp.AVG if s.step.src.reduce_op == "avg" else ReduceOp.SUM
    issued = time.perf_counter()
    s.started(out, reduce_scatter_tensor(out, src, op=op, group=s.group, async_op=True), issued)
    return out


def _all_to_all(x: torch.Tensor, handle: int) -> torch.Tensor:
    s: CollectiveSpec = lookup(handle)
    src = _split_front(x, s.step.dst.dim, s.size)
    if not s.live:
        return src.clone()
    from spmd.runtime.collectives import all_to_all_single

    out = torch.empty_like(src)
    issued = time.perf_counter()
    s.started(out, all_to_all_single(out, src, group=s.group, async_op=True), issued)
    return out


def _local_redistribute(x: torch.Tensor, handle: int) -> torch.Tensor:
    s: CollectiveSpec = lookup(handle)
    rank = s.group.rank() if s.live else 0
    kind = s.step.kind
    if kind == "slice":
        return x.chunk(s.size, dim=s.step.dst.dim)[rank].clone()
    if kind == "zero":
        return x.clone() if rank == 0 else torch.zeros_like(x)
    return table.simulate(s.step, [x] * s.size)[0]  # "scale": the same factor on every rank


def _shard_gather(shard: torch.Tensor, handle: int) -> torch.Tensor:
    """The whole parameter from every rank's shard, in ``param_dtype``: one blocking
    all-gather (the eager form; compiled graphs bucket and overlap it instead)."""
    s: ShardSpec = lookup(handle)
    s.eager = True  # planned graphs run bucket_all_gather instead: this read is eager
    src = shard.detach().to(s.gather_dtype).contiguous()
    if not s.live:  # a simulated mesh: every rank is taken to hold this shard
        return s.whole(torch.cat([src] * s.size)).clone()
    from spmd.runtime.collectives import all_gather_into_tensor

    out = src.new_empty((s.size * s.rows, *src.shape[1:]))
    all_gather_into_tensor(out, src, group=s.group)
    return s.whole(out)


def _shard_reduce(grad: torch.Tensor, handle: int) -> torch.Tensor:
    """This rank's shard of the gradient averaged over every rank's batch: one blocking
    reduce-scatter in ``reduce_dtype`` (and an all-reduce across replicas for hybrid
    sharding), returned in the parameter's dtype."""
    s: ShardSpec = lookup(handle)
    wire = s.reduce_dtype or grad.dtype
    padded = s.padded(grad.detach(), wire)
    if not s.live:
        out = padded[:s.rows].clone()
    else:
        from spmd.runtime.collectives import reduce_scatter_tensor

        out = padded.new_empty(s.local_shape)
        reduce_scatter_tensor(out, padded.mul(1.0 / s.size), group=s.group)
    if s.replicate_group is not None and s.replicate_size > 1 and _sending():
        collectives.all_reduce(out, group=s.replicate_group)
        out.mul_(1.0 / s.replicate_size)
    return out.to(s.dtype)


def _bucket_all_gather(shards: list[torch.Tensor], handle: int) -> torch.Tensor:
    """Start one all-gather of a bucket of shards: each rank's shards packed into one flat
    buffer (cast to ``param_dtype`` on the way); the result is ``size`` such buffers."""
    s: ShardBucketSpec = lookup(handle)
    dtype = s.shards[0].gather_dtype
    flat = pack_planned(shards, 1.0, dtype)
    if not s.live:
        return flat.repeat(s.size)
    from spmd.runtime.collectives import all_gather_into_tensor

    out = flat.new_empty(s.size * flat.numel())
    issued = time.perf_counter()
    s.started(out, all_gather_into_tensor(out, flat, group=s.group, async_op=True), issued)
    return out


def _unpack_gathered(flat: torch.Tensor, handle: int) -> list[torch.Tensor]:
    """The whole parameters out of a gathered bucket: rank r's rows of parameter i sit at
    ``[r, offset_i : offset_i + n_i]`` of the ``(size, total)`` buffer."""
    s: ShardBucketSpec = lookup(handle)
    grid = flat.view(s.size, s.total)
    out, offset = [], 0
    for shard in s.shards:
        n = shard.local_numel
        rows = grid[:, offset:offset + n].reshape(s.size * shard.rows, *shard.shape[1:])
        out.append(shard.whole(rows))
        offset += n
    return out


def _bucket_reduce_scatter(grads: list[torch.Tensor], handle: int) -> torch.Tensor:
    """Start one reduce-scatter of a bucket of gradients: each laid out so rank r's rows
    of every parameter are contiguous (``(size, total)``), padded, pre-divided by the
    number of ranks and cast to the wire dtype in the same copy."""
    s: ShardBucketSpec = lookup(handle)
    wire = s.wire_dtype or grads[0].dtype
    if not s.live:  # every rank is taken to hold these gradients: the average is them
        pieces = [sh.padded(g, wire)[:sh.rows].reshape(-1) for sh, g in zip(s.shards, grads)]
        return torch.cat(pieces)
    grid = torch.empty((s.size, s.total), dtype=wire, device=grads[0].device)
    offset = 0
    for shard, g in zip(s.shards, grads):
        n = shard.local_numel
        grid[:, offset:offset + n].view(s.size, shard.rows, -1).copy_(
            shard.padded(g, g.dtype).view(s.size, shard.rows, -1))
        offset += n
    grid.mul_(1.0 / s.size)
    from spmd.runtime.collectives import reduce_scatter_tensor

    out = grid.new_empty(s.total)
    issued = time.perf_counter()
    s.started(out, reduce_scatter_tensor(out, grid.view(-1), group=s.group, async_op=True),
              issued)
    return out


def _fake_shard_gather(shard: torch.Tensor, handle: int) -> torch.Tensor:
    s: ShardSpec = lookup(handle)
    return shard.new_empty(s.shape, dtype=s.gather_dtype)


def _fake_shard_reduce(grad: torch.Tensor, handle: int) -> torch.Tensor:
    s: ShardSpec = lookup(handle)
    return grad.new_empty(s.local_shape, dtype=s.dtype)


def _fake_bucket_all_gather(shards: list[torch.Tensor], handle: int) -> torch.Tensor:
    s: ShardBucketSpec = lookup(handle)
    return shards[0].new_empty((s.size * s.total,), dtype=s.shards[0].gather_dtype)


def _fake_unpack_gathered(flat: torch.Tensor, handle: int) -> list[torch.Tensor]:
    s: ShardBucketSpec = lookup(handle)
    return [flat.new_empty(sh.shape) for sh in s.shards]


def _fake_bucket_reduce_scatter(grads: list[torch.Tensor], handle: int) -> torch.Tensor:
    s: ShardBucketSpec = lookup(handle)
    return grads[0].new_empty((s.total,), dtype=s.wire_dtype or grads[0].dtype)


def _fake_bucket_all_reduce(grads: list[torch.Tensor], handle: int) -> torch.Tensor:
    s: CollectiveSpec = lookup(handle)
    numel = sum(g.numel() for g in grads)
    return grads[0].new_empty((numel,), dtype=s.wire_dtype or grads[0].dtype)


def _fake_wait(tensor: torch.Tensor, handle: int) -> torch.Tensor:
    return tensor


def _fake_wait_cast(tensor: torch.Tensor, handle: int) -> torch.Tensor:
    return tensor.new_empty(tensor.shape, dtype=lookup(handle).result_dtype)


def _fake_all_gather(x: torch.Tensor, handle: int) -> torch.Tensor:
    s: CollectiveSpec = lookup(handle)
    src = x.movedim(s.step.src.dim, 0)
    return x.new_empty((src.shape[0] * s.size, *src.shape[1:]))


def _fake_reduce_scatter(x: torch.Tensor, handle: int) -> torch.Tensor:
    s: CollectiveSpec = lookup(handle)
    src = x.movedim(s.step.dst.dim, 0)
    return x.new_empty((src.shape[0] // s.size, *src.shape[1:]))


def _fake_all_to_all(x: torch.Tensor, handle: int) -> torch.Tensor:
    s: CollectiveSpec = lookup(handle)
    shape = list(x.shape)
    dim = s.step.dst.dim
    shape[dim:dim + 1] = [shape[dim] // s.size]
    return x.new_empty((s.size, *shape))


def _fake_local_redistribute(x: torch.Tensor, handle: int) -> torch.Tensor:
    s: CollectiveSpec = lookup(handle)
    if s.step.kind == "slice":
        return x.chunk(s.size, dim=s.step.dst.dim)[0].clone()
    return torch.empty_like(x)


_KERNELS = {  # op name -> (Python implementation, fake kernel)
    "bucket_all_reduce": (_bucket_all_reduce, _fake_bucket_all_reduce),
    "wait": (_wait, _fake_wait),
    "wait_cast": (_wait_cast, _fake_wait_cast),
    "all_gather": (_all_gather, _fake_all_gather),
    "reduce_scatter": (_reduce_scatter, _fake_reduce_scatter),
    "all_to_all": (_all_to_all, _fake_all_to_all),
    "local_redistribute": (_local_redistribute, _fake_local_redistribute),
    "shard_gather": (_shard_gather, _fake_shard_gather),
    "shard_reduce": (_shard_reduce, _fake_shard_reduce),
    "bucket_all_gather": (_bucket_all_gather, _fake_bucket_all_gather),
    "unpack_gathered": (_unpack_gathered, _fake_unpack_gathered),
    "bucket_reduce_scatter": (_bucket_reduce_scatter, _fake_bucket_reduce_scatter),
}
for _name, (_impl, _fake) in _KERNELS.items():
    _lib.impl(_name, _impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"spmd::{_name}", _fake, lib=_lib)

bucket_all_reduce = torch.ops.spmd.bucket_all_reduce.default
wait = torch.ops.spmd.wait.default
wait_cast = torch.ops.spmd.wait_cast.default
all_gather = torch.ops.spmd.all_gather.default
reduce_scatter = torch.ops.spmd.reduce_scatter.default
all_to_all = torch.ops.spmd.all_to_all.default
local_redistribute = torch.ops.spmd.local_redistribute.default
shard_gather = torch.ops.spmd.shard_gather.default
shard_reduce = torch.ops.spmd.shard_reduce.default
bucket_all_gather = torch.ops.spmd.bucket_all_gather.default
unpack_gathered = torch.ops.spmd.unpack_gathered.default
bucket_reduce_scatter = torch.ops.spmd.bucket_reduce_scatter.default


def _gather_context(ctx: Any, inputs: tuple, output: Any) -> None:
    ctx.handle = inputs[1]


def _gather_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return shard_reduce(grad, ctx.handle), None


# a sharded parameter's gradient leaves its gather as the reduce-scatter of its gradient:
# autograd (eager) and AOTAutograd (compiled) both see the pair
torch.library.register_autograd("spmd::shard_gather", _gather_backward,
                                setup_context=_gather_context, lib=_lib)

COLLECTIVE_OPS = {"all_reduce": bucket_all_reduce, "all_gather": all_gather,
                  "reduce_scatter": reduce_scatter, "all_to_all": all_to_all}
# the bucketed parameter collectives of sharded strategies
SHARD_OPS = {"all_gather": bucket_all_gather, "reduce_scatter": bucket_reduce_scatter}
WAIT_OPS = (wait, wait_cast)
_OPS = {getattr(torch.ops.spmd, name).default: kernels for name, kernels in _KERNELS.items()}
FAKES = {op: fake for op, (_, fake) in _OPS.items()}
# the Python implementations, for the emitter (one call instead of the dispatcher's)
IMPLEMENTATIONS = {op: impl for op, (impl, _) in _OPS.items()}
