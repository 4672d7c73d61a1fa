"""Expert parallelism's ops: tokens sent to the ranks holding their experts, multiplied by
each expert's weights, and sent back (``spmd.ep``).

The experts of a mixture-of-experts layer are split by expert index over the ranks of
one data dimension (``"ep"``): rank ``r`` holds experts ``r * L .. (r + 1) * L - 1`` of
``E = size * L``. Each rank routes its own tokens; one layer is then

    order, send, recv, offs = spmd.ep_route(top_k_index, handle)     # counts exchanged
    xs = spmd.ep_scatter(rows, order, send, recv, C, handle)         # all-to-all, uneven
    h = spmd.grouped_mm(xs, gate_up, offs, bias, transposed, scale)  # one product per expert
    ...activation...
    ys = spmd.grouped_mm(h, down, offs, bias, transposed, scale)
    back = spmd.ep_gather(ys, order, send, recv, handle)             # all-to-all back

- ``ep_route`` sorts this rank's (token, choice) pairs by expert (``order``), counts
  them per expert (``send``: ``(size, L)``, row ``j`` what goes to rank ``j``), exchanges
  the counts (``recv``: row ``s`` what rank ``s`` sends here, per local expert) and the
  offsets of each local expert's rows (``offs``).
- ``ep_scatter`` sends the rows with uneven splits and lays what arrives out expert by
  expert (each expert's rows contiguous, sources in rank order), padded with zero rows to
  a static bound ``C`` (below); ``ep_gather`` is its exact reverse, so each is the
  other's backward.
- ``grouped_mm`` multiplies each expert's rows by its weight (``torch._grouped_mm``
  where the build, device and dtype take it: bfloat16 on CUDA; else ``spmd.kernels.
  grouped``: one Triton launch on CUDA in float32, bfloat16 or float16, a loop of
  ``torch.mm`` on CPU, where the loop measured faster, and in float64); its backward
  gives the input's gradient and each expert's weight (and bias) gradient, the latter
  times ``scale``.

Shapes are static, as a graph needs: ``C = size * T * k`` rows, enough for every choice
of every rank's tokens to reach this rank's experts (dropless). The padding rows
are zeros, never sent back, and add nothing to any gradient. Under a capacity factor
(GShard, Switch) each expert takes at most :func:`capacity` pairs from each rank, the
first in (token, choice) order; the others are dropped (never sent, their rows come
back zero) and ``C`` shrinks to ``size * L * capacity`` where that is smaller. With a
headroom ``h`` (``spmd.ep.experts(headroom=)``) a dropless ``C`` is ``ceil(h * T * k)``:
``ep_route`` then learns whether any rank of the mesh received more (one all-reduce of
the largest count) and every rank raises :class:`ExpertsOverflow`, which the module's
forward answers by growing ``h`` and running again (``spmd.program.module``).

Scaling: the gradient of each local expert holds the contributions of every rank's
tokens, each scaled by its own rank's loss; the data dimension's average (what
``Partial("avg")`` gives every other parameter) is that sum over ``size``, so
``grouped_mm`` multiplies its weight gradients by ``scale = 1 / size`` and no collective
touches the experts' gradients along ``"ep"``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from spmd.kernels import grouped
from spmd.lowering.ops import define, tp_grad
from spmd.lowering.placements import Placement, Replicate, Shard
from spmd.lowering.specs import lookup, sending
from spmd.runtime import collectives
from spmd.runtime.reduction import ReduceOp

__all__ = ["ExpertsSpec", "ExpertsOverflow", "ep_route", "ep_scatter", "ep_gather",
           "grouped_mm", "capacity", "bound_rows", "ROUTED"]


class ExpertsOverflow(RuntimeError):
    """A dropless layer with a headroom (``spmd.ep.experts(headroom=)``): some rank's
    experts received more rows than its static bound. Raised on every rank alike (they
    agreed on the largest count), in the routing, before any row moved."""

    def __init__(self, module: str, need: int, bound: int, pairs: int) -> None:
        super().__init__(f"{module}: a rank's experts received {need} rows, more than the "
                         f"{bound} its headroom bounds them at ({pairs} pairs per rank)")
        self.module, self.need, self.bound, self.pairs = module, need, bound, pairs


@dataclass(eq=False)
class ExpertsSpec:
    """One expert-parallel layer: where its experts live and what its last step routed.

    Attributes:
        module: the experts module's path in the model.
        num_experts: experts in the whole layer (``E``).
        size: ranks of the expert-parallel dimension they are split over.
        group: its process group (None: a simulated mesh, or one rank).
        mesh_dim: the mesh dimension's name.
        capacity_factor: None: dropless; else each expert takes at most
            :func:`capacity` of each rank's (token, choice) pairs, the rest dropped.
        context_dims: the mesh dimensions the sequence is split over (context
            parallelism): along them each rank routes its own part of the sequence over
            its expert-parallel group (``spmd.lowering.rules.experts``).
        context_groups: the process group along each context dimension, whose ranks
            route parts of one sequence (empty: none, or a simulated mesh).
        parts: how many parts of the sequence the last forward's routing was one of
            (the planned graph beside context parallelism: the product of the context
            dimensions' sizes; eager, or without it: 1); :func:`spmd.ep.expert_load`
            sums the parts over every context group in turn.
        headroom: dropless only: the received rows are bounded at ``headroom * T * k``
            (None: at every pair of every rank); grown where a forward overflowed.
        context_ranks: the ranks of the context dimensions together (the parts a
            headroom's bound is rounded to a multiple of).
        agree_groups: the groups of every mesh dimension: the largest count is agreed
            over them in turn (with a headroom; empty: a simulated mesh).
        grown: how many times the headroom grew.
        load: the last forward's tokens per local expert (from every rank).
        dropped: the last forward's pairs this rank dropped, per expert (all ``E``).
    """

    module: str
    num_experts: int
    size: int
    group: Any = None
    mesh_dim: str = "ep"
    capacity_factor: float | None = None
    context_dims: tuple[str, ...] = ()
    context_groups: tuple[Any, ...] = ()
    parts: int = 1
    headroom: float | None = None
    context_ranks: int = 1
    agree_groups: tuple[Any, ...] = ()
    grown: int = 0
    load: torch.Tensor | None = field(default=None, repr=False)
    dropped: torch.Tensor | None = field(default=None, repr=False)

    @property
    def local(self) -> int:
        """Experts each rank holds (``L``)."""
        return self.num_experts // self.size

    @property
    def communicates(self) -> bool:
        """Rows move between ranks: a live group of several, and not a timing run of one
        rank alone (:func:`spmd.lowering.specs.dry_run`, where each rank's experts take
        its own rows as a simulated mesh's do)."""
        return self.group is not None and self.size > 1 and sending()


def capacity(capacity_factor: float | None, tokens: int, k: int, experts: int) -> int | None:
    """The (token, choice) pairs of one rank an expert takes under a capacity factor
    (GShard's and Switch's expert capacity, per group of tokens: here each rank's):
    ``ceil(capacity_factor * tokens * k / experts)``; None: dropless."""
    if capacity_factor is None:
        return None
    return max(1, math.ceil(capacity_factor * tokens * k / experts))


def bound_rows(size: int, tokens: int, k: int, local: int = 1,
               capacity_factor: float | None = None, experts: int = 1,
               headroom: float | None = None, parts: int = 1) -> int:
    """The static row count ``C`` a rank's experts receive (module doc), for ``tokens``
    tokens of ``k`` choices on each of ``size`` ranks: every pair (dropless), at most
    ``ceil(headroom * tokens * k)`` with a headroom, rounded up to a multiple of
    ``parts`` (the ranks a sequence is split over beside context parallelism, which
    split these rows too), or under a capacity factor at most :func:`capacity` per local
    expert (``local``) from each rank."""
    rows = size * tokens * k
    cap = capacity(capacity_factor, tokens, k, experts)
    if cap is not None:
        rows = min(rows, size * local * cap)
    if headroom is not None:
        rows = min(rows, math.ceil(headroom * tokens * k / parts) * parts)
    return max(1, rows)


# -- routing --------------------------------------------------------------------------


def _route(top_k_index: torch.Tensor, handle: int, parts: int = 1
           ) -> tuple[torch.Tensor, ...]:
    spec: ExpertsSpec = lookup(handle)
    spec.parts = parts
    tokens, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    if flat.numel():
        low, high = (int(v) for v in torch.aminmax(flat))
        if low < 0 or high >= spec.num_experts:
            raise ValueError(f"{spec.module}: routed to expert {high} (or {low}); the layer "
                             f"has experts 0..{spec.num_experts - 1}")
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=spec.num_experts)
    cap = capacity(spec.capacity_factor, tokens, k, spec.num_experts)
    if cap is not None:
        # each expert keeps its first ``cap`` pairs in (token, choice) order; the kept
        # pairs come first in ``order`` (by expert), the dropped after (never sent)
        starts = torch.cumsum(counts, 0) - counts
        kept = (torch.arange(flat.numel()) - starts[flat[order]]) < cap
        order = torch.cat([order[kept], order[~kept]])
        spec.dropped = (counts - counts.clamp(max=cap)).detach().clone()
        counts = counts.clamp(max=cap)
    send = counts.view(spec.size, spec.local)
    recv = torch.empty_like(send)
    if spec.communicates:
        collectives.all_to_all_single(recv, send.contiguous(), group=spec.group)
    else:
        recv.copy_(send)
    per_expert = recv.sum(0)
    offs = torch.cumsum(per_expert, 0)
    # the graph's bound, traced for the whole sequence, is this rank's share of it
    bound = bound_rows(spec.size, tokens * parts, k, spec.local, spec.capacity_factor,
                       spec.num_experts, spec.headroom, spec.context_ranks) // parts
    if spec.headroom is not None and spec.communicates:
        # every rank of the mesh learns the largest count: all raise alike, or none
        need = offs[-1:].clone()
        for group in spec.agree_groups:
            collectives.all_reduce(need, op=ReduceOp.MAX, group=group)
        if int(need) > bound and bound < spec.size * tokens * k:
            raise ExpertsOverflow(spec.module, int(need), bound, tokens * k)
    if int(offs[-1]) > bound:
        raise RuntimeError(
            f"{spec.module}: this rank's experts received {int(offs[-1])} rows, more than "
            f"the {bound} its {tokens} tokens x top-{k} bound allows; every rank of "
            f"{spec.mesh_dim!r} must route the same number of tokens (pad the batch to "
            f"one size on every rank)")
    spec.load = per_expert.detach().clone()
    return order, send, recv, offs


def _fake_route(top_k_index: torch.Tensor, handle: int, parts: int = 1
                ) -> tuple[torch.Tensor, ...]:
    spec: ExpertsSpec = lookup(handle)
    n = top_k_index.numel()
    new = top_k_index.new_empty
    return (new((n,), dtype=torch.int64), new((spec.size, spec.local), dtype=torch.int64),
            new((spec.size, spec.local), dtype=torch.int64),
            new((spec.local,), dtype=torch.int64))


ep_route = define(
    "ep_route(Tensor top_k_index, int handle, int parts=1) -> "
    "(Tensor, Tensor, Tensor, Tensor)",
    _route, _fake_route)


# -- moving rows ----------------------------------------------------------------------


def _expert_major(recv: torch.Tensor) -> torch.Tensor:
    """Indices taking rows laid out source by source (each source's expert by expert, as
    they arrive) to expert by expert (each expert's sources in rank order)."""
    size, local = recv.shape
    flat = recv.reshape(-1)
    starts = torch.cumsum(flat, 0) - flat  # of block (source, expert), arrival order
    by_expert = recv.t().reshape(-1)
    blocks = starts.view(size, local).t().reshape(-1)
    if not by_expert.numel():
        return torch.empty(0, dtype=torch.int64)
    return torch.repeat_interleave(blocks - (torch.cumsum(by_expert, 0) - by_expert),
                                   by_expert) + torch.arange(int(by_expert.sum()))


def _exchange(x: torch.Tensor, out_rows: int, in_splits: list[int], out_splits: list[int],
              spec: ExpertsSpec) -> torch.Tensor:
    out = x.new_empty((out_rows, *x.shape[1:]))
    if spec.communicates:
        collectives.all_to_all_single(out, x.contiguous(), out_splits, in_splits,
                                      group=spec.group)
    else:
        out.copy_(x)
    return out


def _scatter(rows: torch.Tensor, order: torch.Tensor, send: torch.Tensor,
             recv: torch.Tensor, bound: int, handle: int) -> torch.Tensor:
    spec: ExpertsSpec = lookup(handle)
    got = int(recv.sum())
    sent = order[:int(send.sum())]  # (a capacity's dropped pairs are not sent)
    arrived = _exchange(rows[sent], got, send.sum(1).tolist(), recv.sum(1).tolist(), spec)
    out = rows.new_empty((bound, *rows.shape[1:]))
    torch.index_select(arrived, 0, _expert_major(recv), out=out[:got])
    out[got:].zero_()  # the padding: zeros, which add nothing anywhere
    return out


def _gather(ys: torch.Tensor, order: torch.Tensor, send: torch.Tensor,
            recv: torch.Tensor, handle: int) -> torch.Tensor:
    spec: ExpertsSpec = lookup(handle)
    got = int(recv.sum())
    by_source = torch.empty_like(ys[:got])
    by_source[_expert_major(recv)] = ys[:got]
    sent = int(send.sum())
    back = _exchange(by_source, sent, recv.sum(1).tolist(), send.sum(1).tolist(), spec)
    if sent == order.numel():
        out = torch.empty_like(back)
        out[order] = back
    else:  # a dropped pair comes back as zeros: its token keeps only its other choices
        out = back.new_zeros((order.numel(), *back.shape[1:]))
        out[order[:sent]] = back
    return out


def _fake_scatter(rows: torch.Tensor, order: torch.Tensor, send: torch.Tensor,
                  recv: torch.Tensor, bound: int, handle: int) -> torch.Tensor:
    return rows.new_empty((bound, *rows.shape[1:]))


def _fake_gather(ys: torch.Tensor, order: torch.Tensor, send: torch.Tensor,
                 recv: torch.Tensor, handle: int) -> torch.Tensor:
    return ys.new_empty((order.shape[0], *ys.shape[1:]))


def _keep_scatter(ctx: Any, inputs: tuple, output: Any) -> None:
    rows, order, send, recv, bound, handle = inputs
    ctx.routing, ctx.handle = (order, send, recv), handle


def _keep_gather(ctx: Any, inputs: tuple, output: Any) -> None:
    ys, order, send, recv, handle = inputs
    ctx.routing, ctx.handle, ctx.bound = (order, send, recv), handle, ys.shape[0]


def _scatter_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    return (ep_gather(grad.contiguous(), *ctx.routing, ctx.handle),
            None, None, None, None, None)


def _gather_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    return (ep_scatter(grad.contiguous(), *ctx.routing, ctx.bound, ctx.handle),
            None, None, None, None)


ep_scatter = define(
    "ep_scatter(Tensor rows, Tensor order, Tensor send, Tensor recv, SymInt bound, "
    "int handle) -> Tensor", _scatter, _fake_scatter, _scatter_backward, _keep_scatter)
ep_gather = define(
    "ep_gather(Tensor ys, Tensor order, Tensor send, Tensor recv, int handle) -> Tensor",
    _gather, _fake_gather, _gather_backward, _keep_gather)


# -- one product per expert -----------------------------------------------------------


# the dtypes grouped products run in as torch._grouped_mm, by device type: on CUDA what its
# meta kernel admits; any other device or dtype (float64) takes the loop. torch 2.13's CPU
# kernel takes float32 and narrower (tests/cpu/test_experts.py runs it so) but measured
# slower here than the loop (python benchmarks/moe.py --grouped: 1.19x forward)
_GROUPED_DTYPES: dict[str, tuple[torch.dtype, ...]] = {"cuda": (torch.bfloat16,)}
CPU_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _aligned(t: torch.Tensor) -> bool:
    """Whether a matrix's layout is one ``torch._grouped_mm`` reads: one of its last two
    dimensions dense, the other's stride a multiple of 16 bytes."""
    unit = 16 // t.element_size()
    rows, cols = t.stride()[-2:]
    return (cols == 1 and rows % unit == 0) or (rows == 1 and cols % unit == 0)


def grouped_kernel(*mats: torch.Tensor) -> bool:
    """Whether the grouped products of these operands run as one ``torch._grouped_mm``
    (the build has it, the device and dtype are ones it takes, each matrix is laid out as
    it reads them) rather than as a loop of ``torch.mm`` over the experts. Both give the
    same rows; the padding rows are zeros either way."""
    first = mats[0]
    return (hasattr(torch, "_grouped_mm")
            and first.dtype in _GROUPED_DTYPES.get(first.device.type, ())
            and all(m.dtype == first.dtype and _aligned(m) for m in mats))


def _by_kernel(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight[e]`` on each expert's rows by ``torch._grouped_mm`` (``weight``:
    (experts, in, out), any layout it reads), the padding rows zeroed without reading
    the offsets on the host."""
    ends = offs.to(torch.int32)
    out = torch._grouped_mm(x, weight, offs=ends)
    row = torch.arange(x.shape[0], device=x.device)
    expert = torch.bucketize(row, ends, right=True)  # len(offs) on a padding row
    if bias is not None:
        out += torch.cat([bias, bias.new_zeros((1, bias.shape[1]))])[expert]
    return out.masked_fill_((expert == offs.shape[0]).unsqueeze(1), 0)


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor,
                bias: torch.Tensor | None, transposed: bool, scale: float,
                expected: int = 0) -> torch.Tensor:
    weight = w if transposed else w.transpose(1, 2)  # (experts, in, out)
    if grouped_kernel(x, weight):
        return _by_kernel(x, weight, offs, bias)
    return grouped.grouped_mm(x, weight, offs, bias)  # Triton on CUDA, else the loop


def _fake_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor,
                     bias: torch.Tensor | None, transposed: bool, scale: float,
                     expected: int = 0) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[2] if transposed else w.shape[1]))


def _fake_weight_grad(grad: torch.Tensor, x: torch.Tensor, offs: torch.Tensor,
                      transposed: bool, scale: float, expected: int = 0) -> torch.Tensor:
    experts = offs.shape[0]
    return grad.new_empty((experts, x.shape[1], grad.shape[1]) if transposed else
                          (experts, grad.shape[1], x.shape[1]))


def _weight_grad(grad: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, transposed: bool,
                 scale: float, expected: int = 0) -> torch.Tensor:
    # each expert's (in, out) or (out, in) product of its rows, contracted over them
    a, b = (x.t(), grad) if transposed else (grad.t(), x)
    if grouped_kernel(a, b):
        out = torch._grouped_mm(a, b, offs=offs.to(torch.int32))  # an empty expert's: 0
        return out.mul_(scale) if scale != 1.0 else out
    return grouped.grouped_mm_weight(a, b, offs, scale)


def _bias_grad(grad: torch.Tensor, offs: torch.Tensor, scale: float) -> torch.Tensor:
    out = grad.new_zeros((offs.shape[0], grad.shape[1]))
    for e, start, end in grouped.expert_rows(offs):
        if end > start:
            out[e] = grad[start:end].sum(0)
    return out.mul_(scale) if scale != 1.0 else out


def _fake_bias_grad(grad: torch.Tensor, offs: torch.Tensor, scale: float) -> torch.Tensor:
    return grad.new_empty((offs.shape[0], grad.shape[1]))


grouped_mm_weight = define(
    "grouped_mm_weight(Tensor grad, Tensor x, Tensor offs, bool transposed, float scale, "
    "SymInt expected=0) -> Tensor", _weight_grad, _fake_weight_grad)
grouped_sum = define("grouped_sum(Tensor grad, Tensor offs, float scale) -> Tensor",
                     _bias_grad, _fake_bias_grad)


def _keep_product(ctx: Any, inputs: tuple, output: Any) -> None:
    x, w, offs, bias, transposed, scale, *expected = inputs
    ctx.save_for_backward(x, w, offs)
    ctx.has_bias, ctx.transposed, ctx.scale = bias is not None, transposed, scale
    ctx.expected = expected[0] if expected else 0


def _grouped_mm_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    x, w, offs = ctx.saved_tensors
    grad = grad.contiguous()
    # d(x @ w.T)/dx = grad @ w: the same product with the weight read the other way
    gx = grouped_mm(grad, w, offs, None, not ctx.transposed, 1.0, ctx.expected)
    gw = grouped_mm_weight(grad, x, offs, ctx.transposed, ctx.scale, ctx.expected)
    gb = grouped_sum(grad, offs, ctx.scale) if ctx.has_bias else None
    return gx, gw, None, gb, None, None, None


grouped_mm = define(
    "grouped_mm(Tensor x, Tensor w, Tensor offs, Tensor? bias, bool transposed, "
    "float scale, SymInt expected=0) -> Tensor", _grouped_mm, _fake_grouped_mm, _grouped_mm_backward,
    _keep_product)


# the rows even routing brings, by position: a rank's share where its rows are split
EXPECTED_ARG = {grouped_mm: 6, grouped_mm_weight: 5}
# the ops whose arguments tensor_parallel rewrites for a rank's part (:func:`local_args`)
LOCAL_ARGS = frozenset({*EXPECTED_ARG, ep_route})


# where rows an experts layer received leave it: back to their tokens, or summed into a
# weight's gradient; and the arguments of the expert ops that hold such rows
_EXITS = (ep_gather, grouped_mm_weight, grouped_sum)
_ROW_ARGS = {grouped_mm: (0,), grouped_mm_weight: (0, 1), grouped_sum: (0,), ep_gather: (0,)}


def received_rows(graph: Any, dim: str) -> set:
    """The values of ``graph`` that hold rows its experts layers received where the
    routing was each rank's own on ``dim`` (a context dimension: ``ep_scatter`` placed
    ``Shard(0)`` there, :mod:`spmd.lowering.rules.experts`): from each ``ep_scatter``
    through what is computed from them, the values saved for the backward included,
    until ``ep_gather`` or a weight's gradient. Read as a split of some whole tensor,
    they are none (each rank's rows are its own); ``tensor_parallel`` refuses to
    redistribute them."""
    def split(node: Any) -> bool:
        spec = node.meta.get("sharding")
        return not isinstance(spec, tuple) and spec is not None and spec[dim] == Shard(0)

    found = {n for n in graph.nodes if n.target is ep_scatter and split(n)}
    grew = bool(found)
    while grew:
        grew = False
        for node in graph.nodes:
            if node.op != "call_function":
                continue
            inputs = node.all_input_nodes
            if node not in found and node.target not in (*_EXITS, ep_scatter) and any(
                    a in found for a in inputs):
                found.add(node)
                grew = True
            if node.target in _ROW_ARGS:
                sideways = [node.args[k] for k in _ROW_ARGS[node.target]]
            elif node in found and node.target is not ep_scatter:
                sideways = inputs  # operands of an op on received rows: received rows
            else:
                continue
            for a in sideways:
                if hasattr(a, "meta") and a not in found and split(a) and (
                        node in found or node.target in _ROW_ARGS and any(
                            b in found for b in inputs)):
                    found.add(a)
                    grew = True
    return found


def local_args(node: Any, choices: dict[str, Any], mesh: Any) -> tuple:
    """``node``'s arguments for a rank whose rows are split along context dimensions
    (``Shard(0)`` or ``StridedShard(0, b)`` there): a grouped product's ``expected``
    rows (:func:`product_flops`) divided by the ranks they are split over, and
    ``ep_route`` told how many parts of the sequence it routes one of."""
    ranks = math.prod(mesh.size(dim) for dim, c in choices.items()
                      if getattr(c.decision.required(c.inputs)[0], "dim", None) == 0)
    if node.target is ep_route:
        return (*node.args[:2], ranks)
    k = EXPECTED_ARG[node.target]
    if len(node.args) <= k or not isinstance(node.args[k], int):
        return node.args
    return (*node.args[:k], node.args[k] // ranks, *node.args[k + 1:])


def product_flops(node: Any) -> int:
    """A grouped product's FLOPs as a plan prices them: ``2 · rows · in · out`` on the
    rows its experts receive under even routing (the ``expected`` argument: this rank's
    ``T · k``, capped by a capacity), not the static bound the graph pads to."""
    def val(a: Any) -> Any:
        return a.meta.get("val") if hasattr(a, "meta") else a

    args = list(node.args) + [node.kwargs.get("expected", 0)] * (7 - len(node.args))
    if node.target is grouped_mm:
        x, out, expected = val(args[0]), val(node), args[6]
        inner, outer = x.shape[1], out.shape[1]
    else:
        grad, x, expected = val(args[0]), val(args[1]), args[5]
        inner, outer = grad.shape[1], x.shape[1]
    rows = expected if isinstance(expected, int) and expected > 0 else x.shape[0]
    return int(2 * rows * inner * outer)


# the ops whose values follow the routing (counts, offsets, row order): the verifier's
# random values would be no routing at all (tests/graph/test_expert_rules.py checks their
# rules on real routing)
ROUTED = frozenset({ep_route, ep_scatter, ep_gather, grouped_mm, grouped_mm_weight,
                    grouped_sum})


# -- a router statistic over every data rank's tokens ---------------------------------


@dataclass(eq=False)
class MeanSpec:
    """The data ranks a statistic is averaged over (:data:`data_mean`)."""

    group: Any = None
    size: int = 1

    @property
    def communicates(self) -> bool:
        return self.group is not None and self.size > 1 and sending()


def _data_mean(x: torch.Tensor, handle: int) -> torch.Tensor:
    spec: MeanSpec = lookup(handle)
    out = x.detach().clone().contiguous()
    if spec.communicates:
        collectives.all_reduce(out, group=spec.group)
        out.div_(spec.size)
    return out


def _fake_data_mean(x: torch.Tensor, handle: int) -> torch.Tensor:
    return torch.empty_like(x)


def _data_mean_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    # each rank's share of the whole statistic passes its gradient unscaled: the data
    # dimension's average of the ranks' gradients (ddp's) then gives the whole batch's
    return grad, None


data_mean = define("data_mean(Tensor x, int handle) -> Tensor", _data_mean, _fake_data_mean,
                   _data_mean_backward)


def data_placement(target: Any, dim: str, expert_dims: Any,
                   incoming: tuple[Placement, ...] = (), inserted: bool = False
                   ) -> Placement | None:
    """The placement an op gives on data dimension ``dim`` where it is not the per-rank
    ``Varying`` every other op gives (propagation and the verifier both ask): an expert
    gradient is this rank's experts' complete gradient, ``Shard(0)`` along an
    expert-parallel dimension (``expert_dims``), and stays so through the piece a
    tensor-parallel dimension cuts of it (``tp_grad``, an alias once planned) and
    through what the planner inserted to move it along a tensor-parallel dimension
    (``inserted``: its gathers, local steps and their reshapes); a
    data-rank mean is the same on every rank. None for any other op."""
    if dim in expert_dims:
        if target in (grouped_mm_weight, grouped_sum):
            return Shard(0)
        if (target in _PIECES or inserted) and incoming and \
                all(p == Shard(0) for p in incoming):
            return Shard(0)
    if target is data_mean:
        return Replicate()
    return None


# a tensor-parallel parameter's gradient piece, before and after planning
_PIECES = (tp_grad, torch.ops.aten.alias.default)
