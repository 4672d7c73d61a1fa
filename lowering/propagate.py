"""propagate: give every value of the graph its placement on every mesh dimension.

Rules are per mesh dimension:

- On the strategy's data dimension the model runs per rank, as DDP runs it (JAX
  ``shard_map`` semantics): a value computed only from replicated values (parameters,
  buffers, constants) is ``Replicate()``, anything touched by the batch, or drawn from a
  random generator, is ``Varying()``. One decision is made at the boundary: each
  parameter's gradient, computed on this rank's shard of the batch, is what the strategy
  says (``Partial("avg")`` for ``ddp``), and the collectives pass turns it into the
  placement the parameter needs.
- On any other dimension, replicated inputs give a replicated output; anything else needs
  a rule for the op (``spmd.lowering.rules``), and an op without one is refused by name
  rather than guessed.

Nodes a pass inserted keep what it decided (a collective holds its source placement, its
wait the destination's); everything after them is derived again, so a value computed
from a reduced gradient is ``Replicate()``. Passes that rewrite the graph call
:func:`derive` to restore the invariant: every node carries ``meta["sharding"]``.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from spmd.lowering import rules
from spmd.lowering.annotate import PlanningError
from spmd.lowering.context import LoweringContext
from spmd.lowering.placements import Placement, Replicate, Sharding, Varying
from spmd.lowering.state import Boundary, needs

__all__ = ["propagate", "derive"]

def _is_random(node: fx.Node) -> bool:
    target = node.target
    tags = getattr(target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def _input_shardings(node: fx.Node) -> list[Sharding]:
    found: list[Sharding] = []
    for arg in node.all_input_nodes:
        spec = arg.meta.get("sharding")
        if isinstance(spec, tuple):
            found.extend(spec)
        elif spec is not None:
            found.append(spec)
    return found


def _rule(node: fx.Node, ctx: LoweringContext) -> Sharding:
    strategy = ctx.strategy
    specs = _input_shardings(node)
    placements: list[Placement] = []
    for index, dim in enumerate(strategy.mesh.dim_names):
        incoming = [s.placements[index] for s in specs]
        if dim in strategy.data_dims:
            local = _is_random(node) or any(not p.is_replicate() for p in incoming)
            placements.append(Varying() if local else Replicate())
        elif all(p.is_replicate() for p in incoming):
            placements.append(Replicate())
        else:
            rule = rules.lookup(node.target)
            if rule is None:
                raise PlanningError(f"{ctx.graph_name}: no sharding rule for {node.target} "
                                    f"({node.name}) with inputs {incoming} on mesh dimension "
                                    f"{dim!r}")
            placements.append(rule(node, incoming))
    return Sharding(mesh=strategy.mesh, placements=tuple(placements))


def derive(gm: fx.GraphModule, ctx: LoweringContext) -> None:
    """(Re)compute ``meta["sharding"]`` of every node but placeholders and fixed ones."""
    boundary = needs(gm, Boundary, "propagate")
    gradients = {g.node: g.param for g in boundary.gradients}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output") or _decided(node):
            continue
        param = gradients.get(node.name)
        if param is not None:
            node.meta["sharding"] = ctx.strategy.local_gradient(param)
            continue
        spec = _rule(node, ctx)
        val = node.meta.get("val")
        node.meta["sharding"] = tuple(spec for _ in val) if isinstance(val, (tuple, list)) else spec


def _decided(node: fx.Node) -> bool:
    """A collective or a wait: the pass that inserted it decided its sharding."""
    role = node.meta.get("spmd_role")
    return "spmd_collective" in node.meta or (role is not None and role.kind == "wait")


def propagate(gm: fx.GraphModule, ctx: LoweringContext) -> fx.GraphModule:
    derive(gm, ctx)
    return gm
