"""propagate: give every value of the graph its placement on every mesh dimension.

Rules are per mesh dimension:

- On the strategy's data dimension the model runs per rank, as DDP runs it (JAX
  ``shard_map`` semantics): a value computed only from replicated values (parameters,
  buffers, constants) is ``Replicate()``, anything touched by the batch, or drawn from a
  random generator, is ``Varying()``. One decision is made at the boundary: each
  parameter's gradient, computed on this rank's shard of the batch, is what the strategy
  says (``Partial("avg")`` for ``ddp``), and the collectives pass turns it into the
  placement the parameter needs.
- On any other dimension (tensor parallelism's), replicated inputs give a replicated
  output; anything else asks the op's rule (``spmd.lowering.rules``) for the valid
  decisions, prices each one's redistributions with the cost model on that dimension and
  keeps the cheapest (``meta["spmd_tp"][dim]``, a :class:`TPChoice` with the reason and
  the alternatives, for the plan). An op without a rule has its inputs replicated
  first, and the choice says so; ``tensor_parallel`` then inserts what was decided.

Nodes a pass inserted keep what it decided (a collective holds its source placement, its
wait the destination's); everything after them is derived again, so a value computed
from a reduced gradient is ``Replicate()``. Passes that rewrite the graph call
:func:`derive` to restore the invariant: every node carries ``meta["sharding"]``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace

import torch
import torch.fx as fx

from spmd.lowering import rules
from spmd.lowering.annotate import ShardingError
from spmd.lowering.context import LoweringContext
from spmd.lowering.experts import data_placement
from spmd.lowering.placements import (Partial, Placement, Replicate, Sharding, StridedShard,
                                     Varying)
from spmd.lowering.redistribute import redistribution_path
from spmd.lowering.state import Boundary, needs

__all__ = ["propagate", "derive", "TPChoice", "choose", "module_of", "seeded"]


@dataclass(frozen=True, kw_only=True, slots=True)
class TPChoice:
    """What ``propagate`` decided for one node on one tensor-parallel mesh dimension.

    Attributes:
        decision: the rule's decision taken (output placement, inputs' placements).
        inputs: the inputs' placements before it (:func:`rules.tensor_args` order).
        seconds: the predicted time of the redistributions it needs.
        alternatives: the other valid decisions and their predicted seconds.
        fallback: no rule exists for the op: its inputs are replicated first.
    """

    decision: rules.Decision
    inputs: tuple[Placement, ...]
    seconds: float
    alternatives: tuple[tuple[rules.Decision, float], ...] = ()
    fallback: bool = False

    @property
    def output(self) -> Placement | tuple[Placement, ...]:
        return self.decision.output

    def why(self) -> str:
        text = self.decision.reason
        if self.alternatives:
            others = ", ".join(f"{d.reason} ({s * 1e3:.3f} ms)" for d, s in self.alternatives[:3])
            text += f" ({self.seconds * 1e3:.3f} ms of communication; over: {others})"
        return text


def _bytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        val = val[0]
    return int(val.numel()) * val.element_size() if isinstance(val, torch.Tensor) else 0


def _price(decision: rules.Decision, args: list[fx.Node], incoming: tuple[Placement, ...],
           dim: str, ctx: LoweringContext) -> float | None:
    """Predicted seconds of the redistributions ``decision`` needs; None if one of them
    has no step in the table."""
    size = ctx.mesh.size(dim)
    total = 0.0
    for arg, have, want in zip(args, incoming, decision.required(incoming)):
        try:
            steps = redistribution_path(have, want)
        except ValueError:
            return None
        total += sum(step.seconds(_bytes(arg), ctx.cost_model_along(dim), size)
                     for step in steps)
    return total


def choose(node: fx.Node, dim: str, incoming: tuple[Placement, ...],
           ctx: LoweringContext) -> TPChoice:
    """The cheapest valid decision for ``node`` on tensor-parallel dimension ``dim``."""
    args = rules.tensor_args(node)
    rule = rules.lookup(node.target)
    size = ctx.mesh.size(dim)
    if rule is None:
        decision = rules.replicate_all(node, f"no sharding rule for {node.target}: its "
                                             f"inputs are replicated first")
        seconds = _price(decision, args, incoming, dim, ctx) or 0.0
        return TPChoice(decision=decision, inputs=incoming, seconds=seconds, fallback=True)
    found_traits = rules.traits(node.target)
    if any(isinstance(p, StridedShard) for p in incoming) and not found_traits.strided:
        # a rule written before StridedShard would read it as something else: gathered
        decision = rules.replicate_all(node, f"{node.target}'s rule does not take "
                                             f"StridedShard inputs: gathered first")
        seconds = _price(decision, args, incoming, dim, ctx) or 0.0
        return TPChoice(decision=decision, inputs=incoming, seconds=seconds)
    found = (rule(node, incoming, size, dim) if found_traits.wants_dim  # type: ignore[call-arg]
             else rule(node, incoming, size))
    options = found if isinstance(found, list) else [found]
    if dim not in ctx.strategy.context_dims and found_traits.merges and len(
            args[0].users) > 1:
        # a value several reshapes read (a sequence-parallel norm's output, read by the q,
        # k and v projections) is gathered once where it is read, on a tensor-parallel
        # dimension, rather than strided by each reader and gathered by each
        options = [d for d in options if not _strided_out(d)] or options
    options = _reduce_shared_partials(node, args, incoming, options)
    priced = [(d, _price(d, args, incoming, dim, ctx)) for d in options]
    valid = [(d, s) for d, s in priced if s is not None]
    if not valid:
        raise ShardingError(f"{ctx.graph_name}: the sharding rule of {node.target} "
                            f"({node.name}{_where(node)}) offers no decision reachable from "
                            f"inputs {list(incoming)} on mesh dimension {dim!r}")
    best = min(range(len(valid)), key=lambda i: (valid[i][1], i))
    decision, seconds = valid[best]
    others = tuple(v for i, v in enumerate(valid) if i != best)
    return TPChoice(decision=decision, inputs=incoming, seconds=seconds, alternatives=others)


def _strided_out(decision: rules.Decision) -> bool:
    out = decision.output
    return any(isinstance(p, StridedShard) for p in (out if isinstance(out, tuple) else (out,)))


def _reduce_shared_partials(node: fx.Node, args: list[fx.Node],
                            incoming: tuple[Placement, ...], options: list[rules.Decision]
                            ) -> list[rules.Decision]:
    """The decisions that read every ``Partial`` input read by several ops as
    ``Replicate()``: such a value is reduced once, where it is made, and every reader
    shares that all-reduce.

    Carried on partial, each branch would need its own reduction further on: the
    gradient flowing into a norm's backward (a column-parallel layer's input gradient)
    feeds both the weight's gradient and the input's, and the decomposed RMSNorm
    backward needed three all-reduces per norm instead of Megatron's one. A branch never
    ends partial (a parameter's gradient is placed as the parameter, outputs are whole),
    so reducing at the fork costs at most what the branches would."""
    shared = {k for k, (a, p) in enumerate(zip(args, incoming))
              if isinstance(p, Partial) and len(a.users) > 1}
    if not shared or _placing(node):
        return options
    whole = [d for d in options if all(isinstance(d.required(incoming)[k], Replicate)
                                       for k in shared)]
    names = ", ".join(sorted({args[k].name for k in shared}))
    why = f"; {names} is read by several ops: reduced once where it is made"
    if not whole:
        whole = [rules.replicate_all(node, "whole inputs")]
    return [replace(d, reason=d.reason + why) for d in whole]


def module_of(node: fx.Node) -> str:
    """The module path (``layers.0.linear2``) of the model code that made ``node``."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    for prefix in ("L['module']", "L['self']", "self"):
        if path.startswith(prefix):
            path = path[len(prefix):]
            break
    path = path.replace("L__self___", "").replace("['", ".").replace("']", "")
    return path.replace("[", ".").replace("]", "").strip(".")


def _where(node: fx.Node) -> str:
    """`` in <module path>`` of the model code that made ``node``, when known."""
    module = module_of(node)
    return f" in {module}" if module else ""

def seeded(node: fx.Node) -> bool:
    """Whether torch tags the node's op as drawing from a random generator: each rank's
    own value along a data dimension."""
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


def _arg_placements(node: fx.Node, index: int) -> tuple[Placement, ...]:
    """The placement on mesh dimension ``index`` of each tensor argument, in
    :func:`rules.tensor_args` order."""
    found = []
    for arg in rules.tensor_args(node):
        spec = arg.meta.get("sharding")
        found.append(Replicate() if spec is None or isinstance(spec, tuple)
                     else spec.placements[index])
    return tuple(found)


def _rule(node: fx.Node, ctx: LoweringContext) -> Sharding | tuple[Sharding, ...]:
    strategy = ctx.strategy
    specs = _input_shardings(node)
    count = len(node.meta["val"]) if isinstance(node.meta.get("val"), (tuple, list)) else 0
    per_output: list[list[Placement]] = [[] for _ in range(max(count, 1))]
    for index, dim in enumerate(strategy.mesh.dim_names):
        incoming = [s.placements[index] for s in specs]
        if dim in strategy.data_dims:
            local = seeded(node) or any(not p.is_replicate() for p in incoming)
            placed: Placement | tuple = Varying() if local else Replicate()
            # (spmd.ep's ops: an expert gradient, a data-rank mean)
            placed = data_placement(node.target, dim, strategy.experts.values(),
                                    incoming) or placed
        elif node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            source = node.args[0].meta["sharding"]
            placed = (source[node.args[1]] if isinstance(source, tuple) else source
                      ).placements[index]
        elif all(p.is_replicate() for p in incoming) and not _placing(node) \
                and not (_ranked(node) and dim in node.meta.get("spmd_tp", {})):
            # (a ranked op keeps the decision that made it on its own dimension; on any
            # other, whole inputs give a whole output as for every op)
            placed = Replicate()
        else:
            chosen = node.meta.setdefault("spmd_tp", {})
            if dim not in chosen:
                chosen[dim] = choose(node, dim, _arg_placements(node, index), ctx)
            placed = chosen[dim].output
        for k, out in enumerate(per_output):
            out.append(placed[k] if isinstance(placed, tuple) else placed)
    made = tuple(Sharding(mesh=strategy.mesh, placements=tuple(p)) for p in per_output)
    return made if count else made[0]


def derive(gm: fx.GraphModule, ctx: LoweringContext) -> None:
    """(Re)compute ``meta["sharding"]`` of every node but placeholders and fixed ones."""
    boundary = needs(gm, Boundary, "propagate")
    gradients = {g.node: g.param for g in boundary.gradients}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output") or _decided(node):
            continue
        param = gradients.get(node.name)
        if param is not None:
            local = ctx.strategy.local_gradient(param)
            tp_dims = ctx.strategy.tp_dims
            if tp_dims and "spmd_role" not in node.meta and "spmd_collective" not in node.meta:
                # the data dimensions are the strategy's to say; a tensor-parallel one is
                # what the rules give (tensor_parallel brings it to the parameter's)
                computed = _rule(node, ctx)
                local = Sharding(mesh=local.mesh, placements=tuple(
                    c if dim in tp_dims else p for dim, p, c in
                    zip(local.mesh.dim_names, local.placements, computed.placements)))
            node.meta["sharding"] = local
            continue
        role = node.meta.get("spmd_role")
        if role is not None and role.kind == "unpack":
            gathered = _gathered_piece(node)
            if gathered is not None:
                node.meta["sharding"] = gathered
                continue
            # the pieces of a collective's result hold what its wait holds
            source = node.args[0].meta["sharding"]
            if isinstance(source, tuple):
                source = source[node.args[1] if node.target is operator.getitem else 0]
            val = node.meta.get("val")
            node.meta["sharding"] = (tuple(source for _ in val)
                                     if isinstance(val, (tuple, list)) else source)
            continue
        node.meta["sharding"] = _rule(node, ctx)


def _placing(node: fx.Node) -> bool:
    """The node's rule places its output whatever its inputs (a tensor-parallel
    parameter's gradient takes the parameter's placement)."""
    return rules.traits(node.target).wants_dim


def _ranked(node: fx.Node) -> bool:
    """The node is an op whose ranks compute differently, put there by a decision
    (``Decision.ranked``): its inputs were brought whole, its output is the decision's."""
    from spmd.lowering import ranked

    return node.target in ranked.RANKED


def _gathered_piece(node: fx.Node) -> Sharding | None:
    """A parameter's whole tensor out of a bucket of sharded parameters' gather: placed as
    that parameter's shard was, but whole along the gathered dimension (parameters of
    one bucket may differ on a tensor-parallel dimension)."""
    from spmd.lowering import ops

    if node.target is not operator.getitem:
        return None
    unpack = node.args[0]
    if not isinstance(unpack, fx.Node) or unpack.target is not ops.unpack_gathered:
        return None
    coll = unpack.args[0].args[0]
    info = coll.meta.get("spmd_collective")
    shard = coll.args[0][node.args[1]]
    if info is None or "sharding" not in shard.meta:
        return None
    return shard.meta["sharding"].with_placement(info.mesh_dim, Replicate())


def _decided(node: fx.Node) -> bool:
    """A collective or a wait: the pass that inserted it decided its sharding."""
    from spmd.lowering import ops

    role = node.meta.get("spmd_role")
    return ("spmd_collective" in node.meta or (role is not None and role.kind == "wait")
            or node.target is ops.local_redistribute)


def propagate(gm: fx.GraphModule, ctx: LoweringContext) -> fx.GraphModule:
    derive(gm, ctx)
    return gm
