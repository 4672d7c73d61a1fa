"""Cutting a traced training forward into pipeline stages.

The model's forward and its loss are traced once per microbatch shape into one fx graph
(``make_fx`` above autograd, ``pre_dispatch=True``: the graph holds the ops the model
wrote, ``aten.linear``, ``aten.scaled_dot_product_attention``, and nothing autograd added,
so each piece re-runs under autograd exactly as the model would). A forward pre-hook on
every module that may begin a stage marks the last node before it. The graph is then cut
at the chosen marks:

- Every op belongs to the stage whose span it was traced in.
- Values that depend only on the batch and buffers (a causal mask, position ids, rotary
  tables) are recomputed in each stage that reads them; every rank holds the batch, so
  nothing of theirs crosses. Parameters are never recomputed this way, frozen or not:
  the cut does not depend on ``requires_grad``, so a layer unfrozen later trains in the
  stage that holds it, and its gradient flows back across the cut.
- An op that writes the model's state in place (BatchNorm's running statistics and
  ``num_batches_tracked``, a counter buffer) runs in the stage it was traced in, once per
  microbatch, as on one process; a buffer written in one stage and read in another is
  refused by name (each pipeline rank holds its own copy).
- A value computed in stage ``s`` and read in a later stage ``t`` crosses: ``s`` sends it
  to ``t`` in forward, ``t`` sends its gradient back in backward (:class:`Crossing`).
- A parameter read in several stages (an embedding tied to the output head), frozen or
  not, is held by each of them; the runtime sums its gradient across them once per step
  (:attr:`Cut.tied`), as Megatron-LM does for tied embeddings.

Each stage becomes an ``fx.GraphModule`` taking its parameters and buffers, the batch
leaves it reads and the values it receives; it returns the values it sends and, on the
last stage, the loss. How stages are chosen when the user names no cut:
:func:`spmd.lowering.balance.balance`, from each span's FLOPs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

__all__ = ["Crossing", "Stage", "Cut", "Traced", "trace", "cut", "node_flops", "candidates"]

_aten = torch.ops.aten
# ops whose result differs between two runs: never recomputed in a second stage
_RANDOM = {"dropout", "native_dropout", "bernoulli", "rand", "randn", "randint", "rand_like",
           "randn_like", "randint_like", "normal", "uniform", "multinomial", "randperm",
           "feature_dropout", "alpha_dropout", "feature_alpha_dropout"}


@dataclass(frozen=True, kw_only=True)
class Crossing:
    """A value one stage computes and later stages read, per microbatch."""

    index: int
    name: str  # the traced node's
    src: int
    dsts: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    grad: bool  # floating and computed from a parameter: its gradient goes back

    @property
    def bytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(kw_only=True)
class Stage:
    """One stage's forward: ``code(*params, *buffers, *inputs, *received)`` returns
    ``(*sent, loss)`` (the loss on the last stage only)."""

    index: int
    code: fx.GraphModule
    params: tuple[str, ...]
    buffers: tuple[str, ...]
    inputs: tuple[int, ...]  # indices into the microbatch's flat tensor leaves
    received: tuple[int, ...]  # crossing indices, in placeholder order
    sent: tuple[int, ...]  # crossing indices, in output order
    loss: bool
    flops: float  # forward FLOPs per microbatch
    param_numel: int
    param_bytes: int


@dataclass(kw_only=True)
class Cut:
    stages: list[Stage]
    crossings: list[Crossing]
    split_points: tuple[str, ...]
    chosen: str  # how: "named by the user" or the balance's reason
    tied: dict[str, tuple[int, ...]] = field(default_factory=dict)  # parameter -> its stages


@dataclass(kw_only=True)
class Traced:
    """The forward-and-loss graph of one microbatch shape, with the marks of every module
    that may begin a stage: ``(module path, the last node before its first call)``."""

    gm: fx.GraphModule
    kinds: list[tuple[str, str]]  # per placeholder: ("param" | "buffer" | "input", name)
    marks: list[tuple[str, fx.Node | None]]
    trainable: frozenset[str]  # when traced (the cut does not depend on it)
    flops: dict[str, float] = field(default_factory=dict)  # node name -> forward FLOPs
    # activation-checkpointed calls: (the last node before, the last node inside)
    regions: list[tuple[fx.Node | None, fx.Node | None]] = field(default_factory=list)


def candidates(model: nn.Module) -> list[str]:
    """Modules a stage may begin at when the planner chooses: each element of the
    model's largest ``nn.ModuleList``/``nn.Sequential`` (the repeated blocks), and the
    model's other direct children."""
    best, best_size = None, 0
    for path, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and path:
            size = sum(p.numel() for p in module.parameters())
            if size > best_size:
                best, best_size = path, size
    out = [name for name, _ in model.named_children() if name != best]
    if best is not None:
        out += [f"{best}.{name}" for name, _ in model.get_submodule(best).named_children()]
    return out


def trace(model: nn.Module, loss_fn: Callable[..., Any] | None, args: tuple, target: Any,
          marked: Sequence[str], where: str, cast: torch.dtype | None = None) -> Traced:
    """``loss_fn(model(*args), target)`` (``model(*args)`` when ``loss_fn`` is None) as one
    graph on fake tensors, with the marks of the modules in ``marked``. ``cast``: trace as
    mixed precision runs (floating parameters and model inputs in that dtype: a model's
    own casts, ``x.type_as(w)``, are recorded for the dtype they will see)."""
    from torch.func import functional_call
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx

    modules = dict(model.named_modules())
    for path in marked:
        if path not in modules or not path:
            near = [m for m in modules if m and m.split(".")[0] == path.split(".")[0]][:4]
            children = ", ".join(n for n, _ in model.named_children())
            raise ValueError(f"{where}: the model has no module {path!r} to cut at"
                             + (f" (modules there: {', '.join(near)})" if near else
                                f" (its children: {children})"))
    marks: list[tuple[str, fx.Node | None]] = []
    handles = []

    def hook_for(path: str) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: Any) -> None:
            mode = get_proxy_mode()
            if mode is not None:
                nodes = mode.tracer.graph.nodes
                marks.append((path, next(reversed(nodes), None)))
        return hook

    for path in marked:
        handles.append(modules[path].register_forward_pre_hook(hook_for(path)))
    regions: list[tuple[fx.Node | None, fx.Node | None]] = []
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())

    def forward_and_loss(p: dict, b: dict, a: tuple, t: Any) -> Any:
        if cast is not None:
            p = {k: v.to(cast) if v.is_floating_point() else v for k, v in p.items()}
            a = pytree.tree_map_only(
                torch.Tensor, lambda v: v.to(cast) if v.is_floating_point() else v, a)
        out = functional_call(model, {**p, **b}, a)
        return out if loss_fn is None else loss_fn(out, t)

    try:
        with _recording_checkpoints(regions):
            gm = make_fx(forward_and_loss, tracing_mode="fake", pre_dispatch=True)(
                params, buffers, args, target)
    finally:
        for h in handles:
            h.remove()
    if cast is not None:
        moved = _fold_casts(gm)
        marks = [(path, moved.get(node, node)) for path, node in marks]
        regions = [(moved.get(a, a), moved.get(b, b)) for a, b in regions]
    leaves = ([("param", n) for n in params] + [("buffer", n) for n in buffers]
              + [("input", str(i)) for i, _ in enumerate(pytree.tree_leaves((args, target)))])
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(leaves):
        raise RuntimeError(f"{where}: traced {len(placeholders)} inputs for {len(leaves)} "
                           f"leaves (parameters, buffers, batch)")
    seen: dict[str, int] = {}
    for path, _ in marks:
        seen[path] = seen.get(path, 0) + 1
    for path in marked:
        if path not in seen:
            raise ValueError(f"{where}: module {path!r} does not run in the model's forward; "
                             f"a stage can only begin at a module that runs")
        if seen[path] > 1:
            raise ValueError(f"{where}: module {path!r} runs {seen[path]} times in one "
                             f"forward; a stage must begin at a module that runs once")
    traced = Traced(gm=gm, kinds=leaves, marks=marks, regions=regions,
                    trainable=frozenset(n for n, p in params.items() if p.requires_grad))
    traced.flops = {n.name: node_flops(n) for n in gm.graph.nodes if n.op == "call_function"}
    return traced


class _recording_checkpoints:
    """While tracing: ``torch.utils.checkpoint.checkpoint`` runs its function plainly and
    records the span of nodes it traced (outermost calls only), so that each stage can
    checkpoint the same spans again (a trace inlines them: the recomputation would be
    lost, and with it the memory the model was written to save)."""

    def __init__(self, regions: list) -> None:
        self.regions = regions
        self.depth = 0

    def _last(self) -> fx.Node | None:
        from torch.fx.experimental.proxy_tensor import get_proxy_mode

        mode = get_proxy_mode()
        return None if mode is None else next(reversed(mode.tracer.graph.nodes), None)

    def __enter__(self) -> None:
        import torch.utils.checkpoint as ckpt

        recorder = self

        def generator(fn: Any, *args: Any, **kwargs: Any) -> Any:
            begin = recorder._last()
            recorder.depth += 1
            try:
                yield
            finally:
                recorder.depth -= 1
            if recorder.depth == 0:
                recorder.regions.append((begin, recorder._last()))

        class Reentrant:
            @staticmethod
            def apply(function: Any, preserve: Any, *args: Any) -> Any:
                gen = generator(function)
                next(gen)
                out = function(*args)
                next(gen, None)
                return out

        self.saved = (ckpt._checkpoint_without_reentrant_generator, ckpt.CheckpointFunction)
        ckpt._checkpoint_without_reentrant_generator = generator
        ckpt.CheckpointFunction = Reentrant

    def __exit__(self, *exc: Any) -> None:
        import torch.utils.checkpoint as ckpt

        ckpt._checkpoint_without_reentrant_generator, ckpt.CheckpointFunction = self.saved


def _fold_casts(gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """The trace's casts of its inputs (mixed precision's) folded into the inputs: at run
    time the stage receives them in that dtype already. Each removed node -> the node
    before it (where a mark on it moves)."""
    moved: dict[fx.Node, fx.Node] = {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or len(node.args) < 1:
            continue
        name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
        source = node.args[0]
        if name in ("to", "_to_copy") and isinstance(source, fx.Node) \
                and source.op == "placeholder" and len(source.users) == 1:
            source.meta["val"] = node.meta["val"]
            node.replace_all_uses_with(source)
            before = node.prev
            moved.update({k: before for k, v in moved.items() if v is node})
            moved[node] = before
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return moved


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def node_flops(node: fx.Node) -> float:
    """Forward FLOPs of one traced op: matrix products and attention counted as
    multiply-adds x 2; every other op one per output element (which only breaks ties)."""
    out = _val(node)
    name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
    args = [_val(a) for a in node.args]
    numel = out.numel() if isinstance(out, torch.Tensor) else 0
    if name == "linear" and isinstance(args[1], torch.Tensor):
        return 2.0 * numel * args[1].shape[-1]
    if name in ("mm", "matmul", "bmm", "addmm", "baddbmm", "addbmm"):
        a = args[1] if name.startswith("add") or name == "baddbmm" else args[0]
        return 2.0 * numel * a.shape[-1] if isinstance(a, torch.Tensor) else numel
    if name == "scaled_dot_product_attention" or "_scaled_dot_product" in name:
        q, k = args[0], args[1]
        if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor):
            return 4.0 * q.numel() // q.shape[-1] * k.shape[-2] * q.shape[-1]
    if name.startswith("conv") and isinstance(args[1], torch.Tensor):
        w = args[1]
        return 2.0 * numel * math.prod(w.shape[1:])
    return float(numel)


# ops that update running statistics in place when their training flag (the argument at
# that position) is set, though their schema does not say they write
_NORMS = {"batch_norm": 5, "instance_norm": 5}


def _state_written(node: fx.Node, kinds: dict[fx.Node, tuple[str, str]]) -> list[fx.Node]:
    """The parameter and buffer placeholders ``node`` writes in place (through views)."""
    target = node.target
    schema = getattr(target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return []
    written = [a for a, arg in zip(node.args, schema.arguments)
               if arg.alias_info is not None and arg.alias_info.is_write]
    written += [v for k, v in node.kwargs.items() for arg in schema.arguments
                if arg.name == k and arg.alias_info is not None and arg.alias_info.is_write]
    name = getattr(target, "__name__", str(target)).split(".")[0]
    flag = _NORMS.get(name)
    if flag is not None:
        training = node.args[flag] if len(node.args) > flag else node.kwargs.get(
            schema.arguments[flag].name, False)
        if training:
            written += [a for a in node.args[3:5]]
    out = []
    for value in written:
        # through views: a write to a view of a buffer writes the buffer
        while isinstance(value, fx.Node) and value.op == "call_function" and value.args \
                and getattr(getattr(value.target, "_schema", None), "returns", None) \
                and value.target._schema.returns[0].alias_info is not None:
            value = value.args[0]
        if isinstance(value, fx.Node) and kinds.get(value, ("",))[0] in ("param", "buffer"):
            out.append(value)
    return out


def _free_nodes(traced: Traced) -> set[fx.Node]:
    """Nodes every stage can compute for itself: the batch, buffers, constants, and
    deterministic ops on those only that write no buffer. Never a parameter, trainable or
    frozen: the cut must not depend on ``requires_grad``, which the loop may change."""
    free: set[fx.Node] = set()
    placeholders = [n for n in traced.gm.graph.nodes if n.op == "placeholder"]
    kinds = dict(zip(placeholders, traced.kinds))
    for node in traced.gm.graph.nodes:
        if node.op == "placeholder":
            if kinds[node][0] != "param":
                free.add(node)
        elif node.op == "get_attr":
            free.add(node)
        elif node.op == "call_function":
            name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
            inputs = node.all_input_nodes
            if name not in _RANDOM and all(i in free for i in inputs) \
                    and not _state_written(node, kinds):
                free.add(node)
    return free


def cut(traced: Traced, split_points: Sequence[str], where: str, chosen: str) -> Cut:
    """The stages that begin at ``split_points`` (the first stage at the graph's start)."""
    gm = traced.gm
    graph = gm.graph
    marks = dict(traced.marks)
    order = {node: i for i, node in enumerate(graph.nodes)}
    positions = []
    for path in split_points:
        mark = marks.get(path)
        positions.append(-1 if mark is None else order[mark])
    for (a, pa), (b, pb) in zip(zip(split_points, positions), zip(split_points[1:], positions[1:])):
        if pb <= pa:
            raise ValueError(f"{where}: cut points must follow the forward's order: {b!r} "
                             f"does not run after {a!r}")
    free = _free_nodes(traced)
    n_stages = len(split_points) + 1
    stage_of: dict[fx.Node, int] = {}
    boundaries = list(positions)
    current = 0
    for i, node in enumerate(graph.nodes):
        while current < len(boundaries) and i > boundaries[current]:
            current += 1
        if node.op == "call_function" and node not in free:
            stage_of[node] = current
    kinds = dict(zip([n for n in graph.nodes if n.op == "placeholder"], traced.kinds))
    # a parameter read in several stages (tied weights), frozen or not: each holds a
    # copy, and the copies' gradients are summed across those stages once per step
    tied: dict[str, tuple[int, ...]] = {}
    for node, (kind, name) in kinds.items():
        if kind != "param":
            continue
        stages = sorted({stage_of[u] for u in node.users if u in stage_of})
        if len(stages) > 1:
            tied[name] = tuple(stages)
    output = next(n for n in graph.nodes if n.op == "output")
    result = output.args[0]
    if isinstance(result, (list, tuple)) and len(result) == 1:
        result = result[0]
    if not isinstance(result, fx.Node) or not isinstance(_val(result), torch.Tensor):
        raise ValueError(f"{where}: the loss must be one tensor, got "
                         f"{type(_val(result)).__name__}")
    if result.meta["val"].numel() != 1:
        raise ValueError(f"{where}: the loss must be a scalar (one element), got shape "
                         f"{tuple(result.meta['val'].shape)}; reduce it in loss_fn")
    if result not in stage_of or stage_of[result] != n_stages - 1:
        raise ValueError(f"{where}: the loss is not computed in the last stage; the last cut "
                         f"point ({split_points[-1]!r}) leaves the last stage empty")
    for s in range(n_stages):
        if not any(v == s for v in stage_of.values()):
            before = "the start" if s == 0 else repr(split_points[s - 1])
            after = repr(split_points[s]) if s < len(split_points) else "the loss"
            raise ValueError(f"{where}: stage {s} (from {before} to {after}) computes "
                             f"nothing that needs a gradient; choose other cut points")
    # values read across stages
    crossings: list[Crossing] = []
    crossing_of: dict[fx.Node, Crossing] = {}
    needs_grad: set[fx.Node] = {n for n, (k, _) in kinds.items() if k == "param"}
    for node in graph.nodes:
        if node.op == "call_function" and any(i in needs_grad for i in node.all_input_nodes):
            needs_grad.add(node)
    for node in graph.nodes:
        if node not in stage_of:
            continue
        dsts = sorted({stage_of[u] for u in node.users if u in stage_of
                       and stage_of[u] != stage_of[node]})
        if not dsts:
            continue
        val = _val(node)
        if not isinstance(val, torch.Tensor):
            raise ValueError(f"{where}: {node.name} ({type(val).__name__}) crosses from stage "
                             f"{stage_of[node]} to {dsts}; only tensors can cross stages")
        grad = node in needs_grad and val.dtype.is_floating_point
        c = Crossing(index=len(crossings), name=node.name, src=stage_of[node],
                     dsts=tuple(dsts), shape=tuple(val.shape), dtype=val.dtype, grad=grad)
        crossings.append(c)
        crossing_of[node] = c
    stages = [_stage(traced, s, n_stages, stage_of, free, kinds, crossing_of, result)
              for s in range(n_stages)]
    for node, s in stage_of.items():
        for written in _state_written(node, kinds):
            kind, name = kinds[written]
            readers = [st.index for st in stages
                       if st.index != s and name in st.params + st.buffers]
            if readers:
                raise ValueError(f"{where}: {kind} {name!r} is written in stage {s} (by "
                                 f"{node.name}) and read in stage(s) {readers}; each stage "
                                 f"holds its own copy, so they would disagree: cut so that "
                                 f"one stage holds every use")
    return Cut(stages=stages, crossings=crossings, split_points=tuple(split_points),
               chosen=chosen, tied=tied)


def _stage(traced: Traced, s: int, n_stages: int, stage_of: dict, free: set, kinds: dict,
           crossing_of: dict, loss: fx.Node) -> Stage:
    graph = traced.gm.graph
    own = [n for n in graph.nodes if stage_of.get(n) == s]
    own_set = set(own)
    received = [n for n in graph.nodes if n in crossing_of and n not in own_set
                and any(stage_of.get(u) == s for u in n.users)]
    needed: set[fx.Node] = set()
    stack = [i for n in own for i in n.all_input_nodes if i in free]
    while stack:
        n = stack.pop()
        if n in needed:
            continue
        needed.add(n)
        stack.extend(i for i in n.all_input_nodes if i in free)
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    attrs: dict[str, Any] = {}
    params, buffers, inputs = [], [], []
    for node in graph.nodes:  # parameters and buffers, then batch leaves, then received
        if node.op != "placeholder":
            continue
        kind, name = kinds[node]
        if kind == "param" and any(stage_of.get(u) == s for u in node.users):
            params.append((name, node))
        elif kind in ("param", "buffer") and node in needed:
            buffers.append((name, node))
        elif kind == "input" and node in needed:
            inputs.append((int(name), node))
    for name, node in params + buffers:
        env[node] = new.placeholder(_safe(name))
        env[node].meta = dict(node.meta)
    for _, node in inputs:
        env[node] = new.placeholder(f"input_{node.name}")
        env[node].meta = dict(node.meta)
    for node in received:
        env[node] = new.placeholder(f"recv_{node.name}")
        env[node].meta = dict(node.meta)
    for node in graph.nodes:
        if node.op == "get_attr" and node in needed:
            attrs[node.target] = getattr(traced.gm, node.target)
            env[node] = new.get_attr(node.target)
            env[node].meta = dict(node.meta)
        elif node.op == "call_function" and (node in own_set or node in needed):
            env[node] = new.node_copy(node, lambda a: env[a])
    sent = [n for n in own if n in crossing_of]
    outs = [env[n] for n in sent] + ([env[loss]] if s == n_stages - 1 else [])
    new.output(tuple(outs))
    order = {n: i for i, n in enumerate(graph.nodes)}
    for k, (begin, end) in enumerate(traced.regions):
        lo = order[begin] if begin is not None else -1
        hi = order[end] if end is not None else -1
        inside = [n for n in graph.nodes if lo < order[n] <= hi and n.op == "call_function"]
        mine = [n for n in inside if n in env and (n in own_set or n in needed)]
        if not any(n in own_set for n in inside) or any(
                n not in free and stage_of.get(n) != s for n in inside):
            continue  # another stage's, or cut through (then left whole: no recompute)
        _outline(new, [env[n] for n in mine], f"checkpointed_{k}", attrs)
    new.lint()
    code = fx.GraphModule(attrs, new, class_name=f"Stage{s}")
    flops = sum(traced.flops.get(n.name, 0.0) for n in own)
    param_bytes = sum(_bytes(_val(node)) for _, node in params)
    param_numel = sum(_val(node).numel() for _, node in params)
    return Stage(index=s, code=code, params=tuple(n for n, _ in params),
                 buffers=tuple(n for n, _ in buffers), inputs=tuple(i for i, _ in inputs),
                 received=tuple(crossing_of[n].index for n in received),
                 sent=tuple(crossing_of[n].index for n in sent), loss=s == n_stages - 1,
                 flops=flops, param_numel=param_numel, param_bytes=param_bytes)


def _outline(graph: fx.Graph, nodes: list[fx.Node], name: str, attrs: dict) -> None:
    """Replace ``nodes`` (contiguous, in order) by a call of
    ``torch.utils.checkpoint.checkpoint`` on a graph module of them."""
    import operator

    import torch.utils.checkpoint as ckpt

    if not nodes:
        return
    inside = set(nodes)
    inputs: list[fx.Node] = []
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in inside and a not in inputs:
                inputs.append(a)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in inputs:
        env[a] = sub.placeholder(a.name)
        env[a].meta = dict(a.meta)
    sub_attrs = {}
    for n in nodes:
        env[n] = sub.node_copy(n, lambda x: env[x])
        if n.op == "get_attr":
            sub_attrs[n.target] = attrs[n.target]
    sub.output(tuple(env[o] for o in outputs))
    attrs[name] = fx.GraphModule(sub_attrs, sub, class_name="Checkpointed")
    with graph.inserting_after(nodes[-1]):
        module = graph.get_attr(name)
    with graph.inserting_after(module):
        call = graph.call_function(ckpt.checkpoint, (module, *inputs), {"use_reentrant": False})
        call.meta["val"] = tuple(o.meta.get("val") for o in outputs)
    last = call
    for i, o in enumerate(outputs):
        with graph.inserting_after(last):
            item = graph.call_function(operator.getitem, (call, i))
        item.meta = dict(o.meta)
        o.replace_all_uses_with(item)
        last = item
    for n in reversed(nodes):
        graph.erase_node(n)


def _safe(name: str) -> str:
    return "p_" + name.replace(".", "_")


def _bytes(val: Any) -> int:
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(_bytes(v) for v in val)
    return 0
