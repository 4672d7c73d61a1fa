"""emit: turn a planned fx graph into straight-line Python that calls ATen directly.

``GraphModule.forward`` calls each op through ``OpOverload.__call__``, a Python frame per
op; a backward graph of a model with many small layers runs hundreds of them, and the
frames cost more than the arithmetic (measured here: 779-node backward of a 60-layer MLP,
1.60 ms through fx, 1.16 ms through this emitter). The emitted function binds every op
to its cheapest C++ entry point (see :func:`_entry_point`), the collectives to their Python
implementations, reads ``getitem`` as indexing, frees every value after its last use (as
fx does, so peak memory does not grow), and takes its arguments boxed (a list it
clears), the calling convention AOTAutograd uses to free inputs early.
"""

from __future__ import annotations

import itertools
import linecache
import math
import operator
from typing import Any, Callable

import torch
import torch.fx as fx

from spmd.lowering import ops
from spmd.lowering.graph import copy_graph

__all__ = ["emit"]



def _direct(meta: bool) -> dict:
    """Our ops' Python implementations, called straight instead of through the
    dispatcher; for a graph of meta tensors (a model planned on the meta device) their
    fake kernels, as the dispatcher's Meta kernels are: shapes only, nothing read."""
    from spmd.lowering import optimizer  # noqa: F401  (defines optimizer_step)

    return dict(ops.FAKES if meta else ops.IMPLEMENTATIONS)


def _entry_point(target: object) -> object:
    """The cheapest callable that runs ``target``.

    ATen ops that ``torch`` exposes as functions go through its generated argument parser
    (``torch._C._VariableFunctions``), which picks the overload from the arguments and
    costs ~0.3 µs less per call than ``OpOverload._op``'s schema-driven conversion
    (1.33 against 1.63 µs for a 4x4 ``mm`` here). Ops that are only methods (``view``)
    go through the C method of the tensor, the same parser (1.8 against 2.7 µs for a
    ``view``); the rest call ``_op`` directly.
    """
    if not isinstance(target, torch._ops.OpOverload):
        return target
    if target is torch.ops.aten.view.default:
        # reshape: a view wherever view is one, a copy where the strides the tensor has
        # at run time allow no view. The graphs are functional (nothing writes through a
        # view), so only that failure differs: AOTAutograd traces some backwards with
        # strides its eager kernels do not give (softplus_backward of a transposed
        # gradient, Doge's; torch.compile itself fails there).
        return torch._C.TensorBase.reshape
    schema = target._schema
    if target.namespace == "aten" and not schema.is_mutable:
        name = schema.name.split("::")[-1]
        fn = getattr(torch._C._VariableFunctions, name, None)
        if fn is not None:
            return fn
        method = getattr(torch._C.TensorBase, name, None)  # C methods only, not Python ones
        if (type(method).__name__ == "method_descriptor" and schema.arguments
                and schema.arguments[0].name == "self"):
            return method
    return target._op


class _Emitter:
    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self.globals: dict[str, Any] = {"__builtins__": __builtins__}
        self.bound: dict[int, str] = {}
        self.names: dict[fx.Node, str] = {}
        self.direct = _direct(any(
            isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].is_meta
            for n in gm.graph.nodes if n.op == "placeholder"))

    def bind(self, value: Any, prefix: str = "c") -> str:
        key = id(value)
        name = self.bound.get(key)
        if name is None:
            name = f"_{prefix}{len(self.bound)}"
            self.bound[key] = name
            self.globals[name] = value
        return name

    def fmt(self, a: Any) -> str:
        if isinstance(a, fx.Node):
            return self.names[a]
        if a is None or isinstance(a, (bool, str)):
            return repr(a)
        if isinstance(a, int):
            return repr(a)
        if isinstance(a, float):
            return repr(a) if math.isfinite(a) else self.bind(a)
        if isinstance(a, tuple):
            inner = ", ".join(self.fmt(x) for x in a)
            return f"({inner}{',' if len(a) == 1 else ''})"
        if isinstance(a, list):
            return "[" + ", ".join(self.fmt(x) for x in a) + "]"
        if isinstance(a, dict):
            return "{" + ", ".join(f"{self.fmt(k)}: {self.fmt(v)}" for k, v in a.items()) + "}"
        if isinstance(a, slice):
            return f"slice({self.fmt(a.start)}, {self.fmt(a.stop)}, {self.fmt(a.step)})"
        return self.bind(a)  # dtype, device, layout, memory_format, enum, ...

    def call(self, node: fx.Node) -> str:
        args = [self.fmt(a) for a in node.args]
        args += [f"{k}={self.fmt(v)}" for k, v in node.kwargs.items()]
        target = node.target
        if node.op == "call_method":
            return f"{args[0]}.{target}({', '.join(args[1:])})"
        if target is operator.getitem and not node.kwargs:
            return f"{args[0]}[{args[1]}]"
        fn = self.direct.get(target)
        if fn is None:
            fn = _entry_point(target)
        return f"{self.bind(fn, 'f')}({', '.join(args)})"

    def source(self) -> str:
        nodes = list(self.gm.graph.nodes)
        for i, node in enumerate(nodes):
            self.names[node] = f"v{i}"
        last_use: dict[fx.Node, fx.Node] = {}
        for node in nodes:
            for arg in node.all_input_nodes:
                last_use[arg] = node
        frees: dict[fx.Node, list[str]] = {}
        for value, user in last_use.items():
            if user.op != "output":
                frees.setdefault(user, []).append(self.names[value])
        placeholders = [n for n in nodes if n.op == "placeholder"]
        lines = ["def run(args):"]
        if placeholders:
            trailing = "," if len(placeholders) == 1 else ""
            lines.append(f"    {', '.join(self.names[p] for p in placeholders)}{trailing} = args")
        lines.append("    args.clear()")
        for node in nodes:
            name = self.names[node]
            if node.op == "placeholder":
                if not node.users:
                    lines.append(f"    del {name}")
                continue
            if node.op == "output":
                lines.append(f"    return {self.fmt(node.args[0])}")
                continue
            if node.op == "get_attr":
                value = self.gm
                for part in str(node.target).split("."):
                    value = getattr(value, part)
                lines.append(f"    {name} = {self.bind(value)}")
            else:
                lines.append(f"    {name} = {self.call(node)}  # {node.name}")
            dead = list(frees.get(node, []))
            if not node.users:
                dead.append(name)
            if dead:
                lines.append(f"    del {', '.join(dead)}")
        return "\n".join(lines) + "\n"


def _mutates(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and schema is not None and schema.is_mutable


def _without_no_ops(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` without the view operations that compute nothing.

    AOTAutograd's graphs carry operations that exist for autograd, not for values: a
    ``detach`` of saved activations, the transpose of a transpose (a Linear's weight
    gradient), a reduction kept at rank 1 then viewed away (``view(sum(g, [0], True),
    [n])``). Run from Python each costs a call (~1 µs here) and computes nothing: on a
    60-layer MLP they were 180 of the backward graph's 841 nodes. The copy holds the same
    values in the same memory; the planned graph users see is left as it is. Graph
    outputs are never touched (AOTAutograd's runtime knows what they alias), nor any
    graph that mutates in place (a step traced with make_fx may).
    """
    if any(_mutates(n) for n in gm.graph.nodes):
        return gm
    copy = copy_graph(gm)
    graph = copy.graph
    outputs = set(graph.output_node().all_input_nodes)
    aten = torch.ops.aten
    for node in list(graph.nodes):
        if node.op != "call_function" or node in outputs:
            continue
        source = node.args[0] if node.args else None
        if not isinstance(source, fx.Node):
            continue
        if node.target is aten.detach.default:
            node.replace_all_uses_with(source)
        elif node.target is aten.t.default and source.target is aten.t.default:
            node.replace_all_uses_with(source.args[0])
        elif (node.target is aten.view.default and source.target is aten.sum.dim_IntList
              and len(source.args) == 3 and source.args[2] is True
              and "val" in source.meta):
            shape = list(source.meta["val"].shape)
            dims = {d % len(shape) for d in source.args[1]}
            if [n for i, n in enumerate(shape) if i not in dims] == list(node.args[1]):
                with graph.inserting_before(node):
                    total = graph.call_function(aten.sum.dim_IntList,
                                                (source.args[0], source.args[1], False))
                node.replace_all_uses_with(total)
    for node in list(graph.nodes):  # a bucket's unpacking: one C++ call for every view
        if node.target is aten.split_with_sizes.default and _unpacks_to_views(node):
            getitems = sorted(node.users, key=lambda n: n.args[1])
            views = [next(iter(g.users)) for g in getitems]
            likes = [torch.empty(v.args[1], device="meta") for v in views]
            with graph.inserting_before(node):
                pieces = graph.call_function(_unflatten, (node.args[0], likes))
            for k, view in enumerate(views):
                with graph.inserting_before(view):
                    piece = graph.call_function(operator.getitem, (pieces, k))
                view.replace_all_uses_with(piece)
    _stack_scattered_sums(graph, outputs)
    graph.eliminate_dead_code()
    copy.recompile()
    return copy


def _stack_scattered_sums(graph: fx.Graph, outputs: set[fx.Node]) -> None:
    """A sum of ``select_backward`` (or ``slice_backward``) pieces that together cover a
    dimension becomes one ``stack`` (``cat``) of the pieces.

    The backward of ``unbind``/``chunk`` of a fused projection (``nn.MultiheadAttention``'s
    in_proj output split into q, k and v) is written that way: each piece scattered into
    zeros of the whole, then added up. Eager autograd does the same. On a transformer
    encoder of width 256 the three scatters and two adds took 230 µs a block against 40
    for the stack (measured here, one thread). The values are the same (x + 0 is x; only
    the sign of a zero may differ).
    """
    aten = torch.ops.aten
    for root in reversed(list(graph.nodes)):
        if root.target is not aten.add.Tensor or root.graph is not graph:
            continue
        users = list(root.users)
        if len(users) == 1 and users[0].target is aten.add.Tensor:
            continue  # inside a larger sum: handled from its top
        leaves, stack = [], list(root.args)
        if len(stack) != 2 or root.kwargs:
            continue
        while stack:
            n = stack.pop()
            if not isinstance(n, fx.Node):
                leaves = []
                break
            if (n.target is aten.add.Tensor and len(n.users) == 1 and n not in outputs
                    and len(n.args) == 2 and not n.kwargs):
                stack.extend(n.args)
            else:
                leaves.append(n)
        order = _covering(leaves, outputs)
        if order is None:
            continue
        op, dim, pieces = order
        with graph.inserting_before(root):
            whole = graph.call_function(op, (pieces, dim))
        root.replace_all_uses_with(whole)


def _covering(leaves: list[fx.Node], outputs: set[fx.Node]) -> tuple | None:
    """(stack or cat, dim, the pieces in order) when ``leaves`` are scatters of one shape
    along one dimension that cover it exactly once; else None."""
    aten = torch.ops.aten
    if len(leaves) < 2 or any(n in outputs or len(n.users) != 1 for n in leaves):
        return None
    target = leaves[0].target
    if target not in (aten.select_backward.default, aten.slice_backward.default):
        return None
    if any(n.target is not target or n.kwargs for n in leaves):
        return None
    if not all(isinstance(a, int) for n in leaves for a in [*n.args[1], *n.args[2:]]
               if a is not None):
        return None  # a dynamic graph's symbolic sizes or positions (nodes): left alone
    sizes = list(leaves[0].args[1])
    dim = leaves[0].args[2] % len(sizes)
    spans = []
    for n in leaves:
        if list(n.args[1]) != sizes or n.args[2] % len(sizes) != dim:
            return None
        if target is aten.select_backward.default:
            index = n.args[3] % sizes[dim]
            spans.append((index, index + 1, n.args[0]))
        else:
            start, end, step = n.args[3:6]
            start = max(0, start + sizes[dim] if start < 0 else start)
            end = min(sizes[dim], end + sizes[dim] if end < 0 else end)
            if step != 1:
                return None
            spans.append((start, end, n.args[0]))
    spans.sort(key=lambda span: span[0])
    at = 0
    for start, end, _ in spans:
        if start != at or end <= start:
            return None
        at = end
    if at != sizes[dim]:
        return None
    op = aten.stack.default if target is aten.select_backward.default else aten.cat.default
    return op, dim, [piece for _, _, piece in spans]


# views of a flat buffer shaped like each of a list of tensors, in one C++ call (1.1 µs
# a view against 1.7 through split_with_sizes and view from Python, measured here)
_unflatten = torch._C._nn.unflatten_dense_tensors


def _unpacks_to_views(split: fx.Node) -> bool:
    """Every piece of ``split`` is read by exactly one view, together covering it."""
    role = split.meta.get("spmd_role")
    if role is None or role.kind != "unpack":
        return False
    for getitem in split.users:
        if getitem.target is not operator.getitem or len(getitem.users) != 1:
            return False
        (view,) = getitem.users
        if view.target is not torch.ops.aten.view.default:
            return False
    return len(split.users) == len(split.args[1])


_EMITTED = itertools.count(1)


def emit(gm: fx.GraphModule) -> Callable[[list], Any]:
    """A boxed callable (``fn(args_list)``) that runs ``gm``'s graph."""
    emitter = _Emitter(_without_no_ops(gm))
    src = emitter.source()
    name = f"<spmd emitted {gm.__class__.__name__} {next(_EMITTED)}>"
    # a traceback through the emitted code shows its lines (the failing op's node name)
    linecache.cache[name] = (len(src), None, src.splitlines(True), name)
    code = compile(src, name, "exec")
    exec(code, emitter.globals)
    run = emitter.globals["run"]
    run._boxed_call = True  # AOTAutograd passes a list and lets us clear it
    run.spmd_source = src
    return run
