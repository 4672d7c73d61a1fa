"""The parameter-placement layer: one record per parameter, one walk, one class swap.

Every strategy only says where each parameter is **stored** and where it is **computed**,
one placement per mesh dimension (:class:`ParameterPlacement`):

============  ==============================  ===============================  ==========
strategy      stored                          computed                         gathered
============  ==============================  ===============================  ==========
ddp           ``Replicate`` everywhere        ``Replicate``                    never
fsdp, hsdp    ``Shard(0)`` on the shard dim   ``Replicate`` there              each use
zero1, zero2  ``Shard(0)`` on the data dim    ``Replicate`` there              per step
tp pieces     ``Shard(d)`` on a model dim     ``Shard(d)`` there (kept)        never
============  ==============================  ===============================  ==========

(fsdp x tp is both rows at once.) :func:`place_module` walks the module once: each
distinct parameter comes to hold its stored value (the ``nn.Parameter`` object stays the
same, so an optimizer made before keeps stepping it), its class gets one property per
parameter that reads the computed value, and one state-dict hook pair moves whole tensors
in and out. The property is the eager op pair ``spmd::shard_gather`` (data dimensions:
``Shard -> Replicate``, its gradient the reduce-scatter back) and ``spmd::tp_param``
(model dimensions: the pieces, whole in eager code); in a planned graph the passes lower
them: bucketed, prefetched gathers and reduce-scatters along data dimensions, pieces kept
along model dimensions. :func:`placement_of` reads the record of any parameter of a
parallelized model.
"""

from __future__ import annotations

import math
import weakref
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
import torch.nn as nn

from spmd.lowering import ops
from spmd.lowering.options import Options
from spmd.lowering.placements import Replicate, Shard, Sharding, divides
from spmd.lowering.specs import Handles, PlaceSpec, ShardSpec, TPSpec, lookup
from spmd.lowering.strategy import Gathered, Reduced, Strategy
from spmd.runtime.sizecheck import labelled
from spmd.state.chunked import ChunkedTensor
from spmd.state.writethrough import write_through

if TYPE_CHECKING:
    from spmd.program.setup import Setup

__all__ = ["ParameterPlacement", "Layout", "placement_of", "place_module", "hold_piece",
           "shard_evenly", "shard_dims_for", "place_activations", "layout_of",
           "local_state_dicts", "stored_part"]

_CLASSES: dict[tuple[type, tuple[str, ...]], type] = {}


@dataclass(frozen=True, kw_only=True, slots=True)
class ParameterPlacement:
    """Where one parameter of a parallelized model lives.

    Attributes:
        name: its name in the model.
        shape: the whole (global) tensor's shape.
        sharding: where it is stored: its placement on every mesh dimension (the same as
            :attr:`stored`).
        computed: where the model's code computes with it (``Replicate`` along data
            dimensions; a tensor-parallel piece stays ``Shard(d)``).
        local_shape: the tensor this rank stores (on a data dimension, the sharded
            dimension padded to ``rows``).
        rows: rows of the sharded dimension per rank (dim 0 unless
            ``shard_placement_fn`` chose another); ``padding``: rows of zeros this rank's
            shard ends with (those beyond the whole tensor).
        gathered: when the stored shards are gathered for compute (a ``Gathered``,
            printed as its value): ``"each use"`` (fsdp, hsdp), ``"per forward, kept for
            backward"`` (their ``reshard_after_forward=False``), ``"per step"`` (zero1,
            zero2: kept whole until the shard changes, i.e. after the optimizer step) or
            ``"never"``.
        reduced: how its gradient leaves the data dimensions (a ``Reduced``):
            ``"all-reduce"`` (ddp), ``"reduce-scatter"`` (fsdp, hsdp, zero2),
            ``"all-reduce, own rows kept"`` (zero1) or ``"none"`` (no data dimension of
            more than one rank).
    """

    name: str
    shape: tuple[int, ...]
    sharding: Sharding
    computed: Sharding
    local_shape: tuple[int, ...]
    rows: int
    padding: int
    gathered: Gathered = Gathered.NEVER
    reduced: Reduced = Reduced.NONE

    @property
    def stored(self) -> Sharding:
        return self.sharding


def placement_of(param: torch.Tensor) -> ParameterPlacement:
    """The record of a parameter of a parallelized model (``model.parameters()``, or the
    attribute eager code reads, ``model.fc.weight``): global shape, stored and computed
    placements; ``ValueError`` for any other tensor."""
    found = getattr(param, "_spmd_placement", None) if isinstance(param, torch.Tensor) else None
    if found is None:
        raise ValueError("spmd.placement_of: this tensor is not a sharded parameter, "
                         "tensor-parallel piece or replicated parameter of a model passed to "
                         "spmd.parallelize")
    return found


@dataclass(eq=False)
class Layout:
    """What :func:`place_module` did to a module: every parameter name (tied ones
    included) -> its record, and the runtime specs of those stored split (``shards``:
    along the data dimensions, ``pieces``: along the model dimensions)."""

    records: dict[str, ParameterPlacement]
    shards: dict[str, ShardSpec]
    pieces: dict[str, TPSpec]

    def whole_numel(self, name: str, param: torch.Tensor) -> int:
        spec = self.pieces.get(name) or self.shards.get(name)
        return param.numel() if spec is None else math.prod(spec.shape)


def hold_piece(param: nn.Parameter, local: torch.Tensor, name: str) -> nn.Parameter:
    """``param`` itself, now holding ``local`` (its shard or piece): an optimizer created
    before ``parallelize`` (or before a sharded step's first call) keeps stepping the very
    tensors the model uses, as with ``torch.optim`` on any model."""
    if param.grad is not None:
        raise ValueError(f"parallelize: {name} holds a gradient for the whole parameter, "
                         f"which cannot be cut into this rank's piece without the other "
                         f"ranks' gradients; call zero_grad(set_to_none=True) before "
                         f"parallelizing")
    with torch.no_grad():
        param.data = local.detach().clone(memory_format=torch.contiguous_format)
    return param


# -- one record per parameter -----------------------------------------------------------


def shard_evenly(param: torch.Tensor, size: int | None = None,
                 avoid: tuple[int, ...] = ()) -> Shard | None:
    """A ``shard_placement_fn`` that never pads where it need not: ``None`` (dim 0) where
    ``size`` divides dim 0 or divides no dimension, else ``Shard(d)`` for the first
    dimension it divides, other than those in ``avoid``. ``parallelize`` passes the
    sharding dimension's size, each parameter's tensor-parallel piece and the dimensions
    tensor parallelism splits it along."""
    shape = tuple(param.shape)
    if size is None:
        raise TypeError("spmd.shard_evenly: pass it as parallelize(..., shard_placement_fn="
                        "spmd.shard_evenly), which gives it the number of ranks")
    if not shape or shape[0] % size == 0:
        return None
    return next((Shard(d) for d in range(1, len(shape))
                 if shape[d] % size == 0 and d not in avoid), None)


def shard_dims_for(module: nn.Module, strategy: Strategy, fn: Any, where: str) -> dict[str, int]:
    """Every parameter name -> the dimension ``fn`` (``shard_placement_fn``) shards it
    along, where not 0; ``ValueError`` naming a parameter whose choice cannot be kept
    (out of range, split by tensor parallelism already, or not dividing evenly)."""
    size = strategy.mesh.size(strategy.shard_dim)
    dims: dict[str, int] = {}
    chosen: dict[int, int] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) not in chosen:
            placed = strategy.tp_placement(name)
            shape = list(param.shape)
            split = set()
            for dim, p in placed.items():
                if divides(p):
                    shape[p.dim] //= strategy.mesh.size(dim)
                    split.add(p.dim)
            piece = torch.empty(shape, dtype=param.dtype, device="meta")
            got = fn(piece, size, tuple(split)) if fn is shard_evenly else fn(param)
            if got is not None and not isinstance(got, Shard):
                raise TypeError(f"{where}: shard_placement_fn returned {got!r} for {name}; "
                                f"expected spmd.Shard(d) or None")
            d = 0 if got is None else (got.dim + len(shape) if got.dim < 0 else got.dim)
            if got is not None and not 0 <= d < max(len(shape), 1):
                raise ValueError(f"{where}: shard_placement_fn placed {name} (shape "
                                 f"{tuple(param.shape)}) {got!r}, out of range")
            if d and d in split:
                raise ValueError(f"{where}: shard_placement_fn shards {name} along dimension "
                                 f"{d}, which tensor parallelism already splits; choose "
                                 f"another")
            if d and shape[d] % size:
                raise ValueError(f"{where}: shard_placement_fn shards {name} (shape "
                                 f"{tuple(shape)} on this rank) along dimension {d} "
                                 f"({shape[d]}), which {size} ranks do not divide; only dim 0 "
                                 f"is padded")
            chosen[id(param)] = d
        if chosen[id(param)]:
            dims[name] = chosen[id(param)]
    return dims


def _shard_spec(name: str, shape: tuple[int, ...], param: torch.Tensor, setup: Setup,
                options: Options) -> ShardSpec:
    """How a parameter (or its tensor-parallel piece, of ``shape``) is cut along the
    strategy's sharding dimension: along dim 0 (or the dimension ``shard_placement_fn``
    chose), each rank ``ceil(rows / size)`` rows (a 0-dim parameter is one row)."""
    strategy = setup.strategy
    mesh = strategy.mesh
    mesh_dim, replicate = strategy.shard_dim, strategy.replicate_dim
    size = mesh.size(mesh_dim)
    dim = strategy.shard_dims.get(name, 0)
    rows = shape[dim] if shape else 1
    floating = param.is_floating_point()
    regroup_size, regroup = strategy.reshard_to, None
    if regroup_size >= size:  # reshard_after_forward=N of the whole dimension: True's
        regroup_size = 0
    elif regroup_size > 1 and not mesh.simulated:
        regroup = setup.reshard_mesh.get_group(f"{mesh_dim}_within")
    return ShardSpec(
        param=name, sharding=strategy.parameter_sharding(name), shape=shape, dtype=param.dtype, rows=-(-rows // size), dim=dim,
        group=None if mesh.simulated else mesh.get_group(mesh_dim), size=size,
        mesh_dim=mesh_dim,
        replicate_group=(None if mesh.simulated or replicate is None
                         else mesh.get_group(replicate)),
        replicate_size=mesh.size(replicate) if replicate else 1, replicate_dim=replicate or "",
        param_dtype=options.param_dtype if floating else None,
        reduce_dtype=options.reduce_dtype if floating else None,
        persistent=strategy.gathered is Gathered.PER_STEP,
        all_reduce=strategy.reduced is Reduced.ALL_REDUCE_OWN_ROWS,
        regroup_size=regroup_size, regroup=regroup)


def _record(name: str, shape: tuple[int, ...], strategy: Strategy, shard: ShardSpec | None,
            piece: TPSpec | None) -> ParameterPlacement:
    stored = strategy.parameter_sharding(name)
    computed = stored
    for dim in strategy.data_dims:
        computed = computed.with_placement(dim, Replicate())
    local = shard.local_shape if shard is not None else (
        piece.local_shape if piece is not None else shape)
    return ParameterPlacement(
        name=name, shape=shape, sharding=stored, computed=computed, local_shape=local,
        rows=shard.rows if shard is not None else (local[0] if local else 1),
        padding=0 if shard is None else shard.rows - shard.valid_rows(),
        gathered=strategy.gathered if shard is not None else Gathered.NEVER,
        reduced=strategy.reduced if strategy.data_size > 1 else Reduced.NONE)


def place_module(module: nn.Module, setup: Setup, options: Options, handles: Handles) -> Layout:
    """Store every parameter of ``module`` where ``setup``'s strategy says (in place),
    give its class the properties that compute with them, and make its state dicts whole;
    the :class:`Layout`. Every rank of each dimension must hold the same whole
    parameters (``prepare_model`` checks and broadcasts)."""
    from spmd.eager.clip import install_clip

    strategy = setup.strategy
    if strategy.shards_parameters or strategy.tensor_parallel or strategy.experts:
        install_clip()  # torch's clip_grad_norm_ on parts: by the whole gradient's norm
    done: dict[int, tuple[ShardSpec | None, TPSpec | None, tuple[int, int]]] = {}
    layout = Layout(records={}, shards={}, pieces={})
    for prefix, sub in module.named_modules(remove_duplicate=False):
        local: dict[str, tuple[int, int]] = {}
        for pname, param in list(sub._parameters.items()):
            if param is None:
                continue
            name = f"{prefix}.{pname}" if prefix else pname
            entry = done.get(id(param))
            if entry is None:
                entry = done[id(param)] = _place(name, param, setup, options, handles)
            shard, piece, handle_pair = entry
            layout.records[name] = param._spmd_placement  # type: ignore[attr-defined]
            if shard is not None:
                layout.shards[name] = shard
            if piece is not None:
                layout.pieces[name] = piece
            if handle_pair != (_NONE, _NONE):
                local[pname] = handle_pair
        if local:
            sub._spmd_handles = local
            sub.__class__ = _placed_class(type(sub), tuple(sorted(local)))
    if layout.shards or layout.pieces:
        _install_state_dict_hooks(module, layout)
    return layout


_NONE = 0  # "no spec" in a module's handle pair


def _place(name: str, param: nn.Parameter, setup: Setup, options: Options, handles: Handles
           ) -> tuple[ShardSpec | None, TPSpec | None, tuple[int, int]]:
    """Store one distinct parameter as its record says; its specs and handle pair."""
    strategy = setup.strategy
    mesh = strategy.mesh
    shape = tuple(param.shape)
    expert = strategy.experts.get(name)
    if expert is not None:
        return _place_expert(name, param, setup, options, handles, expert)
    placed = strategy.tp_placement(name)
    piece = shard = None
    value = param.detach()
    if any(divides(p) for p in placed.values()):
        piece = TPSpec(param=name, shape=shape, sharding=strategy.parameter_sharding(name),
                       dims=strategy.tp_dims,
                       groups={d: None if mesh.simulated else mesh.get_group(d)
                               for d in strategy.tp_dims})
        value = piece.piece(value)
    if strategy.shards_parameters:
        shard = _shard_spec(name, tuple(value.shape), param, setup, options)
        value = shard.shard_of(value)
    if piece is not None or shard is not None:
        hold_piece(param, value, name)
    param._spmd_placement = _record(name, shape, strategy, shard, piece)  # type: ignore[attr-defined]
    pair = (handles.add(shard) if shard is not None else _NONE,
            handles.add(piece) if piece is not None else _NONE)
    return shard, piece, pair


def _place_expert(name: str, param: nn.Parameter, setup: Setup, options: Options,
                  handles: Handles, dim: str
                  ) -> tuple[ShardSpec | None, TPSpec | None, tuple[int, int]]:
    """An expert parameter (``spmd.ep``): this rank's experts, stored and computed as they
    are (no property: the model reads the stored tensor); the piece's spec serves the
    whole state dict and clipping. Sharded further along another data dimension
    (``Strategy.shards_inside``): this rank's shard of its experts, read through the
    gather (a property), its gradient reduce-scattered there, averaged nowhere else."""
    strategy = setup.strategy
    mesh = strategy.mesh
    stored = strategy.parameter_sharding(name)
    whole = tuple(param.shape)
    dims = (dim, *strategy.tp_dims)  # (split by expert, and by tensor parallelism)
    sharding = Sharding.on(mesh, {d: stored[d] for d in dims})
    piece = TPSpec(param=name, shape=tuple(param.shape), sharding=sharding, dims=dims,
                   groups={d: None if mesh.simulated else mesh.get_group(d) for d in dims})
    value = piece.piece(param.detach())
    if strategy.shards_inside(name):
        shard = replace(_shard_spec(name, tuple(value.shape), param, setup, options),
                        replicate_group=None, replicate_size=1, replicate_dim="")
        hold_piece(param, shard.shard_of(value), name)
        param._spmd_placement = ParameterPlacement(  # type: ignore[attr-defined]
            name=name, shape=whole, sharding=stored,
            computed=stored.with_placement(strategy.shard_dim, Replicate()),
            local_shape=shard.local_shape, rows=shard.rows,
            padding=shard.rows - shard.valid_rows(), gathered=strategy.gathered,
            reduced=strategy.reduced)
        return shard, piece, (handles.add(shard), _NONE)
    hold_piece(param, value, name)
    others = [d for d in strategy.data_dims if d != dim and mesh.size(d) > 1]
    param._spmd_placement = ParameterPlacement(  # type: ignore[attr-defined]
        name=name, shape=whole, sharding=stored, computed=stored,
        local_shape=piece.local_shape, rows=piece.local_shape[0], padding=0,
        reduced=Reduced.ALL_REDUCE if others else Reduced.NONE)
    return None, piece, (_NONE, _NONE)


# -- one class swap ---------------------------------------------------------------------


def _placed_class(cls: type, names: tuple[str, ...]) -> type:
    """``cls`` with a property per placed parameter name. The handles differ per module,
    so the property reads them from the instance's table."""
    key = (cls, names)
    sub = _CLASSES.get(key)
    if sub is None:
        props = {n: _computed_property(n) for n in names}
        sub = type(f"Placed{cls.__name__}", (cls,), {**props, "__module__": cls.__module__})
        sub._apply = _converting(sub)
        _CLASSES[key] = sub
    return sub


def _converting(cls: type) -> Any:
    """``cls._apply``: ``nn.Module._apply`` (what ``.double()``, ``.to(dtype)``,
    ``.half()`` run), then each stored shard's spec takes its new dtype, so gathers and
    gradient reductions follow the conversion; the next forward re-traces (its guards
    see the new dtype)."""
    def _apply(self: nn.Module, fn: Any, recurse: bool = True) -> nn.Module:
        out = super(cls, self)._apply(fn, recurse)
        for name, (shard_handle, _) in self._spmd_handles.items():
            stored = self._parameters[name]
            if getattr(stored, "_spmd_placement", None) is None:
                raise RuntimeError(
                    f"{type(self).__name__}.{name} was replaced by a new tensor when the "
                    f"module was converted (torch.__future__."
                    f"set_overwrite_module_params_on_conversion(True)); a parallelized "
                    f"model's parameters must stay the same objects: turn that off, or "
                    f"convert the model before spmd.parallelize")
            if shard_handle:
                lookup(shard_handle).follow(stored)
        return out

    return _apply


def _computed_property(name: str) -> property:
    def computed(self: nn.Module) -> torch.Tensor:
        stored = self._parameters[name]
        shard_handle, piece_handle = self._spmd_handles[name]
        value = stored
        if shard_handle:
            value = ops.shard_gather(value, shard_handle)
        if piece_handle:
            value = ops.tp_param(value, piece_handle)
        if torch.compiler.is_compiling():
            return value
        shard = lookup(shard_handle) if shard_handle else None
        piece = lookup(piece_handle) if piece_handle else None

        def store(values: torch.Tensor, changed: torch.Tensor | None) -> None:
            new, mask = values, changed
            for spec, cut in ((piece, "piece"), (shard, "shard_of")):
                if spec is not None:
                    new = getattr(spec, cut)(new)
                    mask = None if mask is None else getattr(spec, cut)(mask)
            stored.copy_(new if mask is None else torch.where(mask, new, stored))

        out = write_through(value, store, (shard or piece).param, stored.dtype)
        record = getattr(stored, "_spmd_placement", None)  # (absent on a substitute)
        if record is not None and out is not value:
            out._spmd_placement = record  # placement_of(model.fc.weight)
        return out

    def guarded(self: nn.Module) -> torch.Tensor:
        try:
            return computed(self)
        except AttributeError as e:
            # raised from a property, Python would call nn.Module.__getattr__ instead and
            # hand out the stored shard as if it were the parameter: never
            raise RuntimeError(f"reading {type(self).__name__}.{name}: {e}") from e

    guarded.__name__ = name
    return property(guarded, doc=f"{name}, where it is computed (from what this rank stores)")


# -- one state-dict hook pair -----------------------------------------------------------

# What ``state_dict()`` of a placed model gives for each placed tensor while set (see
# :func:`local_state_dicts`): ``convert(name, stored, shard spec, piece spec)``.
_LOCAL: ContextVar[Callable[..., Any] | None] = ContextVar("spmd_local_state_dict",
                                                           default=None)


@contextmanager
def local_state_dicts(convert: Callable[..., Any]) -> Iterator[None]:
    """Within it, ``state_dict()`` of a placed model holds ``convert(name, stored, shard,
    piece)`` for each placed tensor instead of the gathered whole (no collective; the keys
    stay the plain module's): how ``spmd.checkpoint.get_state_dict`` gets this rank's
    parts through the module's own state-dict machinery."""
    token = _LOCAL.set(convert)
    try:
        yield
    finally:
        _LOCAL.reset(token)


def layout_of(module: nn.Module) -> Layout | None:
    """The :class:`Layout` of a model whose parameters ``parallelize`` stored in parts
    (shards or pieces); None for any other."""
    return module.__dict__.get("_spmd_layout")


def stored_part(layout: Layout, name: str, value: torch.Tensor, key: str) -> torch.Tensor:
    """What this rank stores of placed parameter ``name`` (or of a tensor laid out like
    it, e.g. its optimizer state) given ``value``: the whole tensor, the tensor-parallel
    piece, or the stored part itself (returned as it is); ``ValueError`` naming ``key``
    for any other shape."""
    if isinstance(value, ChunkedTensor):
        value = value.to_local()
    record = layout.records[name]
    shard, piece = layout.shards.get(name), layout.pieces.get(name)
    shape = tuple(value.shape)
    if shape == record.local_shape:
        return value  # this rank's stored part as it is
    if shape == record.shape and piece is not None:
        value = piece.piece(value).clone()
    elif shape == record.shape or (piece is not None and shape == piece.local_shape):
        pass
    else:
        forms = [f"the whole tensor {record.shape}"]
        if piece is not None and shard is not None:
            forms.append(f"this rank's piece {piece.local_shape}")
        forms.append(f"this rank's stored part {record.local_shape}")
        raise ValueError(f"load_state_dict: {key} has shape {shape}; a parameter "
                         f"placed {record.sharding} takes " + " or ".join(forms))
    if shard is not None:
        value = shard.shard_of(value.to(shard.dtype))
    return value


def _install_state_dict_hooks(module: nn.Module, layout: Layout) -> None:
    """Whole tensors in ``state_dict()`` of the module and of any submodule (gathered:
    every rank must call it, as with torch's full state dicts; within
    :func:`local_state_dicts`, this rank's parts); ``load_state_dict`` of either takes
    the whole tensor, the tensor-parallel piece, the stored shard or a
    ``spmd.checkpoint.ChunkedTensor``, and keeps this rank's part.

    Each module that owns placed parameters gets the hooks for its own: torch runs a
    module's hooks whether ``state_dict()`` was called on it or on an ancestor, so
    ``model.layers[0].state_dict()`` gives whole tensors too (a hook on the root alone
    returned this rank's shards there, silently). Tied names share one gather per call."""
    names = sorted(set(layout.shards) | set(layout.pieces))
    module._spmd_layout = layout
    weak = weakref.ref(module)
    owned: dict[int, tuple[nn.Module, set[str]]] = {}
    for path, sub in module.named_modules(remove_duplicate=False):
        mine = [n for n in names if n.rpartition(".")[0] == path]
        if mine:
            owned.setdefault(id(sub), (sub, set()))[1].update(mine)

    for sub, mine in owned.values():
        # (attribute, name); a module shared at two paths converts its keys once
        local = sorted({n.rpartition(".")[2]: n for n in sorted(mine)}.items())
        sub._register_state_dict_hook(_whole_hook(layout, local))
        sub._register_load_state_dict_pre_hook(_stored_hook(layout, local, weak))


_GATHERED: dict[int, tuple[Any, dict[int, Any]]] = {}


def _gathered(state: dict) -> dict[int, Any]:
    """The whole tensors already made for the state dict ``state`` (by id of their
    placement), kept while ``state`` lives; nothing is stored on ``state`` itself (its
    attributes are pickled with it)."""
    key = id(state)
    entry = _GATHERED.get(key)
    if entry is not None and entry[0]() is state:
        return entry[1]
    try:
        ref = weakref.ref(state, lambda _: _GATHERED.pop(key, None))
    except TypeError:  # a destination without weak references: no sharing
        return {}
    _GATHERED[key] = (ref, {})
    return _GATHERED[key][1]


def _whole_hook(layout: Layout, local: list[tuple[str, str]]) -> Any:
    """A module's state-dict hook: its placed tensors ``local`` ((attribute, name)) whole
    in ``state`` (this rank's parts under :func:`local_state_dicts`)."""

    def to_whole(mod: nn.Module, state: dict, prefix: str, local_metadata: Any) -> None:
        convert = _LOCAL.get()
        done = _gathered(state)  # one gather per call, however many modules tie it
        for attribute, name in local:
            key = prefix + attribute
            value = state.get(key)
            if not isinstance(value, torch.Tensor):
                continue
            shard, piece = layout.shards.get(name), layout.pieces.get(name)
            ident = id(shard or piece)
            # the same stored values as the tied key's (a later call into the same
            # destination after a step sees another version, and gathers again)
            seen = (value.data_ptr(), value._version, convert is None)
            made = done.get(ident)
            whole = made[1] if made is not None and made[0] == seen else None
            if whole is None:
                if convert is not None:  # this rank's parts (spmd.checkpoint): nothing sent
                    whole = convert(name, value, shard, piece)
                else:
                    with labelled("state_dict()", "every rank must call it, as with torch's "
                                                  "full state dicts: it gathers each parameter "
                                                  "over the group; save the result on rank 0 "
                                                  "only"):
                        whole = value
                        if shard is not None:
                            whole = shard.gather(whole)
                        if piece is not None:
                            whole = piece.whole(whole)
                done[ident] = (seen, whole)
            state[key] = whole

    return to_whole


def _stored_hook(layout: Layout, local: list[tuple[str, str]], weak: Any) -> Any:
    """A module's load pre-hook: each of its placed tensors in ``state`` as this rank
    stores it (:func:`stored_part`)."""

    def to_stored(state: dict, prefix: str, *args: Any) -> None:
        if weak() is None:
            return
        for attribute, name in local:
            key = prefix + attribute
            value = state.get(key)
            if isinstance(value, torch.Tensor):
                state[key] = stored_part(layout, name, value, key)

    return to_stored


# -- placed activations (sequence parallelism) ------------------------------------------


def place_activations(module: nn.Module, strategy: Strategy, handles: Handles
                      ) -> dict[str, PlaceSpec]:
    """Give every module whose output ``strategy.activations`` places a forward hook that
    passes the output through ``spmd::place`` (its first tensor, for a module returning a
    tuple, as Hugging Face decoder layers do); the specs by module path. Eagerly the op is
    the value itself; in a planned graph the compiler keeps the placed piece and brings
    the gradient there in backward. An output with no dimension after the placed one (a
    position table (sequence, hidden) under ``Shard(1)``) is left to the compiler."""
    specs: dict[str, PlaceSpec] = {}
    for path, placed in strategy.activations.items():
        sub = module.get_submodule(path)
        spec = PlaceSpec(module=path, sharding=Sharding.on(strategy.mesh, dict(placed)),
                         dims=tuple(placed))
        handle = handles.add(spec)
        deepest = max((p.dim for p in placed.values() if isinstance(p, Shard)), default=-1)
        sub.register_forward_hook(_placing_hook(handle, deepest))
        specs[path] = spec
    return specs


def _placing_hook(handle: int, deepest: int) -> Any:
    def placed(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() > deepest + 1 and x.is_floating_point():
            return ops.place(x, handle)
        return x

    def hook(mod: nn.Module, args: Any, out: Any) -> Any:
        if isinstance(out, tuple) and out:
            return (placed(out[0]), *out[1:])
        return placed(out)

    return hook
