"""tensor_parallel: run the graph on each rank's pieces, as ``propagate`` placed them.

Parameters placed ``Shard(d)`` on a tensor-parallel dimension are stored as their pieces
(``spmd.tensor_parallel``); the model's code reads them through ``spmd::tp_param``,
whose value is the whole tensor, so a graph is traced on global shapes (a layer's
``view(B, T, n_heads, head_dim)`` is written for the whole model and stays right) and
its backward hands each piece's gradient through ``spmd::tp_grad``. Eagerly these are a
blocking all-gather and a slice: code outside any compiled graph still computes the
right values. In a planned graph this pass carries out what ``propagate`` decided for
every node on every tensor-parallel dimension (``meta["spmd_tp"]``):

1. each input whose placement differs from the one the node's decision needs is
   redistributed first (the table's collective or local step, once per value and
   placement, with a provenance that names the op, the rule's reason and the module
   that made the node);
2. shape arguments written for the whole tensor (``view``, ``reshape``, ``expand``, the
   input sizes of ``slice_backward``/``select_backward``) are rewritten for the local
   piece, and a ``view`` whose local input is laid out so that
   it cannot be viewed as that shape (a gathered value comes back laid out along its
   gathered dimension first; a piece's strides are not the whole tensor's) becomes a
   ``reshape``: the same values, copied only where the layout needs it;
3. every value gets its local ``meta["val"]``, checked against its global shape and
   placement: a rule that disagrees with the op is a planning error naming the node,
   never a wrong result.

``tp_param`` becomes an alias of the stored piece and ``tp_grad`` of the gradient brought
to the parameter's placement. Values the caller receives (a forward's outputs, gradients
of anything but a tensor-parallel parameter) are made ``Replicate()`` first: the caller
sees whole tensors, as on one process.
"""

from __future__ import annotations

from dataclasses import replace as dc_replace
from typing import Any

import torch
import torch.fx as fx
from torch.fx.node import map_aggregate

from spmd.lowering import experts, ops, ranked, rules
from spmd.lowering.ops import place, tp_grad, tp_param
from spmd.lowering.specs import RankSpec, lookup
from spmd.lowering.annotate import PlanningError, ShardingError, graph_outputs
from spmd.lowering.collectives import GRADIENT_PASS, insert_redistribution
from spmd.lowering.context import LoweringContext
from spmd.lowering.graph import fill_val
from spmd.lowering.passes import Provenance
from spmd.lowering.placements import Partial, Placement, Replicate, Sharding, divides
from spmd.lowering.propagate import TPChoice, derive, module_of
from spmd.lowering.redistribute import redistribution_path
from spmd.lowering.reshard import RESHARDED
from spmd.lowering.state import Boundary, find, put

__all__ = ["tensor_parallel", "local_shape", "module_of", "USER_OUTPUTS", "SAVED_RENAMES",
           "GRADIENT_PASS"]

aten = torch.ops.aten
USER_OUTPUTS = "spmd_user_outputs"  # gm.meta: how many forward outputs the caller receives
PIECE = "spmd_tp_piece"  # node meta: a value traced as a parameter's piece (a gradient)
# gm.meta of a forward: saved value's name -> the node now saved in its place (its reduction)
SAVED_RENAMES = "spmd_saved_renames"


# -- the pass ---------------------------------------------------------------------------


def local_shape(global_shape: tuple[int, ...], sharding: Sharding, dims: tuple[str, ...]
                ) -> tuple[int, ...]:
    """The piece of a tensor of ``global_shape`` each rank holds under ``sharding`` on the
    tensor-parallel dimensions ``dims``."""
    shape = list(global_shape)
    for name in dims:
        p = sharding[name]
        if divides(p):
            size = sharding.mesh.size(name)
            if shape[p.dim] % size:
                raise PlanningError(f"dimension {p.dim} of a tensor of shape {global_shape} "
                                    f"is sharded over {size} ranks of {name!r}, which does not "
                                    f"divide it")
            shape[p.dim] //= size
    return tuple(shape)


_VIEWS = {aten.view.default, aten._unsafe_view.default}
_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default}


def viewable(val: torch.Tensor, shape: Any) -> bool:
    """Whether a tensor laid out as ``val`` (its sizes and strides) can be viewed as
    ``shape`` without a copy."""
    probe = torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=val.dtype,
                                device="meta")
    try:
        probe.view(shape)
    except (RuntimeError, ValueError):  # eager and under a fake mode (in a compile)
        return False
    return True


def _fake_like(val: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A value of ``shape`` laid out in ``val``'s order of dimensions (innermost first):
    what a rank's piece of a value the forward saved looks like. Inductor compiles a
    backward for exactly these strides and checks them when it runs."""
    if tuple(val.shape) == shape:
        return val
    strides, step = [0] * len(shape), 1
    for d in sorted(range(val.dim()), key=lambda d: (val.stride(d), -d)):
        strides[d] = step
        step *= max(shape[d], 1)
    return val.new_empty_strided(shape, strides)


class _Localizer:
    def __init__(self, gm: fx.GraphModule, ctx: LoweringContext) -> None:
        self.gm, self.ctx = gm, ctx
        self.dims = ctx.strategy.tp_dims
        self.brought: dict[tuple[fx.Node, str, Placement], fx.Node] = {}
        self._received: dict[str, set[fx.Node]] = {}

    def received(self, dim: str) -> set[fx.Node]:
        """The values holding rows an experts layer received on ``dim``
        (:func:`spmd.lowering.experts.received_rows`), found once per graph."""
        if dim not in self._received:
            self._received[dim] = experts.received_rows(self.gm.graph, dim)
        return self._received[dim]

    def expected(self, node: fx.Node) -> Any:
        """The local shapes of ``node``'s value(s) under its sharding."""
        val, spec = node.meta["val"], node.meta["sharding"]
        if isinstance(val, (tuple, list)):
            return [None if not isinstance(v, torch.Tensor) else
                    local_shape(tuple(v.shape), s, self.dims) for v, s in zip(val, spec)]
        return local_shape(tuple(val.shape), spec, self.dims)

    def bring(self, value: fx.Node, dim: str, want: Placement, user: fx.Node,
              choice: TPChoice | None, why: str = "the caller receives whole tensors",
              gradient_of: str | None = None) -> fx.Node:
        """``value`` redistributed to ``want`` on ``dim`` (cached). ``gradient_of``: the
        value is that parameter's gradient leaving the graph (``bucketing`` may merge its
        reduction with others': nothing in the graph waits for it)."""
        spec = value.meta["sharding"]
        have = spec[dim]
        if have == want:
            return value
        if dim in self.ctx.strategy.context_dims and value in self.received(dim):
            raise PlanningError(
                f"{self.ctx.graph_name}: {user.target} ({user.name}{_where(user)}) needs "
                f"{value.name} {have!r} -> {want!r} on {dim!r}, but it holds rows an "
                f"experts layer received on this rank (each rank's own, routed from its "
                f"part of the sequence): no redistribution moves them; the op between the "
                f"expert products has no rule that keeps them split along their rows")
        key = (value, dim, want)
        if key in self.brought:
            return self.brought[key]
        path = redistribution_path(have, want)
        if len(path) > 1:  # a StridedShard no one step reaches: gathered, then placed
            whole = self.bring(value, dim, path[0].dst, user, choice, why, gradient_of)
            node = self.bring(whole, dim, want, user, choice, why, gradient_of)
            self.brought[key] = node
            return node
        step = path[0]
        if step.kind == "none":
            return value
        step = dc_replace(step, mesh_dim=dim)
        modules = tuple(dict.fromkeys(m for m in (module_of(value), module_of(user)) if m))
        reason = (f"{user.target} ({user.name}) needs {value.name} {have!r} -> {want!r} on "
                  f"{dim!r}: " + (choice.why() if choice is not None else why))
        why = Provenance(params=(gradient_of,) if gradient_of else modules or (user.name,),
                         pass_name=GRADIENT_PASS if gradient_of else "tensor_parallel",
                         reason=reason)
        node = insert_redistribution(self.gm, self.ctx, value, step, why)
        self._seal(value, node, dim, want)
        self.brought[key] = node
        return node

    def _seal(self, value: fx.Node, result: fx.Node, dim: str, want: Placement) -> None:
        """The inserted nodes from ``value`` to ``result`` are done; the unpacking ones
        (no sharding of their own yet) hold the target placement."""
        dst = value.meta["sharding"].with_placement(dim, want)
        node = value.next
        while True:
            node.meta.setdefault("sharding", dst)
            node.meta["spmd_tp_inserted"] = True
            if node is result:
                break
            node = node.next
        result.meta["sharding"] = dst

    def run(self) -> None:
        graph = self.gm.graph
        role = self.ctx.role
        infos = list(self.ctx.inputs)
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        for k, node in enumerate(placeholders):
            # a forward's inputs are what the model holds (parameters as pieces); a
            # backward's are values traced whole
            if role == "backward" and RESHARDED not in node.meta and isinstance(
                    node.meta.get("val"), torch.Tensor):  # (resharded: a shard; a size)
                want = self.expected(node)
                node.meta["val"] = _fake_like(node.meta["val"], want)
        for node in list(graph.nodes):
            if node.op != "call_function" or node.meta.get("spmd_tp_inserted"):
                continue
            if node.target is ops.bucket_reduce_scatter:
                self.reduce_pieces(node)
                continue
            if "spmd_collective" in node.meta or "spmd_role" in node.meta:
                continue  # a sharded strategy's gathers: of the stored pieces already
            self.localize(node)
        self.finish_outputs(infos)

    def reduce_pieces(self, node: fx.Node) -> None:
        """A sharded strategy's reduce-scatter works on each parameter's piece as stored
        on the tensor-parallel dimensions: its gradients are brought there first. A
        parameter replicated along "tp" whose gradient is a tensor-parallel partial sum
        (a norm's weight in front of column-parallel layers) is all-reduced over "tp"
        here; without it each tp rank would keep its own part of one replicated weight's
        gradient."""
        spec = lookup(node.args[1])
        grads = list(node.args[0])
        for k, (grad, param) in enumerate(zip(grads, spec.params)):
            placed = self.ctx.strategy.tp_placement(param)
            for dim in self.dims:
                grad = self.bring(grad, dim, placed[dim], node, None,
                                  f"{param}'s gradient is reduce-scattered as the parameter "
                                  f"is stored there")
            grads[k] = grad
        node.args = (grads, *node.args[1:])

    def localize(self, node: fx.Node) -> None:
        choices: dict[str, TPChoice] = node.meta.get("spmd_tp", {})
        want = None
        if node.target is tp_grad:  # traced as the piece already
            want = tuple(node.meta["val"].shape)
            spec = lookup(node.args[1])
            source = node.args[0]
            for dim in self.dims:
                source = self.bring(source, dim, spec.placements.get(dim, Replicate()),
                                    node, None)
            node.target, node.args = aten.alias.default, (source,)
            node.meta[PIECE] = True
        elif choices:
            args = rules.tensor_args(node)
            wanted: list[dict[str, Placement]] = [{} for _ in args]
            for dim, choice in choices.items():
                for k, p in enumerate(choice.decision.required(choice.inputs)):
                    wanted[k][dim] = p
            counter = iter(range(len(args)))

            def swap(a: Any) -> Any:
                if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor):
                    k = next(counter)
                    for dim, p in wanted[k].items():
                        a = self.bring(a, dim, p, node, choices[dim])
                return a

            node.args = map_aggregate(node.args, swap)
            node.kwargs = map_aggregate(node.kwargs, swap)
            self.rank_dependent(node, choices)
        if node.target is tp_param or node.target is place:
            node.target, node.args = aten.alias.default, (node.args[0],)
        args = rules.tensor_args(node)
        if want is None and args and all(a.meta.get(PIECE) for a in args):
            # computed from parameter gradients already brought to their pieces (the sum
            # of a parameter's gradients where the model reads it twice): a piece itself
            want = tuple(node.meta["val"].shape)
        if want is not None and node.target is not tp_grad:
            node.meta[PIECE] = True
        if want is None:
            want = self.expected(node)
        if node.target in rules.SHAPE_ARG:
            node.args = (node.args[0], list(want), *node.args[2:])
        if node.target in rules.ROWS_ARG:
            k = rules.ROWS_ARG[node.target]
            node.args = (*node.args[:k], want[0], *node.args[k + 1:])
        if node.target in experts.LOCAL_ARGS:
            node.args = experts.local_args(node, choices, self.ctx.mesh)
        if node.target in _SPLITS and isinstance(want, list) and want and want[0] is not None:
            # sizes written for the whole tensor: a split into equal parts along a
            # dimension the pieces divide (a fused q, k, v output's blocks) is the same
            # chunk(n) on the whole tensor and on every rank's piece
            ndim = len(want[0])
            raw = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
            dim = int(raw) % ndim
            whole = [tuple(v.shape)[dim] for v in node.meta["val"]]
            if [int(w[dim]) for w in want] != whole and len(set(whole)) == 1:
                node.target = aten.chunk.default
                node.args, node.kwargs = (node.args[0], len(whole), dim), {}
        if node.target in _VIEWS and not viewable(node.args[0].meta["val"], want):
            node.target = aten.reshape.default
        self.check(node, want)

    def rank_dependent(self, node: fx.Node, choices: dict[str, TPChoice]) -> None:
        """A decision whose ranks compute differently (``Decision.ranked``): the node
        becomes that ``spmd`` op, told its rank's coordinate on the dimension by handle."""
        split = [(dim, c.decision.ranked) for dim, c in choices.items() if c.decision.ranked]
        if not split:
            return
        if len(split) > 1:
            raise PlanningError(f"{self.ctx.graph_name}: {node.target} ({node.name}"
                                f"{_where(node)}) is split by rank on {len(split)} mesh "
                                f"dimensions at once ({', '.join(d for d, _ in split)}); "
                                f"one is supported")
        dim, op = split[0]
        entry = ranked.RANKED[op]
        size, group = self.ctx.mesh.size(dim), self.ctx.group(dim)
        spec = (entry.spec(dim, size, group, self.ctx.strategy) if entry.spec is not None
                else RankSpec(dim=dim, size=size, group=group))
        args = entry.args(node)
        node.target, node.args, node.kwargs = op, (*args, self.ctx.handles.add(spec)), {}

    def check(self, node: fx.Node, want: Any) -> None:
        global_val = node.meta["val"]
        try:
            fill_val(node)
        except Exception as e:
            raise PlanningError(f"{self.ctx.graph_name}: {node.target} ({node.name}"
                                f"{_where(node)}) fails on the local pieces "
                                f"{self._inputs(node)}: {e}") from e
        got = node.meta["val"]
        if isinstance(got, (tuple, list)):
            shapes = [None if not isinstance(v, torch.Tensor) else tuple(v.shape) for v in got]
            ok = all(w is None or s == tuple(w) for s, w in zip(shapes, want))
        else:
            shapes = tuple(got.shape)
            ok = shapes == tuple(want)
        if not ok:
            raise PlanningError(
                f"{self.ctx.graph_name}: the sharding rule of {node.target} ({node.name}"
                f"{_where(node)}) places its output {node.meta['sharding']} (local shape "
                f"{want}) but the op gives {shapes} on inputs {self._inputs(node)}; whole "
                f"shape {_shapes(global_val)}")

    def _inputs(self, node: fx.Node) -> str:
        return ", ".join(f"{a.name}: {a.meta.get('sharding')}" for a in rules.tensor_args(node))

    def finish_outputs(self, infos: list) -> None:
        """What the caller receives must be whole on every tensor-parallel dimension."""
        graph = self.gm.graph
        output = graph.output_node()
        values = graph_outputs(self.gm)
        role = self.ctx.role
        user = self.gm.meta.get(USER_OUTPUTS, len(values)) if role == "forward" else len(values)
        changed = list(values)
        saved_as: dict[str, str] = {}
        for i, value in enumerate(values):
            if isinstance(value, fx.Node) and i >= user and role == "forward":
                # a saved partial sum the forward reduced anyway: the backward gets the
                # reduced value (else it would reduce it again)
                reduced = value
                for dim in self.dims:
                    if isinstance(reduced.meta.get("sharding"), Sharding) and isinstance(
                            reduced.meta["sharding"][dim], Partial):
                        reduced = self.brought.get((reduced, dim, Replicate()), reduced)
                if reduced is not value:
                    changed[i] = reduced
                    saved_as[value.name] = reduced.name
                continue
            if not isinstance(value, fx.Node) or i >= user:
                continue
            if not isinstance(value.meta.get("val"), torch.Tensor):
                continue
            # a parameter's gradient is placed as the parameter; the rest whole
            param = (infos[i].name if role == "backward" and i < len(infos)
                     and infos[i].kind == "param" else None)
            for dim in self.dims:
                want = (Replicate() if param is None
                        else self.ctx.strategy.tp_placement(param)[dim])
                why = ("the caller receives whole tensors" if param is None else
                       f"{param}'s gradient is placed as {param} is stored ({want!r}); each "
                       f"rank computed it from its part of the work along {dim!r}")
                value = self.bring(value, dim, want, output, None, why, gradient_of=param)
            changed[i] = value
        original = output.args[0]
        output.args = (type(original)(changed) if isinstance(original, (list, tuple))
                       else changed[0],)
        if saved_as:
            self.gm.meta[SAVED_RENAMES] = saved_as
        boundary = find(self.gm, Boundary)
        if boundary is not None and boundary.gradients:
            moved = [g if g.output is None or changed[g.output] is values[g.output]
                     else dc_replace(g, node=changed[g.output].name) for g in boundary.gradients]
            put(self.gm, dc_replace(boundary, gradients=tuple(moved)))


def _where(node: fx.Node) -> str:
    module = module_of(node)
    return f" in {module}" if module else ""


def _shapes(val: Any) -> Any:
    if isinstance(val, (tuple, list)):
        return [tuple(v.shape) if isinstance(v, torch.Tensor) else v for v in val]
    return tuple(val.shape)


def _symbolic(gm: fx.GraphModule) -> str | None:
    """The first input whose shape is symbolic (a dynamic graph), by name."""
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt) or (isinstance(val, torch.Tensor) and any(
                isinstance(d, torch.SymInt) for d in val.shape)):
            return node.name
    return None


def tensor_parallel(gm: fx.GraphModule, ctx: LoweringContext) -> fx.GraphModule:
    if not ctx.strategy.tp_dims:
        return gm
    symbolic = _symbolic(gm)
    if symbolic is not None:  # before any rewrite: the caller runs the model eagerly
        raise PlanningError(f"{ctx.graph_name}: tensor and context parallelism plan fixed "
                            f"shapes; {symbolic} has a symbolic one (shapes that changed "
                            f"between calls make a dynamic graph)")
    try:
        _Localizer(gm, ctx).run()
    except PlanningError as e:  # a graph on whole shapes cannot run on pieces: never
        raise ShardingError(str(e)) from e  # left unplanned
    gm.graph.eliminate_dead_code()
    derive(gm, ctx)
    return gm

