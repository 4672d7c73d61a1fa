"""From the placements a user writes to each parameter's placement: glob patterns over
parameter and module names per mesh dimension (``{"tp": {"layers.*.fc1.weight":
spmd.Shard(0)}}``), presets (``spmd.tp.megatron()``, ``spmd.cp.ring()``) or a list of
both, resolved against one model and checked before anything runs. Public as
``spmd.tp.resolve_layout`` and ``spmd.tp.resolve_placements``."""

from __future__ import annotations

import fnmatch
from typing import Any, Mapping

import torch.nn as nn

from spmd.lowering.placements import Partial, Placement, Replicate, Shard, StridedShard
from spmd.lowering.strategy import tp_dims_of
from spmd.runtime.mesh import Mesh

__all__ = ["resolve_placements", "resolve_layout", "layout_options"]


def resolve_placements(model: nn.Module, mesh: Mesh, spec: Any, where: str
                       ) -> dict[str, dict[str, Placement]]:
    """Each parameter name -> its placement per tensor-parallel dimension (see
    :func:`resolve_layout`, which also gives the placed activations)."""
    return resolve_layout(model, mesh, spec, where)[0]


def resolve_layout(model: nn.Module, mesh: Mesh, spec: Any, where: str
                   ) -> tuple[dict[str, dict[str, Placement]], dict[str, dict[str, Placement]]]:
    """From ``spec`` (patterns over parameter and module names, or a preset): each
    parameter name -> its placement per tensor-parallel dimension, and each module whose
    output is placed -> that placement per dimension. A pattern that matches parameters
    places them; one that matches no parameter but modules places those modules'
    outputs (sequence parallelism: ``{"tp": {"layers.*.norm": spmd.Shard(1)}}``).
    ``ValueError``/``TypeError`` naming the first thing wrong, before anything runs."""
    if isinstance(spec, (list, tuple)):  # several: each resolved, merged
        params: dict[str, dict[str, Placement]] = {}
        placed: dict[str, dict[str, Placement]] = {}
        for one in spec:
            p, a = resolve_layout(model, mesh, one, where)
            for target, found in ((params, p), (placed, a)):
                for name, per_dim in found.items():
                    for dim, placement in per_dim.items():
                        _put(target, name, dim, placement, where)
        return params, placed
    if hasattr(spec, "resolve") and not isinstance(spec, Mapping):
        spec = spec.resolve(model)
    dims = tp_dims_of(spec)
    params = dict(model.named_parameters())
    modules = [path for path, _ in model.named_modules() if path]
    out: dict[str, dict[str, Placement]] = {}
    activations: dict[str, dict[str, Placement]] = {}
    for dim in dims:
        if dim not in mesh.dim_names:
            raise ValueError(f"{where}: placements name mesh dimension {dim!r}; the mesh has "
                             f"{mesh.dim_names}")
        patterns = spec[dim]
        if not isinstance(patterns, Mapping):
            raise TypeError(f"{where}: placements[{dim!r}] must map parameter name patterns "
                            f"to placements, got {type(patterns).__name__}")
        size = mesh.size(dim)
        for pattern, placement in patterns.items():
            if not isinstance(pattern, str):
                raise TypeError(f"{where}: placements[{dim!r}] keys are parameter name "
                                f"patterns (str), got {pattern!r}")
            if isinstance(placement, Partial) or not isinstance(
                    placement, (Shard, Replicate, StridedShard)):
                raise TypeError(f"{where}: placements[{dim!r}][{pattern!r}] must be "
                                f"spmd.Shard(d), spmd.StridedShard(d, split) or "
                                f"spmd.Replicate(), got {placement!r}")
            matched = [n for n in params if fnmatch.fnmatchcase(n, pattern)]
            if not matched:
                outputs = [m for m in modules if fnmatch.fnmatchcase(m, pattern)]
                if not outputs:
                    raise ValueError(f"{where}: placements[{dim!r}] pattern {pattern!r} "
                                     f"matches no parameter of {type(model).__name__} (names "
                                     f"look like {', '.join(list(params)[:3])}) and no module")
                if isinstance(placement, StridedShard):
                    raise TypeError(f"{where}: placements[{dim!r}][{pattern!r}] places "
                                    f"module outputs: spmd.Shard(d) or spmd.Replicate(), got "
                                    f"{placement!r}")
                if isinstance(placement, Shard) and placement.dim < 0:
                    raise ValueError(f"{where}: placements[{dim!r}][{pattern!r}] places "
                                     f"module outputs: count the dimension from the front "
                                     f"(Shard(1) for (batch, sequence, hidden)), got "
                                     f"{placement!r}")
                for path in outputs:
                    _put(activations, path, dim, placement, where)
                continue
            for name in matched:
                p = params[name]
                if isinstance(placement, Shard):
                    d = placement.dim + p.dim() if placement.dim < 0 else placement.dim
                    if not 0 <= d < p.dim():
                        raise ValueError(f"{where}: {name} has {p.dim()} dimensions; "
                                         f"{placement!r} is out of range")
                    if p.shape[d] % size:
                        raise ValueError(f"{where}: {name} has shape {tuple(p.shape)}; "
                                         f"dimension {d} ({p.shape[d]}) does not divide over "
                                         f"the {size} ranks of {dim!r}")
                    placement = Shard(d)
                elif isinstance(placement, StridedShard):
                    d = placement.dim + p.dim() if placement.dim < 0 else placement.dim
                    if not 0 <= d < p.dim():
                        raise ValueError(f"{where}: {name} has {p.dim()} dimensions; "
                                         f"{placement!r} is out of range")
                    if p.shape[d] % (placement.split * size):
                        raise ValueError(f"{where}: {name} has shape {tuple(p.shape)}; "
                                         f"dimension {d} ({p.shape[d]}) does not divide into "
                                         f"{placement.split} blocks over the {size} ranks of "
                                         f"{dim!r}")
                    placement = StridedShard(d, placement.split)
                _put(out, name, dim, placement, where)
    return out, activations


def layout_options(spec: Any) -> dict[str, dict[str, Any]]:
    """Options presets in ``spec`` carry for the strategy (``spmd.cp.ring``'s
    ``load_balance`` per dimension)."""
    found: dict[str, dict[str, Any]] = {}
    for one in spec if isinstance(spec, (list, tuple)) else [spec]:
        for key, per_dim in (one.options() if hasattr(one, "options") else {}).items():
            found.setdefault(key, {}).update(per_dim)
    return found


def _put(out: dict[str, dict[str, Placement]], name: str, dim: str, placement: Placement,
         where: str) -> None:
    previous = out.get(name, {}).get(dim)
    if previous is not None and previous != placement:
        raise ValueError(f"{where}: {name} is placed {previous!r} and {placement!r} on "
                         f"{dim!r} by two patterns")
    out.setdefault(name, {})[dim] = placement
