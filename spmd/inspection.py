"""``spmd.inspect``: the plan of a parallelized model or step, or a plan made without
running one, for any number of ranks."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from spmd.plan import Plan
from spmd.runtime.mesh import Mesh

__all__ = ["inspect"]


def _planning_mesh(mesh: Mesh | None) -> Mesh:
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


def _inspect_pipeline(obj: Any, example_inputs: tuple, mesh: Mesh | None, strategy: str,
                      options: dict) -> Any:
    from spmd.lowering.options import Options
    from spmd.pipeline import inspect_pipeline

    options = dict(options)
    loss_fn, target = options.pop("loss_fn", None), options.pop("target", None)
    if options.get("pipeline") is None:
        raise TypeError("spmd.inspect: loss_fn= and target= plan a pipeline; pass "
                        "pipeline=spmd.pp.schedule(...) too")
    if not isinstance(obj, nn.Module):
        raise TypeError(f"spmd.inspect: a pipeline is cut from a model, got "
                        f"{type(obj).__name__}")
    if mesh is None or not mesh.simulated:
        raise ValueError("spmd.inspect: plan a pipeline on mesh=spmd.Mesh.simulated(shape, "
                         "dim_names) naming its 'pp' dimension")
    opts = Options.from_kwargs("spmd.inspect", strategy=strategy, **options)
    return inspect_pipeline(obj, tuple(example_inputs), target=target, loss_fn=loss_fn,
                            mesh=mesh, options=opts)


def inspect(obj: Any, *example_inputs: Any, mesh: Mesh | None = None, strategy: str = "ddp",
            **options: Any) -> Plan:
    """The :class:`~spmd.plan.Plan` of ``obj``.

    - ``inspect(model)`` / ``inspect(step_fn)`` of something ``parallelize`` returned: the
      plan of its last captured step.
    - ``inspect(model, *example_inputs, mesh=Mesh.simulated(1024), **options)``: plans
      without running a step and without processes: a copy of the model runs one forward
      and backward on the example inputs (the model itself is untouched, no optimizer
      runs, no collective is sent), with the buckets and predictions of ``mesh``.
    - ``inspect(step_fn, model, batch, opt, mesh=...)``: a whole step, traced on fake
      tensors (nothing runs at all).
    - ``inspect(model, x, mesh=Mesh.simulated((8, 8), ("pp", "fsdp")), pipeline=
      spmd.pp.schedule("1f1b", 8), loss_fn=F.cross_entropy, target=y)``: a pipeline's
      plan (:class:`spmd.pipeline_plan.PipelinePlan`), each stage planned on the other
      dimensions; ``inspect(pipelined_model)``: a running pipeline's.

    Example::

        plan = spmd.inspect(Transformer(), tokens, mesh=spmd.Mesh.simulated(1024))
        plan.summary(); plan.timeline(); plan.explain("layers.0.attn.in_proj_weight")
    """
    pipeline = options.get("pipeline")
    if pipeline is not None or {"loss_fn", "target"} & set(options):
        return _inspect_pipeline(obj, example_inputs, mesh, strategy, options)
    if not example_inputs and not options and mesh is None and strategy == "ddp":
        from spmd.pipeline import PipelineModule

        if isinstance(obj, PipelineModule):
            return obj.plan()
        state = getattr(obj, "_spmd", None)
        if state is None:
            raise TypeError(f"spmd.inspect: {type(obj).__name__} was not parallelized; pass the "
                            f"object spmd.parallelize returned, or example inputs and a mesh to "
                            f"plan it")
        return state.plan()
    from spmd.api import _parallelize_instance
    from spmd.lowering.options import Options

    planning = _planning_mesh(mesh)
    opts = Options.from_kwargs("spmd.inspect", strategy=strategy, **options)
    if isinstance(obj, nn.Module):
        if getattr(obj, "_spmd", None) is not None:
            raise ValueError("spmd.inspect: this model is already parallelized; call "
                             "spmd.inspect(model) for its plan, or plan an unparallelized copy")
        # a simulated mesh has no group to calibrate on: the plan records calibrate=False
        model = _parallelize_instance(copy.deepcopy(obj), replace(opts, calibrate=False),
                                      planning)
        model.train()
        out = model(*example_inputs)
        leaves = [t for t in pytree.tree_leaves(out)
                  if isinstance(t, torch.Tensor) and t.requires_grad]
        if not leaves:
            raise ValueError("spmd.inspect: the model's output does not require grad on these "
                             "inputs; there is no backward to plan")
        sum(t.float().sum() for t in leaves).backward()
        return model._spmd.plan()
    if callable(obj):
        from spmd.step import ParallelStep

        fn = obj.fn if isinstance(obj, ParallelStep) else obj
        if opts.sharded:  # sharding replaces parameters: plan on copies (model, optimizer)
            example_inputs = copy.deepcopy(example_inputs)
        step = ParallelStep(fn, opts, planning)
        return step.plan_for(*example_inputs)
    raise TypeError(f"spmd.inspect: expected a model or a step function, got {type(obj).__name__}")
