"""Gradient clipping of a model whose gradients are split over ranks (fsdp, hsdp and zero
shards, tensor-parallel pieces, both): by the norm of the whole gradient, as one process
would clip, and ``torch.nn.utils.clip_grad_norm_`` pointed here so code written the torch
way clips right.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch

from spmd.lowering.placements import divides

__all__ = ["clip_grad_norm_", "total_norm", "install_clip"]

_ORIGINAL_CLIP: Any = None


def _split_over(param: torch.Tensor) -> tuple[Any, tuple[str, ...]]:
    """The mesh a parameter of a parallelized model is split on and the dimensions it is
    split along (sharded or tensor-parallel pieces); (None, ()) for a whole tensor."""
    placed = getattr(param, "_spmd_placement", None)
    if placed is None:
        return None, ()
    mesh = placed.sharding.mesh
    dims = tuple(d for d, p in zip(mesh.dim_names, placed.sharding.placements)
                 if divides(p) and mesh.size(d) > 1)
    return mesh, dims


def _is_split(params: list[torch.Tensor]) -> bool:
    return any(_split_over(p)[1] or _pipeline_of(p) is not None for p in params)


def _pipeline_of(param: torch.Tensor) -> Any:
    """The pipeline group a parameter's model is split over by stages (None: not)."""
    return getattr(param, "_spmd_pipeline", None)


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
    dimensions' groups. Whole parameters count once. The stages of a pipeline hold
    different parameters: their sums are summed over the pipeline's group (a parameter
    tied across stages counted on its first holder only). Every rank must call it."""
    params = list(params)
    grads: dict[tuple, list[torch.Tensor]] = {}
    pipeline = next((g for g in map(_pipeline_of, params) if g is not None), None)
    for p in params:
        if p.grad is not None and not getattr(p, "_spmd_pipeline_skip", False):
            mesh, dims = _split_over(p)
            grads.setdefault((id(mesh), dims), []).append(p)
    norm_type = float(norm_type)
    infinite = math.isinf(norm_type)
    if not grads and pipeline is None:
        return torch.tensor(0.0)
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
    if pipeline is not None and pipeline.size() > 1:
        from spmd.runtime.collectives import ReduceOp, all_reduce

        all_reduce(total, op=ReduceOp.MAX if infinite else ReduceOp.SUM, group=pipeline)
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
