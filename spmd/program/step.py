"""A whole training step under ``@spmd.parallelize``: forward, backward and optimizer in
one graph.

    @spmd.parallelize
    def train_step(model, batch, opt):
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # sees averaged gradients
        opt.step()
        opt.zero_grad()
        return loss

The first call traces the function (``spmd.lowering.trace_step``) and plans the graph
with the same passes as a module's regions (``spmd.lowering.pipeline``). With ``SGD`` or
``AdamW`` and nothing else reading the gradients, the optimizer runs from each reduced
bucket inside the graph; otherwise the averaged (and, say, clipped) gradients are put in
``.grad`` and the optimizer's own ``step()`` runs, as recorded.

Like ``jax.jit``, the step must be traceable: no ``.item()`` or data-dependent Python
control flow on tensors; other Python side effects run once, while tracing. A new
trace happens when the input shapes or dtypes, the training mode, the set of
trainable parameters, the model's dtypes or a plain attribute of one of its modules (a
number, a flag, a string, a tensor that is not a parameter or buffer) change.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from spmd.lowering.specs import Handles, SyncState
from spmd.lowering.annotate import PlanningError
from spmd.lowering.context import LoweringContext
from spmd.lowering.emit import emit
from spmd.lowering.optimizer import register_optimizer, why_not_fusable
from spmd.lowering.options import Options
from spmd.lowering.pipeline import plan_graph
from spmd.lowering.state import OptimizerFusion, find
from spmd.lowering.trace_step import TracedStep, trace_step
from spmd.plan.plan import Plan, plan_from_records, price_on_hardware, tokens_of
from spmd.eager.reducer import broadcast_coalesced
from spmd.runtime.mesh import Mesh
from spmd.program.program import Program
from spmd.program.setup import Setup, prepare_model

__all__ = ["ParallelStep"]


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class _Bound:
    """What the first call with a model and an optimizer set up (kept until either
    changes): the agreed set-up, and the objects its graphs refer to."""

    model: nn.Module
    opt: torch.optim.Optimizer | None
    setup: Setup
    handles: Handles
    optimizer: int | None  # the optimizer's handle, when it can run from the buckets
    why_not: str  # why it cannot, otherwise
    sync: SyncState


@dataclass(eq=False)
class _Program:
    """One traced and planned step for one input signature."""

    run: Callable[[list], Any]
    traced: TracedStep
    fused: bool
    # the graph reads the gradients (to clip them, say) without clearing .grad first: what
    # .grad held before the step would be left out of what it read
    needs_clear_grads: bool
    # zero_grad() (to None) comes before the first backward(): what .grad held before the
    # step never reaches the optimizer
    clears_first: bool = False
    # the model's plain attributes when it was traced (:func:`_attributes`)
    attributes: list = field(default_factory=list)


class _Record:
    """What ``spmd.inspect`` reads: shaped like the module path's GraphRecord."""

    def __init__(self, name: str, inputs: tuple, graph: Any) -> None:
        self.name, self.inputs, self.backward, self.forward = name, inputs, graph, None
        self.label = "step"  # forward, backward and optimizer in one graph
        self.fallback_reason: str | None = None


RETRACE_WARNING = 8  # traces of one step function before it warns


def _static(value: Any) -> Any:
    """How a non-tensor argument enters the cache key: by value when hashable (numbers,
    strings, dtypes, frozen dataclasses), else by identity (the model, the optimizer, a
    mutable object, whose contents are read once per trace)."""
    if isinstance(value, (nn.Module, torch.optim.Optimizer)):
        return ("object", id(value))
    try:
        hash(value)
    except TypeError:
        return ("object", id(value))
    return (type(value), value)


_PLAIN = (bool, int, float, str, type(None))


def _attributes(model: nn.Module) -> list[tuple[dict, str, Any]]:
    """Every plain value (number, string, flag, None, or a tensor that is neither parameter
    nor buffer) the model's modules hold as attributes, with where it is: what a trace
    may have read and baked in (a loss scale, a flag, a mask), as Dynamo guards them on
    the module path."""
    found = []
    for module in model.modules():
        attrs = module.__dict__
        for name, value in attrs.items():
            kind = type(value)
            if kind in _PLAIN or kind is torch.Tensor:
                found.append((attrs, name, value))
    return found


def _changed(attributes: list[tuple[dict, str, Any]]) -> str | None:
    """The first attribute no longer holding its traced value, if any (17 us for a
    6-layer encoder's 300, measured here on 2026-11-28)."""
    for attrs, name, value in attributes:
        now = attrs.get(name, attributes)
        if now is not value and (type(value) is torch.Tensor or now != value):
            return name
    return None


def _held(params: list[torch.Tensor], opt: Any) -> list[torch.Tensor]:
    """The tensors whose .grad a step's optimizer may read: the model's parameters
    (``params``) and the optimizer's."""
    held = list(params)
    if opt is not None:
        held += [p for g in opt.param_groups for p in g["params"]]
    return held


def _hooked(opt: Any) -> tuple:
    """What about ``opt`` may change between calls and stop its step running from the
    buckets (its hooks, its groups' flags): part of the trace key."""
    if opt is None:
        return ()
    from torch.optim import optimizer as torch_optimizer

    hooks = (opt._optimizer_step_pre_hooks, opt._optimizer_step_post_hooks,
             getattr(torch_optimizer, "_global_optimizer_pre_hooks", {}),
             getattr(torch_optimizer, "_global_optimizer_post_hooks", {}))
    return (any(hooks), *(bool(g.get(f)) for g in opt.param_groups
                          for f in ("differentiable", "capturable", "fused")))


def _fusable_calls(calls: list[tuple[str, dict]]) -> bool:
    names = [c for c, _ in calls]
    return names.count("step") == 1 and "backward" in names


class ParallelStep(Program):
    """The callable ``parallelize`` returns for a training-step function (the
    :class:`~spmd.program.program.Program` of a whole step)."""

    def __init__(self, fn: Callable[..., Any], options: Options, mesh: Mesh | None) -> None:
        functools.update_wrapper(self, fn)
        if options.placements is not None:
            raise NotImplementedError(
                f"parallelize({getattr(fn, '__name__', 'step')}): tensor parallelism "
                f"(placements=) applies to models: parallelize the model with placements and "
                f"keep the training step in Python")
        self.fn = fn
        self.options = options
        self.mesh = mesh
        self._bound: _Bound | None = None
        self._programs: dict[Any, _Program] = {}
        self._traces = 0
        self._records: list[_Record] = []

    @property
    def _where(self) -> str:
        return f"parallelize({self.fn.__name__})"

    # -- set-up -----------------------------------------------------------------------

    def _find(self, args: tuple, kwargs: dict) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        leaves = list(args) + list(kwargs.values())
        models = [a for a in leaves if isinstance(a, nn.Module)]
        opts = [a for a in leaves if isinstance(a, torch.optim.Optimizer)]
        if len(models) != 1:
            raise TypeError(f"{self._where}: the step function must receive exactly one "
                            f"nn.Module argument, got {len(models)}")
        if len(opts) > 1:
            raise TypeError(f"{self._where}: at most one optimizer argument, got {len(opts)}")
        return models[0], (opts[0] if opts else None)

    def _bind(self, model: nn.Module, opt: torch.optim.Optimizer | None) -> _Bound:
        bound = self._bound
        if bound is not None and bound.model is model and bound.opt is opt:
            return bound
        if self.options.sharded:
            self._check_shardable(model, opt)  # before anything is sent
        shared = getattr(model, "_spmd_step_setup", None)
        if shared is None:
            setup = prepare_model(model, self.options, self.mesh, self._where)
            handles = Handles()
            self._place(model, setup, handles)
            model._spmd_step_setup = (self.options.strategy, self.mesh, setup, handles)
        else:
            # a second step function (an eval step, a backward-only step) on a model a first
            # one set up: its parameters are already every rank's (and, sharded, this
            # rank's shards); set up again, they would be overwritten by rank 0's
            strategy, mesh, setup, handles = shared
            if strategy != self.options.strategy or mesh is not self.mesh:
                raise ValueError(
                    f"{self._where}: the model was set up by another parallelized step with "
                    f"strategy {strategy!r} on {'the default group' if mesh is None else mesh}; "
                    f"every step function of one model must use the same strategy and mesh")
        trainable = {id(p) for p in model.parameters() if p.requires_grad}
        owned = {id(p) for g in opt.param_groups for p in g["params"]} if opt is not None else set()
        why = "no optimizer argument" if opt is None else why_not_fusable(opt)
        if not why and owned != trainable:
            why = "the optimizer does not hold exactly the model's trainable parameters"
        handle = register_optimizer(opt, handles) if not why else None
        # no safety net reads what the buckets reduced: nothing to track
        self._bound = _Bound(model=model, opt=opt, setup=setup, handles=handles,
                             optimizer=handle, why_not=why, sync=SyncState(track=False))
        self._programs.clear()
        return self._bound

    def _check_shardable(self, model: nn.Module, opt: torch.optim.Optimizer | None) -> None:
        if getattr(model, "_spmd", None) is not None:
            raise ValueError(f"{self._where}: the model is already parallelized as a module; "
                             f"pass the plain model to a parallelized step")
        if getattr(model, "_spmd_step_shards", None) is None and opt is not None and opt.state:
            raise ValueError(f"{self._where}: strategy {self.options.strategy!r} shards the "
                             f"parameters at the first call, but the optimizer already holds "
                             f"state for the whole ones; create it just before the first step")

    def _place(self, model: nn.Module, setup: Setup, handles: Handles) -> None:
        """The model's parameters come to hold what the strategy stores (once per model):
        sharded strategies, their shards. The ``nn.Parameter`` objects stay the same, so an optimizer over them, made
        before the first call or after, steps the shards; it must not hold state yet:
        state made for whole parameters cannot be cut the same way silently."""
        from spmd.state.layout import place_module

        from spmd.state.ownership import own

        model._spmd_step_shards = place_module(model, setup, self.options, handles).shards
        own(model, self._where)

    # -- tracing ----------------------------------------------------------------------

    def _trace(self, model: nn.Module, opt: Any, args: tuple, kwargs: dict,
               fuse: bool = True) -> _Program:
        bound = self._bound
        assert bound is not None
        try:
            traced = trace_step(self.fn, model, opt, args, kwargs)
        except PlanningError as e:
            raise RuntimeError(f"{self._where}: {e}") from None
        # as the trace leaves them (what its forward set itself is no change)
        attributes = _attributes(model)
        name = f"step{len(self._records)}"
        # fusable when bound, and still (a dtype changed by model.double(), hooks or flags
        # set since change that: torch's own step() runs then)
        fuse = fuse and bound.optimizer is not None and not why_not_fusable(opt)
        ctx = LoweringContext(strategy=bound.setup.strategy, options=self.options,
                              cost_model=bound.setup.cost_model, inputs=traced.inputs,
                              role="step", graph_name=name, sync=bound.sync,
                              handles=bound.handles,
                              optimizer=(bound.optimizer if fuse and _fusable_calls(traced.calls)
                                         else None))
        try:
            gm = plan_graph(traced.gm, ctx)
        except PlanningError as e:
            raise RuntimeError(f"{self._where}: {e}") from None
        self._records.append(_Record(name, traced.inputs, gm))
        fusion = find(gm, OptimizerFusion)
        fused = fusion is not None and fusion.fused
        reads = fusion is not None and bool(fusion.readers)
        names = [c for c, _ in traced.calls]
        clears = "zero_grad" in names and (
            "backward" not in names or names.index("zero_grad") < names.index("backward"))
        first = names.index("zero_grad") if clears else -1
        to_none = clears and traced.calls[first][1].get("set_to_none", True)
        return _Program(run=emit(gm), traced=traced, fused=fused,
                        needs_clear_grads=reads and not clears, clears_first=bool(to_none),
                        attributes=attributes)

    # -- running ----------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model, opt = self._find(args, kwargs)
        bound = self._bind(model, opt)
        leaves, _ = pytree.tree_flatten((args, kwargs))
        data = [x for x in leaves if isinstance(x, torch.Tensor)]
        params = list(model.parameters())
        buffers = list(model.buffers())
        # the trace bakes in every non-tensor argument (a loss weight, a flag): its value
        # is part of the key, as the shapes are; and the model's dtypes (model.double()
        # between calls traces again)
        key = (model.training, tuple((tuple(t.shape), t.dtype) for t in data),
               tuple((p.requires_grad, p.dtype) for p in params),
               tuple(b.dtype for b in buffers), _hooked(opt),
               tuple(_static(x) for x in leaves if not isinstance(x, torch.Tensor)))
        program = self._program(key, model, opt, args, kwargs)
        if program.fused and not program.clears_first and any(
                p.grad is not None for p in _held(params, opt)):
            # gradients accumulated by earlier calls (or held by a frozen layer the
            # optimizer would still step): the buckets alone are not what opt.step() would
            # read, so the gradients go to .grad and torch's step runs, as recorded
            program = self._program((*key, "unfused"), model, opt, args, kwargs, fuse=False)
        if program.needs_clear_grads and any(p.grad is not None for p in params):
            raise ValueError(f"{self._where}: the step reads the gradients (to clip them, say) "
                             f"while .grad already holds gradients from before the step, which "
                             f"it would leave out; call opt.zero_grad() before backward()")
        setup = bound.setup
        if self.options.broadcast_buffers and buffers and setup.communicates:
            broadcast_coalesced(buffers, setup.group.ranks[0], setup.group)
        with torch.no_grad():
            out = program.run([*params, *buffers, *data])
        grads, tensors = out[:len(params)], out[len(params) + len(buffers) + len(data):]
        self._replay(program, opt, params, grads)
        traced = program.traced
        result = list(traced.constants)
        for slot, t in zip(traced.tensor_slots, tensors):
            result[slot] = t
        return pytree.tree_unflatten(result, traced.out_spec)

    def _program(self, key: tuple, model: nn.Module, opt: Any, args: tuple, kwargs: dict,
                 fuse: bool = True) -> _Program:
        program = self._programs.get(key)
        if program is not None and _changed(program.attributes) is not None:
            program = None  # an attribute the trace may have read changed: trace again
        if program is None:
            program = self._programs[key] = self._trace(model, opt, args, kwargs, fuse)
            self._traces += 1
            if self._traces == RETRACE_WARNING:
                warnings.warn(f"{self._where} has been traced {RETRACE_WARNING} times (each new "
                              f"input shape, non-tensor argument value, set of trainable "
                              f"parameters, train/eval mode or module attribute traces "
                              f"again); pass values that change every step, such as a loss "
                              f"weight, as tensors",
                              stacklevel=3)
        return program

    @staticmethod
    def _replay(program: _Program, opt: Any, params: list, grads: list) -> None:
        """What the step did besides the graph, in its order, on the real tensors: the
        gradients land in ``.grad`` at the first ``backward()``; ``zero_grad`` and
        ``step`` run as called (a fused step already ran in the graph)."""
        applied = False
        for name, kw in program.traced.calls:
            if name == "backward":
                if not applied and not program.fused:
                    for p, g in zip(params, grads):
                        if g is not None:
                            p.grad = g if p.grad is None else p.grad + g
                applied = True
            elif name == "zero_grad":
                opt.zero_grad(**kw)
            elif not program.fused:
                opt.step(**kw)
            elif hasattr(opt.step, "_wrapped_by_lr_sched"):
                # what torch's LR scheduler wrapper records when step() runs, so a
                # scheduler stepped after this step does not warn that it came first
                opt._opt_called = True

    def plan_for(self, *args: Any, **kwargs: Any) -> Plan:
        """Trace and plan a step for these arguments without running it."""
        model, opt = self._find(args, kwargs)
        self._bind(model, opt)
        self._trace(model, opt, args, kwargs)
        return self.plan()

    def plan(self) -> Plan:
        bound = self._bound
        if bound is None:
            raise RuntimeError(f"spmd.inspect: {self.fn.__name__} has not run yet; call it once "
                               f"(or use spmd.inspect with example inputs)")
        import spmd.kernels as kernels

        records = self._records[-1:]
        plan = plan_from_records(records, setup=bound.setup, options=self.options,
                                 fallbacks=[], frozen=[],
                                 kernel=kernels.implementation(torch.device("cpu")))
        # on a simulated cluster: the step graph on its roofline (optimizer included)
        price_on_hardware(plan, records, self.options, bound.setup.strategy.mesh.hardware)
        plan.tokens_per_step = tokens_of(records, bound.setup.strategy)
        if bound.optimizer is None and self._records:
            plan.optimizer[self._records[-1].name] = f"torch.optim after the graph ({bound.why_not})"
        return plan

    @property
    def _spmd(self) -> "ParallelStep":
        return self  # spmd.inspect reads ``obj._spmd.plan()``
