"""``parallelize``'s one dispatch: what the user gave (a model instance, a model class, a
training-step function, a model with a pipeline schedule) to the program that runs it
(:func:`build`). ``spmd.inspect`` plans without running by building the same program on
a simulated mesh and asking it for ``plan_for(*example_inputs)`` (:func:`plan_for`)."""

from __future__ import annotations

import copy
import enum
import functools
from typing import Any

import torch.nn as nn

from spmd.lowering.options import Options
from spmd.runtime.mesh import Mesh

__all__ = ["Target", "target_of", "build", "plan_for"]


class Target(enum.Enum):
    """What ``parallelize`` was given; the value says it in words."""

    MODULE = "a model instance"
    CLASS = "a model class"
    STEP = "a training-step function"
    PIPELINE = "a model cut into pipeline stages"


def target_of(target: Any, options: Options, where: str) -> Target:
    """Which :class:`Target` ``target`` is under ``options``; ``TypeError`` naming what was
    given where it is none."""
    if options.pipeline is not None:
        if not isinstance(target, nn.Module):
            raise TypeError(f"{where}: pipeline= takes a model instance (its stages are cut "
                            f"from it), got {type(target).__name__}")
        return Target.PIPELINE
    if isinstance(target, nn.Module):
        return Target.MODULE
    if isinstance(target, type) and issubclass(target, nn.Module):
        return Target.CLASS
    if callable(target):
        return Target.STEP
    raise TypeError(f"{where}: expected an nn.Module, an nn.Module subclass or a "
                    f"training-step function, got {type(target).__name__}")


def build(target: Any, options: Options, mesh: Mesh | None, where: str = "parallelize") -> Any:
    """``target`` parallelized with ``options`` on ``mesh``: the module itself (in place,
    its program in ``module._spmd``), a subclass whose instances are, a
    :class:`~spmd.program.step.ParallelStep`, or a
    :class:`~spmd.pipeline.module.PipelineModule`."""
    kind = target_of(target, options, where)
    if kind is Target.PIPELINE:
        from spmd.pipeline.module import parallelize_pipeline

        return parallelize_pipeline(target, options, mesh,
                                    f"{where}({type(target).__name__})")
    if kind is Target.MODULE:
        from spmd.program.wrapper import parallelize_instance

        return parallelize_instance(target, options, mesh)
    if kind is Target.CLASS:
        return _parallelize_class(target, options, mesh)
    from spmd.program.step import ParallelStep

    return ParallelStep(target, options, mesh)


def _parallelize_class(cls: type, options: Options, mesh: Mesh | None) -> type:
    """A subclass whose instances are parallelized when constructed."""
    from spmd.program.wrapper import parallelize_instance

    original_init = cls.__init__

    @functools.wraps(original_init)
    def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        if type(self) is new_cls:  # subclasses of the decorated class parallelize once
            parallelize_instance(self, options, mesh)

    new_cls = type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__,
                                          "__doc__": cls.__doc__})
    return new_cls


def plan_for(obj: Any, example_inputs: tuple, options: Options, mesh: Mesh,
             where: str = "spmd.inspect", **extras: Any) -> Any:
    """The plan of ``obj`` on ``example_inputs`` made without running a step: the
    program :func:`build` makes of it on the simulated ``mesh``, asked for
    ``Program.plan_for`` (``extras``: a pipeline's ``target=`` and ``loss_fn=``). A model
    is planned as a copy (it stays untouched), a sharded step on copies of its inputs."""
    from spmd.program.program import program_of

    kind = target_of(obj, options, where)
    if kind is Target.CLASS:
        raise TypeError(f"{where}: {obj.__name__} is a model class; plan an instance")
    if kind is Target.MODULE:
        from spmd.plan.planning import plan_module

        return plan_module(obj, example_inputs, options, mesh, where)
    if kind is Target.STEP:
        from spmd.program.step import ParallelStep

        if isinstance(obj, ParallelStep):
            obj = obj.fn
        if options.sharded:  # sharding replaces parameters: plan on copies
            example_inputs = copy.deepcopy(example_inputs)
    program = program_of(build(obj, options, mesh, where))
    assert program is not None
    return program.plan_for(*example_inputs, **extras)
