"""verify: check a planned graph against its placements, deriving them again without
trusting the passes that wrote them.

The passes leave each value's placement on its node (``meta["sharding"]``). The verifier
reads none of it. From the graph's inputs (the strategy's placements; for a backward, the
placements its forward was verified to save) it derives every value's placement node by
node, from what the node is:

- an op: on a tensor-parallel dimension, the decision ``propagate`` recorded for it
  (``meta["spmd_tp"]``); its inputs must arrive exactly as that decision needs them, and
  without one every input must be whole. On a data dimension the op runs per rank: its
  output is each rank's own (``Varying``), and a partial sum read there is an error.
- a collective: the redistribution table's step on its mesh dimension and nothing else
  (a bucket: each of its values); its input must hold the step's source placement (on a
  data dimension, each rank's own value is what a reduction averages);
- a wait, the nodes that unpack a bucket: the collective's values, laid out;
- the optimizer run from a bucket: every parameter stepped with its gradient placed where
  the parameter lives.

Then it checks, raising :class:`PlanVerificationError` naming the node, its inputs'
placements, the rule and the line of model code that made the node:

1. no value reaches a consumer in another placement than the consumer's decision needs:
   a ``Partial`` never reaches an op that needs it whole, a parameter's stored shard is
   never read as if whole;
2. every value's local shape is its whole shape cut by its placement (the op run on the
   whole shapes on the meta device);
3. every parameter's gradient leaves the graph reduced over every mesh dimension the
   parameter is replicated on, placed where the parameter lives; what the caller
   receives is whole on every tensor-parallel dimension; what a forward saves is what
   its backward was planned with;
4. every decision taken agrees with running the op on real shards of the graph's own
   shapes (:func:`spmd.lowering.rule_check.on_shards`), each distinct (op, decision,
   shapes) once per process.

It runs as the last pass when ``SPMD_VERIFY`` is set (``1``: everything; ``structure``:
1-3 only), always in this project's tests, and on demand as ``Plan.verify()``.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import torch
import torch.fx as fx

from spmd.lowering import ops, rules
from spmd.lowering import ranked as ranked_ops
from spmd.lowering.context import LoweringContext
from spmd.lowering.graph import is_collective
from spmd.lowering.placements import (Partial, Placement, Replicate, Sharding, Varying,
                                     divides)
from spmd.lowering.experts import ROUTED, data_placement
from spmd.lowering.propagate import module_of, seeded
from spmd.lowering.reshard import RESHARDED, forward_name
from spmd.lowering.rule_check import on_shards, random_like, run_op
from spmd.lowering.specs import lookup
from spmd.lowering.state import Boundary, Record, find, put, state_of

__all__ = ["verify", "verify_pass", "PlanVerificationError", "Verified", "NUMERIC_LIMIT"]

NUMERIC_LIMIT = 1 << 20  # elements of one op's whole inputs checked on real shards, at most
_BUCKETS = (ops.bucket_all_reduce, ops.bucket_all_gather, ops.bucket_reduce_scatter)
_CHECKED: dict[tuple, None] = {}  # decisions already checked on real shards in this process


class PlanVerificationError(RuntimeError):
    """A planned graph breaks one of the invariants a correct plan keeps; the message
    names the node, its inputs' placements, the rule and the model code. This is a bug
    in the compiler (or in a sharding rule), never something to fall back from."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Verified(Record):
    """What ``verify`` checked on a graph.

    Attributes:
        nodes: values whose placement was derived.
        decisions: tensor-parallel decisions checked on real shards here (others were
            checked on the same shapes earlier in this process).
        unchecked: decisions not checked on real shards, each with why (too large, an
            op without a CPU or meta kernel).
    """

    producer: ClassVar[str] = "verify"
    nodes: int
    decisions: int
    unchecked: tuple[str, ...] = ()


def _source(node: fx.Node) -> str:
    """`` at file:line: `code` `` of the model code that made ``node``, when recorded."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in [^\n]*\n\s*([^\n]*)', trace)
    if not frames:
        return ""
    path, line, code = frames[-1]
    return f", model code {path}:{line}: `{code.strip()}`"


def _origin(node: fx.Node, limit: int = 64) -> fx.Node:
    """``node``, or for a node a pass inserted the nearest value it was computed from that
    the model's code made (not past a collective: a bucket mixes many values)."""
    seen, frontier = 0, [node]
    while frontier and seen < limit:
        current = frontier.pop(0)
        seen += 1
        if current.meta.get("stack_trace") or module_of(current):
            return current
        if not is_collective(current):
            frontier.extend(current.all_input_nodes)
    return node


def _rule_name(target: Any) -> str:
    rule = rules.lookup(target)
    if rule is None:
        return "no rule (inputs replicated first)"
    return f"{rule.__module__}.{rule.__qualname__}"


def _shape(val: Any) -> list[int] | None:
    """``val``'s shape as ints, None when it is symbolic or not a tensor."""
    if not isinstance(val, torch.Tensor):
        return None
    try:
        return [int(d) for d in val.shape] if all(
            isinstance(d, int) for d in val.shape) else None
    except TypeError:
        return None


class _Verifier:
    def __init__(self, gm: fx.GraphModule, ctx: LoweringContext, numerics: int | None) -> None:
        self.gm, self.ctx = gm, ctx
        self.strategy = ctx.strategy
        self.mesh = ctx.mesh
        self.data = set(self.strategy.data_dims)
        self.tp = set(self.strategy.tp_dims)
        self.placed: dict[fx.Node, Any] = {}
        self.inputs: dict[fx.Node, Any] = {}  # placeholder -> its InputInfo (not backward)
        self.shards: set[fx.Node] = set()  # parameters' stored shards on a data dimension
        # symbolic sizes of a rank's own rows (a dynamic graph's batch size, and sizes
        # computed from it): what is built from them is the rank's own, as the plan says
        self.rank_sized: set[fx.Node] = set()
        self.numerics = numerics
        self.checked = 0
        self.unchecked: list[str] = []
        self.generator = torch.Generator().manual_seed(0)

    # -- reporting ---------------------------------------------------------------------

    def fail(self, node: fx.Node, what: str) -> None:
        origin = _origin(node)
        module = module_of(origin)
        where = f" in {module}" if module else ""
        made = f" (computed from {origin.name})" if origin is not node else ""
        inputs = ", ".join(f"{a.name}: {self._show(self.placed.get(a))}"
                           for a in node.all_input_nodes if a in self.placed)
        raise PlanVerificationError(
            f"plan verification failed in {self.ctx.graph_name} ({self.ctx.role}): "
            f"{node.name} ({node.target}){made}{where}{_source(origin)}: {what}"
            + (f" [inputs: {inputs}]" if inputs else ""))

    @staticmethod
    def _show(value: Any) -> str:
        if isinstance(value, tuple):
            return "(" + ", ".join(map(str, value)) + ")"
        return str(value)

    # -- placements --------------------------------------------------------------------

    def norm(self, s: Sharding) -> Sharding:
        """A placement on a dimension of one rank is no placement: ``Replicate()``."""
        placements = tuple(Replicate() if self.mesh.size(d) == 1 else p
                           for d, p in zip(self.mesh.dim_names, s.placements))
        return s if placements == s.placements else Sharding(mesh=self.mesh,
                                                             placements=placements)

    def local(self) -> Sharding:
        """Each rank's own value: ``Varying`` on the data dimensions, whole elsewhere."""
        return self.norm(Sharding.on(self.mesh, {d: Varying() for d in self.data}))

    def value(self, node: fx.Node, user: fx.Node) -> Sharding | None:
        """The placement ``user`` reads ``node`` in: one value (a bucket of one is its
        value; a bucket of several read as one tensor is an error)."""
        s = self.placed.get(node)
        if isinstance(s, tuple):
            if len(s) != 1:
                self.fail(user, f"reads {node.name}, a flat bucket of {len(s)} values, as one "
                                f"tensor")
            s = s[0]
        return s

    # -- the walk ----------------------------------------------------------------------

    def run(self) -> Verified:
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        if self.ctx.role != "backward":
            self.inputs = dict(zip(placeholders, self.ctx.inputs))
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                self.placed[node] = self.placeholder(node)
            elif node.op == "call_function":
                self.placed[node] = self.call(node)
            elif node.op == "output":
                self.outputs(node)
        return Verified(nodes=len(self.placed), decisions=self.checked,
                        unchecked=tuple(self.unchecked))

    def _per_rank_size(self, node: fx.Node) -> bool:
        """A symbolic size the plan places as each rank's own on a data dimension (a
        dynamic graph's batch size: the rank's rows), or one computed from such a size or
        from a tensor that is each rank's own there."""
        def own(s: Any) -> bool:  # each rank's own on some data dimension
            return isinstance(s, Sharding) and any(
                dim in self.data and not isinstance(p, Replicate)
                for dim, p in zip(self.mesh.dim_names, self.norm(s).placements))

        return isinstance(node.meta.get("val"), torch.SymInt) and (
            own(node.meta.get("sharding")) or any(
                a in self.rank_sized or own(self.placed.get(a)) for a in node.all_input_nodes))

    def placeholder(self, node: fx.Node) -> Any:
        if not isinstance(node.meta.get("val"), torch.Tensor):
            if self._per_rank_size(node):
                self.rank_sized.add(node)
            return None
        if self.ctx.role == "backward":
            # a saved value (the forward's verification checked what it saves); a tangent
            saved = self.ctx.saved.get(forward_name(node))
            if RESHARDED in node.meta:
                self.shards.add(node)
            return self.local() if saved is None else self.norm(saved)
        info = self.inputs[node]
        if info.kind == "param" and self.strategy.shards_parameters and \
                info.name not in self.strategy.experts:  # (experts are computed as stored)
            self.shards.add(node)
        return self.norm(self.strategy.input_sharding(info))

    def call(self, node: fx.Node) -> Any:
        if node.target is operator.getitem:
            source = self.placed.get(node.args[0])
            return source[node.args[1]] if isinstance(source, tuple) else source
        if is_collective(node):
            return self.collective(node)
        role = node.meta.get("spmd_role")
        if role is not None and role.kind == "optimizer":
            self.optimizer(node)
            return None
        if node.target is ops.local_redistribute:
            step = lookup(node.args[1]).step
            have = self.value(node.args[0], node)
            return self.step(node, node.args[0], have, step.mesh_dim, step.src, step.dst,
                             "a local step")
        if role is not None:  # a wait, or a node unpacking a collective's result
            return self.placed.get(node.args[0])
        val = node.meta.get("val")
        tensors = val if isinstance(val, (tuple, list)) else [val]
        if not any(isinstance(t, torch.Tensor) for t in tensors):
            if self._per_rank_size(node):
                self.rank_sized.add(node)
            return None
        return self.op(node)

    def step(self, node: fx.Node, source: fx.Node, have: Sharding, dim: str,
             src: Placement, dst: Placement, what: str) -> Sharding:
        """``have`` after the table's step ``src -> dst`` on ``dim``, which must apply."""
        p = have[dim]
        fits = p == src or self.mesh.size(dim) == 1
        if not fits and dim in self.data and isinstance(src, Partial):
            # on a data dimension each rank's own value is the part a reduction averages
            # (a gradient of this rank's rows, a batch norm's per-rank sums)
            fits = isinstance(p, Varying) or (isinstance(p, Replicate)
                                              and src.reduce_op == "avg")
        if not fits:
            self.fail(node, f"{what} takes {src!r} on {dim!r} to {dst!r}, but {source.name} is "
                            f"{p!r} there")
        return self.norm(have.with_placement(dim, dst))

    def collective(self, node: fx.Node) -> Any:
        info = node.meta["spmd_collective"]
        spec = lookup(info.handle)
        bucket = node.target in _BUCKETS
        sources = list(node.args[0]) if bucket else [node.args[0]]
        shards = getattr(spec, "shards", ())
        results = []
        for k, source in enumerate(sources):
            have = self.value(source, node)
            if have is None:
                self.fail(node, f"sends {source.name}, which is not a tensor")
            out = self.step(node, source, have, info.mesh_dim, info.src, info.dst, info.kind)
            if info.kind == "reduce_scatter" and k < len(shards) and shards[k].replicate_dim \
                    and self.mesh.size(shards[k].replicate_dim) > 1:
                # hybrid sharding: the shards are then averaged across the replicas
                out = self.step(node, source, out, shards[k].replicate_dim, Partial("avg"),
                                Replicate(), "the replicas' average")
            results.append(out)
        return tuple(results) if bucket else results[0]

    def optimizer(self, node: fx.Node) -> None:
        flat = self.placed.get(node.args[1])
        pieces = flat if isinstance(flat, tuple) else (flat,)
        for param, piece in zip(node.args[0], pieces):
            name = self.inputs[param].name
            want = self.norm(self.strategy.gradient_target(name))
            if piece != want:
                self.fail(node, f"steps {name} with its gradient placed {piece}; it must be "
                                f"{want}, where the parameter lives")

    def op(self, node: fx.Node) -> Any:
        args = rules.tensor_args(node)
        have = [self.value(a, node) for a in args]
        for a, h in zip(args, have):
            if h is None:
                self.fail(node, f"reads {a.name}, whose placement is unknown")
            if a in self.shards:
                self.fail(node, f"reads {a.name}, a parameter's stored shard "
                                f"({self.placed[a]}), as if it were the whole parameter")
        val = node.meta["val"]
        count = len(val) if isinstance(val, (tuple, list)) else 0
        per_output: list[list[Placement]] = [[] for _ in range(max(count, 1))]
        decided = []
        for i, dim in enumerate(self.mesh.dim_names):
            incoming = tuple(h.placements[i] for h in have)
            if self.mesh.size(dim) == 1:
                placed: Any = Replicate()
            elif dim in self.data:
                placed = self.per_rank(node, args, incoming, dim)
            else:
                placed = self.decided(node, dim, args, incoming)
                if placed is None:  # nothing decided, every input whole: whole
                    placed = Replicate()
                else:
                    decided.append(dim)
            for k, out in enumerate(per_output):
                out.append(placed[k] if isinstance(placed, tuple) else placed)
        made = tuple(Sharding(mesh=self.mesh, placements=tuple(p)) for p in per_output)
        result = made if count else made[0]
        if decided:
            self.check_shapes(node, args, have, result)
            for dim in decided:
                self.check_numerics(node, dim, args, have, result)
        return result

    def per_rank(self, node: fx.Node, args: list[fx.Node], incoming: tuple[Placement, ...],
                 dim: str) -> Placement:
        """A data dimension: the op runs on each rank's rows (DDP's semantics)."""
        for a, p in zip(args, incoming):
            if isinstance(p, Partial):
                self.fail(node, f"reads {a.name} as a whole value on data dimension {dim!r}, "
                                f"but it is {p!r} there: a partial sum, not reduced")
        placed = data_placement(node.target, dim, self.strategy.experts.values(),
                                incoming, "spmd_tp_inserted" in node.meta)
        if placed is not None:
            return placed
        local = (seeded(node) or any(not isinstance(p, Replicate) for p in incoming)
                 or any(a in self.rank_sized for a in node.all_input_nodes))
        return Varying() if local else Replicate()

    def decided(self, node: fx.Node, dim: str, args: list[fx.Node],
                incoming: tuple[Placement, ...]) -> Any:
        """A tensor-parallel dimension: the decision recorded for the node (its output
        placement(s)), whose inputs must arrive as it needs; None when nothing was decided
        and every input is whole (the output is whole)."""
        choice = node.meta.get("spmd_tp", {}).get(dim)
        if choice is None:
            moved = [f"{a.name}: {p!r}" for a, p in zip(args, incoming)
                     if not isinstance(p, Replicate)]
            if moved:
                self.fail(node, f"has no sharding decision on {dim!r}, yet reads "
                                f"{', '.join(moved)} there; only whole inputs give a whole "
                                f"output")
            return None
        need = choice.decision.required(choice.inputs)
        for a, p, want in zip(args, incoming, need):
            if p != want:
                hint = (" (a partial sum reaching an op that needs it whole)"
                        if isinstance(p, Partial) else "")
                self.fail(node, f"reads {a.name} as {p!r} on {dim!r}, but its decision needs "
                                f"{want!r}{hint}; rule {_rule_name(node.target)}: "
                                f"{choice.decision.reason}")
        return choice.decision.output

    # -- shapes and values -------------------------------------------------------------

    def whole_shape(self, shape: list[int], s: Sharding, dims: Sequence[str]) -> list[int]:
        out = list(shape)
        for dim in dims:
            p = s[dim]
            if divides(p):
                out[p.dim] *= self.mesh.size(dim)
        return out

    def others(self, node: fx.Node) -> dict[fx.Node, Any] | None:
        """Values of the node's non-tensor node arguments; None when one is symbolic."""
        found: dict[fx.Node, Any] = {}
        for a in node.all_input_nodes:
            val = a.meta.get("val")
            if isinstance(val, torch.Tensor) or isinstance(val, (tuple, list)):
                continue
            if not isinstance(val, (int, float, bool)):
                return None
            found[a] = val
        return found

    def check_shapes(self, node: fx.Node, args: list[fx.Node], have: list[Sharding],
                     result: Any) -> None:
        """The op run on the whole shapes (meta tensors) and cut by the derived placement
        must give the local shapes the graph holds."""
        dims = [d for d in self.mesh.dim_names if d in self.tp]
        shapes = [_shape(a.meta["val"]) for a in args]
        val = node.meta["val"]
        vals = list(val) if isinstance(val, (tuple, list)) else [val]
        outs = list(result) if isinstance(result, tuple) else [result]
        others = self.others(node)
        if others is None or any(s is None for s in shapes) or not any(
                _shape(v) is not None for v in vals):
            self.unchecked.append(f"{node.name}: symbolic shapes (local shapes not checked)")
            return
        inputs = [torch.empty(self.whole_shape(s, h, dims), dtype=a.meta["val"].dtype,
                              device="meta") for s, h, a in zip(shapes, have, args)]
        target_shape = (self.whole_shape(_shape(vals[0]), outs[0], dims)
                        if node.target in rules.SHAPE_ARG or node.target in rules.ROWS_ARG
                        else None)
        ranked = ranked_ops.RANKED.get(node.target)  # (its own op computes a rank's part)
        try:
            whole = run_op(node, inputs, others, target_shape,
                           ranked.whole if ranked is not None else None)
        except Exception as e:  # an op without a meta kernel: its shapes stay unchecked
            self.unchecked.append(f"{node.name}: {node.target} does not run on meta ({e})")
            return
        wholes = list(whole) if isinstance(whole, (tuple, list)) else [whole]
        for k, (w, local, s) in enumerate(zip(wholes, vals, outs)):
            if not isinstance(w, torch.Tensor) or not isinstance(local, torch.Tensor):
                continue
            want = list(w.shape)
            for dim in dims:
                p = s[dim]
                if divides(p):
                    if want[p.dim] % self.mesh.size(dim):
                        self.fail(node, f"output {k} is {p!r} on {dim!r}, but its whole "
                                        f"shape {list(w.shape)} does not divide there")
                    want[p.dim] //= self.mesh.size(dim)
            if _shape(local) != want:
                self.fail(node, f"output {k} has local shape {_shape(local)}, but its whole "
                                f"shape {list(w.shape)} placed {s} is {want} on each rank")

    def check_numerics(self, node: fx.Node, dim: str, args: list[fx.Node],
                       have: list[Sharding], result: Any) -> None:
        """The decision on ``dim`` run on real shards of the graph's own shapes (whole
        along ``dim``, this rank's pieces along any other dimension)."""
        if self.numerics is not None and self.numerics <= 0:
            return
        choice = node.meta["spmd_tp"][dim]
        need = tuple(choice.decision.required(choice.inputs))
        output = choice.decision.output
        outs = output if isinstance(output, tuple) else (output,)
        if choice.fallback or all(isinstance(p, Replicate) for p in (*need, *outs)):
            return  # whole inputs give the whole output: nothing to check
        if node.target in ROUTED:
            self.unchecked.append(f"{node.name} on {dim!r}: its values follow the routing, "
                                  f"which random values are not")
            return
        locals_ = [_shape(a.meta["val"]) for a in args]
        others = self.others(node)
        if others is None or any(s is None for s in locals_):
            self.unchecked.append(f"{node.name} on {dim!r}: symbolic shapes")
            return
        shapes = [self.whole_shape(s, h, [dim]) for s, h in zip(locals_, have)]
        outs_s = result if isinstance(result, tuple) else (result,)
        target_shape = (self.whole_shape(_shape(node.meta["val"]), outs_s[0], [dim])
                        if node.target in rules.SHAPE_ARG or node.target in rules.ROWS_ARG
                        else None)
        key = (node.target, self.mesh.size(dim), need, output, tuple(map(tuple, shapes)),
               tuple(str(a.meta["val"].dtype) for a in args), repr(target_shape),
               repr([a for a in node.args if not isinstance(a, fx.Node)]),
               repr(sorted((k, v) for k, v in node.kwargs.items()
                           if not isinstance(v, fx.Node))))
        if key in _CHECKED:
            return
        if self.numerics is not None and self.checked >= self.numerics:
            self.unchecked.append(f"{node.name} on {dim!r}: past the sample of "
                                  f"{self.numerics} decisions")
            return
        if sum(math.prod(s) for s in shapes) > NUMERIC_LIMIT:
            self.unchecked.append(f"{node.name} on {dim!r}: inputs over {NUMERIC_LIMIT} "
                                  f"elements")
            return
        values: dict[fx.Node, torch.Tensor] = {}
        for a, s in zip(args, shapes):
            if a not in values:
                values[a] = random_like(s, a.meta["val"].dtype, self.generator)
        ranked = ranked_ops.RANKED.get(node.target)
        # split by rank on this dimension: each rank runs its part (ranked.local); on
        # another (ring attention's heads split by "tp"): the op's meaning on the pieces
        by_rank = ranked is not None and choice.decision.ranked is not None
        size = self.mesh.size(dim)
        try:
            verdict = on_shards(
                node, [values[a] for a in args], need, output, size, self.generator, others,
                target_shape, op=ranked.whole if ranked is not None else None,
                rank_op=None if not by_rank else (
                    lambda r: lambda *a: ranked.local(r, size, *a)),
                peers=by_rank and ranked.peers)
        except Exception as e:  # the op will not run on CPU float64 values: unchecked
            self.unchecked.append(f"{node.name} on {dim!r}: {type(e).__name__}: {e}")
            return
        self.checked += 1
        if verdict is not None:
            self.fail(node, f"its decision on {dim!r} ({list(need)} -> {output!r}: "
                            f"{choice.decision.reason}) does not hold on real shards of "
                            f"shapes {shapes}: {verdict}; rule {_rule_name(node.target)}")
        if len(_CHECKED) > 100_000:
            _CHECKED.clear()
        _CHECKED[key] = None

    # -- what leaves the graph ---------------------------------------------------------

    def outputs(self, node: fx.Node) -> None:
        from spmd.lowering.tensor_parallel import USER_OUTPUTS

        raw = node.args[0]
        values = list(raw) if isinstance(raw, (tuple, list)) else [raw]
        boundary = find(self.gm, Boundary)
        grads = {g.output: g.param for g in (boundary.gradients if boundary else ())
                 if g.output is not None}
        role = self.ctx.role
        user = self.gm.meta.get(USER_OUTPUTS, len(values)) if role == "forward" else len(values)
        for i, v in enumerate(values):
            if not isinstance(v, fx.Node):
                continue
            s = self.value(v, node)
            if s is None:
                continue
            if i in grads:
                self.gradient(v, grads[i], s)
            elif role == "forward" and i >= user:
                claimed = v.meta.get("sharding")
                if isinstance(claimed, Sharding) and self.norm(claimed) != s:
                    self.fail(v, f"is saved for the backward, which is planned with it placed "
                                 f"{claimed}, but it is {s}")
            else:
                for dim, p in zip(self.mesh.dim_names, s.placements):
                    if isinstance(p, Partial) or (dim in self.tp and not isinstance(
                            p, Replicate)):
                        self.fail(v, f"is returned to the caller as {p!r} on {dim!r}; the "
                                     f"caller receives whole tensors")

    def gradient(self, node: fx.Node, param: str, s: Sharding) -> None:
        want = self.norm(self.strategy.gradient_target(param))
        if s == want:
            return
        wrong = [f"{p!r} on {dim!r} (must be {w!r})" for dim, p, w in
                 zip(self.mesh.dim_names, s.placements, want.placements) if p != w]
        self.fail(node, f"is the gradient of {param}, which leaves the graph "
                        f"{', '.join(wrong)}: not reduced to where the parameter lives "
                        f"({want})")


def verify(gm: fx.GraphModule, ctx: LoweringContext | None = None,
           numerics: int | None = None) -> fx.GraphModule:
    """Check ``gm`` (a planned graph) against the invariants in this module's doc;
    :class:`PlanVerificationError` on the first violation, else ``gm`` unchanged with a
    :class:`Verified` record.

    Args:
        gm: a graph the pass list planned.
        ctx: its lowering context (default: the one it was planned with).
        numerics: decisions at most checked on real shards (None: every distinct one;
            0: none).
    """
    if ctx is None:
        ctx = state_of(gm).context
        if ctx is None:
            raise ValueError("verify: this graph was not planned by the pass list; pass ctx")
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    try:
        with unset_fake_temporarily():  # a compiler runs under the tracer's fake mode
            put(gm, _Verifier(gm, ctx, numerics).run())
    except PlanVerificationError:
        raise
    except Exception as e:  # the verifier's own failure is as loud as a violation
        raise PlanVerificationError(f"plan verification of {ctx.graph_name} could not run: "
                                    f"{type(e).__name__}: {e}") from e
    return gm


def verify_pass(gm: fx.GraphModule, ctx: LoweringContext) -> fx.GraphModule:
    """:func:`verify` as the pass list's last pass: real shards too unless
    ``SPMD_VERIFY=structure``."""
    from spmd.runtime import config

    return verify(gm, ctx, numerics=0 if config.verify_plans() == "structure" else None)
