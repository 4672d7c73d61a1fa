"""One pipeline stage as a module: its parameters and buffers under their names in the
model (so placements, checkpoints and optimizers see the model's names), and the stage's
traced forward for the current microbatch shape; with what building stages needs
around it (stand-ins for released parameters while tracing again, a group over the
stage mesh that every rank makes)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from spmd.runtime.mesh import Mesh

__all__ = ["StageModule", "stage_of", "siblings", "standing_in", "stage_mesh_group", "tp_dims",
           "stage_placements"]


class _Holder(nn.Module):
    pass


class StageModule(nn.Module):
    """One stage: its parameters under their names in the model, its buffers (those its
    code reads, and every other buffer of the modules that own them: a BatchNorm's
    ``num_batches_tracked`` with its running statistics, even where an evaluation step
    traced first reads only those), and the stage's traced forward for the current
    program (microbatch shape, mode)."""

    def __init__(self, index: int, model: nn.Module, params: tuple[str, ...],
                 buffers: tuple[str, ...]) -> None:
        super().__init__()
        self.index = index
        for name in params:
            self._place(name, model.get_parameter(name), True)
        self.hold(model, buffers + siblings(model, buffers))
        self.__dict__["_params"] = params
        self.__dict__["_names"] = (params, buffers)
        self.__dict__["_code"] = None

    def hold(self, model: nn.Module, buffers: tuple[str, ...]) -> None:
        """Hold ``buffers`` of ``model`` too (those not held yet)."""
        held = dict(self.named_buffers())
        for name in buffers:
            if name in held:
                continue
            owner, _, leaf = name.rpartition(".")
            module = model.get_submodule(owner)
            persistent = leaf not in module._non_persistent_buffers_set
            self._place(name, model.get_buffer(name), False, persistent)

    def _place(self, name: str, tensor: torch.Tensor, param: bool,
               persistent: bool = True) -> None:
        owner: nn.Module = self
        *path, leaf = name.split(".")
        for part in path:
            child = owner._modules.get(part)
            if child is None:
                child = _Holder()
                owner.add_module(part, child)
            owner = child
        if param:
            owner.register_parameter(leaf, tensor)  # type: ignore[arg-type]
        else:
            owner.register_buffer(leaf, tensor, persistent=persistent)

    def set_code(self, code: Any, names: tuple[tuple[str, ...], tuple[str, ...]]) -> None:
        """Run ``code`` on the parameters and buffers ``names`` (a program's)."""
        self.__dict__["_code"] = code
        self.__dict__["_names"] = names

    def forward(self, *inputs: Any) -> Any:
        params, buffers = self.__dict__["_names"]
        # by attribute: a parallelized stage may read its parameters through properties
        tensors = [_attr(self, n) for n in params + buffers]
        return self.__dict__["_code"](*tensors, *inputs)


def _attr(module: nn.Module, name: str) -> Any:
    for part in name.split("."):
        module = getattr(module, part)
    return module


def siblings(model: nn.Module, names: tuple[str, ...]) -> tuple[str, ...]:
    """Every buffer of the modules that own ``names`` (theirs only, not their children's)."""
    out: dict[str, None] = {}
    for name in names:
        owner, _, _ = name.rpartition(".")
        for leaf in model.get_submodule(owner)._buffers:
            if model.get_submodule(owner)._buffers[leaf] is not None:
                out[f"{owner}.{leaf}" if owner else leaf] = None
    return tuple(out)


def stage_of(module: nn.Module) -> StageModule:
    assert isinstance(module, StageModule)
    return module


def tp_dims(placements: Any) -> tuple[str, ...]:
    from spmd.tp import tp_dims_of

    return tuple(tp_dims_of(placements))


class standing_in:
    """Parameters this rank does not hold whole (``shapes``: name -> (whole shape, dtype);
    released ones, and a composed stage's shards and pieces) get a stand-in of their whole
    shape (one element, expanded) while the model is traced again for a new shape; each
    gets back what it held after."""

    def __init__(self, model: nn.Module, shapes: dict) -> None:
        self.model, self.shapes = model, shapes
        self.held: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def __enter__(self) -> None:
        for name, (shape, dtype) in self.shapes.items():
            p = self.model.get_parameter(name)
            self.held[name] = (p.data, p.grad)  # (a gradient of another shape refuses it)
            p.grad = None
            p.data = torch.zeros((), dtype=dtype, device=p.device).expand(shape)

    def __exit__(self, *exc: Any) -> None:
        for name, (data, grad) in self.held.items():
            p = self.model.get_parameter(name)
            p.data = data
            p.grad = grad
        self.held.clear()


def stage_mesh_group(mesh: Mesh, dim: str) -> Any:
    """A group over this rank's stage mesh (every dimension but the pipeline's), for
    strategies whose batch spans several of them. Every rank of the world makes every
    slice's group, in the same order, and keeps its own."""
    from spmd.runtime.groups import new_group, world

    state = world("parallelize")
    state.meshes += 1  # every rank counts the same meshes: the names agree
    d = mesh.dim_names.index(dim)
    mine = None
    for i in range(mesh.shape[d]):
        ranks = [r for r in mesh.ranks if mesh.coordinate_of(r)[d] == i]
        group = new_group(ranks, group_name=f"mesh{state.meshes}/stages-of-{dim}/{i}")
        if mesh.coordinate()[d] == i:
            mine = group
    return mine


def stage_placements(model: nn.Module, mesh: Mesh, placements: Any, stage_params: Any,
                     where: str, experts: Any = None) -> Any:
    """The tensor-parallel placements of one stage's parameters, by name (a preset such
    as ``megatron()`` resolved on the whole model, where it can see the layers), for the
    stage parallelized on its own. Placements of module outputs (sequence and context
    parallelism) are refused: a stage has its parameters, not the model's modules.
    ``experts`` (expert parameter name -> (dimension, shape), ``spmd.ep`` in a
    pipeline): the stage's own go with them, by name, in a list; None when nothing is
    placed."""
    from dataclasses import replace

    from spmd.ep import split_experts

    placements, preset = split_experts(placements)
    mine = tuple(n for n in stage_params if n in (experts or {}))
    ep = [replace(preset, dim=experts[mine[0]][0], names=mine)] if preset and mine else []
    if placements is None:
        return ep or None
    explicit = _explicit(model, mesh, placements, stage_params, where)
    return ep + [explicit] if ep else explicit


def _explicit(model: nn.Module, mesh: Mesh, placements: Any, stage_params: Any,
              where: str) -> dict[str, dict[str, Any]]:
    from spmd.state.resolve import resolve_layout

    params, activations = resolve_layout(model, mesh, placements, where)
    if activations:
        raise ValueError(
            f"{where}: placements that place module outputs (sequence or context "
            f"parallelism: {', '.join(sorted(activations)[:3])}) do not compose with "
            f"pipeline stages yet; place parameters only")
    explicit: dict[str, dict[str, Any]] = {d: {} for d in tp_dims(placements)}
    for name, per_dim in params.items():
        if name in stage_params:
            for dim, placement in per_dim.items():
                explicit.setdefault(dim, {})[name] = placement
    return explicit
