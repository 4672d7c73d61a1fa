"""One program type for what ``spmd.parallelize`` builds, whatever it was given.

A :class:`Program` is a model (or step, or pipeline) bound to a mesh with the options it
was built with: live, it runs steps; on a simulated mesh it only plans. There are three
kinds, one per thing a user hands over, each a subclass:

- :class:`~spmd.program.module.ModuleState`: a model instance (or a class's instances),
  captured region by region as its forward runs;
- :class:`~spmd.program.step.ParallelStep`: a whole training-step function, traced once
  per input signature (forward, backward and optimizer in one graph);
- :class:`~spmd.pipeline.module.PipelineModule`: a model cut into pipeline stages, each
  stage a ``ModuleState`` on the other mesh dimensions.

All three are built by one dispatch (:func:`spmd.program.build.build`) and answer the
same questions: :meth:`Program.plan` (the plan of what ran), :meth:`Program.plan_for`
(the plan of example inputs without running a step: what ``spmd.inspect(obj, *inputs,
mesh=Mesh.simulated(...))`` returns, building the same program on a simulated mesh), and
``options`` / ``mesh``. ``strategy="auto"`` is a search over programs built this way.
``obj._spmd`` is the program of any object ``parallelize`` returned (:func:`program_of`),
so ``spmd.inspect``, ``spmd.checkpoint``, ``spmd.profile`` and ``spmd.Join`` ask one
question of all three.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spmd.lowering.options import Options
    from spmd.runtime.mesh import Mesh

__all__ = ["Program", "program_of"]


class Program(ABC):
    """What every parallelized object is.

    Attributes:
        options: the options it was built with (as ``Options.from_kwargs`` checked them).
        mesh: the mesh it runs on, live or simulated (None: the default group's, resolved
            at the first step).
    """

    options: Options
    mesh: Mesh | None

    @abstractmethod
    def plan(self) -> Any:
        """The plan of what ran (a :class:`~spmd.plan.plan.Plan`; a pipeline's
        :class:`~spmd.pipeline.plan.PipelinePlan`); ``RuntimeError`` before the first
        step."""

    @abstractmethod
    def plan_for(self, *example_inputs: Any, **kwargs: Any) -> Any:
        """The plan of a step on ``example_inputs``, made without running one: nothing is
        sent and no optimizer steps (on a simulated mesh nothing can be)."""

    @property
    def simulated(self) -> bool:
        """Whether it only plans (its mesh exists on paper)."""
        return self.mesh is not None and self.mesh.simulated


def program_of(obj: object) -> Program | None:
    """The program ``obj`` carries if ``spmd.parallelize`` made it (a model, a step, a
    pipeline), else None."""
    program = getattr(obj, "_spmd", None)
    return program if isinstance(program, Program) else None
