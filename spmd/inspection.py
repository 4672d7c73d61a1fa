"""``spmd.inspect``: the plan of a parallelized model or step, or a plan made without
running one, for any number of ranks."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from spmd.lowering.options import Options
from spmd.plan.plan import Plan
from spmd.program.program import program_of
from spmd.runtime.mesh import Mesh

__all__ = ["inspect"]


def _inspect_auto(obj: Any, example_inputs: tuple, mesh: Mesh | None, options: dict) -> Any:
    from spmd.auto.search import plan_auto
    from spmd.plan.planning import planning_mesh

    if not isinstance(obj, nn.Module):
        raise TypeError(f"spmd.inspect: strategy='auto' searches a model's layout, got "
                        f"{type(obj).__name__}")
    if program_of(obj) is not None:
        raise ValueError("spmd.inspect: this model is already parallelized; plan an "
                         "unparallelized copy")
    if not example_inputs:
        raise TypeError("spmd.inspect: strategy='auto' needs example inputs (one rank's batch)")
    options = dict(options)
    if options.get("pipeline") is not None:
        from spmd.auto.pipeline import plan_pipeline_auto

        if mesh is None or not mesh.simulated:
            raise ValueError("spmd.inspect: plan a pipeline on mesh=spmd.Mesh.simulated(shape, "
                             "dim_names) naming its 'pp' dimension")
        options.pop("optimizer", None)
        return plan_pipeline_auto(obj, tuple(example_inputs), mesh=mesh,
                                  pipeline=options.pop("pipeline"),
                                  loss_fn=options.pop("loss_fn", None),
                                  target=options.pop("target", None),
                                  memory_budget=options.pop("memory_budget", None),
                                  placements=options.pop("placements", None), **options)
    auto = plan_auto(obj, tuple(example_inputs), mesh=planning_mesh(mesh),
                     memory_budget=options.pop("memory_budget", None),
                     placements=options.pop("placements", None),
                     optimizer=options.pop("optimizer", "adamw"), **options)
    plan = auto.chosen.plan
    plan.auto = auto
    return plan


def inspect(obj: Any, *example_inputs: Any, mesh: Mesh | None = None, strategy: str = "ddp",
            **options: Options) -> Plan:
    """The :class:`~spmd.plan.plan.Plan` of ``obj``.

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
      plan (:class:`spmd.pipeline.plan.PipelinePlan`), each stage planned on the other
      dimensions; ``inspect(pipelined_model)``: a running pipeline's.

    Example::

        plan = spmd.inspect(Transformer(), tokens, mesh=spmd.Mesh.simulated(1024))
        plan.summary(); plan.timeline(); plan.explain("layers.0.attn.in_proj_weight")
    """
    if strategy == "auto":
        return _inspect_auto(obj, example_inputs, mesh, options)
    if "memory_budget" in options:
        raise TypeError("spmd.inspect: memory_budget= is the budget of strategy='auto'")
    pipeline = options.get("pipeline")
    if pipeline is not None or {"loss_fn", "target"} & set(options):
        return _inspect_pipeline(obj, example_inputs, mesh, strategy, options)
    if not example_inputs and not options and mesh is None and strategy == "ddp":
        program = program_of(obj)
        if program is None:
            raise TypeError(f"spmd.inspect: {type(obj).__name__} was not parallelized; pass the "
                            f"object spmd.parallelize returned, or example inputs and a mesh to "
                            f"plan it")
        return program.plan()
    from spmd.plan.planning import planning_mesh
    from spmd.program.build import plan_for

    if not callable(obj):
        raise TypeError(f"spmd.inspect: expected a model or a step function, got "
                        f"{type(obj).__name__}")
    opts = Options.from_kwargs("spmd.inspect", strategy=strategy, **options)
    return plan_for(obj, example_inputs, opts, planning_mesh(mesh))


def _inspect_pipeline(obj: Any, example_inputs: tuple, mesh: Mesh | None, strategy: str,
                      options: dict) -> Any:
    """``spmd.inspect(model, *inputs, mesh=Mesh.simulated(...), pipeline=, loss_fn=,
    target=)``: the pipeline ``parallelize`` would build, planned for the inputs."""
    from spmd.program.build import plan_for

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
    return plan_for(obj, tuple(example_inputs), opts, mesh, loss_fn=loss_fn, target=target)
