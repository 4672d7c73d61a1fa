"""Capture of a whole training step: forward, backward and the optimizer's place in one
graph, traced with ``make_fx`` on fake tensors.

The model's parameters and buffers become graph inputs (``_reparametrize_module``).
``loss.backward()`` becomes ``torch.autograd.grad`` so the backward is in the graph, and
its gradients are set on the parameters' ``.grad`` as backward would, so code that reads
them (``clip_grad_norm_``) is traced reading them. ``opt.step()`` and ``zero_grad()`` are
recorded, not run; the ``.grad`` each parameter holds when ``opt.step()`` is called is
what the graph returns for it.

Each parameter's gradient as autograd computed it passes a marker op while tracing
(``spmd::gradient_of``), so it is found even when later code mutates it in place; the
marker is then removed and its input tagged (``meta["spmd_gradient_of"]``). That value
is each rank's own, and the passes reduce it and make every reader of it read the
reduced one. A step that reads a gradient the compiler cannot place after the
reduction is refused, naming what it does: reading ``.grad`` between two ``backward()``
calls, calling ``torch.autograd.grad`` itself, stepping the optimizer more than once or
before the last backward.

``make_fx`` and the patches above are process-wide, so traces are serialised (thread
ranks trace one after another) and the patches answer only the thread that traces.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from spmd.lowering.annotate import GRADIENT_TAG, PlanningError
from spmd.lowering.context import InputInfo
from spmd.lowering import ops

__all__ = ["TracedStep", "trace_step"]

_LOCK = threading.Lock()  # make_fx's patcher is process-global
_local = threading.local()  # the recorder of the thread that traces, if any
_ORIGINAL_BACKWARD = torch.Tensor.backward
_ORIGINAL_GRAD = torch.autograd.grad

_gradient_of = ops.define("gradient_of(Tensor(a) grad, str param) -> Tensor(a)",
                         lambda grad, param: grad, lambda grad, param: grad)


def _backward(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    recorder = getattr(_local, "recorder", None)
    if recorder is None:
        return _ORIGINAL_BACKWARD(tensor, *args, **kwargs)
    return recorder.backward(tensor, *args, **kwargs)


def _grad(*args: Any, **kwargs: Any) -> Any:
    recorder = getattr(_local, "recorder", None)
    if recorder is not None and not recorder.differentiating:
        raise PlanningError("the step calls torch.autograd.grad itself; its gradients would be "
                            "each rank's own, never averaged. Call loss.backward() and read "
                            ".grad instead")
    return _ORIGINAL_GRAD(*args, **kwargs)


class _Recorder:
    """Stands in for ``Tensor.backward``, ``opt.step`` and ``zero_grad`` while tracing."""

    def __init__(self, params: list[torch.Tensor], names: tuple[str, ...]) -> None:
        self.params = params
        self.names = names
        self.grads: list[torch.Tensor | None] = [None] * len(params)
        self.calls: list[tuple[str, dict]] = []
        self.at_step: list[torch.Tensor | None] | None = None
        self.differentiating = False  # inside our own torch.autograd.grad call

    def backward(self, loss: torch.Tensor, gradient: Any = None, retain_graph: Any = None,
                 create_graph: bool = False, inputs: Any = None) -> None:
        if create_graph:
            raise PlanningError("the step calls backward(create_graph=True) (higher-order "
                                "gradients), which parallelize does not support")
        if any(c == "step" for c, _ in self.calls):
            raise PlanningError("the step calls backward() after opt.step(); one optimizer "
                                "step after the last backward() is supported")
        wanted = [i for i, p in enumerate(self.params) if p.requires_grad]
        self.differentiating = True
        try:
            grads = _ORIGINAL_GRAD(loss, [self.params[i] for i in wanted],
                                   grad_outputs=gradient, retain_graph=retain_graph,
                                   allow_unused=True)
        finally:
            self.differentiating = False
        for i, g in zip(wanted, grads):
            if g is None:
                continue
            if self.grads[i] is not None:
                g = self.grads[i] + g
            g = self.grads[i] = _gradient_of(g, self.names[i])
            self.params[i].grad = g  # what code after backward() reads
        self.calls.append(("backward", {}))

    def step(self, *args: Any, **kwargs: Any) -> None:
        if args or kwargs.get("closure") is not None:
            raise PlanningError("opt.step(closure) is not supported inside a parallelized step")
        if self.at_step is not None:
            raise PlanningError("the step calls opt.step() more than once; one optimizer step "
                                "per parallelized step is supported")
        self.at_step = [p.grad for p in self.params]
        self.calls.append(("step", kwargs))

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append(("zero_grad", kwargs))


def _tag_gradients(gm: fx.GraphModule) -> None:
    """Replace each ``gradient_of`` marker by its input, tagging the last one of each
    parameter (after every ``backward()``) as its gradient. An earlier one must feed only
    the next accumulation: a step that read it would read a gradient before the last
    backward, which no reduction can come before."""
    markers: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.target is _gradient_of:
            markers.setdefault(node.args[1], []).append(node)
    for param, nodes in markers.items():
        for node in nodes[:-1]:
            readers = [u for u in node.users if u.op != "output"]
            if len(readers) > 1:
                raise PlanningError(f"the step reads the gradient of {param} between two "
                                    f"backward() calls ({readers[-1].name}); only the gradient "
                                    f"after the last backward() is averaged across ranks")
        nodes[-1].args[0].meta[GRADIENT_TAG] = param
        for node in nodes:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)


@dataclass(eq=False)
class TracedStep:
    """One traced step: its graph (outputs: the gradient each parameter holds at
    ``opt.step()``, then None for every buffer and data input, then the step's tensor
    results), what each input is, and what to replay after the graph runs."""

    gm: fx.GraphModule
    inputs: tuple[InputInfo, ...]
    calls: list[tuple[str, dict]]
    out_spec: Any
    constants: list[Any]
    tensor_slots: list[int]


def trace_step(fn: Callable[..., Any], model: nn.Module, opt: Any, args: tuple,
               kwargs: dict) -> TracedStep:
    """Trace ``fn(*args, **kwargs)`` (which trains ``model`` with ``opt``) into a graph."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.nn.utils.stateless import _reparametrize_module

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
        for p in ps:  # the graph computes this step's gradients; what .grad already held
            p.grad = None  # is added when the step is replayed (make_fx copied it as a fake)
        recorder = _local.recorder = _Recorder(list(ps), pnames)
        saved = {name: opt.__dict__[name] for name in ("step", "zero_grad")
                 if opt is not None and name in opt.__dict__}  # e.g. an LR scheduler's wrapper
        if opt is not None:
            opt.step, opt.zero_grad = recorder.step, recorder.zero_grad
        try:
            with _reparametrize_module(model, {**dict(zip(pnames, ps)), **dict(zip(bnames, bs))},
                                       tie_weights=True):  # a tied parameter everywhere
                result = fn(*call_args, **call_kwargs)
                at_step = recorder.at_step or [p.grad for p in ps]
        finally:
            _local.recorder = None
            if opt is not None:
                del opt.step, opt.zero_grad
                opt.__dict__.update(saved)
        out_leaves, box["spec"] = pytree.tree_flatten(result)
        box["constants"] = out_leaves
        box["calls"] = recorder.calls
        tensors = [x for x in out_leaves if isinstance(x, torch.Tensor)]
        return (*at_step, *tensors)

    data = [leaves[i] for i in slots]
    with _LOCK:
        torch.Tensor.backward, torch.autograd.grad = _backward, _grad  # type: ignore
        try:
            gm = make_fx(traced, tracing_mode="fake")(*params, *buffers, *data)
        finally:
            torch.Tensor.backward, torch.autograd.grad = _ORIGINAL_BACKWARD, _ORIGINAL_GRAD  # type: ignore
    _tag_gradients(gm)
    outputs = list(gm.graph.output_node().args[0])
    gm.graph.output_node().args = (tuple([*outputs[:P], *[None] * (B + len(data)),
                                          *outputs[P:]]),)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    inputs = tuple(
        [InputInfo(kind="param", name=n, shape=tuple(p.shape), dtype=p.dtype,
                   requires_grad=p.requires_grad) for n, p in zip(pnames, params)]
        + [InputInfo(kind="buffer", name=n, shape=tuple(b.shape), dtype=b.dtype)
           for n, b in zip(bnames, buffers)]
        + [InputInfo(kind="data", name=f"input{i}", shape=tuple(t.shape), dtype=t.dtype)
           for i, t in enumerate(data)])
    tensors_at = [i for i, x in enumerate(box["constants"]) if isinstance(x, torch.Tensor)]
    return TracedStep(gm=gm, inputs=inputs, calls=box["calls"], out_spec=box["spec"],
                      constants=box["constants"], tensor_slots=tensors_at)
