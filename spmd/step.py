"""A whole training step under ``@spmd.parallelize``: forward, backward and optimizer in
one graph.

    @spmd.parallelize
    def train_step(model, batch, opt):
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

The first call traces the function with ``make_fx`` on fake tensors: the model's
parameters and buffers become graph inputs (``_reparametrize_module``), ``loss.backward()``
becomes ``torch.autograd.grad`` so the backward is in the graph, and ``opt.step()`` /
``zero_grad()`` are recorded rather than run. The gradients then go through the same
passes as the module path (collectives, buckets, schedule); with ``SGD``/``AdamW`` the
optimizer runs from each reduced bucket inside the graph (``fuse_optimizer``), otherwise
the averaged gradients are put in ``.grad`` and the optimizer runs as recorded.

Like ``jax.jit``, the step must be traceable: no ``.item()`` or data-dependent Python
control flow on tensors; other Python side effects run once, while tracing. A new
trace happens when the input shapes or dtypes, the training mode or the set of
trainable parameters change. Gradient clipping inside the step is not supported (it
would read gradients before they are averaged); the fused path leaves ``.grad`` empty.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from spmd.lowering import ops
from spmd.lowering.annotate import PlanningError, input_placements
from spmd.lowering.bucketing import bucketing
from spmd.lowering.collectives import insert_collectives
from spmd.lowering.context import InputInfo, LoweringContext
from spmd.lowering.cost_model import CostModel
from spmd.lowering.emit import emit
from spmd.lowering.optimizer import fusable, fuse_optimizer, register_optimizer
from spmd.lowering.options import Options
from spmd.lowering.passes import run_passes
from spmd.lowering.propagate import propagate
from spmd.lowering.schedule import schedule
from spmd.plan import Plan, plan_from_records
from spmd.reducer import broadcast_coalesced
from spmd.runtime.mesh import Mesh

__all__ = ["ParallelStep", "STEP_PASSES"]


def annotate_step(gm: fx.GraphModule, ctx: LoweringContext) -> fx.GraphModule:
    """The step tracer already knows output i is the gradient of parameter input i."""
    gm.meta["spmd_input_placements"] = input_placements(ctx.inputs)
    return gm


STEP_PASSES = [
    ("annotate", annotate_step),
    ("propagate", propagate),
    ("insert_collectives", insert_collectives),
    ("bucketing", bucketing),
    ("fuse_optimizer", fuse_optimizer),
    ("schedule", schedule),
]


class _Recorder:
    """Stands in for ``Tensor.backward``, ``opt.step`` and ``zero_grad`` while tracing."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.grads: list[torch.Tensor | None] = [None] * len(params)
        self.calls: list[tuple[str, dict]] = []

    def backward(self, loss: torch.Tensor, gradient: Any = None, retain_graph: Any = None,
                 create_graph: bool = False, inputs: Any = None) -> None:
        wanted = [i for i, p in enumerate(self.params) if p.requires_grad]
        grads = torch.autograd.grad(loss, [self.params[i] for i in wanted], grad_outputs=gradient,
                                    retain_graph=retain_graph, allow_unused=True)
        for i, g in zip(wanted, grads):
            if g is not None:
                self.grads[i] = g if self.grads[i] is None else self.grads[i] + g
        self.calls.append(("backward", {}))


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class _Setup:
    """What the first call with a model and an optimizer set up (kept until either changes)."""

    model: nn.Module
    opt: torch.optim.Optimizer | None
    group: Any
    world: int
    cost: CostModel
    handle: int | None  # the registered optimizer, when it can run from the buckets
    sync: ops.SyncState


@dataclass(eq=False)
class _Program:
    """One traced and planned step for one input signature."""

    run: Callable[[list], Any]
    out_spec: Any
    constants: list[Any]
    tensor_slots: list[int]
    calls: list[tuple[str, dict]]
    fused: bool


class _Record:
    """What ``spmd.inspect`` reads: shaped like the module path's GraphRecord."""

    def __init__(self, name: str, inputs: tuple[InputInfo, ...], graph: fx.GraphModule) -> None:
        self.name, self.inputs, self.backward, self.forward = name, inputs, graph, None
        self.label = "step"  # forward, backward and optimizer in one graph
        self.fallback_reason: str | None = None


class ParallelStep:
    """The callable ``parallelize`` returns for a training-step function."""

    def __init__(self, fn: Callable[..., Any], options: Options, mesh: Mesh | None) -> None:
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.options = options
        self.mesh = mesh
        self._setup: _Setup | None = None
        self._programs: dict[Any, _Program] = {}
        self._records: list[_Record] = []

    # -- set-up -----------------------------------------------------------------------

    def _find(self, args: tuple, kwargs: dict) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        leaves = list(args) + list(kwargs.values())
        models = [a for a in leaves if isinstance(a, nn.Module)]
        opts = [a for a in leaves if isinstance(a, torch.optim.Optimizer)]
        if len(models) != 1:
            raise TypeError(f"parallelize({self.fn.__name__}): the step function must receive "
                            f"exactly one nn.Module argument, got {len(models)}")
        if len(opts) > 1:
            raise TypeError(f"parallelize({self.fn.__name__}): at most one optimizer argument, "
                            f"got {len(opts)}")
        return models[0], (opts[0] if opts else None)

    def _prepare(self, model: nn.Module, opt: torch.optim.Optimizer | None) -> _Setup:
        setup = self._setup
        if setup is not None and setup.model is model and setup.opt is opt:
            return setup
        from spmd.api import prepare_model

        group, world, cost, _ = prepare_model(model, self.options, self.mesh,
                                              f"parallelize({self.fn.__name__})")
        trainable = {id(p) for p in model.parameters() if p.requires_grad}
        owned = {id(p) for g in opt.param_groups for p in g["params"]} if opt is not None else set()
        handle = register_optimizer(opt) if (opt is not None and fusable(opt)
                                             and owned == trainable) else None
        # no safety net reads what the buckets reduced: nothing to track
        self._setup = _Setup(model=model, opt=opt, group=group, world=world, cost=cost,
                             handle=handle, sync=ops.SyncState(track=False))
        self._programs.clear()
        return self._setup

    # -- tracing ----------------------------------------------------------------------

    def _trace(self, model: nn.Module, opt: Any, args: tuple, kwargs: dict) -> _Program:
        from torch.fx.experimental.proxy_tensor import make_fx
        from torch.nn.utils.stateless import _reparametrize_module

        setup = self._setup
        named_params, named_buffers = list(model.named_parameters()), list(model.named_buffers())
        pnames, params = zip(*named_params) if named_params else ((), ())
        bnames, buffers = zip(*named_buffers) if named_buffers else ((), ())
        leaves, in_spec = pytree.tree_flatten((args, kwargs))
        slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        P, B = len(params), len(buffers)
        box: dict[str, Any] = {}

        def traced(*flat: torch.Tensor) -> tuple:
            ps, bs, data = flat[:P], flat[P:P + B], flat[P + B:]
            call_leaves = list(leaves)
            for slot, t in zip(slots, data):
                call_leaves[slot] = t
            call_args, call_kwargs = pytree.tree_unflatten(call_leaves, in_spec)
            recorder = _Recorder(list(ps))
            saved = (torch.Tensor.backward, getattr(opt, "step", None), getattr(opt, "zero_grad", None))
            torch.Tensor.backward = (  # type: ignore[method-assign]
                lambda tensor, *a, **k: recorder.backward(tensor, *a, **k))
            if opt is not None:
                opt.step = lambda *a, **k: recorder.calls.append(("step", k))
                opt.zero_grad = lambda *a, **k: recorder.calls.append(("zero_grad", k))
            try:
                with _reparametrize_module(model, {**dict(zip(pnames, ps)), **dict(zip(bnames, bs))}):
                    result = self.fn(*call_args, **call_kwargs)
            finally:
                torch.Tensor.backward = saved[0]  # type: ignore[method-assign]
                if opt is not None:
                    del opt.step, opt.zero_grad
            out_leaves, box["spec"] = pytree.tree_flatten(result)
            box["constants"] = out_leaves
            box["calls"] = recorder.calls
            grads = list(recorder.grads) + [None] * (B + len(data))
            tensors = [x for x in out_leaves if isinstance(x, torch.Tensor)]
            return (*grads, *tensors)

        data = [leaves[i] for i in slots]
        gm = make_fx(traced, tracing_mode="fake")(*params, *buffers, *data)
        inputs = tuple(
            [InputInfo(kind="param", name=n, shape=tuple(p.shape), dtype=p.dtype,
                       requires_grad=p.requires_grad) for n, p in zip(pnames, params)]
            + [InputInfo(kind="buffer", name=n, shape=tuple(b.shape), dtype=b.dtype)
               for n, b in zip(bnames, buffers)]
            + [InputInfo(kind="data", name=f"input{i}", shape=tuple(t.shape), dtype=t.dtype)
               for i, t in enumerate(data)])
        outputs = list(gm.graph.output_node().args[0])
        gm.meta["spmd_param_grads"] = {i: pnames[i] for i in range(P)
                                       if isinstance(outputs[i], fx.Node)}
        names_called = [c for c, _ in box["calls"]]
        fuse = setup.handle is not None and names_called.count("step") == 1 and (
            names_called.count("backward") == 1 and
            names_called.index("backward") < names_called.index("step"))
        if fuse:
            gm.meta["spmd_optimizer"] = setup.handle
        name = f"step{len(self._records)}"
        ctx = LoweringContext(group=setup.group, world_size=setup.world, options=self.options,
                              cost_model=setup.cost, inputs=inputs, graph_name=name,
                              sync=setup.sync)
        try:
            gm = run_passes(gm, ctx, STEP_PASSES)
        except PlanningError as e:  # pragma: no cover - the tracer sets the meta itself
            raise RuntimeError(f"parallelize({self.fn.__name__}): {e}") from e
        self._records.append(_Record(name, inputs, gm))
        tensors_at = [i for i, x in enumerate(box["constants"]) if isinstance(x, torch.Tensor)]
        return _Program(run=emit(gm), out_spec=box["spec"], constants=box["constants"],
                        tensor_slots=tensors_at, calls=box["calls"], fused=fuse)

    # -- running ----------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model, opt = self._find(args, kwargs)
        setup = self._prepare(model, opt)
        leaves, _ = pytree.tree_flatten((args, kwargs))
        data = [x for x in leaves if isinstance(x, torch.Tensor)]
        params = list(model.parameters())
        key = (model.training, tuple((tuple(t.shape), t.dtype) for t in data),
               tuple(p.requires_grad for p in params))
        program = self._programs.get(key)
        if program is None:
            program = self._programs[key] = self._trace(model, opt, args, kwargs)
        buffers = list(model.buffers())
        group = setup.group
        if self.options.broadcast_buffers and buffers and group is not None and setup.world > 1:
            broadcast_coalesced(buffers, group.ranks[0], group)
        with torch.no_grad():
            out = program.run([*params, *buffers, *data])
        grads, tensors = out[:len(params)], out[len(params) + len(buffers) + len(data):]
        if not program.fused:  # replay what the step did, in its order, on real tensors
            for name, kw in program.calls:
                if name == "backward":
                    for p, g in zip(params, grads):
                        if g is not None:
                            p.grad = g if p.grad is None else p.grad + g
                else:
                    getattr(opt, name)(**kw)
        result = list(program.constants)
        for slot, t in zip(program.tensor_slots, tensors):
            result[slot] = t
        return pytree.tree_unflatten(result, program.out_spec)

    def plan_for(self, *args: Any, **kwargs: Any) -> Plan:
        """Trace and plan a step for these arguments without running it."""
        model, opt = self._find(args, kwargs)
        self._prepare(model, opt)
        self._trace(model, opt, args, kwargs)
        return self.plan()

    def plan(self) -> Plan:
        setup = self._setup
        if setup is None:
            raise RuntimeError(f"spmd.inspect: {self.fn.__name__} has not run yet; call it once "
                               f"(or use spmd.inspect with example inputs)")
        import spmd.kernels as kernels

        group = setup.group
        plan = plan_from_records(self._records[-1:], strategy=self.options.strategy,
                                 world_size=setup.world,
                                 group_name=group.name if group is not None else "simulated",
                                 group_ranks=tuple(group.ranks) if group is not None else (),
                                 options=self.options, cost_model=setup.cost,
                                 fallbacks=[], frozen=[],
                                 kernel=kernels.implementation(torch.device("cpu")))
        return plan

    @property
    def _spmd(self) -> "ParallelStep":
        return self  # spmd.inspect reads ``obj._spmd.plan()``
