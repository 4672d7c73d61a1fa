"""Running a pipeline: ``parallelize(model, mesh=, pipeline=spmd.pp.schedule(...))``.

What :class:`PipelineModule` does each ``step(inputs, target, loss_fn)``:

1. Splits every tensor of the batch along dim 0 into the schedule's microbatches.
2. On the first step of a program (a microbatch shape, a loss, grad mode on or off, the
   modules' ``training`` flags), traces the model with its loss and cuts the graph into
   stages (:mod:`spmd.lowering.stages`); the cut points chosen on the first step hold for
   every later program, so each stage keeps its parameters. A plain attribute of the
   model's modules (a number, flag, string) changed since a program's trace traces it
   again (as whole steps do, :func:`spmd.program.step._attributes`). This rank keeps only its
   stages' parameters; the others are released (what no stage reads stays on the first
   pipeline rank, whose state dict holds it; an optimizer handed to ``release_with``
   drops the released parameters' state).
3. Runs this rank's actions (:mod:`spmd.pp`) in order. ``F``: the stage's forward on the
   microbatch and what it received, its outputs sent on at once (``isend``); ``B``: the
   backward from the gradients its consumers sent back (the last stage starts from the
   loss, scaled by ``1 / microbatches``); ``W``: the weight gradient of a split
   backward. Receives are posted one action ahead, so the transfer of the next input
   overlaps this action's compute.
4. Sums the gradients of tied parameters (read in stages on several ranks) across their
   holders: what this step added only, so gradients accumulated over several ``step``
   calls before ``opt.step()`` are what one process would hold.
5. Returns the step's loss (the mean of the microbatches' losses), on every pipeline rank.

Buffers written in the forward (BatchNorm's running statistics, ``num_batches_tracked``)
are written once per microbatch, by the stage that holds them: the statistics are one
process's running the same microbatches in order (not one process on the whole batch,
whose batch statistics differ).

Composition: a stage runs as its own module on the other mesh dimensions
(``parallelize(stage, mesh=mesh[others], strategy=, placements=)``), so ``fsdp``/``hsdp``
and tensor parallelism apply to it as to any model. ``ddp`` gradients accumulate over the
microbatches and are averaged once, at the end of the step; sharded gradients are
reduce-scattered each backward (a gradient must stay a shard), which sums to the same.
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from spmd.lowering.balance import balance
from spmd.lowering.options import Options
from spmd.lowering.stages import Cut, candidates, cut, trace
from spmd.pipeline.actions import Actions, StepState, Traced
from spmd.pipeline.stage import (StageModule, siblings, stage_mesh_group, stage_of,
                                 stage_placements, standing_in)
from spmd.pipeline.stored import Stored
from spmd.pp import Action, Schedule
from spmd.program.program import Program
from spmd.runtime.mesh import Mesh

__all__ = ["PipelineModule", "parallelize_pipeline", "check_pipeline"]


class PipelineModule(Actions, Stored, nn.Module, Program):
    """A model split into pipeline stages over a mesh dimension (``"pp"``); see the module
    docstring. ``module`` is the model (this rank's stages' parameters; the others empty
    after the first step); ``step`` trains on one batch; ``plan()`` shows the stages, the
    schedule and its predicted timeline."""

    def __init__(self, module: nn.Module, schedule: Schedule, mesh: Mesh, options: Options,
                 where: str) -> None:
        super().__init__()
        self.module = module
        self.schedule = schedule
        self._where = where
        self._mesh = mesh
        self._options = options
        self._ranks = mesh.size(schedule.dim)
        schedule.check(self._ranks, where)
        self._group = None if mesh.simulated else mesh.get_group(schedule.dim)
        self._pp_rank = 0 if mesh.simulated else mesh.coordinate()[
            mesh.dim_names.index(schedule.dim)]
        others = tuple(d for d in mesh.dim_names if d != schedule.dim)
        self._others = mesh[others] if others else None
        if self._others is not None and self._others.size() > 1 and not mesh.simulated:
            self._others._whole_group = stage_mesh_group(mesh, schedule.dim)
        # spmd.ep: the experts modules take the expert-parallel forward before the model
        # is traced (each stage's graph holds the expert ops); name -> (dimension, the
        # shape this rank stores and the trace reads)
        self._experts: dict[str, tuple[str, tuple[int, ...]]] = {}
        from spmd.ep import split_experts

        preset = split_experts(options.placements)[1]
        if preset is not None:
            from spmd.ep import place_for_pipeline
            from spmd.lowering.specs import Handles

            self._expert_handles = Handles()
            self._experts = place_for_pipeline(preset, module, self._others,
                                               self._expert_handles, where)
        self._split_points: tuple[str, ...] | None = schedule.split_points
        self._chosen = "named by the user" if schedule.split_points else ""
        self._programs: dict[Any, Traced] = {}
        self._stages: dict[int, nn.Module] = {}  # this rank's, by stage index
        # planning without processes: every stage here, none composed (each is planned on
        # its own, see spmd.pipeline.planning.plan_pipeline), no parameter released
        self._planning = mesh.simulated
        self._composed = (self._others is not None and self._others.size() > 1
                          and not self._planning)
        self._released: dict[str, tuple[torch.Size, torch.dtype]] = {}
        # what no stage reads (an unused parameter, a buffer no stage's code touches): kept
        # by the first pipeline rank, so the ranks' state dicts together hold every entry
        self._unread: tuple[str, ...] = ()
        # optimizers whose state of the parameters this rank releases goes with them
        self._optimizers: weakref.WeakSet = weakref.WeakSet()
        self._last_cut: Cut | None = None
        self._traces = 0  # programs traced (each microbatch shape, mode, attribute change)
        self.last_spans: list[tuple[Action, float, float]] = []

    # -- the stages -----------------------------------------------------------------

    def local_stages(self) -> list[int]:
        n = self.schedule.stages(self._ranks)
        if self._planning:
            return list(range(n))
        return [s for s in range(n) if self.schedule.rank_of(s, self._ranks) == self._pp_rank]

    def _program(self, leaves: list, spec: Any, loss_fn: Any) -> Traced:
        from spmd.program.step import RETRACE_WARNING, _attributes, _changed

        # a trace bakes in the shapes, the loss, grad mode and every module's training
        # flag (dropout, BatchNorm, anything reading self.training): one program for each
        key = (spec, tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t
                           for t in leaves), loss_fn, torch.is_grad_enabled(),
               tuple(m.training for m in self.module.modules()))
        program = self._programs.get(key)
        if program is not None and _changed(program.attributes) is None:
            return program
        self._traces += 1
        if self._traces == RETRACE_WARNING:
            import warnings

            warnings.warn(f"{self._where} has been traced {RETRACE_WARNING} times (each new "
                          f"microbatch shape, loss function, grad mode, train/eval mode or "
                          f"module attribute traces again); pass values that change every "
                          f"step, such as a loss weight, as tensors", stacklevel=3)
        args, target = pytree.tree_unflatten(leaves, spec)
        n = self.schedule.stages(self._ranks)
        with standing_in(self.module, {**self._released, **self._placed(),
                                       **self._expert_shapes()}):
            marked = list(self._split_points) if self._split_points else candidates(self.module)
            traced = trace(self.module, loss_fn, args, target, marked, self._where,
                           cast=self._options.param_dtype)
        self._traced = traced
        if self._split_points is None:
            points, why = balance(traced, n, self._where)
            self._split_points, self._chosen = tuple(points), why
        result = cut(traced, self._split_points, self._where, self._chosen)
        self._agree(result)
        if self._stages:
            for s, module in self._stages.items():
                stage = result.stages[s]
                if stage_of(module).__dict__["_params"] != stage.params:
                    raise RuntimeError(f"{self._where}: stage {s} reads other parameters for "
                                       f"this input shape, mode or attribute values than "
                                       f"for the first; the model's forward must read the "
                                       f"same parameters every step")
                stage_of(module).hold(self.module, stage.buffers)
            # a buffer this program reads (only in training, say) is its stage's now
            read = self._read(result)
            self._unread = tuple(n for n in self._unread if n not in read)
        else:
            self._build(result)
        # as the trace leaves them (what its forward set itself is no change)
        program = Traced(cut=result, spec=spec, attributes=_attributes(self.module))
        self._programs[key] = program
        self._use(result)
        self._last_cut = result
        return program

    def _agree(self, result: Cut) -> None:
        """Every pipeline rank must have cut the same graph (the same model, batch shapes
        and loss): a receive sized by one rank's cut and sent by another's would corrupt or
        hang. Compared once per microbatch shape; a difference is named by rank."""
        if self._group is None or self._ranks == 1:
            return
        from spmd.runtime.objects import all_gather_object

        mine = (result.split_points, [(c.src, c.dsts, c.shape, str(c.dtype), c.grad)
                                      for c in result.crossings],
                sorted(result.tied.items()))
        every: list[Any] = [None] * self._ranks
        all_gather_object(every, mine, group=self._group)
        for r, theirs in enumerate(every):
            if theirs != every[0]:
                a, b = self._group.ranks[0], self._group.ranks[r]
                raise RuntimeError(
                    f"{self._where}: the pipeline's ranks cut different graphs: rank {a} "
                    f"cut at {list(every[0][0])} with {len(every[0][1])} values crossing, "
                    f"rank {b} at {list(theirs[0])} with {len(theirs[1])} (the model, the "
                    f"batch's shapes and the loss must be the same on every rank of a "
                    f"pipeline)")

    def _recut(self, points: list[str], why: str) -> Cut:
        """Planning: the last traced graph cut again at ``points``, the stages rebuilt."""
        assert self._planning
        self._split_points, self._chosen = tuple(points), why
        result = cut(self._traced, self._split_points, self._where, why)
        self._stages = {}
        self._build(result)
        self._use(result)
        self._last_cut = result
        return result

    def _use(self, result: Cut) -> None:
        """This rank's stages run ``result``'s code (each step: programs alternate)."""
        for s, module in self._stages.items():
            stage = result.stages[s]
            stage_of(module).set_code(stage.code, (stage.params, stage.buffers))

    def _placed(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """This rank's parameters stored in parts by a composed stage (fsdp shards, tensor-
        parallel pieces): name -> (whole shape, dtype), for tracing again."""
        layout = self.layout()
        if layout is None:
            return {}
        return {name: (layout.records[name].shape, self.module.get_parameter(name).dtype)
                for name in set(layout.shards) | set(layout.pieces)}

    def _expert_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The experts as a stage stores them (this rank's), for tracing: name ->
        (shape, dtype)."""
        return {name: (shape, self.module.get_parameter(name).dtype)
                for name, (_, shape) in self._experts.items()}

    def _read(self, result: Cut) -> set[str]:
        """What some stage of ``result`` holds: its parameters and buffers, with the other
        buffers of the modules owning those (``StageModule`` holds them too)."""
        return {n for stage in result.stages for n in
                stage.params + stage.buffers + siblings(self.module, stage.buffers)}

    def _build(self, result: Cut) -> None:
        local = self.local_stages()
        kept: set[str] = set()
        for name, stages in result.tied.items():
            mine = [s for s in stages if s in local]
            if self._composed and len(mine) > 1:
                raise ValueError(
                    f"{self._where}: parameter {name!r} is read in stages {mine}, which "
                    f"this rank both holds; with a strategy on the other mesh dimensions "
                    f"each stage is parallelized on its own and cannot share it: cut so "
                    f"that one stage holds every use, or untie it")
        read = self._read(result)
        self._unread = tuple(n for n, _ in [*self.module.named_parameters(),
                                            *self.module.named_buffers()] if n not in read)
        if self._pp_rank == 0:
            kept.update(self._unread)  # released everywhere, they would be lost
        for s in local:
            stage = result.stages[s]
            module = StageModule(s, self.module, stage.params, stage.buffers)
            kept.update(stage.params + stage.buffers)
            if self._composed:
                module = self._compose(module, stage)
            self._stages[s] = module
        if self._planning:
            return
        from spmd.eager.clip import install_clip

        install_clip()  # torch's clip_grad_norm_ on a stage's parameters: the whole norm
        first_holder = {name: min(self.schedule.rank_of(s, self._ranks) for s in stages)
                        for name, stages in result.tied.items()}
        for name, param in self.module.named_parameters():
            param._spmd_pipeline = self._group  # type: ignore[attr-defined]
            if first_holder.get(name, self._pp_rank) != self._pp_rank:
                param._spmd_pipeline_skip = True  # type: ignore[attr-defined]
        # this rank holds only its stages' parameters
        for name, param in self.module.named_parameters():
            if name not in kept and param.numel():
                self._released[name] = (param.shape, param.dtype)
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
                param.grad = None
        for optimizer in list(self._optimizers):
            self.release_with(optimizer)

    def _compose(self, module: StageModule, stage: Any) -> nn.Module:
        from dataclasses import replace

        from spmd.program.setup import prepare_model
        from spmd.program.wrapper import parallelize_module

        options = self._options
        if options.placements is not None:
            options = replace(options, placements=stage_placements(
                self.module, self._mesh, options.placements, stage.params, self._where,
                self._experts))
        # buffers are broadcast once per step (PipelineModule.step), not per microbatch:
        # a microbatch's saved views of them must not change before its backward
        options = replace(options, broadcast_buffers=False, pipeline=None)
        where = f"{self._where} stage {stage.index}"
        setup = prepare_model(module, options, self._others, where)
        return parallelize_module(module, options, setup)

    # -- running --------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"{self._where}: a pipelined model runs whole steps: loss = model.step(inputs, "
            f"target, loss_fn) (under torch.no_grad() for evaluation); its forward alone "
            f"would leave the output on the last stage's ranks")

    def step(self, inputs: Any, target: Any = None,
             loss_fn: Callable[[Any, Any], torch.Tensor] | None = None) -> torch.Tensor:
        """Forward and backward of one batch through the pipeline; the mean of the
        microbatches' losses, on every pipeline rank. ``inputs``: the model's argument, or
        a tuple of them; ``target`` and ``loss_fn(output, target)``: the loss (None: the
        model's output is the loss). Gradients accumulate into ``.grad`` as one
        ``loss.backward()`` on the whole batch would leave them (for a loss that is a
        mean over equal microbatches). Under ``torch.no_grad()``: the loss only."""
        where = f"{self._where}.step"
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        m = self.schedule.microbatches
        leaves, spec = pytree.tree_flatten((args, target))
        rows = {t.shape[0] for t in leaves if isinstance(t, torch.Tensor) and t.dim()}
        if not rows:
            raise ValueError(f"{where}: the batch holds no tensor with a batch dimension")
        if len(rows) > 1:
            raise ValueError(f"{where}: the batch's tensors have different sizes along dim 0 "
                             f"({sorted(rows)}); microbatches split them all along dim 0")
        (size,) = rows
        if size % m:
            raise ValueError(f"{where}: microbatches={m} do not divide the batch of {size} "
                             f"rows")
        pieces = [list(t.chunk(m, 0)) if isinstance(t, torch.Tensor) and t.dim() else [t] * m
                  for t in leaves]
        micro = [[p[i] for p in pieces] for i in range(m)]
        program = self._program(micro[0], spec, loss_fn)
        self._use(program.cut)
        self._last_cut = program.cut
        state = StepState(microbatches=micro)
        training = torch.is_grad_enabled()
        before = self._set_aside_tied(program) if training else {}
        if training and self._options.broadcast_buffers:
            self._broadcast_buffers()
        actions = self.schedule.actions(self._ranks)[self._pp_rank]
        if not training:
            actions = [a for a in actions if a.kind == "F"]
            actions.sort(key=lambda a: (a.microbatch, a.stage))
        clock = time.perf_counter
        begin = clock()
        try:
            for i, action in enumerate(actions):
                for ahead in actions[i:i + 2]:
                    self._post(program, state, ahead)
                start, waited = clock(), state.waited
                if action.kind == "F":
                    self._forward(program, state, action, training)
                elif action.kind == "B":
                    self._backward(program, state, action)
                else:
                    self._weight(program, state, action)
                # an action waits for its inputs first: its span starts when they arrived
                state.spans.append((action, start - begin + state.waited - waited,
                                    clock() - begin))
            for work in state.sends:
                work.wait()
        finally:
            state.saved.clear()
        if training:
            # what this rank measured: (action, start, end) seconds from the step's start,
            # each span from when its inputs had arrived
            self.last_spans = state.spans
        if training:
            self._reduce_accumulated()
            self._sum_tied(program, before)
        return self._loss(program, state)

    # -- the program (spmd.program.program.Program) -----------------------------------

    @property
    def options(self) -> Options:
        """The options the pipeline was built with (each stage runs under them)."""
        return self._options

    @property
    def mesh(self) -> Mesh:
        """The whole mesh, the pipeline dimension included."""
        return self._mesh

    @property
    def _spmd(self) -> PipelineModule:
        return self  # the program of a pipeline is the pipeline (spmd.program.program_of)

    # -- inspection ------------------------------------------------------------------

    def plan_for(self, *example_inputs: Any, target: Any = None, loss_fn: Any = None,
                 **kwargs: Any) -> Any:
        """The plan of a step on ``example_inputs`` (one batch, cut into the schedule's
        microbatches) and ``target``, made without processes on a simulated mesh: the
        model cut as a run would cut it, each distinct stage planned on the other mesh
        dimensions, the schedule simulated on those stages' times
        (:func:`spmd.pipeline.planning.plan_pipeline`)."""
        from spmd.pipeline.planning import plan_pipeline

        if kwargs:
            raise TypeError(f"{self._where}.plan_for: unexpected keyword(s) "
                            f"{', '.join(sorted(kwargs))}; the inputs are positional, with "
                            f"target= and loss_fn=")
        if not self._mesh.simulated:
            raise RuntimeError(f"{self._where}.plan_for plans on a simulated mesh; a live "
                               f"pipeline's plan is plan() after its first step")
        return plan_pipeline(self, tuple(example_inputs), target=target, loss_fn=loss_fn)

    def plan(self) -> Any:
        """The stages (where the graph was cut and why), what crosses between them, the
        schedule and its predicted timeline (:class:`spmd.pipeline.plan.PipelinePlan`);
        after the first step."""
        from spmd.pipeline.plan import of_run

        if self._last_cut is None:
            raise RuntimeError(f"{self._where}.plan(): the stages are cut at the first step "
                               f"(they depend on the batch's shape); run model.step(...) "
                               f"first, or plan without processes: spmd.inspect(model, x, "
                               f"mesh=spmd.Mesh.simulated(...), pipeline=..., loss_fn=..., "
                               f"target=y)")
        return of_run(self._last_cut, self.schedule, self._ranks, self._stages,
                      self.last_spans)


# -- helpers ----------------------------------------------------------------------------

def check_pipeline(schedule: Any, mesh: Mesh, where: str) -> None:
    """``TypeError``/``ValueError`` for a ``pipeline=`` that is not a schedule or whose
    dimension the mesh lacks, before anything is made."""
    if not isinstance(schedule, Schedule):
        raise TypeError(f"{where}: pipeline must be an spmd.pp.schedule(...), got "
                        f"{type(schedule).__name__}")
    if schedule.dim not in mesh.dim_names:
        raise ValueError(f"{where}: the pipeline runs along mesh dimension {schedule.dim!r}; "
                         f"the mesh has {mesh.dim_names}")


def parallelize_pipeline(module: nn.Module, options: Options, mesh: Mesh, where: str) -> PipelineModule:
    """``parallelize(module, mesh=, pipeline=)``: checks, then the pipelined model."""
    from spmd.program.setup import _check_materialized, resolve_mesh

    mesh = resolve_mesh(mesh, where)
    check_pipeline(options.pipeline, mesh, where)
    if not mesh.simulated:
        _check_materialized(module, where)
    return PipelineModule(module, options.pipeline, mesh, options, where)
