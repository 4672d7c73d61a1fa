"""``spmd.ep``'s placing: each experts module given the expert-parallel forward (its class
swapped; the forward runs the ``spmd::`` ops of :mod:`spmd.lowering.experts`) and the spec
of its layer, for a model (:func:`place_experts`) or a pipeline's whole model before it
is traced (:func:`place_for_pipeline`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn as nn

from spmd.ep.presets import DEFAULT_HEADROOM, ExpertParallel, _routed, _weights


@dataclass(frozen=True)
class _Reads:
    """How the experts forward reads each stacked weight: as stored (this rank's
    experts), or, split by tensor parallelism too (``spmd.ep.experts`` beside a ``tp``
    dimension), through ``spmd::tp_param`` (its handle here), which the compiler keeps
    as this rank's piece and the eager path gathers along the tensor-parallel
    dimensions."""

    pieces: tuple[tuple[str, int], ...] = ()

    def __call__(self, module: nn.Module, name: str) -> torch.Tensor | None:
        if name not in module._parameters:  # (no getattr with a default: Dynamo guards
            return None                     # it with hasattr, which would gather it)
        value = getattr(module, name)
        for known, handle in self.pieces:
            if known == name:
                from spmd.lowering.ops import tp_param

                return tp_param(value, handle)
        return value


class _Placed(NamedTuple):
    """What the experts forward reads of its layer: plain numbers and names, found when
    it was placed (Dynamo traces no spec lookup)."""

    handle: int
    size: int
    experts: int
    up: str
    down: str
    read: _Reads
    capacity_factor: float | None
    # the headroom in thousandths, rounded up (an int, which Dynamo specializes on a
    # module; a float it would make an input): replaced where it grows, so Dynamo recompiles
    headroom: int | None = None
    parts: int = 1  # the ranks of the context dimensions: the bound a multiple of it


def _ep_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    from spmd.lowering import experts as ops

    handle, size, experts, up, down, read, capacity_factor, headroom, parts = self._spmd_ep
    tokens, k = top_k_index.shape
    hidden = hidden_states.shape[-1]
    transposed = bool(getattr(self, "is_transposed", False))
    scale = 1.0 / size
    order, send, recv, offs = ops.ep_route(top_k_index.to(torch.int64), handle)
    rows = hidden_states.repeat_interleave(k, dim=0)
    bound = ops.bound_rows(size, tokens, k, experts // size, capacity_factor, experts,
                           None if headroom is None else headroom / 1000, parts)
    # the rows even routing brings (a plan prices the products on them, not the bound)
    cap = ops.capacity(capacity_factor, tokens, k, experts)
    expected = tokens * k if cap is None else min(tokens * k, experts * cap)
    xs = ops.ep_scatter(rows, order, send, recv, bound, handle)
    h = ops.grouped_mm(xs, read(self, up), offs, read(self, f"{up}_bias"), transposed, scale,
                       expected)
    if up == "gate_up_proj":
        h = self._apply_gate(h) if hasattr(self, "_apply_gate") else _gate(self, h)
    else:
        h = self.act_fn(h)
    ys = ops.grouped_mm(h, read(self, down), offs, read(self, f"{down}_bias"), transposed,
                        scale, expected)
    if getattr(self, "has_post_expert_norm", False):
        ys = self.post_expert_norm(ys)
    back = ops.ep_gather(ys, order, send, recv, handle)
    out = (back.view(tokens, k, hidden) * top_k_weights.unsqueeze(-1).to(back.dtype)).sum(1)
    return out.to(hidden_states.dtype)


def grow_headroom(model: nn.Module, specs: dict[str, Any], error: Any) -> float:
    """Grow the headroom of the layer an :class:`~spmd.lowering.experts.ExpertsOverflow`
    names so that what overflowed fits: at least doubled, at most every pair of every
    rank (which no routing exceeds). Its forward reads the new one (Dynamo recompiles:
    the placed tuple it guards on is replaced). The new headroom."""
    spec = specs[error.module]
    grown = min(float(spec.size), max(2 * spec.headroom, error.need / error.pairs))
    spec.headroom = _thousandths(grown) / 1000  # (what the forward reads: the same bound)
    spec.grown += 1
    sub = model.get_submodule(error.module) if error.module else model
    sub._spmd_ep = sub._spmd_ep._replace(headroom=_thousandths(grown))
    return spec.headroom


def _thousandths(headroom: float | None) -> int | None:
    return None if headroom is None else math.ceil(headroom * 1000 - 1e-9)


def _gate(self: nn.Module, h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return self.act_fn(gate) * up


_CLASSES: dict[type, type] = {}


def _ep_class(cls: type) -> type:
    sub = _CLASSES.get(cls)
    if sub is None:
        sub = type(f"ExpertParallel{cls.__name__}", (cls,),
                   {"forward": _ep_forward, "__module__": cls.__module__})
        _CLASSES[cls] = sub
    return sub


def place_experts(module: nn.Module, strategy: Any, handles: Any,
                  preset: ExpertParallel | None = None) -> dict[str, Any]:
    """Give every experts module of ``module`` that ``strategy.experts`` names the
    expert-parallel forward (its class swapped) and a spec (the ``preset``'s capacity
    factor); the specs by module path."""
    mesh = strategy.mesh
    specs: dict[str, Any] = {}
    paths = {name.rpartition(".")[0]: dim for name, dim in strategy.experts.items()}
    for path, dim in sorted(paths.items()):
        sub = module.get_submodule(path) if path else module
        if not _routed(sub):  # a pipeline stage's: placed on the whole model, and traced
            continue
        count = _whole(sub, _weights(sub)[0])[0]
        specs[path] = _place(sub, path, count, mesh, dim, handles,
                             _Reads(_tp_pieces(sub, path, strategy, handles)), preset,
                             strategy.context_dims)
    return specs


def _whole(module: nn.Module, name: str) -> tuple[int, ...]:
    """The whole shape of a placed parameter (from its record, without reading it: a
    sharded one would be gathered)."""
    param = module._parameters[name]
    return tuple(param._spmd_placement.shape)


def _headroom(preset: ExpertParallel | None, size: int, pipelined: bool) -> float | None:
    """The headroom a layer's received rows are bounded by (``spmd.ep.experts``): None
    where they are every pair of every rank (under a capacity factor, in a pipeline by
    default, or a headroom of ``size`` and more, which is the same bound)."""
    if preset is not None and preset.capacity_factor is not None:
        return None
    asked = preset.headroom if preset is not None else None
    if asked is None:
        asked = math.inf if pipelined else DEFAULT_HEADROOM
    return None if asked >= size else asked


def _place(sub: nn.Module, path: str, count: int, mesh: Any, dim: str, handles: Any,
           read: _Reads, preset: ExpertParallel | None, context: tuple[str, ...] = (),
           pipelined: bool = False) -> Any:
    """One experts module given the expert-parallel forward (its class swapped) and the
    spec of its ``count`` experts over ``dim`` (``context``: the dimensions the sequence
    is split over)."""
    from spmd.lowering.experts import ExpertsSpec

    size = mesh.size(dim)
    factor = preset.capacity_factor if preset is not None else None
    headroom = _headroom(preset, size, pipelined)
    live = not mesh.simulated
    spec = ExpertsSpec(module=path, num_experts=count, size=size,
                       group=mesh.get_group(dim) if live else None, mesh_dim=dim,
                       capacity_factor=factor, context_dims=tuple(context),
                       context_groups=tuple(mesh.get_group(d) for d in context) if live
                       else (),
                       headroom=None if headroom is None else _thousandths(headroom) / 1000,
                       context_ranks=math.prod(mesh.size(d) for d in context),
                       agree_groups=tuple(mesh.get_group(d) for d in mesh.dim_names
                                          if mesh.size(d) > 1) if live else ())
    names = _weights(sub)
    sub._spmd_ep_handle = handles.add(spec)
    sub._spmd_ep = _Placed(sub._spmd_ep_handle, size, count, names[0], names[1], read, factor,
                           _thousandths(headroom), spec.context_ranks)
    sub.__class__ = _ep_class(type(sub))
    return spec


def _tp_pieces(module: nn.Module, path: str, strategy: Any, handles: Any
               ) -> tuple[tuple[str, int], ...]:
    """(weight name, handle of its ``TPSpec``) for each stacked weight of ``module`` that
    a tensor-parallel dimension splits as well: the spec cuts this rank's experts (whole
    along the tensor-parallel dimensions) into its piece there."""
    from spmd.lowering.placements import divides
    from spmd.lowering.specs import TPSpec

    mesh = strategy.mesh
    found = []
    for local in _weights(module):
        name = f"{path}.{local}" if path else local
        placed = strategy.tp_placement(name)
        if not any(divides(p) for p in placed.values()):
            continue
        shape = list(_whole(module, local))  # this rank's experts, whole on "tp"
        shape[0] //= mesh.size(strategy.experts[name])
        spec = TPSpec(param=name, shape=tuple(shape), sharding=strategy.parameter_sharding(name),
                      dims=strategy.tp_dims,
                      groups={d: None if mesh.simulated else mesh.get_group(d)
                              for d in strategy.tp_dims})
        found.append((local, handles.add(spec)))
    return tuple(found)


def place_for_pipeline(preset: ExpertParallel, model: nn.Module, mesh: Any, handles: Any,
                       where: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``pipeline=`` with expert parallelism: the whole model's experts modules given the
    expert-parallel forward before it is traced (each stage's graph then holds the
    expert ops), their specs over dimension ``preset.dim`` of the stage mesh ``mesh``.
    Each expert parameter's name -> (that dimension, its shape on this rank, which the
    trace reads: the stages store only their experts)."""
    if preset.tensor_parallel is not None:
        raise NotImplementedError(
            f"{where}: expert tensor parallelism in a pipeline is not planned yet (each "
            f"stage's experts would need their pieces read in the traced graph); pass "
            f"spmd.ep.experts() without tensor_parallel=")
    if preset.headroom is not None and preset.headroom != math.inf:
        raise NotImplementedError(
            f"{where}: spmd.ep.experts(headroom={preset.headroom}) in a pipeline is not "
            f"supported: a layer that overflows runs its forward again on every rank, "
            f"and a pipeline's stages run theirs at different times; leave headroom out "
            f"(in a pipeline: every pair of every rank) or pass a capacity_factor")
    dims = () if mesh is None else mesh.dim_names
    dim = preset.dim or (dims[0] if len(dims) == 1 else None)
    if dim is None or dim not in dims:
        raise ValueError(
            f"{where}: spmd.ep.experts(dim={preset.dim!r}) in a pipeline: the experts are "
            f"split over a dimension of the stages' mesh (besides the pipeline's: "
            f"{dims}); name it with dim=")
    size = mesh.size(dim)
    params = preset.parameters(model, size, where, dim)
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for path in sorted(set(params.values())):
        sub = model.get_submodule(path) if path else model
        names = _weights(sub)
        count = getattr(sub, names[0]).shape[0]  # whole until a stage stores its own
        _place(sub, path, count, mesh, dim, handles, _Reads(), preset, pipelined=True)
        for local in names:
            shape = list(getattr(sub, local).shape)
            shape[0] //= size
            out[f"{path}.{local}" if path else local] = (dim, tuple(shape))
    return out
