"""Compute from the graph: what each node costs on a device, and what a step's FLOPs are.

Every node of a planned graph falls in one class, priced as a roofline at that class's
efficiency (:meth:`spmd.hardware.Device.efficiency_of`, each figure with its source):

- ``matmul`` (``mm``, ``addmm``, ``bmm``, ``baddbmm``, convolutions): FLOPs (torch's
  ``flop_counter`` formulas) at the peak of the dtype the product runs in (the
  device's ``matmul_dtype`` for FP8 training), or the bytes it moves, whichever is longer;
- ``attention`` (the fused kernels, forward and backward): FLOPs from the same formulas
  (the backward recomputes the scores: five products to the forward's two), halved when
  causal (the kernels skip the masked blocks), against the bytes of the query, keys,
  values, output and log-sum-exp it reads and writes;
- ``memory`` (everything else that computes: pointwise ops, reductions, norms, softmax,
  casts, copies): the bytes it reads and writes at the device's memory bandwidth;
- ``free``: views, and the collectives and waits the cost model prices apart.

A graph compiled by Inductor (``compile_compute=True``, and what a GPU run picks) fuses
memory-bound chains: connected ``memory`` nodes (views between them included) are priced
as one pass that reads what enters the chain and writes what leaves it.

FLOPs are counted two ways (:func:`step_flops`): **model FLOPs**, the field's definition
of MFU (PaLM, Chowdhery et al. 2022, appendix B; torchtitan and Megatron-LM count
alike): three times the forward's matrix products and attention (forward, then the
backward's two products per forward product), attention over the full score matrix,
nothing recomputed; and **hardware FLOPs**: what the device executes, the backward's
recomputation (activation checkpointing, attention's own) included and causal attention
halved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

if TYPE_CHECKING:
    from spmd.plan.plan import Plan

__all__ = ["op_class", "class_seconds", "throughput", "node_flops", "node_bytes", "node_times", "graph_seconds",
           "graph_flops", "step_flops", "StepFlops", "matmul_dtype"]

_FREE = ("view", "_unsafe_view", "t", "transpose", "permute", "expand", "alias", "detach",
         "unsqueeze", "squeeze", "slice", "select", "split", "split_with_sizes", "getitem",
         "reshape", "unbind", "as_strided", "_reshape_alias", "view_as_real",
         "view_as_complex")
_MATMULS = ("mm", "addmm", "bmm", "baddbmm", "convolution", "convolution_backward",
            "_convolution", "grouped_mm", "grouped_mm_weight")


def _name(node: fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target)).split(".")[0]


def op_class(node: fx.Node) -> str:
    """``"matmul"``, ``"attention"``, ``"memory"`` or ``"free"`` (see the module doc)."""
    from spmd.lowering.graph import is_collective, is_wait
    from spmd.lowering.meta_trace import ATTENTION

    if node.op != "call_function" or is_collective(node) or is_wait(node):
        return "free"
    if node.target in ATTENTION:
        return "attention"
    name = _name(node)
    if name in _FREE:
        return "free"
    if name in _MATMULS:
        return "matmul"
    return "memory"


def _val(a: Any) -> Any:
    return a.meta.get("val") if isinstance(a, fx.Node) else a


def node_flops(node: fx.Node, *, causal_halved: bool = True) -> int:
    """The node's FLOPs by torch's ``flop_counter`` formulas (0 where it has none); a
    causal attention node's halved unless ``causal_halved=False``."""
    from torch.fx.node import map_aggregate
    from torch.utils.flop_counter import flop_registry

    from spmd.lowering.meta_trace import ATTENTION, attention_causal

    from spmd.lowering import experts

    if node.op != "call_function":
        return 0
    if node.target in (experts.grouped_mm, experts.grouped_mm_weight):
        return experts.product_flops(node)
    attention = node.target in ATTENTION
    if attention:
        flops = _attention_flops(node)
    else:
        fn = flop_registry.get(getattr(node.target, "overloadpacket", None))
        if fn is None:
            return 0
        args = map_aggregate(node.args, _val)
        kwargs = map_aggregate(node.kwargs, _val)
        try:
            flops = int(fn(*args, **kwargs, out_val=node.meta.get("val")))
        except Exception:  # a formula that needs what the graph does not carry
            return 0
    if attention and causal_halved and attention_causal(node):
        flops //= 2
    return flops


def _attention_flops(node: fx.Node) -> int:
    """2·b·h·s_q·s_k·(d + d_v) forward (scores, then the weighted sum); the backward
    recomputes the scores and takes four more products: 2.5 times that."""
    from spmd.lowering.meta_trace import ATTENTION_BACKWARD

    names = [a.name for a in node.target._schema.arguments]  # type: ignore[union-attr]

    def arg(name: str) -> Any:
        i = names.index(name)
        return _val(node.args[i] if i < len(node.args) else node.kwargs[name])

    q, k, v = arg("query"), arg("key"), arg("value")
    *batch, s_q, d = q.shape
    s_k, d_v = k.shape[-2], v.shape[-1]
    ring = _ring_size(node)
    if ring:  # this rank's queries against every rank's keys
        s_k = int(s_k) * ring
    rows = 1
    for x in batch:
        rows *= int(x)
    forward = 2 * rows * int(s_q) * int(s_k) * (int(d) + int(d_v))
    return forward * 5 // 2 if node.target in ATTENTION_BACKWARD else forward


def _ring_size(node: fx.Node) -> int:
    """Ranks along a ring attention node's dimension (0: not ring attention)."""
    from spmd.lowering import ranked
    from spmd.lowering.specs import lookup

    if node.target not in (ranked.ring_attention, ranked.ring_attention_backward):
        return 0
    try:
        return int(lookup(node.args[-1]).size)
    except RuntimeError:  # a plan whose model is gone
        return 0


def _nbytes(t: torch.Tensor) -> int:
    """A value's bytes; a symbolic size (a dynamic graph's) at this trace's value, so the
    prices stay numbers rather than growing sympy expressions."""
    from spmd.lowering.capture import size_hint

    return size_hint(t.numel()) * t.element_size()


def node_bytes(node: fx.Node) -> int:
    """Bytes the node reads (its tensor inputs) and writes (its tensor outputs)."""
    from spmd.lowering.graph import tensor_vals

    total = 0
    for arg in node.all_input_nodes:
        total += sum(_nbytes(t) for t in tensor_vals(arg.meta.get("val")))
    total += sum(_nbytes(t) for t in tensor_vals(node.meta.get("val")))
    return total


def _out_bytes(node: fx.Node) -> int:
    from spmd.lowering.graph import tensor_vals

    return sum(_nbytes(t) for t in tensor_vals(node.meta.get("val")))


def matmul_dtype(node: fx.Node, device: Any | None) -> torch.dtype:
    """The dtype ``node``'s arithmetic runs in on ``device``: the device's
    ``matmul_dtype`` for matrix products when it sets one (FP8 training), else the
    node's own."""
    if device is not None and device.matmul_dtype is not None and op_class(node) == "matmul":
        return getattr(torch, device.matmul_dtype)
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        val = next((v for v in val if isinstance(v, torch.Tensor)), None)
    return val.dtype if isinstance(val, torch.Tensor) else torch.float32


def node_times(gm: fx.GraphModule, device: Any, fused: bool = False) -> dict[str, float]:
    """Predicted seconds of each computing node of ``gm`` on ``device`` (see the module
    doc); with ``fused``, each fused memory-bound chain's time is shared among its nodes
    in proportion to their unfused bytes."""
    memory = device.efficiency_of("memory").value * device.memory_bandwidth
    times: dict[str, float] = {}
    classes = {n: op_class(n) for n in gm.graph.nodes}
    for node, kind in classes.items():
        if kind in ("matmul", "attention"):
            dtype = matmul_dtype(node, device)
            rate = device.peak(dtype) * device.efficiency_of(kind, dtype).value
            times[node.name] = max(node_flops(node) / rate, node_bytes(node) / memory)
        elif kind == "memory" and not fused:
            times[node.name] = node_bytes(node) / memory
    if fused:
        for chain in _chains(gm, classes):
            members = [n for n in chain if classes[n] == "memory"]
            if not members:
                continue  # views alone: free
            inside = set(chain)
            read = {_root(a, inside) for n in members for a in n.all_input_nodes}
            read -= set(members)
            written = [n for n in members if _escapes(n, inside)]
            alone = [node_bytes(n) for n in members]
            seconds = min(sum(_out_bytes(a) for a in read)
                          + sum(_out_bytes(n) for n in written), sum(alone)) / memory
            total = sum(alone) or 1
            for n, w in zip(members, alone):
                times[n.name] = seconds * (w or 1) / total
    return times


def _root(node: fx.Node, inside: set[fx.Node]) -> fx.Node:
    """What ``node`` views, through the chain's views (a kernel reads the base)."""
    while node in inside and op_class(node) == "free" and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


def _escapes(node: fx.Node, inside: set[fx.Node]) -> bool:
    """Whether ``node``'s value (itself or through the chain's views) is read outside the
    chain: then the fused kernel writes it."""
    for user in node.users:
        if user not in inside:
            return True
        if op_class(user) == "free" and _escapes(user, inside):
            return True
    return False


def _chains(gm: fx.GraphModule, classes: dict[fx.Node, str]) -> list[list[fx.Node]]:
    """Connected groups of memory-bound nodes and the views between them: what Inductor
    fuses into one kernel (matrix products, attention and collectives end a chain)."""
    parent: dict[fx.Node, fx.Node] = {}

    def find(x: fx.Node) -> fx.Node:
        while parent[x] is not x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    fusible = [n for n, k in classes.items() if n.op == "call_function" and (
        k == "memory" or (k == "free" and _name(n) in _FREE))]
    for n in fusible:
        parent[n] = n
    for n in fusible:
        for a in n.all_input_nodes:
            if a in parent:
                parent[find(a)] = find(n)
    groups: dict[fx.Node, list[fx.Node]] = {}
    for n in fusible:
        groups.setdefault(find(n), []).append(n)
    return list(groups.values())


def class_seconds(gm: fx.GraphModule, times: dict[str, float]) -> dict[str, float]:
    """``times`` (:func:`node_times` of ``gm``) summed by op class."""
    out: dict[str, float] = {}
    for node in gm.graph.nodes:
        if node.name in times:
            kind = op_class(node)
            out[kind] = out.get(kind, 0.0) + times[node.name]
    return out


def graph_seconds(gm: fx.GraphModule, device: Any, fused: bool = False) -> float:
    """Predicted seconds of a graph's compute on ``device``: its nodes' times summed (one
    stream)."""
    return sum(node_times(gm, device, fused).values())


def graph_flops(gm: fx.GraphModule, device: Any | None = None) -> dict[torch.dtype, int]:
    """The graph's FLOPs (hardware FLOPs: causal attention halved) by the dtype they run
    in."""
    out: dict[torch.dtype, int] = {}
    for node in gm.graph.nodes:
        flops = node_flops(node)
        if flops:
            dtype = matmul_dtype(node, device)
            out[dtype] = out.get(dtype, 0) + flops
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class StepFlops:
    """FLOPs of one step on one device (see the module doc).

    Attributes:
        model: three times the forward's matrix-product and attention FLOPs (full score
            matrices), the numerator of MFU.
        hardware: every graph's matrix-product and attention FLOPs as executed
            (recomputation included, causal attention halved), the numerator of HFU.
        dtype: the dtype of most of the matrix-product FLOPs; its peak is MFU's
            denominator.
    """

    model: int
    hardware: int
    dtype: torch.dtype


def step_flops(graphs: dict[str, fx.GraphModule], device: Any | None = None) -> StepFlops:
    """The :class:`StepFlops` of a plan's graphs (``plan.graphs``)."""
    model = hardware = 0
    by_dtype: dict[torch.dtype, int] = {}
    split = any(key.endswith(".forward") for key in graphs)
    for key, gm in graphs.items():
        # a whole step traced as one graph has no forward of its own: its products
        # once each (recomputation, if any, included)
        forward = key.endswith(".forward")
        for node in gm.graph.nodes:
            if op_class(node) not in ("matmul", "attention"):
                continue
            flops = node_flops(node)
            hardware += flops
            dtype = matmul_dtype(node, device)
            by_dtype[dtype] = by_dtype.get(dtype, 0) + flops
            if forward:
                model += 3 * node_flops(node, causal_halved=False)
            elif not split:
                model += node_flops(node, causal_halved=False)
    dtype = max(by_dtype, key=by_dtype.get) if by_dtype else torch.float32
    return StepFlops(model=model, hardware=hardware, dtype=dtype)


def throughput(plan: Plan) -> str:
    """Lines for a plan on a simulated cluster: the predicted step (compute, exposed
    communication, the optimizer step), MFU as the field defines it (model FLOPs per
    step, the matmul dtype's peak) beside HFU (the FLOPs the device executes,
    recomputation included), tokens/s per device when the model's first input is token
    ids, and where each efficiency the roofline used comes from."""
    hardware = plan.mesh.hardware
    device = hardware.device
    timeline = plan.predicted_timeline()
    step = timeline.step_seconds
    flops = step_flops(plan.graphs, device)
    peak = device.peak(flops.dtype)
    mfu = flops.model / (step * peak) if step > 0 else 0.0
    hfu = flops.hardware / (step * peak) if step > 0 else 0.0
    dtype = str(flops.dtype).removeprefix("torch.")
    extra = timeline.optimizer_seconds
    line = (f"on {device.name}: predicted step {step * 1e3:.3f} ms (exposed communication "
            f"{timeline.exposed_seconds * 1e3:.3f} ms" + (
                f", {timeline.optimizer_label} {extra * 1e3:.3f} ms" if extra else "")
            + f"); {flops.model / 1e12:.3f} model TFLOP per device per step, MFU {mfu:.1%} "
            f"of the {dtype} peak; hardware {flops.hardware / 1e12:.3f} TFLOP, HFU {hfu:.1%}")
    if plan.tokens_per_step and step > 0:
        line += f"; {plan.tokens_per_step / step:,.0f} tokens/s per device"
    compiled = "fused memory-bound chains (Inductor)" if plan.fused else "each node alone"
    by_class: dict[str, float] = {}
    for key, times in plan.node_seconds.items():
        for kind, seconds in class_seconds(plan.graphs[key], times).items():
            by_class[kind] = by_class.get(kind, 0.0) + seconds
    split = ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in sorted(by_class.items()))
    lines = [line, f"  roofline: {compiled}; compute {split}; efficiencies:"]
    lines += [f"    {e}" for e in device.efficiency_lines()]
    return "\n".join(lines)
