"""Plans of a model made without processes: the simulated mesh to plan on, and a copy of
a model parallelized on it whose program plans one forward and backward
(:func:`plan_model`, what ``strategy="auto"`` and a pipeline's stages plan with).
``spmd.inspect`` of anything: :func:`spmd.program.build.plan_for`; a pipeline's:
:mod:`spmd.pipeline.planning`."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

from spmd.plan.plan import Plan
from spmd.runtime.mesh import Mesh

__all__ = ["planning_mesh", "plan_model", "plan_module"]


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


def plan_model(model: Any, example_inputs: tuple, mesh: Mesh | None, strategy: str,
               options: dict) -> Plan:
    """The plan of a copy of ``model`` (an unparallelized ``nn.Module``) with ``strategy``
    and ``options`` on the simulated ``mesh``: the copy is parallelized as ``parallelize``
    would, and its program's ``plan_for(*example_inputs)`` runs one forward and backward
    without sending anything; the model itself is untouched. What ``strategy="auto"``
    plans each candidate with, and a pipeline each stage with; ``spmd.inspect`` reaches
    it through :func:`spmd.program.build.plan_for`."""
    from spmd.lowering.options import Options

    opts = Options.from_kwargs("spmd.inspect", strategy=strategy, **options)
    return plan_module(model, example_inputs, opts, mesh)


def plan_module(model: Any, example_inputs: tuple, options: Any, mesh: Mesh | None,
                where: str = "spmd.inspect") -> Plan:
    """:func:`plan_model` with ``options`` already checked (an ``Options``)."""
    from spmd.program.program import program_of
    from spmd.program.wrapper import parallelize_instance

    if program_of(model) is not None:
        raise ValueError(f"{where}: this model is already parallelized; call "
                         f"spmd.inspect(model) for its plan, or plan an unparallelized copy")
    # a simulated mesh has no group to calibrate on: the plan records calibrate=False
    copied = parallelize_instance(copy.deepcopy(model), replace(options, calibrate=False),
                                  planning_mesh(mesh))
    return copied._spmd.plan_for(*example_inputs)
