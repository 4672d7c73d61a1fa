"""Hand-built graphs and contexts for the pass tests (no process group anywhere).

A graph here looks like a whole step's: placeholders (the inputs: parameters, then one
data input), compute, and an output tuple whose i-th entry is the gradient of input i.
With a simulated mesh the collectives pack and unpack without communicating, so running
the emitted code must give back exactly the gradients the unplanned graph computes.
"""

from __future__ import annotations

import torch
import torch.fx as fx

import spmd
from spmd.lowering.context import InputInfo, LoweringContext
from spmd.lowering.cost_model import CostModel
from spmd.lowering.graph import collective_nodes
from spmd.lowering.options import Options
from spmd.lowering.pipeline import PASSES, plan_graph
from spmd.lowering.passes import run_passes
from spmd.lowering.strategy import resolve_strategy

aten = torch.ops.aten


def backward_like(shapes: list[tuple[int, ...]], dtypes: list[torch.dtype], order: list[int],
                  frozen: frozenset[int] = frozenset()) -> tuple[fx.GraphModule, tuple]:
    """Gradient i = 2·x_i + x_(i-1).sum(), computed in ``order``; one data input at the end."""
    graph = fx.Graph()
    xs = [graph.placeholder(f"x{i}") for i in range(len(shapes))]
    data = graph.placeholder("data")
    grads: dict[int, fx.Node] = {}
    for i in order:
        g = graph.call_function(aten.mul.Tensor, (xs[i], 2.0))
        if i:
            g = graph.call_function(aten.add.Tensor, (g, graph.call_function(
                aten.sum.default, (xs[i - 1],))))
        grads[i] = g
    outs = [None if i in frozen else grads[i] for i in range(len(shapes))]
    graph.output(tuple(outs + [graph.call_function(aten.neg.default, (data,))]))
    infos = tuple(InputInfo(kind="param", name=f"p{i}", shape=s, dtype=d,
                            requires_grad=i not in frozen)
                  for i, (s, d) in enumerate(zip(shapes, dtypes)))
    infos += (InputInfo(kind="data", name="data", shape=(4,), dtype=torch.float32),)
    return fx.GraphModule(torch.nn.Module(), graph), infos


def context(infos: tuple, mesh=None, **options) -> LoweringContext:
    mesh = mesh if mesh is not None else spmd.Mesh.simulated(4)
    return LoweringContext(strategy=resolve_strategy("ddp", mesh, "test"),
                           options=Options(**options), cost_model=CostModel.default("gloo", 4),
                           inputs=infos, role="step")


def lower(gm: fx.GraphModule, infos: tuple, disabled=None, mesh=None,
          **options) -> fx.GraphModule:
    """``gm`` through the pipeline as the options say, or without the passes named in
    ``disabled``."""
    ctx = context(infos, mesh, **options)
    return plan_graph(gm, ctx) if disabled is None else run_passes(gm, ctx, PASSES, disabled)


def inputs_for(infos: tuple) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(i.shape, generator=gen).to(i.dtype) for i in infos]


def buckets(gm: fx.GraphModule) -> list[tuple[str, ...]]:
    return [n.meta["spmd_collective"].params for n in collective_nodes(gm)]
