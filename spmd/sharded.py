"""Parameters stored as shards (``strategy="fsdp"``/``"hsdp"``), the way SimpleFSDP does it.

Each parameter comes to hold its dim-0 shard (padded where dim 0 does not divide, as
FSDP2 does; the ``nn.Parameter`` object stays the same, so an optimizer made before
keeps working): ``model.parameters()`` are the shards, so
any ``torch.optim`` optimizer keeps 1/N of the state, and ``.grad`` is the gradient's
shard. The module's class gets a property per parameter name that reads
``spmd.shard_gather(shard, handle)``: the whole tensor, in ``param_dtype``. So the
model's own code runs unchanged; eagerly each read is a blocking all-gather and each
gradient a blocking reduce-scatter (autograd's backward of the gather), and in a captured
graph the compiler buckets, overlaps and prefetches them (``spmd.lowering.shard_params``).

``state_dict()`` gives whole tensors (gathered: every rank must call it, as with torch's
full state dicts) and ``load_state_dict`` takes whole tensors and keeps each rank's
piece, so a checkpoint moves between a plain model and a sharded one either way.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.nn as nn

from spmd.lowering import ops
from spmd.lowering.specs import Handles, ShardSpec, lookup
from spmd.lowering.placements import Sharding
from spmd.writethrough import write_through

__all__ = ["shard_module", "shard_for", "spec_for", "hold_piece", "placement_of",
           "ParameterPlacement", "clip_grad_norm_", "total_norm", "install_clip", "gather_full"]

_CLASSES: dict[tuple[type, tuple[str, ...]], type] = {}


@dataclass(frozen=True, kw_only=True, slots=True)
class ParameterPlacement:
    """Where a parameter of a parallelized model lives.

    Attributes:
        name: its name in the model.
        shape: the whole (global) tensor's shape.
        sharding: its placement on every mesh dimension (``Shard(0)`` along the
            sharding dimension).
        local_shape: the shard this rank stores (dim 0 padded to ``rows``).
        rows: rows of dim 0 per rank; ``padding``: rows of zeros this rank's shard ends
            with (those beyond the whole tensor).
    """

    name: str
    shape: tuple[int, ...]
    sharding: Sharding
    local_shape: tuple[int, ...]
    rows: int
    padding: int


def placement_of(param: torch.Tensor) -> ParameterPlacement:
    """The global shape and placement of a sharded parameter (``model.parameters()`` of an
    ``fsdp``/``hsdp`` model); ``ValueError`` for any other tensor."""
    found = getattr(param, "_spmd_placement", None) if isinstance(param, torch.Tensor) else None
    if found is None:
        raise ValueError("spmd.placement_of: this tensor is not a sharded parameter of a model "
                         "parallelized with strategy 'fsdp' or 'hsdp' (ddp parameters are "
                         "replicated: whole on every rank)")
    return found


def _sharded_class(cls: type, handles: dict[str, int]) -> type:
    """``cls`` with a property per sharded parameter name. The handles differ per module,
    so the property reads them from the instance's table."""
    key = (cls, tuple(sorted(handles)))
    sub = _CLASSES.get(key)
    if sub is None:
        props = {n: _lookup_property(n) for n in handles}
        sub = type(f"Sharded{cls.__name__}", (cls,), {**props, "__module__": cls.__module__})
        _CLASSES[key] = sub
    return sub


def _lookup_property(name: str) -> property:
    def gathered(self: nn.Module) -> torch.Tensor:
        shard, handle = self._parameters[name], self._spmd_shard_handles[name]
        whole = ops.shard_gather(shard, handle)
        if torch.compiler.is_compiling():
            return whole
        spec: ShardSpec = lookup(handle)

        def store(values: torch.Tensor, changed: torch.Tensor | None) -> None:
            new = spec.shard_of(values)
            if changed is not None:
                new = torch.where(spec.shard_of(changed), new, shard)
            shard.copy_(new)

        return write_through(whole, store, spec.param, shard.dtype)

    gathered.__name__ = name
    return property(gathered, doc=f"{name}, gathered from its shards")


def shard_module(module: nn.Module, specs_for: Any, sharding: Sharding,
                 handles: Handles) -> dict[str, ShardSpec]:
    """Replace every parameter of ``module`` by its shard (see the module doc); every
    parameter name (tied ones included) -> its spec.

    ``specs_for(name, param) -> ShardSpec`` describes each distinct parameter;
    ``sharding`` is where every parameter lives on the mesh (or a function of its name).
    """
    shards: dict[int, tuple[nn.Parameter, ShardSpec, int]] = {}
    by_name: dict[str, ShardSpec] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        local: dict[str, int] = {}
        for pname, param in list(sub._parameters.items()):
            if param is None:
                continue
            name = f"{prefix}.{pname}" if prefix else pname
            entry = shards.get(id(param))
            if entry is None:
                spec = specs_for(name, param)
                shard = hold_piece(param, spec.shard_of(param), name)
                entry = shards[id(param)] = (shard, spec, handles.add(spec))
                shard._spmd_placement = ParameterPlacement(  # type: ignore[attr-defined]
                    name=name, shape=spec.shape,
                    sharding=sharding(name) if callable(sharding) else sharding,
                    local_shape=spec.local_shape, rows=spec.rows,
                    padding=spec.rows - spec.valid_rows())
            shard, spec, handle = entry
            sub._parameters[pname] = shard
            local[pname] = handle
            by_name[name] = spec
        if local and getattr(sub, "_spmd_shard_handles", None) is None:
            sub._spmd_shard_handles = local
            # tensor-parallel pieces: their property gathers the shards itself
            own = {n: h for n, h in local.items()
                   if n not in (getattr(sub, "_spmd_tp_handles", None) or {})}
            if own:
                sub.__class__ = _sharded_class(type(sub), own)
    return by_name


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


def spec_for(name: str, param: torch.Tensor, setup: Any, options: Any) -> ShardSpec:
    """How ``param`` is cut: along dim 0 over the strategy's sharding dimension, each rank
    ``ceil(rows / size)`` rows (a 0-dim parameter is one row)."""
    strategy = setup.strategy
    mesh = strategy.mesh
    dim, replicate = strategy.shard_dim, strategy.replicate_dim
    size = mesh.size(dim)
    rows = param.shape[0] if param.dim() else 1
    floating = param.is_floating_point()
    return ShardSpec(
        param=name, shape=tuple(param.shape), dtype=param.dtype, rows=-(-rows // size),
        group=None if mesh.simulated else mesh.get_group(dim), size=size, mesh_dim=dim,
        replicate_group=(None if mesh.simulated or replicate is None
                         else mesh.get_group(replicate)),
        replicate_size=mesh.size(replicate) if replicate else 1, replicate_dim=replicate or "",
        param_dtype=options.param_dtype if floating else None,
        reduce_dtype=options.reduce_dtype if floating else None)


def shard_for(module: nn.Module, setup: Any, options: Any, handles: Handles
              ) -> dict[str, ShardSpec]:
    """Shard ``module``'s parameters for ``setup``'s strategy (in place) and make its
    state dicts whole; every parameter name -> its spec."""
    install_clip()
    shards = shard_module(module, lambda name, p: spec_for(name, p, setup, options),
                          setup.strategy.parameter_sharding, handles)
    install_state_dict_hooks(module, shards)
    return shards


def gather_full(spec: ShardSpec, shard: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded parameter (or of a tensor laid out like it, such as
    its gradient), in the stored dtype: a blocking all-gather every rank must join."""
    src = shard.detach().contiguous()
    if not spec.live:
        return spec.whole(torch.cat([src] * spec.size)).clone()
    from spmd.runtime.collectives import all_gather_into_tensor

    out = src.new_empty((spec.size * spec.rows, *src.shape[1:]))
    all_gather_into_tensor(out, src, group=spec.group)
    return spec.whole(out).clone()


def install_state_dict_hooks(module: nn.Module, shards: dict[str, ShardSpec]) -> None:
    """Whole tensors in ``module.state_dict()``; whole (or already local) tensors accepted
    by ``load_state_dict``."""

    def to_full(mod: nn.Module, state: dict, prefix: str, local_metadata: Any) -> None:
        done: dict[int, torch.Tensor] = {}
        for name, spec in shards.items():
            key = prefix + name
            value = state.get(key)
            if value is None:
                continue
            full = done.get(id(spec))
            if full is None:
                full = done[id(spec)] = gather_full(spec, value)
            state[key] = full

    module._register_state_dict_hook(to_full)
    install_load_hook(module, shards, lambda spec, value: spec.shard_of(value.to(spec.dtype)),
                      "a sharded parameter", "shard")


def install_load_hook(module: nn.Module, specs: dict[str, Any], cut: Any, what: str,
                      piece: str) -> None:
    """Make ``load_state_dict`` take, for each parameter in ``specs`` (name -> a spec with
    ``shape`` and ``local_shape``), the whole tensor (``cut(spec, whole)`` keeps this
    rank's part) or this rank's part as it is; ``ValueError`` for any other shape."""
    weak = weakref.ref(module)

    def to_local(state: dict, prefix: str, *args: Any) -> None:
        if weak() is None:
            return
        for name, spec in specs.items():
            key = prefix + name
            value = state.get(key)
            if not isinstance(value, torch.Tensor):
                continue
            shape = tuple(value.shape)
            if shape == spec.shape:
                state[key] = cut(spec, value)
            elif shape != spec.local_shape:
                raise ValueError(
                    f"load_state_dict: {key} has shape {shape}; {what} takes the whole tensor "
                    f"{spec.shape} (or this rank's {piece} {spec.local_shape})")

    module._register_load_state_dict_pre_hook(to_local)


_ORIGINAL_CLIP: Any = None


def _split_over(param: torch.Tensor) -> tuple[Any, tuple[str, ...]]:
    """The mesh a parameter of a parallelized model is split on and the dimensions it is
    split along (sharded or tensor-parallel pieces); (None, ()) for a whole tensor."""
    placed = getattr(param, "_spmd_placement", None)
    if placed is None:
        return None, ()
    mesh = placed.sharding.mesh
    dims = tuple(d for d, p in zip(mesh.dim_names, placed.sharding.placements)
                 if p.is_shard() and mesh.size(d) > 1)
    return mesh, dims


def _is_split(params: list[torch.Tensor]) -> bool:
    return any(_split_over(p)[1] for p in params)


def _torch_clip_on_shards(parameters: Any, max_norm: float, norm_type: float = 2.0,
                          error_if_nonfinite: bool = False, foreach: Any = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_``, made right for shards: on a sharded model's
    parameters each rank holds part of every gradient, so torch's own function would clip
    each rank by its part of the norm; here the parts are summed over the group first.
    Anything else goes to torch's function unchanged."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if not _is_split(params):
        return _ORIGINAL_CLIP(params, max_norm, norm_type, error_if_nonfinite, foreach)
    total = total_norm(params, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from "
                           f"`parameters` is non-finite, so it cannot be clipped")
    return clip_grad_norm_(params, max_norm, norm_type, total=total)


def install_clip() -> None:
    """Point ``torch.nn.utils.clip_grad_norm_`` at :func:`_torch_clip_on_shards` (once):
    code that clips a sharded model the torch way then clips by the whole gradient's
    norm. A name imported from torch before any sharded model existed keeps torch's."""
    global _ORIGINAL_CLIP
    import torch.nn.utils as utils
    import torch.nn.utils.clip_grad as clip_module

    if _ORIGINAL_CLIP is not None:
        return
    _ORIGINAL_CLIP = clip_module.clip_grad_norm_
    utils.clip_grad_norm_ = _torch_clip_on_shards
    clip_module.clip_grad_norm_ = _torch_clip_on_shards


def total_norm(params: Iterable[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The norm of the whole gradient whose parts ``params`` hold on this rank.

    A parameter split along some mesh dimensions (``fsdp`` shards, tensor-parallel
    pieces, both) holds one part of its gradient per rank along them: each such group of
    parameters' local sum of ``|g|^p`` (max for the inf-norm) is summed over those
    dimensions' groups. Whole parameters count once. Every rank must call it."""
    grads: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            mesh, dims = _split_over(p)
            grads.setdefault((id(mesh), dims), []).append(p)
    if not grads:
        return torch.tensor(0.0)
    norm_type = float(norm_type)
    infinite = math.isinf(norm_type)
    # in the gradients' widest floating dtype, float32 at least (as torch's own, which
    # takes each norm in its gradient's dtype): float64 gradients get a float64 norm
    dtype = torch.float32
    for members in grads.values():
        for m in members:
            if m.grad.is_floating_point():
                dtype = torch.promote_types(dtype, m.grad.dtype)
    total = torch.tensor(0.0, dtype=dtype)
    for (_, dims), members in sorted(grads.items(), key=lambda kv: kv[0][1]):
        gs = [m.grad.detach() for m in members]
        if infinite:
            part = torch.stack([g.abs().max().to(dtype) for g in gs]).max()
        else:
            part = torch.stack([g.to(dtype).norm(norm_type) ** norm_type for g in gs]).sum()
        mesh = _split_over(members[0])[0]
        if dims and not mesh.simulated:
            from spmd.runtime.collectives import ReduceOp, all_reduce

            for dim in dims:
                all_reduce(part, op=ReduceOp.MAX if infinite else ReduceOp.SUM,
                           group=mesh.get_group(dim))
        total = torch.maximum(total, part) if infinite else total + part
    return total if infinite else total ** (1.0 / norm_type)


def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                    total: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for gradients split over ranks (shards, pieces):
    every rank clips by the norm of the whole gradient (:func:`total_norm`; padding rows
    hold zeros and add nothing); the norm."""
    params = list(params)
    if total is None:
        total = total_norm(params, norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.detach().mul_(coef.to(p.grad.dtype))
    return total
