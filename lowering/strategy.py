"""Strategies say where the inputs of a graph live on the mesh; the passes do the rest.

A strategy names the mesh dimensions it uses and, for each input of a graph (parameter,
buffer or data), its :class:`~spmd.lowering.placements.Sharding`; for each parameter,
where its gradient must end up. Everything else (the placements of every other value,
the collectives, the buckets) is derived by the passes.

- ``ddp``: on the data-parallel dimension (named ``"dp"``, or the mesh's only one) the
  batch is ``Shard(0)``, parameters and buffers ``Replicate()``; the model runs per rank
  (DDP's semantics) and each parameter's gradient, ``Partial("avg")``, must become
  ``Replicate()``.
- ``fsdp`` (ZeRO-3): on one dimension (named ``"fsdp"`` or ``"dp"``, or the mesh's only
  one) the batch is ``Shard(0)`` and so is every parameter: each rank stores one piece
  of dim 0. A use of a parameter reads it gathered (``Shard(0) -> Replicate()``, an
  all-gather); its gradient, ``Partial("avg")``, leaves as its shard
  (``Partial("avg") -> Shard(0)``, a reduce-scatter).
- ``hsdp``: ``fsdp`` along the ``"fsdp"`` dimension, replicated along ``"dp"`` (a 2-D
  mesh; without those names, its first dimension replicates and its second shards). The
  batch is split along both; gradients are reduce-scattered along ``"fsdp"`` and the
  shards averaged along ``"dp"``.
- ``zero2`` (DeepSpeed's ZeRO stage 2): stored as ``fsdp`` stores (so gradients and
  optimizer state are shards), but the gathered parameters are kept whole until the
  shards change: one all-gather per optimizer step, in the first forward after it.
- ``zero1`` (ZeRO stage 1): as ``zero2``, but each gradient is all-reduced whole and
  every rank keeps its own rows (what ``ZeroRedundancyOptimizer`` over DDP moves).

- ``fsdp``/``hsdp`` with ``reshard_after_forward=False`` (FSDP2's): gathered in the
  forward and kept for the backward (one gather per step instead of two; every layer's
  whole parameters alive at the end of the forward).
- ``fsdp``/``hsdp`` with ``reshard_after_forward=N`` (FSDP2's integer): after the
  forward's gather each rank keeps 1/N of the whole parameter, and the backward gathers
  it again among N ranks only (consecutive ranks of the sharding dimension: a host's,
  when N is the ranks per host) instead of all of them. ``N`` divides the sharding
  dimension; N equal to it is ``True``, 1 keeps the whole (``False``'s memory).

Each is one row of :data:`KINDS`, selected by ``strategy=`` and
``reshard_after_forward=``: whether it stores shards, when they are gathered
(:class:`Gathered`), how gradients leave the data dimension (:class:`Reduced`), whether
it is hybrid, which dimension names it prefers, whether ``strategy="auto"`` tries it.
The parameter layer (``spmd.state.layout``) turns those into one record per parameter, the
memory view, the option checks and the search's costs read the same fields; nothing
branches on the strategy's name.

Tensor parallelism composes with each: ``placements`` name, per mesh dimension, where
parameters live (``Shard(d)`` or ``Replicate()``); those dimensions (``tp_dims``) are
not data dimensions (every rank of one sees the same batch), and the placements of
everything computed from those parameters follow from the ops' rules.

A mesh dimension no strategy uses is refused when larger than 1, naming it: its ranks
would each repeat the same work, which is never what the user meant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Mapping

from spmd.lowering.state import InputInfo
from spmd.lowering.placements import Partial, Placement, Replicate, Shard, Sharding, divides
from spmd.runtime.mesh import Mesh

__all__ = ["Strategy", "StrategyKind", "Gathered", "Reduced", "KINDS", "kind_name", "kind_of",
           "row_argument",
           "resolve_strategy", "STRATEGIES", "tp_dims_of", "dims_to_flatten", "flatten_data_dims"]


class Gathered(StrEnum):
    """When a sharded parameter is gathered whole for compute (the value is how plans
    print it)."""

    EACH_USE = "each use"  # in every forward and again in backward (ZeRO-3)
    PER_FORWARD = "per forward, kept for backward"  # FSDP2's reshard_after_forward=False
    # FSDP2's reshard_after_forward=N: 1/N of the whole kept after the forward, gathered
    # again among N ranks in backward
    REGROUPED = "per forward, again in backward within a smaller group"
    PER_STEP = "per step"  # kept whole until the shards change (after the optimizer step)
    NEVER = "never"  # stored whole

    @property
    def gathers(self) -> int:
        """All-gathers of the whole parameter per training step (one forward, one
        backward; ``REGROUPED``'s second runs among fewer ranks, and counts as one where
        the group's size is not known)."""
        return {Gathered.EACH_USE: 2, Gathered.PER_FORWARD: 1, Gathered.REGROUPED: 2,
                Gathered.PER_STEP: 1, Gathered.NEVER: 0}[self]

    @property
    def holds_whole(self) -> bool:
        """The whole parameter is alive at the step's peak (the end of the forward)."""
        return self not in (Gathered.EACH_USE, Gathered.REGROUPED)


class Reduced(StrEnum):
    """How a parameter's gradient leaves the data dimensions (the value is how plans
    print it)."""

    ALL_REDUCE = "all-reduce"
    REDUCE_SCATTER = "reduce-scatter"
    ALL_REDUCE_OWN_ROWS = "all-reduce, own rows kept"  # ZeRO-1: the whole gradient, own rows kept
    NONE = "none"  # no data dimension of more than one rank

    @property
    def collective(self) -> str:
        """The collective that carries it (a cost model's kind)."""
        return "reduce_scatter" if self is Reduced.REDUCE_SCATTER else "all_reduce"

    @property
    def keeps_whole(self) -> bool:
        """Each rank holds the whole gradient (else its shard)."""
        return self is not Reduced.REDUCE_SCATTER


@dataclass(frozen=True, kw_only=True, slots=True)
class StrategyKind:
    """What a strategy does with parameters along its data dimension(s): one row of
    :data:`KINDS`, which the layout, the memory view, the search's costs and the option
    checks read.

    Attributes:
        strategy: the ``strategy=`` argument that selects this row.
        reshard_after_forward: the ``reshard_after_forward=`` argument that selects it
            (with ``strategy``): True, False, or ``int`` for the row of every integer.
        shards: parameters (so gradients and optimizer state) are stored as shards.
        gathered: when shards are gathered whole (:class:`Gathered`).
        reduced: how a gradient leaves (:class:`Reduced`).
        hybrid: shards along one dimension, replicas along another (``hsdp``): the search
            prices it along ``"fsdp"`` plus an all-reduce of the shards along ``"dp"``.
        preferred: the data dimension's names, in order of preference.
        searched: ``strategy="auto"`` tries it (hybrid rows: where two data dimensions
            have several ranks each; the others on one data dimension or two).
        searched_with_tp: ``strategy="auto"`` tries it beside tensor parallelism.
    """

    strategy: str
    reshard_after_forward: bool | type[int] = True
    shards: bool
    gathered: Gathered
    reduced: Reduced
    hybrid: bool = False
    preferred: tuple[str, ...] = ("dp",)
    searched: bool = False
    searched_with_tp: bool = False

    @property
    def arguments(self) -> dict[str, object]:
        """The ``parallelize`` keywords that select this row."""
        if self.reshard_after_forward is True:
            return {"strategy": self.strategy}
        if self.reshard_after_forward is int:
            return {"strategy": self.strategy, "reshard_after_forward": "N"}
        return {"strategy": self.strategy, "reshard_after_forward": self.reshard_after_forward}


# The rows, in the order strategy="auto" tries them.
KINDS: dict[str, StrategyKind] = {
    "ddp": StrategyKind(strategy="ddp", shards=False, gathered=Gathered.NEVER,
                        reduced=Reduced.ALL_REDUCE, searched=True, searched_with_tp=True),
    "fsdp": StrategyKind(strategy="fsdp", shards=True, gathered=Gathered.EACH_USE,
                         reduced=Reduced.REDUCE_SCATTER, preferred=("fsdp", "dp"),
                         searched=True, searched_with_tp=True),
    "hsdp": StrategyKind(strategy="hsdp", shards=True, gathered=Gathered.EACH_USE,
                         reduced=Reduced.REDUCE_SCATTER, hybrid=True, searched=True),
    "zero2": StrategyKind(strategy="zero2", shards=True, gathered=Gathered.PER_STEP,
                          reduced=Reduced.REDUCE_SCATTER, preferred=("dp", "fsdp"),
                          searched=True, searched_with_tp=True),
    "zero1": StrategyKind(strategy="zero1", shards=True, gathered=Gathered.PER_STEP,
                          reduced=Reduced.ALL_REDUCE_OWN_ROWS, preferred=("dp", "fsdp"),
                          searched=True),
    # FSDP2's reshard_after_forward=False: gathered in the forward, kept for the backward
    "fsdp(reshard_after_forward=False)": StrategyKind(
        strategy="fsdp", reshard_after_forward=False, shards=True,
        gathered=Gathered.PER_FORWARD, reduced=Reduced.REDUCE_SCATTER,
        preferred=("fsdp", "dp")),
    "hsdp(reshard_after_forward=False)": StrategyKind(
        strategy="hsdp", reshard_after_forward=False, shards=True,
        gathered=Gathered.PER_FORWARD, reduced=Reduced.REDUCE_SCATTER, hybrid=True),
    # FSDP2's integer: 1/N kept after the forward, gathered again among N ranks
    "fsdp(reshard_after_forward=N)": StrategyKind(
        strategy="fsdp", reshard_after_forward=int, shards=True,
        gathered=Gathered.REGROUPED, reduced=Reduced.REDUCE_SCATTER,
        preferred=("fsdp", "dp")),
    "hsdp(reshard_after_forward=N)": StrategyKind(
        strategy="hsdp", reshard_after_forward=int, shards=True,
        gathered=Gathered.REGROUPED, reduced=Reduced.REDUCE_SCATTER, hybrid=True),
}
STRATEGIES = tuple(sorted({k.strategy for k in KINDS.values()}))


def row_argument(reshard_after_forward: bool | int) -> bool | type[int]:
    """What a row records for a ``reshard_after_forward`` value: the bool, or ``int``."""
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        return int
    return reshard_after_forward


def kind_name(strategy: str, reshard_after_forward: bool | int = True) -> str:
    """The row of :data:`KINDS` that ``parallelize``'s ``strategy=`` and
    ``reshard_after_forward=`` select; ``ValueError`` naming an unknown strategy, or a
    ``reshard_after_forward`` no row of it takes."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy {strategy!r} is not supported; expected one of "
                         f"{', '.join(STRATEGIES)}")
    argument = row_argument(reshard_after_forward)
    for name, kind in KINDS.items():
        if kind.strategy == strategy and kind.reshard_after_forward is argument:
            return name
    raise ValueError(f"reshard_after_forward={reshard_after_forward!r} does not apply to "
                     f"strategy {strategy!r}")


def kind_of(name: str) -> StrategyKind:
    """The row ``name`` of :data:`KINDS`; ``ValueError`` naming an unknown one (never
    another row's behaviour)."""
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"strategy kind {name!r} is not a row of KINDS; expected one of "
                         f"{', '.join(KINDS)}") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class Strategy:
    """A strategy bound to a mesh: which dimensions it uses, and the placements it implies.

    Attributes:
        name: the ``strategy=`` argument (``"ddp"``, ``"fsdp"``, ...).
        mesh: the mesh it runs on.
        data_dim: the dimension whose group plans are agreed on (the batch's for ``ddp``
            and ``fsdp``, the sharding one for ``hsdp``).
        data_dims: every dimension the batch is split along.
        shard_dim: the dimension parameters are sharded along (None: replicated).
        replicate_dim: ``hsdp``'s dimension across which shards are replicated.
        tp_dims: the tensor-parallel dimensions (named in ``placements``).
        placements: parameter name -> its placement on each tensor-parallel dimension.
        shard_dims: parameter name -> the dimension it is sharded along, where not 0
            (``shard_placement_fn``).
        activations: module path -> the placement of its output on each tensor-parallel
            dimension (sequence parallelism).
        load_balance: mesh dimension -> whether causal ring attention along it exchanges
            halves of the sequence so that every rank does the same work (context
            parallelism; True where not named).
        row: its row of :data:`KINDS` (``name`` unless ``reshard_after_forward`` chose
            another).
        reshard_to: ``reshard_after_forward=N``'s N (0 for every other row): the ranks of
            the sharding dimension a backward gathers among.
        experts: expert parameter name -> the data dimension its experts are split over
            (``spmd.ep.experts``): stored and computed ``Shard(0)`` there (never
            gathered), its gradient complete on each rank (the expert-parallel ops
            average it), averaged along the other data dimensions.
    """

    name: str
    mesh: Mesh
    data_dim: str | None
    data_dims: tuple[str, ...] = ()
    shard_dim: str | None = None
    replicate_dim: str | None = None
    tp_dims: tuple[str, ...] = ()
    placements: Mapping[str, Mapping[str, Placement]] = field(default_factory=dict,
                                                             compare=False)
    shard_dims: Mapping[str, int] = field(default_factory=dict, compare=False)
    activations: Mapping[str, Mapping[str, Placement]] = field(default_factory=dict,
                                                              compare=False)
    load_balance: Mapping[str, bool] = field(default_factory=dict, compare=False)
    row: str = ""
    reshard_to: int = 0
    experts: Mapping[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not self.data_dims and self.data_dim is not None:
            object.__setattr__(self, "data_dims", (self.data_dim,))
        if not self.row:
            object.__setattr__(self, "row", self.name)

    @property
    def context_dims(self) -> tuple[str, ...]:
        """The context-parallel dimensions (``spmd.cp.ring``): where a reshape merging the
        batch with the split sequence keeps it split (``StridedShard``)."""
        return tuple(self.load_balance)

    def tp_placement(self, param: str) -> dict[str, Placement]:
        """``param``'s placement on each tensor-parallel dimension (``Replicate()`` where
        the user named none)."""
        own = self.placements.get(param, {})
        return {dim: own.get(dim, Replicate()) for dim in self.tp_dims}

    @property
    def kind(self) -> StrategyKind:
        return kind_of(self.row)

    @property
    def gathered(self) -> Gathered:
        return self.kind.gathered

    @property
    def reduced(self) -> Reduced:
        return self.kind.reduced

    @property
    def tensor_parallel(self) -> bool:
        return any(any(divides(p) for p in placed.values())
                   for placed in self.placements.values())

    @property
    def data_size(self) -> int:
        """Ranks the batch is split over (the product along every data dimension)."""
        return math.prod(self.mesh.size(dim) for dim in self.data_dims)

    @property
    def shards_parameters(self) -> bool:
        return self.shard_dim is not None

    def input_sharding(self, info: InputInfo) -> Sharding:
        """Where a graph input lives: data ``Shard(0)`` on the data dimensions, parameters
        ``Shard(0)`` on the sharding dimension (if any), everything else ``Replicate()``."""
        if info.kind == "data":
            return Sharding.on(self.mesh, {d: Shard(0) for d in self.data_dims})
        if info.kind == "param":
            return self.parameter_sharding(info.name)
        return Sharding.replicated(self.mesh)

    def parameter_sharding(self, param: str | None = None) -> Sharding:
        """Where a parameter lives: its shard along the sharding dimension (for the
        sharded strategies) and its placement on each tensor-parallel dimension."""
        placed: dict[str, Placement] = {}
        expert = self.experts.get(param) if param is not None else None
        if expert is not None:
            placed[expert] = Shard(0)  # its own experts, on this rank for good
            if self.shards_inside(param):  # and sharded further, fsdp's way
                placed[self.shard_dim] = Shard(0)  # type: ignore[index]
        elif self.shard_dim is not None:
            placed[self.shard_dim] = Shard(self.shard_dims.get(param, 0) if param else 0)
        if param is not None:
            placed.update(self.tp_placement(param))
        return Sharding.on(self.mesh, placed)

    def shards_inside(self, param: str) -> bool:
        """An expert parameter (``spmd.ep``) that the strategy also shards along its
        sharding dimension, that being another data dimension than the experts' (``hsdp``
        with the experts along the replicas' dimension: torchtitan's experts sharded
        over ``dp_shard_mod_ep``), gathered for use and reduce-scattered there."""
        expert = self.experts.get(param)
        return (expert is not None and self.shards_parameters and self.shard_dim is not None
                and self.shard_dim != expert and self.mesh.size(self.shard_dim) > 1)

    def local_gradient(self, param: str) -> Sharding:
        """Each rank's gradient of a parameter as the graph leaves it.

        ``ddp``: computed on this rank's shard of the batch, ``Partial("avg")`` on the
        data dimension (the average over ranks is the gradient of the whole batch's mean
        loss); ``Replicate()`` when the dimension has one rank. Sharded strategies: the
        graph's gradient is already the reduce-scattered shard that the parameter's
        gather produced in backward, where the parameter lives.
        """
        expert = self.experts.get(param)
        if expert is not None:  # complete along its own dimension, averaged along others
            local = self.parameter_sharding(param)
            inside = self.shard_dim if self.shards_inside(param) else None
            for dim in self.data_dims:
                if dim not in (expert, inside) and self.mesh.size(dim) > 1:
                    local = local.with_placement(dim, Partial("avg"))
            return local
        if self.shard_dim is not None or self.data_size == 1:
            return self.parameter_sharding(param)
        placed: dict[str, Placement] = dict(self.tp_placement(param))
        placed[self.data_dim] = Partial("avg")  # type: ignore[index]
        return Sharding.on(self.mesh, placed)

    def gradient_target(self, param: str) -> Sharding:
        """Where a parameter's gradient must end up: where the parameter lives."""
        return self.parameter_sharding(param)


class _Dims:
    """The names and sizes of some of a mesh's dimensions, for choosing data dimensions
    among those tensor parallelism leaves."""

    def __init__(self, names: tuple[str, ...], shape: tuple[int, ...]) -> None:
        self.dim_names, self.shape, self.ndim = names, shape, len(names)

    def size(self, dim: str) -> int:
        return self.shape[self.dim_names.index(dim)]

    def __repr__(self) -> str:
        return f"Mesh({self.shape}, dim_names={self.dim_names})"


def _without(mesh: Mesh, dims: tuple[str, ...]) -> "_Dims":
    names = tuple(d for d in mesh.dim_names if d not in dims)
    return _Dims(names, tuple(mesh.size(d) for d in names))


def tp_dims_of(spec: object) -> tuple[str, ...]:
    """The mesh dimensions a ``placements`` argument names: a dict's keys, a preset's
    ``dims`` (``spmd.tp.megatron()``, ``spmd.cp.ring()``), or those of each in a list."""
    if spec is None:
        return ()
    if isinstance(spec, (list, tuple)):  # several presets or dicts, each its dimensions
        found: list[str] = []
        for one in spec:
            found += [d for d in tp_dims_of(one) if d not in found]
        return tuple(found)
    dims = getattr(spec, "dims", None)
    if dims is not None:
        return tuple(dims)
    if not isinstance(spec, Mapping):
        raise TypeError(f"placements must be a dict {{mesh dimension: {{parameter name "
                        f"pattern: placement}}}} or a preset such as spmd.tp.megatron(), got "
                        f"{type(spec).__name__}")
    return tuple(spec)


def dims_to_flatten(name: str, mesh: Mesh, tp_dims: tuple[str, ...] = ()) -> tuple[str, ...]:
    """2-D fsdp: the dimensions a sharding strategy shards over at once, to be flattened
    into one (``Mesh.flatten``): every dimension tensor parallelism leaves, when more than
    one of them has several ranks and each is named a data dimension (``"dp"`` and
    ``"fsdp"``, as ``hsdp`` names them; ``hsdp`` replicates along ``"dp"`` instead). ()
    when there is nothing to flatten."""
    kind = KINDS.get(name)
    if kind is None or not kind.shards or kind.hybrid:
        return ()
    rest = tuple(d for d in mesh.dim_names if d not in tp_dims)
    several = [d for d in rest if mesh.size(d) > 1]
    if len(several) > 1 and all(d in ("dp", "fsdp") for d in several):
        return rest
    return ()


def flatten_data_dims(name: str, mesh: Mesh, where: str, tp_dims: tuple[str, ...] = ()
                      ) -> Mesh:
    """``mesh`` with the dimensions :func:`dims_to_flatten` names merged into one (2-D
    fsdp), or ``mesh`` itself; ``ValueError`` naming them when they are not adjacent.
    On a live mesh every rank must call it (the merged dimension gets its groups)."""
    flat = dims_to_flatten(name, mesh, tp_dims)
    if not flat:
        return mesh
    try:
        return mesh.flatten(flat)
    except ValueError as e:
        raise ValueError(f"{where}: strategy {name!r} shards parameters over {flat} at once, "
                         f"which must be adjacent: {e}") from None


def _pick(mesh: Mesh, names: tuple[str, ...]) -> str | None:
    return next((n for n in names if n in mesh.dim_names), None)


def resolve_strategy(name: str, mesh: Mesh, where: str, tp_dims: tuple[str, ...] = (),
                     placements: Mapping[str, Mapping[str, Placement]] | None = None
                     ) -> Strategy:
    """The strategy ``name`` (a ``strategy=`` argument, or a row of :data:`KINDS`) on
    ``mesh``, with tensor parallelism along ``tp_dims`` (``placements``: parameter name ->
    placement per such dimension); ``ValueError`` naming a dimension it cannot use."""
    if name not in KINDS:
        raise ValueError(f"{where}: strategy {name!r} is not supported; expected one of "
                         f"{', '.join(STRATEGIES)}")
    row, kind = name, KINDS[name]
    name = kind.strategy
    for dim in tp_dims:
        if dim not in mesh.dim_names:
            raise ValueError(f"{where}: placements name mesh dimension {dim!r}, which mesh "
                             f"{mesh} does not have")
    if tp_dims:
        if all(d in tp_dims for d in mesh.dim_names):  # tensor parallelism alone: no data dimension
            if kind.shards:
                raise ValueError(f"{where}: strategy {name!r} shards parameters along a data "
                                 f"dimension, but every dimension of mesh {mesh} is "
                                 f"tensor-parallel; add one, e.g. Mesh((2, 2), dim_names="
                                 f"('fsdp', 'tp'))")
            return Strategy(name=name, mesh=mesh, data_dim=None, data_dims=(),
                            tp_dims=tuple(tp_dims), placements=dict(placements or {}), row=row)
        base = resolve_strategy(row, _without(mesh, tp_dims), where)  # type: ignore[arg-type]
        return Strategy(name=name, mesh=mesh, data_dim=base.data_dim, data_dims=base.data_dims,
                        shard_dim=base.shard_dim, replicate_dim=base.replicate_dim,
                        tp_dims=tuple(tp_dims), placements=dict(placements or {}), row=row)
    if kind.hybrid:
        if mesh.ndim != 2:
            raise ValueError(f"{where}: strategy {name!r} needs a 2-D mesh (replicate x shard, "
                             f"e.g. Mesh((2, 4), dim_names=('dp', 'fsdp'))); got {mesh}")
        if "fsdp" in mesh.dim_names:
            shard = "fsdp"
            replicate = next(d for d in mesh.dim_names if d != "fsdp")
        else:
            replicate, shard = mesh.dim_names
        return Strategy(name=name, mesh=mesh, data_dim=shard, data_dims=(replicate, shard),
                        shard_dim=shard, replicate_dim=replicate, row=row)
    preferred = kind.preferred
    data_dim = _pick(mesh, preferred)
    if data_dim is None:
        if mesh.ndim != 1:
            raise ValueError(f"{where}: strategy {name!r} splits the batch along a mesh "
                             f"dimension named {' or '.join(map(repr, preferred))}; mesh "
                             f"{mesh} has none")
        data_dim = mesh.dim_names[0]
    for dim, size in zip(mesh.dim_names, mesh.shape):
        if dim != data_dim and size > 1:
            raise ValueError(
                f"{where}: mesh dimension {dim!r} (size {size}) is not used by strategy "
                f"{name!r}, which places everything on {data_dim!r}; its {size} ranks would "
                f"repeat the same work. Pass a mesh without it (or of size 1 there)")
    return Strategy(name=name, mesh=mesh, data_dim=data_dim,
                    shard_dim=data_dim if kind.shards else None, row=row)
