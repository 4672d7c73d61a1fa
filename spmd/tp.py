"""Tensor parallelism: where parameters live on the named dimensions of a mesh, written as
glob patterns over parameter names, the way JAX users write partition specs.

    mesh = spmd.Mesh((2, 2), dim_names=("dp", "tp"))
    model = spmd.parallelize(Net(), mesh=mesh, placements={"tp": {
        "layers.*.linear1.weight": spmd.Shard(0),     # column-parallel
        "layers.*.linear1.bias":   spmd.Shard(0),
        "layers.*.linear2.weight": spmd.Shard(1)}})   # row-parallel
    model = spmd.parallelize(Net(), mesh=mesh, placements=spmd.tp.megatron())

Each parameter placed ``Shard(d)`` is stored as this rank's piece (``model.parameters()``
are the pieces, so an optimizer keeps only its part of the state); the model's code is
unchanged, and the compiler places everything computed from the pieces by the ops'
sharding rules, inserting only the collectives those placements need (a Megatron MLP:
one all-reduce in forward, one in backward). ``state_dict()`` gives whole tensors and
``load_state_dict`` takes whole tensors or this rank's pieces.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn as nn

from spmd.lowering.placements import Partial, Placement, Replicate, Shard
from spmd.lowering.strategy import tp_dims_of

__all__ = ["megatron", "Preset", "resolve_placements", "tp_dims_of", "shard_tensor_parallel",
           "install_state_dict_hooks", "COLUMN", "ROW"]

# Megatron-LM's layer names (and the common ones of Hugging Face and torch models):
# column-parallel layers split their output features, row-parallel their input features
COLUMN = ("q_proj", "k_proj", "v_proj", "query", "key", "value", "wq", "wk", "wv", "q", "k",
          "v", "fc1", "linear1", "w1", "w3", "up_proj", "gate_proj", "c_fc",
          "dense_h_to_4h", "ff1", "mlp_in", "in_proj")
ROW = ("o_proj", "out_proj", "wo", "o", "proj", "fc2", "linear2", "w2", "down_proj", "c_proj",
       "dense_4h_to_h", "ff2", "mlp_out", "dense")

Spec = Mapping[str, Mapping[str, Placement]]


@dataclass(frozen=True)
class Preset:
    """Placements decided from the model when it is parallelized (``megatron()``)."""

    name: str
    dim: str

    @property
    def dims(self) -> tuple[str, ...]:
        return (self.dim,)

    def resolve(self, model: nn.Module) -> dict[str, dict[str, Placement]]:
        if self.name == "megatron":
            return megatron(model, dim=self.dim)
        raise ValueError(f"unknown preset {self.name!r}")


def megatron(model: Any = None, *, dim: str = "tp") -> Any:
    """Megatron-LM's tensor parallelism for a transformer: in each block, the query, key
    and value projections and the MLP's first linear layer(s) column-parallel (weight and
    bias ``Shard(0)``), the attention's output projection and the MLP's second linear
    layer row-parallel (weight ``Shard(1)``, bias replicated). Layers are recognised by
    the names Megatron-LM, Hugging Face and torch use (:data:`COLUMN`, :data:`ROW`); a
    row-parallel layer is only split where a column-parallel sibling feeds it.

    Args:
        model: an ``nn.Module`` instance: its placements, ``{dim: {name: placement}}``;
            None (or a class): a :class:`Preset` resolved against the model
            ``parallelize`` or ``inspect`` is given.
        dim: the mesh dimension to split along.
    """
    if model is None or isinstance(model, type):
        return Preset("megatron", dim)
    if not isinstance(model, nn.Module):
        raise TypeError(f"spmd.tp.megatron: expected an nn.Module (or nothing), got "
                        f"{type(model).__name__}")
    placed: dict[str, Placement] = {}
    for prefix, module in model.named_modules():
        linears = {name: child for name, child in module.named_children()
                   if isinstance(child, nn.Linear)}
        columns = [n for n in linears if n in COLUMN]
        rows = [n for n in linears if n in ROW]
        if not columns:
            continue
        base = f"{prefix}." if prefix else ""
        for name in columns:
            placed[f"{base}{name}.weight"] = Shard(0)
            if linears[name].bias is not None:
                placed[f"{base}{name}.bias"] = Shard(0)
        for name in rows:
            placed[f"{base}{name}.weight"] = Shard(1)
    if not placed:
        raise ValueError(f"spmd.tp.megatron: no column-parallel layer found in "
                         f"{type(model).__name__} (nn.Linear children named one of "
                         f"{', '.join(COLUMN)}); write placements by name instead")
    return {dim: placed}


def resolve_placements(model: nn.Module, mesh: Any, spec: Any, where: str
                       ) -> dict[str, dict[str, Placement]]:
    """Each parameter name -> its placement per tensor-parallel dimension, from ``spec``
    (patterns over parameter names, or a preset); ``ValueError``/``TypeError`` naming
    the first thing wrong, before anything runs."""
    if isinstance(spec, Preset):
        spec = spec.resolve(model)
    dims = tp_dims_of(spec)
    params = dict(model.named_parameters())
    out: dict[str, dict[str, Placement]] = {}
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
            if isinstance(placement, Partial) or not isinstance(placement, (Shard, Replicate)):
                raise TypeError(f"{where}: placements[{dim!r}][{pattern!r}] must be "
                                f"spmd.Shard(d) or spmd.Replicate(), got {placement!r}")
            matched = [n for n in params if fnmatch.fnmatchcase(n, pattern)]
            if not matched:
                raise ValueError(f"{where}: placements[{dim!r}] pattern {pattern!r} matches no "
                                 f"parameter of {type(model).__name__} (names look like "
                                 f"{', '.join(list(params)[:3])})")
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
                previous = out.get(name, {}).get(dim)
                if previous is not None and previous != placement:
                    raise ValueError(f"{where}: {name} is placed {previous!r} and "
                                     f"{placement!r} on {dim!r} by two patterns")
                out.setdefault(name, {})[dim] = placement
    return out


def _property(name: str) -> property:
    from spmd.lowering.tensor_parallel import tp_param

    def whole(self: nn.Module) -> torch.Tensor:
        local = self._parameters[name]
        sharded = getattr(self, "_spmd_shard_handles", None)
        if sharded is not None and name in sharded:  # fsdp x tp: the piece from its shards
            from spmd.lowering.ops import shard_gather

            local = shard_gather(local, sharded[name])
        return tp_param(local, self._spmd_tp_handles[name])

    whole.__name__ = name
    return property(whole, doc=f"{name}, whole (from its tensor-parallel pieces)")


_CLASSES: dict[tuple[type, tuple[str, ...]], type] = {}


def _tp_class(cls: type, names: tuple[str, ...]) -> type:
    key = (cls, names)
    sub = _CLASSES.get(key)
    if sub is None:
        props = {n: _property(n) for n in names}
        sub = type(f"TensorParallel{cls.__name__}", (cls,), {**props,
                                                            "__module__": cls.__module__})
        _CLASSES[key] = sub
    return sub


def shard_tensor_parallel(module: nn.Module, strategy: Any, handles: Any) -> dict[str, Any]:
    """Store every parameter with a ``Shard`` placement as this rank's piece (in place;
    every rank of each tensor-parallel dimension must already hold the same whole
    parameters); every such parameter name (tied ones included) -> its
    :class:`~spmd.lowering.tensor_parallel.TPSpec`. A sharded strategy then shards the
    pieces along its dimension; :func:`install_state_dict_hooks` comes after it, so
    state dicts go shards -> pieces -> whole tensors and back."""
    from spmd.lowering.tensor_parallel import TPSpec
    from spmd.sharded import ParameterPlacement, install_clip

    install_clip()  # torch's clip_grad_norm_ on pieces: by the whole gradient's norm

    mesh = strategy.mesh
    groups = {d: None if mesh.simulated else mesh.get_group(d) for d in strategy.tp_dims}
    sizes = {d: mesh.size(d) for d in strategy.tp_dims}
    done: dict[int, tuple[nn.Parameter, Any, int]] = {}
    specs: dict[str, Any] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        local: dict[str, int] = {}
        for pname, param in list(sub._parameters.items()):
            if param is None:
                continue
            name = f"{prefix}.{pname}" if prefix else pname
            placed = strategy.tp_placement(name)
            entry = done.get(id(param))
            if entry is None:
                if not any(isinstance(p, Shard) for p in placed.values()):
                    continue
                spec = TPSpec(param=name, shape=tuple(param.shape), placements=placed,
                              sizes=sizes, groups=groups)
                piece = nn.Parameter(spec.piece(param.detach()).clone(),
                                     requires_grad=param.requires_grad)
                piece._spmd_placement = ParameterPlacement(  # type: ignore[attr-defined]
                    name=name, shape=spec.shape,
                    sharding=strategy.parameter_sharding(name), local_shape=spec.local_shape,
                    rows=spec.local_shape[0] if spec.local_shape else 1, padding=0)
                entry = done[id(param)] = (piece, spec, handles.add(spec))
            piece, spec, handle = entry
            sub._parameters[pname] = piece
            local[pname] = handle
            specs[name] = spec
        if local:
            sub._spmd_tp_handles = local
            sub.__class__ = _tp_class(type(sub), tuple(sorted(local)))
    _load_hook(module, specs)
    return specs


def install_state_dict_hooks(module: nn.Module, specs: dict[str, Any]) -> None:
    """Whole tensors in ``state_dict()`` (every rank of the tensor-parallel groups must
    call it); registered after any sharded strategy's hook, which gives the pieces."""

    def to_whole(mod: nn.Module, state: dict, prefix: str, local_metadata: Any) -> None:
        for name, spec in specs.items():
            key = prefix + name
            if isinstance(state.get(key), torch.Tensor):
                state[key] = spec.whole(state[key])

    module._register_state_dict_hook(to_whole)


def _load_hook(module: nn.Module, specs: dict[str, Any]) -> None:
    """Whole tensors or this rank's pieces accepted by ``load_state_dict`` (before any
    sharded strategy's hook, which takes pieces)."""
    from spmd.sharded import install_load_hook

    install_load_hook(module, specs, lambda spec, value: spec.piece(value).clone(),
                      "a tensor-parallel parameter", "piece")
