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
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from spmd.lowering.balance import balance
from spmd.lowering.stages import Cut, candidates, cut, trace
from spmd.pp import Action, Schedule
from spmd.pipeline.split_backward import backward_input, backward_weight
from spmd.pipeline.stage import (StageModule, siblings, stage_mesh_group, stage_of,
                                stage_placements, standing_in)

__all__ = ["PipelineModule", "parallelize_pipeline", "check_pipeline"]


@dataclass(kw_only=True)
class _Program:
    """One microbatch shape: the cut and the leaves' layout."""

    cut: Cut
    spec: Any  # the pytree spec of (args, target)
    # the model's plain attributes when it was traced (spmd.program.step._attributes)
    attributes: list = field(default_factory=list)


@dataclass(kw_only=True)
class _StepState:
    microbatches: list[list[Any]]  # per microbatch: flat leaves of (args, target)
    saved: dict[tuple[int, int], tuple[list, tuple]] = field(default_factory=dict)
    local: dict[tuple[int, int, int], torch.Tensor] = field(default_factory=dict)
    grads: dict[tuple[int, int, int], torch.Tensor] = field(default_factory=dict)
    posted: dict[tuple, tuple[Any, torch.Tensor]] = field(default_factory=dict)
    sends: list[Any] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)
    spans: list[tuple[Action, float, float]] = field(default_factory=list)
    waited: float = 0.0  # seconds spent waiting for receives
    weight: dict[tuple[int, int], Any] = field(default_factory=dict)


class PipelineModule(nn.Module):
    """A model split into pipeline stages over a mesh dimension (``"pp"``); see the module
    docstring. ``module`` is the model (this rank's stages' parameters; the others empty
    after the first step); ``step`` trains on one batch; ``plan()`` shows the stages, the
    schedule and its predicted timeline."""

    def __init__(self, module: nn.Module, schedule: Schedule, mesh: Any, options: Any,
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
        self._split_points: tuple[str, ...] | None = schedule.split_points
        self._chosen = "named by the user" if schedule.split_points else ""
        self._programs: dict[Any, _Program] = {}
        self._stages: dict[int, nn.Module] = {}  # this rank's, by stage index
        # planning without processes: every stage here, none composed (each is planned on
        # its own, see spmd.inspection._plan_pipeline), no parameter released
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

    def _program(self, leaves: list, spec: Any, loss_fn: Any) -> _Program:
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
        with standing_in(self.module, {**self._released, **self._placed()}):
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
        program = _Program(cut=result, spec=spec, attributes=_attributes(self.module))
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

        from spmd.program.module import parallelize_module
        from spmd.program.setup import prepare_model

        options = self._options
        if options.placements is not None:
            options = replace(options, placements=stage_placements(
                self.module, self._mesh, options.placements, stage.params, self._where))
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
        state = _StepState(microbatches=micro)
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

    def _rank(self, stage: int) -> int:
        """The global rank holding ``stage`` (in this rank's pipeline)."""
        assert self._group is not None
        return self._group.ranks[self.schedule.rank_of(stage, self._ranks)]

    def _local(self, stage: int) -> bool:
        return self.schedule.rank_of(stage, self._ranks) == self._pp_rank

    def _tag(self, program: _Program, crossing: int, mb: int, dst: int, backward: bool) -> int:
        n = len(program.cut.crossings)
        stages = self.schedule.stages(self._ranks)
        return (((mb * n + crossing) * stages + dst) * 2) + int(backward)

    def _post(self, program: _Program, state: _StepState, action: Action) -> None:
        """Post the receives ``action`` needs (once)."""
        from spmd.runtime.p2p import irecv

        crossings = program.cut.crossings
        stage = program.cut.stages[action.stage]
        wanted: list[tuple[int, int, int, bool]] = []  # crossing, from stage, to stage
        if action.kind == "F":
            wanted = [(c, crossings[c].src, action.stage, False) for c in stage.received]
        elif action.kind == "B":
            wanted = [(c, d, action.stage, True) for c in stage.sent if crossings[c].grad
                      for d in crossings[c].dsts]
        for c, frm, to, backward in wanted:  # frm: the stage it comes from
            if self._local(frm):
                continue
            key = (c, action.microbatch, to if not backward else frm, backward)
            if key in state.posted:
                continue
            info = crossings[c]
            buffer = torch.empty(info.shape, dtype=info.dtype)
            work = irecv(buffer, src=self._rank(frm), group=self._group,
                         tag=self._tag(program, c, action.microbatch,
                                       to if not backward else frm, backward))
            state.posted[key] = (work, buffer)

    def _take(self, state: _StepState, key: tuple) -> torch.Tensor:
        work, buffer = state.posted.pop(key)
        start = time.perf_counter()
        work.wait()
        state.waited += time.perf_counter() - start
        return buffer

    def _forward(self, program: _Program, state: _StepState, action: Action,
                 training: bool) -> None:
        from spmd.runtime.p2p import isend

        crossings = program.cut.crossings
        stage = program.cut.stages[action.stage]
        mb = action.microbatch
        leaves = state.microbatches[mb]
        received = []
        for c in stage.received:
            src = crossings[c].src
            if self._local(src):
                value = state.local.pop((c, mb, action.stage))
            else:
                value = self._take(state, (c, mb, action.stage, False))
            if training and crossings[c].grad:
                value = value.detach().requires_grad_(True)
            received.append(value)
        module = self._stages[action.stage]
        with _no_sync(module, training):
            outs = module(*[leaves[i] for i in stage.inputs], *received)
        if not isinstance(outs, (tuple, list)):
            outs = (outs,)
        for k, c in enumerate(stage.sent):
            value = outs[k].detach()
            for dst in crossings[c].dsts:
                if self._local(dst):
                    state.local[(c, mb, dst)] = value
                else:
                    state.sends.append(isend(value.contiguous(), dst=self._rank(dst),
                                             group=self._group,
                                             tag=self._tag(program, c, mb, dst, False)))
        if stage.loss:
            state.losses.append(outs[-1].detach())
        if training:
            state.saved[(action.stage, mb)] = (received, tuple(outs))

    def _backward(self, program: _Program, state: _StepState, action: Action) -> None:
        from spmd.runtime.p2p import isend

        crossings = program.cut.crossings
        stage = program.cut.stages[action.stage]
        mb = action.microbatch
        received, outs = state.saved[(action.stage, mb)]
        roots, grads = [], []
        for k, c in enumerate(stage.sent):
            if not crossings[c].grad or not outs[k].requires_grad:
                continue
            total = None
            for dst in crossings[c].dsts:
                if self._local(dst):
                    g = state.grads.pop((c, mb, dst))
                else:
                    g = self._take(state, (c, mb, dst, True))
                total = g if total is None else total + g
            roots.append(outs[k])
            grads.append(total)
        if stage.loss and outs[-1].requires_grad:
            roots.append(outs[-1])
            grads.append(torch.full_like(outs[-1], 1.0 / self.schedule.microbatches))
        needs = [r for r in received if r.requires_grad]
        module = self._stages[action.stage]
        split = self.schedule.split_backward and not self._composed
        if roots:
            with _no_sync(module, True):
                if split:
                    weights = [p for p in module.parameters() if p.requires_grad]
                    got, groups = backward_input(roots, grads, needs, weights)
                    state.weight[(action.stage, mb)] = groups
                    for r, g in zip(needs, got):
                        r.grad = g
                else:
                    torch.autograd.backward(roots, grads, inputs=needs + [
                        p for p in module.parameters() if p.requires_grad] or None)
        k = 0
        for c in stage.received:
            if not crossings[c].grad:
                continue
            value = received[k] if received[k].requires_grad else None
            k += 1
            grad = value.grad if value is not None and value.grad is not None else \
                torch.zeros(crossings[c].shape, dtype=crossings[c].dtype)
            src = crossings[c].src
            if self._local(src):
                state.grads[(c, mb, action.stage)] = grad
            else:
                state.sends.append(isend(grad.contiguous(), dst=self._rank(src),
                                         group=self._group,
                                         tag=self._tag(program, c, mb, action.stage, True)))
        if not split:
            del state.saved[(action.stage, mb)]

    def _weight(self, program: _Program, state: _StepState, action: Action) -> None:
        key = (action.stage, action.microbatch)
        groups = state.weight.pop(key, None)
        if groups is not None:
            backward_weight(groups)
        state.saved.pop(key, None)

    def _reduce_accumulated(self) -> None:
        """``ddp`` stages: the microbatches' summed gradients averaged over the data
        dimension, once per step."""
        if not self._composed:
            return
        from spmd.runtime.collectives import all_reduce

        for module in self._stages.values():
            st = getattr(module, "_spmd", None)
            if st is None or st.sharded or not st.communicates:
                continue
            grads = [p.grad for p in module.parameters() if p.grad is not None]
            for dtype in sorted({g.dtype for g in grads}, key=str):
                same = [g for g in grads if g.dtype == dtype]
                flat = torch.cat([g.reshape(-1) for g in same])
                all_reduce(flat, group=st.group)
                flat /= st.world_size
                offset = 0
                for g in same:
                    g.copy_(flat[offset:offset + g.numel()].view_as(g))
                    offset += g.numel()

    def _tied_here(self, program: _Program) -> list[tuple[int, str, list[int]]]:
        """(tag offset, name, holders) of each tied parameter this rank holds with other
        pipeline ranks."""
        tied = program.cut.tied
        out = []
        if self._group is None:
            return out
        for k, name in enumerate(sorted(tied)):
            holders = sorted({self.schedule.rank_of(s, self._ranks) for s in tied[name]})
            if self._pp_rank in holders and len(holders) > 1:
                out.append((k, name, holders))
        return out

    def _set_aside_tied(self, program: _Program) -> dict[str, torch.Tensor | None]:
        """The ``.grad`` tied parameters held before the step (accumulated by earlier
        steps, already summed across holders), set aside: only what this step adds is
        summed across holders, then added to it."""
        before: dict[str, torch.Tensor | None] = {}
        for _, name, _ in self._tied_here(program):
            param = self.module.get_parameter(name)
            before[name] = param.grad
            param.grad = None
        return before

    def _sum_tied(self, program: _Program, before: dict[str, torch.Tensor | None]) -> None:
        """A parameter read in stages on several pipeline ranks (tied weights): what this
        step added to every holder's gradient summed, in pipeline-rank order, on each
        holder, and added to what ``.grad`` held before the step (``before``). A
        parameter no holder computed a gradient for keeps what it held; a frozen one sends
        nothing (every rank of a pipeline runs the same loop: they agree)."""
        from spmd.runtime.p2p import irecv, isend

        for k, name, holders in self._tied_here(program):
            param = self.module.get_parameter(name)
            if not param.requires_grad and param.grad is None:
                param.grad = before.get(name)
                continue
            # the gradient, flattened, and one element more: whether it was computed
            mine = torch.zeros(param.numel() + 1, dtype=param.dtype, device=param.device)
            if param.grad is not None:
                mine[:-1] = param.grad.detach().reshape(-1)
                mine[-1] = 1
            tag = 2 ** 30 + k  # above every activation's tag
            works, got = [], {}
            for r in holders:
                if r == self._pp_rank:
                    continue
                peer = self._group.ranks[r]
                works.append(isend(mine, dst=peer, group=self._group, tag=tag))
                got[r] = torch.empty_like(mine)
                works.append(irecv(got[r], src=peer, group=self._group, tag=tag))
            for w in works:
                w.wait()
            total = None
            for r in holders:
                part = mine if r == self._pp_rank else got[r]
                total = part.clone() if total is None else total + part
            assert total is not None
            held = before.get(name)
            if not total[-1]:
                param.grad = held
                continue
            grad = total[:-1].view_as(param)
            if held is None:
                param.grad = grad
            else:
                param.grad = held.add_(grad)

    def _broadcast_buffers(self) -> None:
        """Each stage's buffers from the first rank of its data group, as DDP does before
        a training forward: once per step."""
        from spmd.eager.reducer import broadcast_coalesced

        for module in self._stages.values():
            st = getattr(module, "_spmd", None)
            buffers = list(module.buffers())
            if st is not None and st.communicates and buffers:
                broadcast_coalesced(buffers, st.group.ranks[0], st.group)

    def _loss(self, program: _Program, state: _StepState) -> torch.Tensor:
        last = self.schedule.stages(self._ranks) - 1
        if state.losses:
            loss = torch.stack(state.losses).mean()
        else:
            val = program.cut.stages[last].code.graph.find_nodes(op="output")[0].args[0][-1]
            loss = torch.zeros((), dtype=val.meta["val"].dtype)
        if self._group is not None and self._ranks > 1:
            from spmd.runtime.collectives import broadcast

            loss = loss.detach().clone().reshape(())
            broadcast(loss, src=self._rank(last), group=self._group)
        return loss

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """This rank's stages' parameters and persistent buffers, whole, under the names
        the model's own ``state_dict()`` gives them (a tied parameter under each of its
        names, ``num_batches_tracked`` with its BatchNorm's statistics; a pipeline
        checkpoint is one file per pipeline rank, as with torch's pipelining), in the
        model's order; before the first step, the whole model's."""
        if not self._stages:
            return self.module.state_dict(*args, **kwargs)
        out: dict[str, Any] = {}
        for module in self._stages.values():
            out.update(module.state_dict(*args, **kwargs))
        prefix = kwargs.get("prefix", "")
        if self._unread and self._pp_rank == 0:
            whole = self.module.state_dict(prefix=prefix,
                                           keep_vars=kwargs.get("keep_vars", False))
            out.update({prefix + n: whole[prefix + n] for n in self._unread
                        if prefix + n in whole})
        for alias, name in _aliases(self.module).items():
            if prefix + name in out:
                out[prefix + alias] = out[prefix + name]
        order = {k: i for i, k in enumerate(self.module.state_dict(prefix=prefix,
                                                                      keep_vars=True))}
        keys = sorted(out, key=lambda k: order.get(k, len(order)))
        return {k: out[k] for k in keys}

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False
                        ) -> Any:
        """Load what this rank's stages hold from ``state_dict`` (entries of other
        stages are skipped; the first pipeline rank also loads what no stage reads); with
        ``strict``, every entry of this rank's stages must be there, and no entry the
        model does not have."""
        from torch.nn.modules.module import _IncompatibleKeys

        from spmd.state.layout import local_state_dicts

        if not self._stages:  # not cut yet: what the checkpoint holds (a stage's entries)
            result = self.module.load_state_dict(state_dict, strict=False, assign=assign)
            if strict and result.unexpected_keys:
                raise RuntimeError(f"{self._where}.load_state_dict: entries the model does "
                                   f"not have: {', '.join(result.unexpected_keys[:5])}")
            return result
        plain = set(self.module.state_dict(keep_vars=True))
        unexpected = [k for k in state_dict if k not in plain]
        if strict and unexpected:
            raise RuntimeError(f"{self._where}.load_state_dict: entries the model does not "
                               f"have: {', '.join(unexpected[:5])}"
                               + (" ..." if len(unexpected) > 5 else ""))
        # the keys each stage holds, read without gathering (a composed stage's
        # state_dict() would gather every parameter over its group)
        with local_state_dicts(lambda name, stored, shard, piece: stored):
            owners: list[tuple[nn.Module, list[str]]] = [
                (module, list(module.state_dict(keep_vars=True)))
                for module in self._stages.values()]
        if self._unread and self._pp_rank == 0:
            owners.append((self.module, [n for n in self._unread if n in plain]))
        missing: list[str] = []
        for module, own in owners:
            part = {k: state_dict[k] for k in own if k in state_dict}
            missing += [k for k in own if k not in state_dict]
            module.load_state_dict(part, strict=False, assign=assign)
        if strict and missing:
            raise RuntimeError(f"{self._where}.load_state_dict: missing entries of this "
                               f"rank's stages: {', '.join(missing[:5])}"
                               + (" ..." if len(missing) > 5 else ""))
        return _IncompatibleKeys(missing, unexpected)

    def release_with(self, optimizer: torch.optim.Optimizer) -> None:
        """Keep ``optimizer``'s state to what this rank holds: the state of the parameters
        it releases dropped, and where each stage is parallelized over the other mesh
        dimensions, state shaped like a whole parameter cut to the part this rank stores
        (as the parameter was): now if the stages are cut, else at the cut (the first
        step). Before the cut every rank holds the whole model, so state loaded then (a
        checkpoint loaded before the first step) is every stage's and whole; without this
        each rank would keep the other stages' state, stale, for good, and a sharded
        parameter would meet whole state at the optimizer's step.
        ``spmd.checkpoint.get_state_dict``/``set_state_dict`` call it.

        Example::

            model.release_with(opt)
            opt.load_state_dict(torch.load(path))  # a plain model's, before the first step
        """
        from spmd.state.layout import layout_of, stored_part

        if not self._stages:
            self._optimizers.add(optimizer)
            return
        for name in self._released:
            optimizer.state.pop(self.module.get_parameter(name), None)
        for stage in self._stages.values():
            layout = layout_of(stage)
            placed = () if layout is None else sorted(set(layout.shards) | set(layout.pieces))
            for name in placed:
                record = layout.records[name]
                state = optimizer.state.get(self.module.get_parameter(name))
                if not state or record.shape == record.local_shape:
                    continue
                for key, value in list(state.items()):
                    if isinstance(value, torch.Tensor) and value.dim() \
                            and tuple(value.shape) == record.shape:
                        state[key] = stored_part(layout, name, value,
                                                 f"{name}: {key}").clone()

    def layout(self) -> Any:
        """The :class:`spmd.state.layout.Layout` of this rank's stages merged (each parallelized
        on its own over the other mesh dimensions; names are the model's); None where no
        stage is (a pipeline alone, or before the cut)."""
        from spmd.state.layout import Layout, layout_of

        parts = [p for p in map(layout_of, self._stages.values()) if p is not None]
        if not parts:
            return None
        merged = Layout(records={}, shards={}, pieces={})
        for part in parts:
            merged.records.update(part.records)
            merged.shards.update(part.shards)
            merged.pieces.update(part.pieces)
        return merged

    def held(self) -> set[str] | None:
        """The parameters this rank holds, by their first names (``named_parameters()``
        of the model); None before the cut, when every rank holds them all."""
        if not self._stages:
            return None
        return {n for n, _ in self.module.named_parameters() if n not in self._released}

    def others(self) -> dict[str, tuple[torch.Size, torch.dtype, torch.device]]:
        """The entries of the model's ``state_dict()`` that this rank's ``state_dict()``
        lacks (other stages' parameters and buffers), each with its whole shape, its dtype
        and device; empty before the cut."""
        if not self._stages:
            return {}
        mine = _all_keys_local(self)
        aliases = _aliases(self.module)
        out: dict[str, tuple[torch.Size, torch.dtype, torch.device]] = {}
        for key, value in self.module.state_dict(keep_vars=True).items():
            if key in mine:
                continue
            shape, _ = self._released.get(aliases.get(key, key), (value.shape, None))
            out[key] = (torch.Size(shape), value.dtype, value.device)
        return out

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip every stage's gradients by the norm of the whole model's gradient, as
        ``torch.nn.utils.clip_grad_norm_`` does on one process (which, on these
        parameters, is rerouted to do the same); the total norm, on every rank. Every rank
        must call it, after ``step``."""
        from spmd.eager.clip import clip_grad_norm_

        return clip_grad_norm_(self.module.parameters(), max_norm, norm_type)

    # -- inspection ------------------------------------------------------------------

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

def _all_keys_local(pipe: PipelineModule) -> set[str]:
    """The keys of ``pipe.state_dict()``, read without gathering."""
    from spmd.state.layout import local_state_dicts

    with local_state_dicts(lambda name, stored, shard, piece: stored):
        return set(pipe.state_dict(keep_vars=True))


def _aliases(model: nn.Module) -> dict[str, str]:
    """Every second name of a parameter or buffer (a head tied to the embedding) -> the
    name the model's ``named_parameters()`` gives it (the name a stage holds it by)."""
    out: dict[str, str] = {}
    for named in (model.named_parameters, model.named_buffers):
        first: dict[int, str] = {}
        for name, tensor in named(remove_duplicate=False):
            if id(tensor) in first:
                out[name] = first[id(tensor)]
            else:
                first[id(tensor)] = name
    return out


def _no_sync(module: nn.Module, training: bool) -> Any:
    import contextlib

    if training and hasattr(module, "_spmd") and not module._spmd.sharded:
        return module.no_sync()  # averaged once, at the end of the step
    return contextlib.nullcontext()


def check_pipeline(schedule: Any, mesh: Any, where: str) -> None:
    """``TypeError``/``ValueError`` for a ``pipeline=`` that is not a schedule or whose
    dimension the mesh lacks, before anything is made."""
    if not isinstance(schedule, Schedule):
        raise TypeError(f"{where}: pipeline must be an spmd.pp.schedule(...), got "
                        f"{type(schedule).__name__}")
    if schedule.dim not in mesh.dim_names:
        raise ValueError(f"{where}: the pipeline runs along mesh dimension {schedule.dim!r}; "
                         f"the mesh has {mesh.dim_names}")


def parallelize_pipeline(module: nn.Module, options: Any, mesh: Any, where: str) -> PipelineModule:
    """``parallelize(module, mesh=, pipeline=)``: checks, then the pipelined model."""
    from spmd.program.setup import _check_materialized, resolve_mesh

    mesh = resolve_mesh(mesh, where)
    check_pipeline(options.pipeline, mesh, where)
    if not mesh.simulated:
        _check_materialized(module, where)
    return PipelineModule(module, options.pipeline, mesh, options, where)
