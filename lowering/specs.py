"""The runtime half of a plan: what each collective node of a planned graph does when it
runs, reached from the graph by an integer handle.

A :class:`CollectiveSpec` holds a collective's group, scale, wire dtype, the owner's sync
switch (:class:`SyncState`) and the work in flight; a :class:`ShardSpec` one parameter
stored as its dim-0 shard; a :class:`ShardBucketSpec` a bucket of those gathered or
reduce-scattered together. Specs belong to the parallelized model or step that planned
them (its :class:`Handles`); the process-wide table only maps handles to specs weakly,
so a model that is collected takes its specs, groups and optimizers with it.
:func:`dry_run` makes this thread's collectives act as on a simulated mesh.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from spmd.kernels.layout import BucketTables
from spmd.lowering import redistribute as table
from spmd.lowering.placements import Placement, Shard, Sharding, StridedShard, divides
from spmd.runtime import collectives

__all__ = ["CollectiveSpec", "ShardSpec", "ShardBucketSpec", "TPSpec", "PlaceSpec", "RankSpec",
           "SyncState",
           "Handles",
           "lookup", "dry_run", "sending", "gather_rows"]

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


def sending() -> bool:
    """False inside :func:`dry_run`: collectives then move nothing."""
    return not getattr(_DRY, "on", False)


def gather_rows(src: torch.Tensor, size: int, group: Any) -> torch.Tensor:
    """Every rank's ``src`` stacked along dim 0 (``size * len(src)`` rows): one blocking
    all-gather over ``group``, or on a simulated mesh (None, or inside :func:`dry_run`)
    this rank's ``src`` repeated. The one "whole tensor from the pieces" of eager code."""
    src = src.detach().contiguous()
    if group is None or size == 1 or not sending():
        return torch.cat([src] * size)
    out = src.new_empty((src.shape[0] * size, *src.shape[1:]))
    collectives.all_gather_into_tensor(out, src, group=group)
    return out


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

    enabled: bool = True  # the switch no_sync() turns off
    # the switch as the last training forward found it: whether that forward's backward
    # averages (DDP decides at forward time too, so no_sync() around backward() alone
    # changes nothing)
    backward: bool = True
    track: bool = True
    profiler: Any = None  # set while a profile records this model's steps
    comm_hook: Any = None  # a torch DDP communication hook: hook(state, bucket) -> Future
    comm_state: Any = None
    reduced: dict[int, tuple["CollectiveSpec", torch.Tensor]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def begin_step(self) -> None:
        """A training forward: decide whether its backward averages, forget the last."""
        self.backward = self.enabled
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
    algorithm: str = "native"  # "native", "fp32" or "hierarchical" (spmd.lowering.reduction)
    compress: torch.dtype | None = None  # the "fp32" algorithm's wire dtype
    index: int = 0  # a gradient bucket's index, for communication hooks
    last: bool = False  # the graph's last gradient bucket
    pending: dict[int, tuple[Any, Any]] = field(default_factory=dict)  # storage -> work
    lock: threading.Lock = field(default_factory=threading.Lock)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    tables: BucketTables = field(default_factory=BucketTables, repr=False)  # kernel launches

    @property
    def live(self) -> bool:
        return self.group is not None and self.size > 1 and sending()

    @property
    def active(self) -> bool:
        return self.live and (self.sync is None or self.sync.backward)

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
    """One parameter stored as its shard (``strategy="fsdp"``, ``"hsdp"``, ``"zero1"``,
    ``"zero2"``).

    The global tensor of shape ``shape`` is cut along ``dim`` (0 unless
    ``shard_placement_fn`` chose another) into ``size`` pieces of ``rows`` rows each, the
    last ones padded with zeros where dim 0 does not divide (as FSDP2 does; another
    dimension is chosen only where it divides); a 0-dim parameter is one row. Each rank
    stores its piece, shape :attr:`local_shape`. The parameter's uses read :func:`shard_gather` of the shard (the
    whole tensor, in ``param_dtype``); its gradient leaves through :func:`shard_reduce`
    (the average over the ranks' batches, reduce-scattered in ``reduce_dtype``, and with
    ``replicate_group`` also averaged across the replicas: hybrid sharding).

    Attributes:
        param: the parameter's name in the model.
        sharding: where it is stored on every mesh dimension (the record
            ``spmd.placement_of`` returns): ``Shard(dim)`` on ``mesh_dim``, and its
            tensor-parallel placements, if any; the spec checks that its own fields agree.
        shape: its global shape; ``dtype``: the dtype it is stored and stepped in.
        rows: rows of the sharded dimension per rank (padded).
        dim: the sharded dimension.
        group, size: the process group the shards are spread over (None: a simulated
            mesh) and its size; ``mesh_dim`` its name.
        replicate_group, replicate_size, replicate_dim: hybrid sharding's other dimension.
        param_dtype: the dtype it is gathered and computed in (None: ``dtype``).
        reduce_dtype: the dtype its gradient is reduced in (None: the gradient's).
        persistent: the gathered whole is kept until the shard changes (``zero1``,
            ``zero2``: gathered once per optimizer step, not at every use).
        all_reduce: the gradient is all-reduced whole and this rank keeps its rows
            (``zero1``) rather than reduce-scattered.
        regroup_size, regroup: ``reshard_after_forward=N``: after the forward's gather
            this rank keeps :meth:`part_of` the whole (1/N of it, its place among the N
            consecutive ranks of ``regroup``, None for N = 1) and the backward gathers
            the parts among those N ranks; 0 for every other strategy.
    """

    param: str
    sharding: Sharding
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
    persistent: bool = False
    all_reduce: bool = False
    dim: int = 0
    regroup_size: int = 0
    regroup: Any = None
    eager: bool = False  # gathered outside any planned graph at least once
    # persistent: where this parameter's last gather lies, (version key, flat, total,
    # offset): columns [offset, offset + local_numel) of ``flat`` viewed (size, total)
    # hold every rank's shard. Whichever graph (or eager read) gathered it, every other
    # reads it from there until the shard changes: one kept copy, and a decision every
    # rank makes alike (it depends on the parameters' versions only, not on which
    # graphs a rank compiled)
    held: Any = field(default=None, repr=False)
    # reshard_after_forward=N: (version key of the shard, this rank's part of the whole)
    # from the last forward, until a backward takes it
    part: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        mesh = self.sharding.mesh
        placed = self.sharding[self.mesh_dim]
        if placed != Shard(self.dim) or mesh.size(self.mesh_dim) != self.size:
            raise ValueError(f"ShardSpec of {self.param}: stored {self.sharding}, but the "
                             f"spec cuts it Shard({self.dim}) over {self.size} ranks of "
                             f"{self.mesh_dim!r}")
        if self.replicate_dim and mesh.size(self.replicate_dim) != self.replicate_size:
            raise ValueError(f"ShardSpec of {self.param}: {self.replicate_size} replicas, "
                             f"but {self.replicate_dim!r} has {mesh.size(self.replicate_dim)}")

    @property
    def live(self) -> bool:
        return self.group is not None and self.size > 1 and sending()

    @property
    def local_shape(self) -> tuple[int, ...]:
        if not self.shape:
            return (self.rows,)
        return (*self.shape[:self.dim], self.rows, *self.shape[self.dim + 1:])

    @property
    def rows_global(self) -> int:
        """Rows of the sharded dimension of the whole tensor (1 for a 0-dim parameter)."""
        return self.shape[self.dim] if self.shape else 1

    @property
    def gather_dtype(self) -> torch.dtype:
        return self.param_dtype or self.dtype

    @property
    def local_numel(self) -> int:
        return math.prod(self.local_shape)

    def rank(self) -> int:
        return self.group.rank() if self.live else 0

    def follow(self, stored: torch.Tensor) -> None:
        """Take the dtype of the tensor this rank stores, after the module was converted
        (``model.double()``, ``model.to(dtype)``): gathers come out, and gradients are
        reduced into, the new dtype; a kept gather of the old values is dropped."""
        if stored.dtype != self.dtype:
            self.dtype = stored.dtype
            self.held = None

    def check_stored(self, stored: torch.Tensor) -> None:
        """``stored`` is this rank's shard as the spec says, in shape; its dtype is followed
        (``p.data = p.data.double()``). ``ValueError`` naming the parameter otherwise: a
        whole tensor assigned to the stored shard's ``.data`` would be cut wrongly."""
        if tuple(stored.shape) != self.local_shape:
            raise ValueError(
                f"{self.param} stores a tensor of shape {tuple(stored.shape)}, where this "
                f"rank stores its shard {self.local_shape} of the whole {self.shape}: set the "
                f"whole parameter through the module attribute (model.{self.param}.data = w, "
                f"or copy_ under torch.no_grad()) or load_state_dict, not through the "
                f".data of model.parameters(), which are the shards")
        self.follow(stored)

    def valid_rows(self) -> int:
        """How many of this rank's shard rows hold the parameter (the rest is padding)."""
        return max(0, min(self.rows, self.rows_global - self.rank() * self.rows))

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's padded piece of the whole tensor ``full`` (a new tensor)."""
        return self._cut(full, self.rows, self.rank())

    def _cut(self, full: torch.Tensor, rows: int, index: int) -> torch.Tensor:
        """Rows ``[index * rows, (index + 1) * rows)`` of the sharded dimension of
        ``full`` (the whole tensor), zero padded past its end (a new tensor)."""
        front = full.detach().reshape(self.shape or (1,)).movedim(self.dim, 0)
        start = index * rows
        piece = front[start:start + rows]
        out = front.new_zeros((rows, *front.shape[1:]))
        out[:piece.shape[0]] = piece
        return out.movedim(0, self.dim).contiguous() if self.dim else out

    def positions(self, dim: int, idx: torch.Tensor) -> torch.Tensor:
        """The entries of ``idx`` (positions along dimension ``dim`` of the tensor this
        spec cuts) that this rank's shard holds, in its order, padding left out:
        :meth:`shard_of` along one dimension (what a checkpoint records as offsets)."""
        if dim != self.dim or not self.shape:
            return idx
        start = self.rank() * self.rows
        return idx[start:start + self.rows]

    def whole(self, gathered: torch.Tensor) -> torch.Tensor:
        """The parameter's tensor from every rank's shard laid end to end, rank by rank
        (``size * local_numel`` elements; the padding cut)."""
        if self.dim == 0:
            rows = gathered.reshape(self.size * self.rows, *self.local_shape[1:])
            return rows[:self.rows_global].view(self.shape)
        stacked = gathered.reshape(self.size, *self.local_shape)  # (no padding off dim 0)
        return stacked.movedim(0, self.dim).reshape(self.shape)

    def rank_part(self, laid_out: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s shard out of a tensor laid out as :meth:`padded` lays one."""
        return laid_out.reshape(self.size, -1)[rank].view(self.local_shape)

    def gather(self, shard: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole tensor from every rank's ``shard`` (of this parameter, or laid out
        like it, such as its gradient), in ``dtype`` (default: ``shard``'s): a blocking
        all-gather every rank must join."""
        src = shard.detach() if dtype is None else shard.detach().to(dtype)
        return self.whole(gather_rows(src, self.size, self.group if self.live else None))

    def held_columns(self, shard: torch.Tensor) -> torch.Tensor | None:
        """Every rank's shard as last gathered, ``(size, local_numel)``, if ``shard`` has
        not changed since (a persistent spec); else None."""
        if self.held is None:
            return None
        key, flat, total, offset = self.held
        if key != _version_key(shard):
            return None
        return flat.view(self.size, total)[:, offset:offset + self.local_numel]

    def keep(self, shard: torch.Tensor, flat: torch.Tensor, total: int, offset: int) -> None:
        """Remember that ``flat`` (``(size, total)``, columns from ``offset``) holds this
        parameter's gather of ``shard`` as it is now. Not inside :func:`dry_run`: what a
        timing run "gathers" there is this rank's shard repeated, never to be read as the
        parameter."""
        if sending():
            self.held = (_version_key(shard), flat, total, offset)

    def padded(self, grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``grad`` (the whole tensor's) in ``dtype`` laid out rank by rank: rank r's shard
        is the r-th of ``size`` equal contiguous parts (zero padded), as a reduce-scatter
        takes it."""
        if self.dim:
            parts = grad.reshape(self.shape).to(dtype).chunk(self.size, dim=self.dim)
            return torch.stack(parts)
        rows = grad.reshape(self.rows_global, *self.shape[1:])
        total = self.size * self.rows
        if total == self.rows_global:
            return rows if rows.dtype == dtype else rows.to(dtype)
        out = rows.new_zeros((total, *self.shape[1:]), dtype=dtype)
        out[:self.rows_global] = rows
        return out

    # -- reshard_after_forward=N: a part of the whole kept from forward to backward ----

    @property
    def part_rows(self) -> int:
        """Rows of the sharded dimension in each of the N parts (padded)."""
        return -(-self.rows_global // self.regroup_size)

    def part_of(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's part of the whole tensor among its N ranks (a new tensor)."""
        index = self.regroup.rank() if self.regroup is not None else 0
        return self._cut(whole, self.part_rows, index)

    def keep_part(self, key: tuple[int, int], whole: torch.Tensor) -> None:
        """Keep this rank's part of ``whole``, gathered from the shard whose version key
        was ``key``, for the backward's gather among N ranks. Not inside
        :func:`dry_run`, whose "gathers" are this rank's shard repeated."""
        if self.regroup_size and self.live:
            self.part = (key, self.part_of(whole))

    def take_part(self, shard: torch.Tensor) -> torch.Tensor | None:
        """The part kept by the last forward, if ``shard`` has not changed since (else
        None: the backward gathers every rank's shard); it is handed over once, and no
        longer held here."""
        kept, self.part = self.part, None
        if kept is None or kept[0] != _version_key(shard):
            return None
        return kept[1]

    def whole_from_parts(self, parts: torch.Tensor) -> torch.Tensor:
        """The whole tensor from the N ranks' parts laid end to end, rank by rank."""
        shape = list(self.shape or (1,))
        shape[self.dim] = self.part_rows
        joined = torch.cat(list(parts.reshape(self.regroup_size, *shape)), dim=self.dim)
        return joined.narrow(self.dim, 0, self.rows_global).reshape(self.shape)


@dataclass(eq=False, kw_only=True)
class ShardBucketSpec(CollectiveSpec):
    """A bucket of sharded parameters gathered, or of their gradients reduce-scattered,
    by one collective (the compiled path's form of :func:`shard_gather` and
    :func:`shard_reduce`). ``shards`` are the parameters' specs, in bucket order."""

    shards: tuple[ShardSpec, ...] = ()
    # reshard_after_forward=N: a forward gather keeps each parameter's part after it
    # (``keeps_parts``, the shards' version keys in ``versions``); a backward gather
    # gathers those parts among N ranks instead (``regathers``; ``regathered`` counts it)
    keeps_parts: bool = False
    regathers: bool = False
    regathered: int = 0
    versions: tuple = field(default=(), repr=False)
    # a persistent gather in a graph Inductor compiles hands out copies of what it holds
    # (Inductor may reuse a returned buffer's memory once the graph is done reading it)
    copy_held: bool = False
    last: Any = field(default=None, repr=False)  # persistent: this bucket's last result
    choice: str = ""  # why its algorithm (flat or two-level across hosts), for provenance
    # hybrid sharding: the replicas' all-reduce runs right after the reduce-scatter, on a
    # thread of its own (spmd.runtime.hierarchical.then_all_reduce), not at the wait
    chained: bool = False

    @property
    def total(self) -> int:
        return sum(s.local_numel for s in self.shards)

    def held_result(self, shards: list[torch.Tensor]) -> torch.Tensor | None:
        """A persistent gather's result without communicating, when none of ``shards``
        changed since it was last gathered, by any graph (every rank steps the same
        parameters and gathers each after a step, so every rank decides alike): this
        bucket's own last result, or one laid out from where each parameter lies."""
        if not self.shards[0].persistent:
            return None
        columns = [spec.held_columns(t) for spec, t in zip(self.shards, shards)]
        if any(c is None for c in columns):
            return None
        if self.last is not None and all(
                spec.held[1] is self.last and spec.held[3] == offset
                for spec, offset in zip(self.shards, self.offsets)):
            return self.last.clone() if self.copy_held else self.last
        out = columns[0].new_empty(self.size * self.total)
        for target, c in zip(self.columns(out), columns):
            target.copy_(c)
        return out

    def hold(self, shards: list[torch.Tensor], result: torch.Tensor) -> torch.Tensor:
        """Remember ``result`` (being gathered) as where each of ``shards`` lies now."""
        if self.shards[0].persistent and sending():  # (see ShardSpec.keep)
            for spec, t, offset in zip(self.shards, shards, self.offsets):
                spec.keep(t, result, self.total, offset)
            self.last = result
        return result

    @functools.cached_property
    def offsets(self) -> tuple[int, ...]:
        """Where each parameter's columns start in a ``(size, total)`` bucket buffer."""
        return tuple(itertools.accumulate((s.local_numel for s in self.shards[:-1]),
                                          initial=0))

    def columns(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's ``(size, local_numel)`` columns of a bucket buffer ``flat``
        (``size * total`` elements, rank r's shards in row r)."""
        grid = flat.view(self.size, self.total)
        return [grid[:, o:o + s.local_numel] for s, o in zip(self.shards, self.offsets)]

    def finish(self, buffer: torch.Tensor) -> None:
        """Wait for the collective; a reduce-scatter of hybrid sharding then averages the
        shards across the replicas: chained after it on its own thread where the bucket
        started it so (``chained``), else here (blocking, on the replicate dimension's
        group)."""
        CollectiveSpec.finish(self, buffer)
        if self.chained:
            return
        first = self.shards[0]
        if (self.step.kind == "reduce_scatter" and first.replicate_group is not None
                and first.replicate_size > 1 and sending()):
            collectives.all_reduce(buffer, group=first.replicate_group)
            buffer.mul_(1.0 / first.replicate_size)


def _version_key(t: torch.Tensor) -> tuple[int, int]:
    """What changes when a tensor is written (in place or through ``.data``)."""
    return (t.untyped_storage().data_ptr(), t._version)


@dataclass(eq=False, kw_only=True)
class RankSpec:
    """A rank's coordinate along one mesh dimension, for an op whose ranks compute
    differently (a vocabulary-parallel lookup keeps the rows of its own range). ``group``
    None: a simulated mesh (every rank computes as the first)."""

    dim: str
    size: int
    group: Any = None

    def rank(self) -> int:
        return 0 if self.group is None else self.group.rank()


@dataclass(eq=False, kw_only=True)
class PlaceSpec:
    """Where one module's output activation is placed (sequence parallelism: ``Shard(1)``
    on "tp"), and its gradient with it: the activation's :class:`Sharding` along the
    tensor-parallel dimensions ``dims`` (the others are left to the compiler). ``module``
    names it in plans and errors."""

    module: str
    sharding: Sharding
    dims: tuple[str, ...]

    @functools.cached_property
    def placements(self) -> dict[str, Placement]:
        """The placement on each dimension of :attr:`dims`."""
        return {d: self.sharding[d] for d in self.dims}


@dataclass(eq=False, kw_only=True)
class TPSpec:
    """One tensor-parallel parameter: its whole shape, where it is stored (its
    :class:`Sharding`, the same record ``spmd.placement_of`` returns), the tensor-parallel
    dimensions ``dims`` this spec cuts it along, and the process groups along them (None:
    a simulated mesh)."""

    param: str
    shape: tuple[int, ...]
    sharding: Sharding
    dims: tuple[str, ...]
    groups: dict[str, Any] = field(default_factory=dict)

    @functools.cached_property
    def placements(self) -> dict[str, Placement]:
        """The placement on each tensor-parallel dimension."""
        return {d: self.sharding[d] for d in self.dims}

    @functools.cached_property
    def sizes(self) -> dict[str, int]:
        """Ranks along each tensor-parallel dimension."""
        return {d: self.sharding.mesh.size(d) for d in self.dims}

    def rank(self, dim: str) -> int:
        group = self.groups.get(dim)
        return 0 if group is None else group.rank()

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.shape)
        for dim, p in self.placements.items():
            if divides(p):
                shape[p.dim] //= self.sizes[dim]
        return tuple(shape)

    def piece(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a whole tensor laid out like the parameter (a view; a
        copy for a ``StridedShard``, whose piece is one part of each block)."""
        out = full
        for dim, p in self.placements.items():
            if p.is_shard():
                out = out.chunk(self.sizes[dim], dim=p.dim)[self.rank(dim)]
            elif isinstance(p, StridedShard):
                blocked = out.reshape(p.blocks(out.shape))
                out = blocked.chunk(self.sizes[dim], dim=p.dim + 1)[self.rank(dim)].flatten(
                    p.dim, p.dim + 1)
        return out

    def positions(self, dim: int, idx: torch.Tensor) -> torch.Tensor:
        """The entries of ``idx`` (positions along dimension ``dim`` of the whole tensor)
        that this rank's piece holds, in its order: :meth:`piece` along one dimension."""
        rank = max(len(self.shape), 1)
        for mesh_dim, p in self.placements.items():
            if not divides(p) or p.dim % rank != dim:
                continue
            if p.is_shard():
                idx = idx.chunk(self.sizes[mesh_dim])[self.rank(mesh_dim)]
            else:
                idx = idx.reshape(p.split, -1).chunk(self.sizes[mesh_dim], dim=1)[
                    self.rank(mesh_dim)].flatten()
        return idx

    def whole(self, local: torch.Tensor) -> torch.Tensor:
        """The whole tensor from every rank's piece: a blocking all-gather along each
        sharded dimension (on a simulated mesh, this piece repeated)."""
        out = local.detach()
        for dim, p in self.placements.items():
            if p.is_shard():
                front = gather_rows(out.movedim(p.dim, 0), self.sizes[dim],
                                    self.groups.get(dim))
                out = front.movedim(0, p.dim)
            elif isinstance(p, StridedShard):  # every rank's part of each block, in order
                blocked = out.reshape(p.blocks(out.shape)).movedim(p.dim + 1, 0)
                front = gather_rows(blocked.contiguous(), self.sizes[dim],
                                    self.groups.get(dim))
                out = front.movedim(0, p.dim + 1).flatten(p.dim, p.dim + 1)
        return out.contiguous()


def _alone(t: torch.Tensor) -> bool:
    """No tensor but ``t`` itself uses its memory (no view of it is alive anywhere)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:  # a torch without it: never reuse
        return False
    return use_count(t.untyped_storage()._cdata) <= 2  # ``t`` and the storage just made
