"""One handle for what ``spmd.parallelize`` builds, whatever it was given.

A model instance (or a class's instances) gets a :class:`~spmd.program.module.ModuleState`,
a training-step function is a :class:`~spmd.program.step.ParallelStep`, and a model cut
into stages is a :class:`~spmd.pipeline.module.PipelineModule`. Each is a
:class:`Program`: the options it was built with, the mesh it runs on (live, or simulated
for a plan made without processes) and its :meth:`Program.plan`. ``obj._spmd`` is the
program of any object ``parallelize`` returned (:func:`program_of`), so ``spmd.inspect``,
``spmd.checkpoint``, ``spmd.profile`` and ``spmd.Join`` ask one question of all three.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from spmd.lowering.options import Options
    from spmd.runtime.mesh import Mesh

__all__ = ["Program", "program_of"]


@runtime_checkable
class Program(Protocol):
    """What every parallelized object answers: ``options`` (as checked by
    ``Options.from_kwargs``), ``mesh`` (None: the default group's, resolved at the first
    step) and ``plan()`` (a :class:`~spmd.plan.plan.Plan`; a pipeline's a
    :class:`~spmd.pipeline.plan.PipelinePlan`)."""

    @property
    def options(self) -> Options: ...

    @property
    def mesh(self) -> Mesh | None: ...

    def plan(self) -> Any: ...


def program_of(obj: object) -> Program | None:
    """The program ``obj`` carries if ``spmd.parallelize`` made it (a model, a step, a
    pipeline), else None."""
    program = getattr(obj, "_spmd", None)
    return program if isinstance(program, Program) else None
