"""Every tensor-parallel sharding rule checked against running its op on real shards, for
small random shapes (hypothesis), no process group.

For each op node of a small traced aten graph, each placement of its tensor arguments on
one mesh dimension (all of them, or a random sample where there are many; never all
``Replicate``, where ``propagate`` asks no rule) and each decision the rule returns: every
argument's real global value is cut into the decision's required placement, the op runs
on each rank's local arguments (the size arguments of ``rules.SHAPE_ARG`` rewritten to the
local output shape, as the compiler does; nothing else), and the ranks' outputs,
reassembled with the decision's output placement, must be the op's output on the global
values: :func:`spmd.lowering.rule_check.on_shards`, which the plan verifier runs on every
planned graph's own shapes. An op with no CPU kernel runs as torch's decomposition of it
(:data:`ON_CPU`).
"""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace
from typing import Callable, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch._decomp import decomposition_table
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from spmd.lowering import ranked, rules
from spmd.lowering.placements import Partial, Placement, Replicate, Shard
from spmd.lowering.rule_check import on_shards

aten = torch.ops.aten
DTYPE = torch.float64
SIZES = st.sampled_from([2, 3])
DIMS = st.sampled_from([1, 2, 3, 4, 6])
SEEDS = st.integers(0, 2**16)
MAX_COMBOS = 12  # placement combinations tried per node; sampled beyond that

# ops with no CPU kernel (CUDA's), run here by torch's own decomposition of them
ON_CPU = {aten._fused_rms_norm_backward.default:
          decomposition_table[aten._fused_rms_norm_backward.default]}


# -- the harness -----------------------------------------------------------------------


def trace(fn: Callable, *inputs: torch.Tensor) -> tuple[fx.GraphModule, dict[fx.Node, object]]:
    """``fn``'s aten graph (global shapes in ``meta["val"]``) and every node's real value
    on ``inputs``."""
    return _record(make_fx(fn, tracing_mode="fake")(*inputs), inputs)


def trace_as_written(fn: Callable, *inputs: torch.Tensor
                     ) -> tuple[fx.GraphModule, dict[fx.Node, object]]:
    """:func:`trace` keeping the aten ops ``fn`` calls as they are: ops that make_fx
    decomposes on CPU (``_fused_rms_norm``, CUDA's kernel) stay one node."""
    gm = fx.symbolic_trace(fn)
    FakeTensorProp(gm).propagate(*inputs)
    return _record(gm, inputs)


def _record(gm: fx.GraphModule, inputs: Sequence[torch.Tensor]
            ) -> tuple[fx.GraphModule, dict[fx.Node, object]]:
    values: dict[fx.Node, object] = {}

    class Record(fx.Interpreter):
        def run_node(self, n: fx.Node) -> object:
            values[n] = result = super().run_node(n)
            return result

        def call_function(self, target, args, kwargs) -> object:
            return super().call_function(ON_CPU.get(target, target), args, kwargs)

    with torch.no_grad():
        Record(gm).run(*inputs)
    return gm, values


def options(node: fx.Node, size: int) -> list[Placement]:
    """The placements a value may have on a mesh dimension of ``size``."""
    val = node.meta["val"]
    found: list[Placement] = [Replicate()]
    found += [Shard(d) for d, n in enumerate(val.shape) if n > 0 and n % size == 0]
    if val.is_floating_point() or val.is_complex():
        found += [Partial("sum"), Partial("avg")]
    return found


def combinations(args: Sequence[fx.Node], size: int, rng: random.Random
                 ) -> list[tuple[Placement, ...]]:
    """Input placements to try: one per distinct argument (a repeated argument is one value
    with one placement), never all replicated; a random sample where there are many."""
    distinct = list(dict.fromkeys(args))
    every = [c for c in itertools.product(*(options(a, size) for a in distinct))
             if not all(isinstance(p, Replicate) for p in c)]
    if len(every) > MAX_COMBOS:
        every = rng.sample(every, MAX_COMBOS)
    return [tuple(dict(zip(distinct, c))[a] for a in args) for c in every]


def check_decision(node: fx.Node, values: dict, current: tuple[Placement, ...],
                   decision: rules.Decision, size: int, gen: torch.Generator) -> None:
    """The decision run on real shards of the traced values
    (:func:`spmd.lowering.rule_check.on_shards`, what the plan verifier runs too)."""
    rank_op = None
    entry = None
    if decision.ranked is not None:  # each rank runs its own part (a vocabulary range)
        entry = ranked.RANKED[decision.ranked]

        def ranks_part(r):
            def run(*a, **k):  # the node's arguments, as values -> the op's
                node_values = SimpleNamespace(args=a, kwargs=k, target=node.target,
                                              meta=node.meta)
                return entry.local(r, size, *entry.args(node_values))
            return run
        rank_op = ranks_part
    verdict = on_shards(node, [values[a] for a in rules.tensor_args(node)],
                        decision.required(current), decision.output, size, gen,
                        others=values, op=ON_CPU.get(node.target), rank_op=rank_op,
                        peers=entry is not None and entry.peers)
    assert verdict is None, f"{node.format_node()} from {current} by {decision}: {verdict}"


def check_graph(gm: fx.GraphModule, values: dict, size: int, seed: int,
                expected_ops: Sequence[object]) -> None:
    """Check every node with a rule, under every (sampled) input placement and every
    decision; ``expected_ops`` must all be among them, each with a decision checked where
    it has a floating-point argument (which can always be ``Partial``; an integer one, as
    ``repeat_interleave``'s counts, may have no dimension the mesh divides)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    seen = set()
    checked: set = set()  # ops with at least one decision run on real shards
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        rule = rules.lookup(node.target)
        if rule is None:
            continue
        seen.add(node.target)
        args = rules.tensor_args(node)
        for current in combinations(args, size, rng):
            decisions = (rule(node, current, size, "tp") if rules.traits(node.target).wants_dim
                         else rule(node, current, size))
            decisions = decisions if isinstance(decisions, list) else [decisions]
            assert decisions, f"{node.format_node()}: no decision for {current}"
            for decision in decisions:
                check_decision(node, values, current, decision, size, gen)
            checked.add(node.target)
    missing = [op for op in expected_ops if op not in seen]
    assert not missing, f"not in the traced graph (or without a rule): {missing}"
    floating = {n.target for n in gm.graph.nodes if n.op == "call_function"
                and any(a.meta["val"].is_floating_point() for a in rules.tensor_args(n))}
    unchecked = [op for op in expected_ops if op in floating and op not in checked]
    assert checked and not unchecked, f"no input placement tried: {unchecked or 'any op'}"


def randn(*shape: int, grad: bool = False) -> torch.Tensor:
    return torch.randn(*shape, dtype=DTYPE, requires_grad=grad)


# -- one test per family ---------------------------------------------------------------


@settings(max_examples=12, deadline=None)
@given(size=SIZES, b=DIMS, t=DIMS, h=DIMS, seed=SEEDS)
def test_pointwise(size, b, t, h, seed):
    torch.manual_seed(seed)

    def fn(x, y, bias, col, mask):
        r = torch.relu(x + bias)
        g = F.gelu(x * bias - y)
        out = [x + y, x - 1.0, (x + 1.0) * 2.0, x * y, col * x, x / (bias.abs() + 1.0),
               torch.tanh(y) / 2.0, torch.where(mask, x, y), x.masked_fill(mask, 0.0),
               aten.threshold_backward(y, r, 0.0), aten.gelu_backward(y, x),
               x.to(torch.float32), x.to(torch.int32), x.clone(), torch.zeros_like(x),
               torch.ones_like(g) + g, torch.full_like(x, 2.0), torch.empty_like(x),
               torch.sigmoid(x).exp(), torch.maximum(x, y), (x > 0) & mask, -x.pow(2),
               aten.silu_backward(y, x), aten.native_dropout_backward(y, mask, 2.0),
               x * x, y + y]  # one value twice
        return out

    gm, values = trace(fn, randn(b, t, h), randn(b, t, h), randn(h), randn(t, 1),
                       torch.rand(b, t, h) > 0.5)
    check_graph(gm, values, size, seed, [
        aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.gelu.default,
        aten.relu.default, aten.threshold_backward.default, aten.gelu_backward.default,
        aten.tanh.default, aten.where.self, aten.masked_fill.Scalar, aten._to_copy.default,
        aten.clone.default, aten.zeros_like.default, aten.ones_like.default,
        aten.full_like.default, aten.empty_like.default, aten.silu_backward.default,
        aten.native_dropout_backward.default, aten.maximum.default, aten.pow.Tensor_Scalar])


@settings(max_examples=15, deadline=None)
@given(size=SIZES, m=DIMS, k=DIMS, n=DIMS, batch=DIMS, seed=SEEDS)
def test_matmul(size, m, k, n, batch, seed):
    torch.manual_seed(seed)

    def fn(a, w, bias, bias2, x, y):
        return (a @ w, aten.addmm(bias, a, w), aten.addmm(bias2, a, w, beta=0.5, alpha=2.0),
                x @ y, aten.baddbmm(bias, x, y), aten.baddbmm(bias2, x, y))

    gm, values = trace(fn, randn(m, k), randn(k, n), randn(n), randn(m, n), randn(batch, m, k),
                       randn(batch, k, n))
    check_graph(gm, values, size, seed, [aten.mm.default, aten.addmm.default, aten.bmm.default,
                                         aten.baddbmm.default])


@settings(max_examples=12, deadline=None)
@given(size=SIZES, b=DIMS, t=DIMS, nh=DIMS, hd=DIMS, seed=SEEDS)
def test_views(size, b, t, nh, hd, seed):
    torch.manual_seed(seed)
    h = nh * hd

    def fn(x, w, row):
        heads = x.view(b, t, nh, hd).transpose(1, 2)           # [B, nh, T, hd]
        back = heads.permute(0, 2, 1, 3).reshape(b, t, h)       # and back
        flat = aten._unsafe_view(x, [b * t, h])                 # merge
        parts = flat.split(hd, dim=-1)
        sizes = flat.split_with_sizes([h - hd, hd], dim=1) if nh > 1 else (flat,)
        return (heads, back, flat, w.t(), row.expand(b, t, h), x.unsqueeze(1),
                row.squeeze(1), aten.squeeze.dim(x, 0), aten.squeeze.default(x),
                x[:, 1:], x[:, :, :hd], x.select(1, 0), *parts, *sizes,
                torch.cat([x, x * 2.0], dim=1), torch.cat([x, back], dim=-1),
                torch.stack([x, back], dim=1), torch.stack([x, back]), x.chunk(2, dim=-1),
                aten.unbind.int(x, 1), aten.squeeze.dims(x, [0, 1]),
                F.pad(x, (1, 2)), F.pad(x, (0, 0, 2, 0), value=1.0),
                aten.slice_backward(x, [b, t + 2, h], 1, 1, t + 1, 1),
                aten.select_backward(x, [b, 3, t, h], 1, 2),
                aten.slice_scatter(torch.cat([x, x], 1), x * 3.0, 1, t, 2 * t),
                aten.slice_scatter(torch.zeros(b, t + 2, h, dtype=x.dtype), x, 1, 1, t + 1),
                aten.select_scatter(torch.stack([x, back], 1), back, 1, 0))

    gm, values = trace(fn, randn(b, t, h), randn(h, t), randn(b, 1, h))
    check_graph(gm, values, size, seed, [
        aten.view.default, aten._unsafe_view.default, aten.transpose.int, aten.permute.default,
        aten.t.default, aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim,
        aten.squeeze.default, aten.slice.Tensor, aten.select.int, aten.split.Tensor,
        aten.cat.default, aten.stack.default, aten.unbind.int, aten.squeeze.dims,
        aten.constant_pad_nd.default, aten.slice_backward.default,
        aten.select_backward.default, aten.slice_scatter.default,
        aten.select_scatter.default])
    assert nh == 1 or aten.split_with_sizes.default in {n.target for n in gm.graph.nodes}


@settings(max_examples=12, deadline=None)
@given(size=SIZES, b=DIMS, t=DIMS, h=DIMS, seed=SEEDS)
def test_reductions(size, b, t, h, seed):
    torch.manual_seed(seed)

    def fn(x, g):
        sm = aten._softmax(x, -1, False)
        lsm = aten._log_softmax(x, 1, False)
        return (x.sum(dim=[0, 2]), x.sum(dim=-1, keepdim=True), x.sum(), x.mean(dim=1),
                x.mean(dim=[0, 1], keepdim=True), x.amax(-1, keepdim=True), x.amax(dim=[0, 1]),
                sm, lsm, aten._softmax_backward_data(g, sm, -1, DTYPE),
                aten._log_softmax_backward_data(g, lsm, 1, DTYPE), x.max(dim=1), x.argmax(-1),
                torch.logsumexp(x, [0, 2]), x.var(dim=1, correction=0), x.mean(),
                aten._safe_softmax(x, 1))

    gm, values = trace(fn, randn(b, t, h), randn(b, t, h))
    check_graph(gm, values, size, seed, [
        aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.amax.default,
        aten._softmax.default, aten._log_softmax.default, aten._softmax_backward_data.default,
        aten._log_softmax_backward_data.default, aten.max.dim, aten.argmax.default,
        aten.logsumexp.default, aten.var.correction, aten.mean.default,
        aten._safe_softmax.default])


def test_reductions_over_other_dims_keep_the_shards():
    """Not only valid but kept: a reduction that names its dimensions (``amax`` takes a
    list) keeps a shard along another one, nothing gathered."""
    gm, _ = trace(lambda x: (x.amax(-1, keepdim=True), x.amax([1]), x.sum([1]), x.max(1)),
                  randn(4, 6))
    checked = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and rules.lookup(node.target):
            outputs = [d.output for d in rules.lookup(node.target)(node, (Shard(0),), 2)]
            assert Shard(0) in outputs or (Shard(0), Shard(0)) in outputs, node.format_node()
            checked.append(node.target)
    assert sorted(map(str, checked)) == sorted(map(str, [
        aten.amax.default, aten.amax.default, aten.sum.dim_IntList, aten.max.dim])), checked


@settings(max_examples=10, deadline=None)
@given(size=SIZES, b=DIMS, t=DIMS, h=DIMS, seed=SEEDS)
def test_norms(size, b, t, h, seed):
    torch.manual_seed(seed)

    def fn(x, w, bias, g):
        y = F.layer_norm(x, (h,), w, bias)
        z = F.layer_norm(x, (t, h))
        return y, z, torch.autograd.grad([y, z], [x, w, bias], [g, g])

    gm, values = trace(fn, randn(b, t, h, grad=True), randn(h, grad=True),
                       randn(h, grad=True), randn(b, t, h))
    check_graph(gm, values, size, seed, [aten.native_layer_norm.default,
                                         aten.native_layer_norm_backward.default])


@settings(max_examples=10, deadline=None)
@given(size=SIZES, b=DIMS, t=DIMS, h=DIMS, weight=st.booleans(), seed=SEEDS)
def test_fused_rms_norm(size, b, t, h, weight, seed):
    """``_fused_rms_norm`` and its backward (what ``F.rms_norm`` and ``nn.RMSNorm`` become
    on CUDA; on CPU they decompose into pow, mean, rsqrt and mul), over the last one or
    two dimensions, with and without a weight."""
    torch.manual_seed(seed)

    def fn(x, w, w2, g):
        w, w2 = (w, w2) if weight else (None, None)
        norm, backward = aten._fused_rms_norm.default, aten._fused_rms_norm_backward.default
        y, rstd = norm(x, [h], w, 1e-6)
        z, rstd2 = norm(x, [t, h], w2, None)
        return (y, rstd, z, rstd2, backward(g, x, [h], rstd, w, [True, weight]),
                backward(g, x, [t, h], rstd2, w2, [True, weight]))

    gm, values = trace_as_written(fn, randn(b, t, h), randn(h), randn(t, h), randn(b, t, h))
    check_graph(gm, values, size, seed, [aten._fused_rms_norm.default,
                                         aten._fused_rms_norm_backward.default])


@settings(max_examples=12, deadline=None)
@given(size=SIZES, b=DIMS, t=DIMS, e=DIMS, vocab=st.integers(1, 7), seed=SEEDS)
def test_embedding(size, b, t, e, vocab, seed):
    torch.manual_seed(seed)

    def fn(table, idx, g):
        out = F.embedding(idx, table)
        (grad,) = torch.autograd.grad(out, [table], g)
        by_freq = aten.embedding_dense_backward(g, idx, vocab, -1, True)
        return out, grad, by_freq

    gm, values = trace(fn, randn(vocab, e, grad=True), torch.randint(0, vocab, (b, t)),
                       randn(b, t, e))
    check_graph(gm, values, size, seed, [aten.embedding.default,
                                         aten.embedding_dense_backward.default])


@settings(max_examples=8, deadline=None)
@given(size=SIZES, b=DIMS, h=DIMS, seed=SEEDS)
def test_dropout(size, b, h, seed):
    torch.manual_seed(seed)

    def fn(x):
        return aten.native_dropout(x, 0.5, True), aten.native_dropout(x.t(), 0.0, False)

    gm, values = trace(fn, randn(b, h))
    check_graph(gm, values, size, seed, [aten.native_dropout.default])


@settings(max_examples=8, deadline=None)
@given(size=SIZES, n=DIMS, c=DIMS, seed=SEEDS)
def test_losses(size, n, c, seed):
    torch.manual_seed(seed)
    target = torch.randint(0, c, (n,))
    target[0] = -100 if n > 1 else target[0]  # one ignored row

    def fn(logits, target, w):
        mean = F.cross_entropy(logits, target)
        total = F.cross_entropy(logits, target, weight=w, reduction="sum")
        mse = F.mse_loss(logits, w.expand(n, c))
        return mean, total, mse, torch.autograd.grad(mean + total + mse, [logits])

    gm, values = trace(fn, randn(n, c, grad=True), target, torch.rand(c, dtype=DTYPE))
    check_graph(gm, values, size, seed, [aten.nll_loss_forward.default,
                                         aten.nll_loss_backward.default,
                                         aten.mse_loss.default, aten.mse_loss_backward.default])


@settings(max_examples=10, deadline=None)
@given(size=SIZES, b=DIMS, t=DIMS, nh=DIMS, pairs=st.sampled_from([1, 2, 3]), seed=SEEDS)
def test_complex_rotary(size, b, t, nh, pairs, seed):
    """LLaMA's complex rotary embeddings: ``view_as_complex`` of the heads' pairs, times
    ``freqs_cis`` (``polar``) broadcast over batch and heads, ``view_as_real`` and a
    flatten back; the backward conjugates the angles (``_conj``)."""
    torch.manual_seed(seed)

    def fn(x, radius, angle, g):
        cis = torch.polar(radius, angle)                        # [T, pairs] complex
        z = torch.view_as_complex(x.reshape(b, t, nh, pairs, 2))
        out = torch.view_as_real(z * cis[:, None]).flatten(3)
        (grad,) = torch.autograd.grad(out, [x], g)
        return out, grad, torch.view_as_real(z), z * z

    gm, values = trace(fn, randn(b, t, nh, 2 * pairs, grad=True), randn(t, pairs).abs(),
                       randn(t, pairs), randn(b, t, nh, 2 * pairs))
    check_graph(gm, values, size, seed, [
        aten.view_as_complex.default, aten.view_as_real.default, aten.polar.default,
        aten.mul.Tensor, aten._conj.default])


def test_complex_views_keep_shards_off_the_pair():
    gm, _ = trace(lambda x: torch.view_as_real(torch.view_as_complex(x)), randn(4, 6, 2))
    as_complex, as_real = [n for n in gm.graph.nodes if n.op == "call_function"]
    rule = rules.lookup(as_complex.target)
    assert [d.output for d in rule(as_complex, (Shard(1),), 2)] == [Shard(1)]
    assert [d.output for d in rule(as_complex, (Partial("sum"),), 2)] == [Partial("sum")]
    assert [d.inputs for d in rule(as_complex, (Shard(2),), 2)] == [(Replicate(),)]
    assert [d.output for d in rule(as_real, (Shard(1),), 2)] == [Shard(1)]


@settings(max_examples=10, deadline=None)
@given(size=SIZES, b=DIMS, kv=DIMS, group=st.sampled_from([1, 2, 3]), e=DIMS, seed=SEEDS)
def test_index_select_and_add(size, b, kv, group, e, seed):
    """``repeat_interleave`` with a tensor of counts: ``repeat_interleave.Tensor`` makes
    the indices, ``index_select`` repeats, and its backward adds the rows back into
    ``new_zeros`` with ``index_add``."""
    torch.manual_seed(seed)

    def fn(x, counts, along_e, along_kv, g):
        rep = x.repeat_interleave(counts, dim=1, output_size=kv * group)
        (grad,) = torch.autograd.grad(rep, [x], g)
        return (rep, grad, aten.index_select(x, -1, along_e),
                aten.index_add(x, 2, along_e, x * 2.0),
                aten.index_add(x, 1, along_kv, x, alpha=0.5), x.new_ones([2, e]))

    counts = torch.full((kv,), group)
    gm, values = trace(fn, randn(b, kv, e, grad=True), counts, torch.randint(0, e, (e,)),
                       torch.randint(0, kv, (kv,)), randn(b, kv * group, e))
    check_graph(gm, values, size, seed, [
        aten.repeat_interleave.Tensor, aten.index_select.default, aten.index_add.default,
        aten.new_zeros.default, aten.new_ones.default])


@settings(max_examples=8, deadline=None)
@given(size=SIZES, b=DIMS, t=DIMS, kv=st.sampled_from([1, 2, 3]), group=st.sampled_from(
       [1, 2]), half=st.sampled_from([1, 2]), seed=SEEDS)
def test_llama_block_ops(size, b, t, kv, group, half, seed):
    """The rest of a LLaMA block, forward and backward: RMSNorm by hand (pow, mean with
    keepdim, rsqrt), rotate-half rotary embeddings (chunk, neg, cat), key/value heads
    repeated by ``repeat_interleave(int)`` and by ``expand`` + ``reshape``, SwiGLU (silu
    times a linear)."""
    torch.manual_seed(seed)
    nh, hd = kv * group, 2 * half

    def fn(x, w, k, cos, sin, up, gate, g):
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
        x1, x2 = k.chunk(2, dim=-1)
        rotated = k * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]
        heads = rotated.transpose(1, 2)                                  # [B, kv, T, hd]
        repeated = heads.repeat_interleave(group, dim=1)
        expanded = heads[:, :, None].expand(b, kv, group, t, hd).reshape(b, nh, t, hd)
        swiglu = F.silu(normed @ gate) * (normed @ up)
        outs = (normed, repeated, expanded, swiglu)
        grads = torch.autograd.grad(outs, [x, w, k, up, gate], [g, *map(torch.ones_like,
                                                                         outs[1:])])
        return outs, grads

    gm, values = trace(fn, randn(b, t, hd, grad=True), randn(hd, grad=True),
                       randn(b, t, kv, hd, grad=True), randn(t, hd), randn(t, hd),
                       randn(hd, 2 * hd, grad=True), randn(hd, 2 * hd, grad=True),
                       randn(b, t, hd))
    check_graph(gm, values, size, seed, [
        aten.pow.Tensor_Scalar, aten.mean.dim, aten.rsqrt.default, aten.add.Tensor,
        aten.split.Tensor, aten.neg.default, aten.cat.default, aten.expand.default,
        aten.clone.default, aten.silu.default, aten.silu_backward.default, aten.mul.Tensor])


MASKS = st.sampled_from([None, "2d", "4d", "heads"])


def _check_attention(size: int, seed: int, q, k, v, g, m, causal: bool) -> torch.Tensor:
    """The CPU attention kernels, forward and backward, traced on these values and their
    rule checked on real shards; the forward's output."""
    def fn(q, k, v, g, m):
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=m)
        grads = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            g, q, k, v, out, lse, 0.0, causal, attn_mask=m)
        return out, lse, grads

    gm, values = trace(fn, q, k, v, g, m)
    check_graph(gm, values, size, seed, [
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default])
    return values[next(n for n in gm.graph.nodes if n.op == "output").args[0][0]]


@settings(max_examples=10, deadline=None)
@given(size=SIZES, b=DIMS, nh=DIMS, seq=DIMS, kv=DIMS, e=st.sampled_from([1, 2, 4]),
       mask=MASKS, causal=st.booleans(), seed=SEEDS)
def test_attention(size, b, nh, seq, kv, e, mask, causal, seed):
    torch.manual_seed(seed)
    shapes = {None: None, "2d": (seq, kv), "4d": (b, nh, seq, kv), "heads": (1, nh, seq, kv)}
    m = None if mask is None else randn(*shapes[mask])
    causal = causal and m is None

    q, g = randn(b, nh, seq, e), randn(b, nh, seq, e)
    k, v = randn(b, nh, kv, e), randn(b, nh, kv, e)  # keys and values of another length
    _check_attention(size, seed, q, k, v, g, m, causal)


@settings(max_examples=10, deadline=None)
@given(size=SIZES, b=DIMS, kv_heads=st.sampled_from([1, 2, 3, 4, 6]), group=st.sampled_from(
       [2, 3]), seq=DIMS, e=st.sampled_from([1, 2, 4]), mask=MASKS, causal=st.booleans(),
       seed=SEEDS)
def test_grouped_query_attention(size, b, kv_heads, group, seq, e, mask, causal, seed):
    """``enable_gqa=True`` traces to the same kernels with fewer key/value heads than query
    heads (no flag in the graph): sharding the queries along heads must shard keys and
    values on their own head count, or leave a single key/value head whole."""
    torch.manual_seed(seed)
    nh = kv_heads * group
    shapes = {None: None, "2d": (seq, seq), "4d": (b, nh, seq, seq), "heads": (1, nh, seq, seq)}
    m = None if mask is None else randn(*shapes[mask])
    causal = causal and m is None

    q, g = randn(b, nh, seq, e), randn(b, nh, seq, e)
    k, v = randn(b, kv_heads, seq, e), randn(b, kv_heads, seq, e)
    got = _check_attention(size, seed, q, k, v, g, m, causal)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal,
                                          enable_gqa=True)
    assert torch.allclose(got, want, rtol=1e-9, atol=1e-9)


def test_enable_gqa_traces_to_the_kernels_with_fewer_key_heads():
    """What ``enable_gqa`` leaves in an aten graph (torch 2.13, CPU): the fused kernel and
    its backward, keys and values with their own head count, no flag among the arguments;
    and the heads decision shards both, each on its own count."""
    def fn(q, k, v):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return torch.autograd.grad(out, [q, k, v], torch.ones_like(out))

    gm, _ = trace(fn, randn(2, 4, 8, 4, grad=True), randn(2, 2, 8, 4, grad=True),
                  randn(2, 2, 8, 4, grad=True))
    found = {n.target: n for n in gm.graph.nodes if n.op == "call_function"}
    forward = found[aten._scaled_dot_product_flash_attention_for_cpu.default]
    backward = found[aten._scaled_dot_product_flash_attention_for_cpu_backward.default]
    assert [rules.shape(a)[1] for a in rules.tensor_args(forward)] == [4, 2, 2]
    assert forward.args[3:] == (0.0, True) and not forward.kwargs  # dropout_p, is_causal
    assert "enable_gqa" not in [a.name for a in forward.target._schema.arguments]
    heads = rules.lookup(forward.target)(forward, (Shard(1), Replicate(), Replicate()), 2)[0]
    assert heads.inputs == (Shard(1), Shard(1), Shard(1)), heads
    heads = rules.lookup(backward.target)(backward, (Shard(1),) * 6, 2)[0]
    assert heads.output == (Shard(1), Shard(1), Shard(1)), heads
    # 2 key/value heads do not divide over 4 ranks: nothing pairs the heads there; the
    # sequence (8 positions) does: ring attention, each rank its 2 positions of each
    found = rules.lookup(forward.target)(forward, (Shard(1),) * 3, 4)
    assert all(d.inputs[1] == Replicate() and d.inputs[0] != Shard(1)
               for d in found if d.ranked is None)
    assert [d.inputs for d in found if d.ranked is not None] == [(Shard(2),) * 3]


def test_every_family_registers_rules():
    # aten ops only: spmd's own (tp_param, tp_grad) register in tensor_parallel
    families = {t: f for t, f in rules.registered().items() if f != "tensor_parallel"}
    assert set(families.values()) == set(rules.FAMILIES)
    for target, family in families.items():
        assert rules.lookup(target) is not None
        assert family in rules.FAMILIES, target
    one_each = {aten.add.Tensor: "pointwise", aten.mm.default: "matmul",
                aten.view.default: "views", aten.sum.dim_IntList: "reductions",
                aten.native_layer_norm.default: "norms", aten.embedding.default: "embedding",
                aten.native_dropout.default: "dropout", aten.nll_loss_forward.default: "losses",
                aten._scaled_dot_product_flash_attention_for_cpu.default: "attention"}
    assert {t: families.get(t) for t in one_each} == one_each
