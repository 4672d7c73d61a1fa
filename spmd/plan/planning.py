"""Plans made without processes, under ``spmd.inspect`` and the layout search
(``strategy="auto"``): a model's (a copy runs one forward and backward on a simulated
mesh) and a step function's (traced on fake tensors). A pipeline's:
:mod:`spmd.pipeline.planning`."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from spmd.plan.plan import Plan
from spmd.runtime.mesh import Mesh

__all__ = ["planning_mesh", "plan_model"]


def planning_mesh(mesh: Mesh | None) -> Mesh:
    """A simulated mesh for planning: the given shape, else the live world's size."""
    if mesh is not None:
        if not isinstance(mesh, Mesh):
            raise TypeError(f"spmd.inspect: mesh must be an spmd.Mesh, got {type(mesh).__name__}")
        return mesh if mesh.simulated else Mesh.simulated(mesh.shape, mesh.dim_names)
    from spmd.runtime import groups

    if groups.is_initialized():
        return Mesh.simulated(groups.get_world_size())
    raise ValueError("spmd.inspect: pass mesh=spmd.Mesh.simulated(n) to plan for n ranks (no "
                     "process group is initialized to take the size from)")


def plan_model(obj: Any, example_inputs: tuple, mesh: Mesh | None, strategy: str,
               options: dict) -> Plan:
    """``spmd.inspect(obj, *example_inputs, mesh=, strategy=, **options)`` of a model (a
    copy runs one forward and backward) or a step function (traced on fake tensors)."""
    from spmd.lowering.options import Options
    from spmd.program.build import Target, build, target_of
    from spmd.program.program import program_of

    planning = planning_mesh(mesh)
    opts = Options.from_kwargs("spmd.inspect", strategy=strategy, **options)
    if not callable(obj):
        raise TypeError(f"spmd.inspect: expected a model or a step function, got "
                        f"{type(obj).__name__}")
    kind = target_of(obj, opts, "spmd.inspect")
    if kind is Target.CLASS:
        raise TypeError(f"spmd.inspect: {obj.__name__} is a model class; plan an instance")
    if kind is Target.MODULE:
        if program_of(obj) is not None:
            raise ValueError("spmd.inspect: this model is already parallelized; call "
                             "spmd.inspect(model) for its plan, or plan an unparallelized copy")
        # a simulated mesh has no group to calibrate on: the plan records calibrate=False
        model = build(copy.deepcopy(obj), replace(opts, calibrate=False), planning,
                      "spmd.inspect")
        model.train()
        out = model(*example_inputs)
        leaves = [t for t in pytree.tree_leaves(out)
                  if isinstance(t, torch.Tensor) and t.requires_grad]
        if not leaves:
            raise ValueError("spmd.inspect: the model's output does not require grad on these "
                             "inputs; there is no backward to plan")
        sum(t.float().sum() for t in leaves).backward()
        return model._spmd.plan()
    from spmd.program.step import ParallelStep

    fn = obj.fn if isinstance(obj, ParallelStep) else obj
    if opts.sharded:  # sharding replaces parameters: plan on copies (model, optimizer)
        example_inputs = copy.deepcopy(example_inputs)
    step = build(fn, opts, planning, "spmd.inspect")
    return step.plan_for(*example_inputs)
