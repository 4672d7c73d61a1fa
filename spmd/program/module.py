"""A parallelized ``nn.Module`` instance's program: :class:`ModuleState`, what the compiler
decided for it and what runs each step. It lives in ``module._spmd`` (the class swap that
puts it there is :mod:`spmd.program.wrapper`), and ``spmd.inspect(module)`` reads it as a
:class:`~spmd.plan.plan.Plan`.

One training step:

1. (``broadcast_buffers``) buffers are broadcast from the group's first rank;
2. the compiled forward runs (Dynamo + AOTAutograd, emitted by ``spmd.lowering``);
3. backward runs the planned backward graphs: each bucket's all-reduce starts as soon
   as its gradients exist and is waited on at the end, so gradients land in ``.grad``
   averaged;
4. gradients no graph reduced (graph breaks into eager code, a model Dynamo refused,
   accumulation under ``no_sync()``) are averaged by the eager safety net when the
   backward pass ends.
"""

from __future__ import annotations

import contextlib
import logging
import types
import weakref
from typing import Any, Iterator

import torch
import torch.nn as nn

from spmd.lowering.capture import Capture, GraphRecord
from spmd.lowering.context import LoweringContext
from spmd.lowering.specs import Handles, ShardSpec, SyncState
from spmd.lowering.options import Options
from spmd.program.agreement import Agreement
from spmd.plan.plan import Fallback, Plan, module_plan
from spmd.eager.reducer import EagerReducer, broadcast_coalesced
from spmd.eager.safety_net import SafetyNet
from spmd.runtime.errors import DistError
from spmd.program.program import Program
from spmd.program.setup import Setup

__all__ = ["ModuleState"]

log = logging.getLogger("spmd")


class ModuleState(Program):
    """What ``parallelize`` attached to one module: its group, options, graphs and plan
    (the :class:`~spmd.program.program.Program` of a model)."""

    def __init__(self, module: nn.Module, options: Options, setup: Setup) -> None:
        self._module = weakref.ref(module)  # (the module holds this state)
        self.options = options
        self.setup = setup
        self.group = setup.group
        self.world_size = setup.world_size
        # a simulated mesh (no group) or one rank: plan as usual, run no collectives
        self.communicates = setup.communicates
        self.cost_model = cost_model = setup.cost_model
        self.index = setup.index  # the how-many-th parallelized model of this rank
        self.auto: Any = None  # strategy="auto": what the search chose (spmd.auto.live.Searched)
        self.sync = SyncState(comm_hook=options.comm_hook, comm_state=options.comm_state)
        self.handles = Handles()  # the specs this model's graphs refer to
        # one record per parameter: fsdp/hsdp/zero store shards, tensor parallelism pieces
        # (then shards of those), ddp the whole tensors
        from spmd.state.layout import place_module

        self.layout = place_module(module, setup, options, self.handles)
        if setup.strategy.activations:
            from spmd.state.layout import place_activations

            self.placed_activations = place_activations(module, setup.strategy, self.handles)
        self.experts: dict = {}
        if setup.strategy.experts:  # spmd.ep: experts split by index, their own forward
            from spmd.ep import place_experts, split_experts

            self.experts = place_experts(module, setup.strategy, self.handles,
                                         split_experts(options.placements)[1])
        self.shards: dict[str, ShardSpec] = self.layout.shards
        self.sharded = setup.strategy.shards_parameters
        self.params = dict(module.named_parameters())
        self.buffers = dict(module.named_buffers())
        names = {id(p): ("param", n) for n, p in self.params.items()}
        names.update({id(b): ("buffer", n) for n, b in self.buffers.items()})
        self.records: list[GraphRecord] = []  # one per captured region
        self.capture = Capture(names, self, options.compile_compute,
                               reshard=options.reshards,
                               fused_attention=setup.strategy.mesh.hardware is not None)
        self.fallbacks: dict[str, str] = {}
        # gradients no planned graph averaged (ddp): hooks on every trainable parameter
        # (an expert's gradient is complete on its rank: the ep ops made it so)
        self.net = SafetyNet(
            {n: p for n, p in self.params.items() if n not in setup.strategy.experts},
            self.sync, self.fallbacks,
            EagerReducer(self.group, self.world_size,
                         options.bucket_cap_bytes or cost_model.bucket_bytes(
                             sum(p.numel() * p.element_size() for p in self.params.values()),
                             None),
                         options.reduce_dtype, self.sync),
            active=self.communicates and not self.sharded)
        self.compiled = None
        self.estimates: dict[str, float] = {}  # graph -> shared backward-seconds estimate
        self.agreement = Agreement(setup)  # estimates and plans shared across ranks
        self.capture_failed: str | None = None  # why the model runs eagerly, if it does
        self.eager_forward: str | None = None  # why the last forward ran no graph, if it did
        self.profiler: Any = None
        self.measured: Any = None  # the last profiled step's Timeline
        self.measured_steps: list = []  # every profiled step's
        self.join: Any = None  # the spmd.Join context this model trains in, if any
        self.net.hook_all()

    # -- planning ---------------------------------------------------------------------

    def context(self, record: GraphRecord, role: str) -> LoweringContext:
        backward = role == "backward"
        return LoweringContext(
            strategy=self.setup.strategy, options=self.options, cost_model=self.cost_model,
            inputs=record.inputs, role=role, graph_name=record.name, sync=self.sync,
            handles=self.handles, compute=record.compute,
            backward_seconds=self._backward_estimate(record) if backward else None,
            saved=record.saved if backward else {})

    def _backward_estimate(self, record: GraphRecord) -> float | None:
        """Backward compute is about twice the forward's (a gradient matmul for the input
        and one for the weight per forward matmul). The forward is timed on the group's
        first rank and the figure shared, so every rank derives the same buckets; on a
        simulated cluster (``Mesh.simulated(..., hardware=)``) it is the forward graph's
        roofline on that cluster's device instead.

        How the figure is shared without anyone waiting inside a compile:
        :class:`spmd.program.agreement.Agreement`.
        """
        hardware = self.setup.strategy.mesh.hardware
        if hardware is not None and record.forward is not None:
            from spmd.plan.plan import compiled_on_gpu
            from spmd.plan.roofline import graph_seconds

            fused = compiled_on_gpu(self.options, [record], hardware)
            seconds = 2.0 * graph_seconds(record.forward, hardware.device, fused)
            self.estimates[record.name] = seconds
            return seconds
        seconds = self.agreement.backward_estimate(record)
        if seconds is not None:
            self.estimates[record.name] = seconds
        return seconds

    def forward_compiled(self, record: GraphRecord) -> None:
        if self.setup.strategy.mesh.hardware is None:
            self.agreement.forward_compiled(record)  # the first rank times it

    def planned(self, record: GraphRecord) -> None:
        """Called at the first run of the record's backward: every rank must run
        identically planned collectives."""
        self.agreement.agree(record)

    @property
    def mesh(self) -> Any:
        """The mesh the model runs on (its strategy's)."""
        return self.setup.strategy.mesh

    def plan(self) -> Plan:
        frozen = [n for n, p in self.params.items() if not p.requires_grad]
        for name, spec in self.shards.items():
            if spec.eager and self.params[name].requires_grad:
                self.fallbacks.setdefault(
                    name, "read outside any compiled graph (graph break into eager code): "
                          "gathered and reduce-scattered eagerly (blocking, unbucketed)")
        for record in self.records:
            if record.fallback_reason:  # the cause, where the hook saw only the effect
                for name in record.trainable:
                    self.fallbacks[name] = record.fallback_reason
        plan = module_plan(
            self.records, setup=self.setup, options=self.options, layout=self.layout,
            params=self.params, buffers=self.buffers, estimates=self.estimates,
            fallbacks=[Fallback(param=n, reason=r) for n, r in self.fallbacks.items()],
            frozen=frozen, measured=self.measured, measured_steps=self.measured_steps)
        plan.auto = self.auto  # strategy="auto": what was searched (spmd.auto.live.Searched)
        return plan

    def plan_for(self, *example_inputs: Any, **kwargs: Any) -> Plan:
        """One training forward of the model on ``example_inputs`` and a backward of the
        sum of its outputs that require grad, then :meth:`plan`. On a simulated mesh
        nothing is sent (the planning of ``spmd.inspect(model, *inputs, mesh=...)``);
        live, it is a step without the optimizer, which every rank must take."""
        import torch.utils._pytree as pytree

        module = self._module()
        if module is None:
            raise RuntimeError("plan_for: the parallelized model was collected")
        module.train()
        out = module(*example_inputs, **kwargs)
        leaves = [t for t in pytree.tree_leaves(out)
                  if isinstance(t, torch.Tensor) and t.requires_grad]
        if not leaves:
            raise ValueError("spmd.inspect: the model's output does not require grad on these "
                             "inputs; there is no backward to plan")
        sum(t.float().sum() for t in leaves).backward()
        return self.plan()

    # -- profiling --------------------------------------------------------------------

    def attach_profiler(self, profiler: Any) -> None:
        self.profiler = self.sync.profiler = self.capture.profiler = profiler

    def _end_profiled_step(self) -> None:
        profiler = self.profiler
        if profiler is None:
            return
        self.measured = profiler.end_step()
        self.measured_steps = list(profiler.timelines)
        if profiler.done:
            self.profiler = self.sync.profiler = self.capture.profiler = None

    # -- running ----------------------------------------------------------------------

    def forward(self, module: nn.Module, original: Any, *args: Any, **kwargs: Any) -> Any:
        training = module.training and torch.is_grad_enabled()
        if self.options.param_dtype is not None:  # mixed precision: inputs as parameters
            args, kwargs = _cast_floating((args, kwargs), self.options.param_dtype)
        if training and self.sharded:
            # gradients leave as their shards' reduce-scatters, under no_sync() too (the
            # sum of averages is the average of the sums); only buffers need syncing
            if self.profiler is not None:
                self.profiler.begin_step()
            if self.options.broadcast_buffers and self.buffers and self.communicates:
                self._broadcast_buffers()
        elif training:
            self.sync.begin_step()
            self.net.hook_all()
            if self.profiler is not None:
                self.profiler.begin_step()
            if self.join is not None:
                self.join.notify(self)
            if self.options.broadcast_buffers and self.buffers and self.communicates:
                broadcast_coalesced(self.buffers.values(), self._buffer_source(), self.group)
            if self.sync.enabled and self.net.accumulated:
                self.net.reduce_accumulated()
            elif not self.sync.enabled:
                self.net.accumulated = True
        if self.compiled is None:
            self.compiled = _compile(module, original, self.capture)
        self.agreement.check_inputs(args, kwargs)
        out = (self._run_bounded(module, original, args, kwargs)
               if any(spec.headroom is not None for spec in self.experts.values())
               else self._run(module, original, args, kwargs))
        self.net.eager_forward = self.eager_forward
        if training and self.net.reducer.pending:
            # gradients accumulated under no_sync() wait in the reducer: make sure this
            # backward ends by averaging them, even if no parameter hook remains
            _on_first_gradient(out, self.net.queue_finish)
        if training and self.profiler is not None:
            engine = torch.autograd.Variable._execution_engine
            _on_first_gradient(out, lambda: engine.queue_callback(self._end_profiled_step))
        return out

    def _run_bounded(self, module: nn.Module, original: Any, args: tuple, kwargs: dict
                     ) -> Any:
        """:meth:`_run` where expert layers bound their received rows by a headroom
        (``spmd.ep.experts(headroom=)``): when one overflowed on some rank (every rank
        raised alike, before any row moved), its headroom is grown and the forward run
        again from the same random state (the graph recompiles for the new bound). Each
        layer grows at most until its bound holds every pair, which cannot overflow."""
        from spmd.ep.placing import grow_headroom
        from spmd.lowering.experts import ExpertsOverflow
        from spmd.state.rng import rng_state, set_rng_state

        state = rng_state()
        try:
            while True:
                try:
                    return self._run(module, original, args, kwargs)
                except ExpertsOverflow as e:
                    grown = grow_headroom(module, self.experts, e)
                    log.warning("spmd: %s; its headroom grown to %.3g and the forward run "
                                "again", e, grown)
                    self.capture.recompiling = (f"the expert headroom of {e.module} grew to "
                                                f"{grown:.3g} (a rank received {e.need} rows, "
                                                f"more than its bound {e.bound})")
                    set_rng_state(state)
        finally:
            self.capture.recompiling = None

    def _run(self, module: nn.Module, original: Any, args: tuple, kwargs: dict) -> Any:
        """The compiled forward; if the model cannot be captured at all, the eager one,
        with every gradient left to the safety net (the plan says why)."""
        if self.capture_failed is None:
            try:
                runs = self.capture.forward_runs
                out = self.compiled(*args, **kwargs)
                # no compiled graph ran: Dynamo ran the forward eagerly (its recompile limit
                # was hit, or it skipped the frame); the safety net averages the gradients
                self.eager_forward = None if self.capture.forward_runs != runs else (
                    "its forward ran without a compiled graph (Dynamo's recompile limit, "
                    "torch._dynamo.config.recompile_limit, was hit, or Dynamo skipped the "
                    "frame): " + ("gathered and reduce-scattered eagerly" if self.sharded
                                  else "averaged by the eager safety net"))
                if self.eager_forward and self.sharded and torch.is_grad_enabled():
                    for name, param in self.params.items():
                        if param.requires_grad:
                            self.fallbacks.setdefault(name, self.eager_forward)
                return out
            except Exception as e:
                from torch._dynamo.exc import TorchDynamoException

                if not isinstance(e, TorchDynamoException):
                    raise  # the model's own error, not a capture failure
                inner = getattr(e, "inner_exception", None) or e.__cause__ or e
                from spmd.lowering.annotate import EmptyBackwardError, ShardingError
                from spmd.lowering.verify import PlanVerificationError

                # tensor parallelism cannot place an op, a backward lost its gradients,
                # the plan is wrong (a compiler bug), or the ranks disagree (they traced
                # different graphs): no eager run would be right either
                if isinstance(inner, (ShardingError, EmptyBackwardError,
                                      PlanVerificationError, DistError)):
                    raise inner from None
                first = (str(inner).strip().splitlines() or ["?"])[0][:200]
                reason = f"the model could not be captured ({type(inner).__name__}: {first})"
                log.warning("spmd: %s; running it eagerly, gradients averaged by the safety "
                            "net", reason)
                self.capture_failed = reason
        reason = self.capture_failed
        if self.sharded:
            reason += ("; its parameters are gathered and their gradients reduce-scattered "
                       "eagerly (blocking, one collective per parameter use)")
        for name in self.params:
            if self.params[name].requires_grad:
                self.fallbacks.setdefault(name, reason)
        return original(module, *args, **kwargs)

    def _buffer_source(self) -> int:
        """The rank buffers are broadcast from: the group's first, or under ``spmd.Join``
        the highest rank still training (a MAX all-reduce; joined ranks add zeros)."""
        if self.join is None:
            return self.group.ranks[0]
        from spmd.runtime.collectives import ReduceOp, all_reduce

        source = torch.tensor([float(self.group.rank())])
        all_reduce(source, op=ReduceOp.MAX, group=self.group)
        return self.group.ranks[int(source.item())]

    def _broadcast_buffers(self) -> None:
        """Buffers from the mesh's first rank to every rank (along each data dimension
        in turn when the batch is split along several)."""
        strategy = self.setup.strategy
        if len(strategy.data_dims) == 1:
            broadcast_coalesced(self.buffers.values(), self.group.ranks[0], self.group)
            return
        for dim in reversed(strategy.data_dims):
            group = strategy.mesh.get_group(dim)
            if group.size() > 1:
                broadcast_coalesced(self.buffers.values(), group.ranks[0], group)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        previous = self.sync.enabled
        self.sync.enabled = False
        try:
            yield
        finally:
            self.sync.enabled = previous


def _cast_floating(value: Any, dtype: torch.dtype) -> Any:
    import torch.utils._pytree as pytree

    return pytree.tree_map_only(
        torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, value)


def _on_first_gradient(out: Any, callback: Any) -> None:
    """Run ``callback`` when backward first reaches ``out`` (a tensor in a nest)."""
    import torch.utils._pytree as pytree

    for leaf in pytree.tree_leaves(out):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            leaf.register_hook(lambda grad: (callback(), grad)[1])
            return


def _compile(module: nn.Module, original: Any, capture: Capture) -> Any:
    """``torch.compile`` of this instance's forward, with a code object of its own.

    Dynamo caches compiled code per code object and stops recompiling after a limit;
    a fresh copy of the trampoline's code per instance keeps instances from sharing (and
    exhausting) one cache. It also gets a globals dict of its own: Dynamo stores each
    compiled graph as a global of the frame it compiled, where it would outlive the
    module (and everything the graph refers to) for the life of the process.
    """
    def trampoline(*args: Any, **kwargs: Any) -> Any:
        return original(module, *args, **kwargs)

    code = trampoline.__code__.replace(co_name=f"spmd_forward_{id(module):x}")
    own_globals = {"__builtins__": __builtins__, "__name__": __name__}
    fresh = types.FunctionType(code, own_globals, code.co_name, trampoline.__defaults__,
                               trampoline.__closure__)
    return torch.compile(fresh, backend=capture)
