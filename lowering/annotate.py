"""annotate: give every input of the graph its placement, and find its gradients.

Each input's :class:`~spmd.lowering.placements.Sharding` comes from the strategy
(``ddp``: data ``Shard(0)`` on the data dimension, parameters and buffers
``Replicate()``) and is written on its placeholder. A backward graph's inputs are not the
region's inputs but values its forward saved (found by name in ``ctx.saved``) and the
gradients flowing in (``tangents_*``, each rank's own: ``Varying()``).

The gradients: in a backward graph, output i is the gradient of forward input i (the
AOTAutograd contract, checked here against the inputs' shapes); in a whole step, the
tracer tagged each parameter's gradient node (``meta["spmd_gradient_of"]``). The
result is a :class:`~spmd.lowering.state.Boundary` record, so no later pass guesses.

Every node must carry ``meta["val"]`` (a fake tensor): graphs from Dynamo, AOTAutograd
and make_fx do; a hand-built graph gets them here from the inputs' shapes.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from spmd.lowering.context import LoweringContext
from spmd.lowering.placements import Sharding, Varying
from spmd.lowering.state import Boundary, Gradient, put

__all__ = ["annotate", "PlanningError", "ShardingError", "EmptyBackwardError", "graph_outputs",
           "GRADIENT_TAG"]

GRADIENT_TAG = "spmd_gradient_of"  # set by the step tracer on each parameter's gradient


class PlanningError(RuntimeError):
    """The graph does not have the shape a pass relies on; the caller falls back."""


class ShardingError(RuntimeError):
    """Tensor parallelism cannot place an op as its rule says (the message names the op,
    its inputs' placements and the model code): there is no correct unplanned graph to
    fall back to, so this is raised to the user."""


class EmptyBackwardError(RuntimeError):
    """A backward graph computes no gradient for any trainable parameter although its
    forward's output requires grad: an op on the way had no derivative where it was
    traced, so planning it would price (and run) a step without its backward. Raised to
    the user; no eager path would give gradients either."""


def graph_outputs(gm: fx.GraphModule) -> list:
    values = gm.graph.output_node().args[0]
    return list(values) if isinstance(values, (list, tuple)) else [values]


def _ensure_vals(gm: fx.GraphModule, ctx: LoweringContext) -> None:
    """Fake values for a graph built by hand: placeholders from the inputs' shapes, the
    rest propagated through the ops' fake kernels."""
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    if all("val" in n.meta for n in nodes):
        return
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    if _fill_missing(nodes):
        return
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if len(placeholders) != len(ctx.inputs):
        missing = next(n.name for n in nodes if "val" not in n.meta)
        raise PlanningError(f"{ctx.graph_name}: node {missing} has no meta['val'] and the "
                            f"graph's placeholders do not match its inputs")
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [mode.from_tensor(torch.empty(i.shape, dtype=i.dtype)) for i in ctx.inputs]
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)


def _fill_missing(nodes: list[fx.Node]) -> bool:
    """Give the few nodes AOTAutograd leaves without a value (the RNG-state wrappers
    activation checkpointing puts around random ops: ``run_and_save_rng_state``,
    ``run_with_rng_state``) one, by running them in the fake mode of the graph's other
    values. False where that cannot be done (then the whole graph is propagated)."""
    from torch._guards import detect_fake_mode

    missing = [n for n in nodes if "val" not in n.meta]
    if any(n.op != "call_function" for n in missing):
        return False
    mode = detect_fake_mode([n.meta["val"] for n in nodes if "val" in n.meta])
    if mode is None:
        return False
    for node in missing:
        if any("val" not in a.meta for a in node.all_input_nodes):
            return False
        args = fx.node.map_arg(node.args, lambda a: a.meta["val"])
        kwargs = fx.node.map_arg(node.kwargs, lambda a: a.meta["val"])
        try:
            with mode:
                node.meta["val"] = node.target(*args, **kwargs)
        except Exception:  # noqa: BLE001 - the whole graph's propagation is next
            return False
    return True


def _input_shardings(gm: fx.GraphModule, ctx: LoweringContext) -> None:
    strategy = ctx.strategy
    local = Sharding.on(strategy.mesh, {d: Varying() for d in strategy.data_dims})
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if ctx.role == "backward":
        from spmd.lowering.reshard import forward_name

        for node in placeholders:  # a resharded input holds the forward's shard instead
            node.meta["sharding"] = ctx.saved.get(forward_name(node), local)
        return
    if len(placeholders) != len(ctx.inputs):
        raise PlanningError(f"{ctx.graph_name}: {len(placeholders)} placeholders for "
                            f"{len(ctx.inputs)} inputs")
    for node, info in zip(placeholders, ctx.inputs):
        node.meta["sharding"] = strategy.input_sharding(info)


def _gradients(gm: fx.GraphModule, ctx: LoweringContext) -> tuple[Gradient, ...]:
    outputs = graph_outputs(gm)
    position = {id(v): i for i, v in enumerate(outputs) if isinstance(v, fx.Node)}
    trainable = {i.name: (k, i) for k, i in enumerate(ctx.inputs)
                 if i.kind == "param" and i.requires_grad}
    if ctx.role == "forward":
        return ()
    found: dict[str, fx.Node] = {}
    if ctx.role == "step":
        found = {n.meta[GRADIENT_TAG]: n for n in gm.graph.nodes if GRADIENT_TAG in n.meta}
    if not found:  # AOTAutograd's contract: output i is the gradient of input i
        if ctx.role == "backward" and len(outputs) != len(ctx.inputs):
            raise PlanningError(f"{ctx.graph_name}: backward graph has {len(outputs)} outputs "
                                f"for {len(ctx.inputs)} forward inputs")
        found = {name: outputs[k] for name, (k, _) in trainable.items()
                 if k < len(outputs) and isinstance(outputs[k], fx.Node)}
        if ctx.role == "backward" and trainable and not any(
                isinstance(o, fx.Node) for o in outputs):
            names = ", ".join(list(trainable)[:3]) + (", ..." if len(trainable) > 3 else "")
            raise EmptyBackwardError(
                f"{ctx.graph_name}: the backward graph computes no gradient for any of the "
                f"{len(trainable)} trainable parameters ({names}) although the forward's "
                f"output requires grad: an op on the way had no derivative where it was "
                f"traced (torch warns 'an autograd kernel was not registered', naming it): "
                f"give that op a derivative (torch.library.register_autograd), or plan on "
                f"real (small) tensors. (F.cross_entropy and F.nll_loss, which have none "
                f"on the meta device under torch {torch.__version__.split('+')[0]}, are "
                f"traced as their decomposition there)")
    grads = []
    for name, node in found.items():
        if name not in trainable:
            raise PlanningError(f"{ctx.graph_name}: {node.name} is tagged as the gradient of "
                                f"{name!r}, which is not a trainable parameter input")
        k, info = trainable[name]
        val = node.meta.get("val")
        if val is not None and val.layout is not torch.strided:
            raise PlanningError(f"{ctx.graph_name}: the gradient of {name} is a {val.layout} "
                                f"tensor (nn.Embedding(sparse=True), say); the graph reduces "
                                f"dense gradients only, so the eager safety net averages this "
                                f"step's gradients, sparse ones as sparse all-reduces")
        if val is not None and tuple(val.shape) != info.shape:
            raise PlanningError(f"{ctx.graph_name}: the gradient of {name} ({node.name}) has "
                                f"shape {tuple(val.shape)} but the parameter has {info.shape}")
        out = k if position.get(id(node)) == k else None
        grads.append(Gradient(param=name, node=node.name, output=out))
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    return tuple(sorted(grads, key=lambda g: order[g.node]))


def annotate(gm: fx.GraphModule, ctx: LoweringContext) -> fx.GraphModule:
    _ensure_vals(gm, ctx)
    _input_shardings(gm, ctx)
    put(gm, Boundary(role=ctx.role, gradients=_gradients(gm, ctx)))
    return gm
