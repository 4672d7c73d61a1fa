"""Every tensor-parallel sharding rule checked against running its op on real shards, for
small random shapes (hypothesis), no process group.

For each op node of a small traced aten graph, each placement of its tensor arguments on
one mesh dimension (all of them, or a random sample where there are many; never all
``Replicate``, where ``propagate`` asks no rule) and each decision the rule returns: every
argument's real global value is cut into the decision's required placement
(:func:`to_locals`), the op runs on each rank's local arguments (shape arguments of
``view``/``reshape``/``expand`` rewritten to the local output shape, as the compiler does;
nothing else), and the ranks' outputs, reassembled with the decision's output placement
(:func:`from_locals`), must be the op's output on the global values.
"""

from __future__ import annotations

import itertools
import random
from typing import Callable, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.node import map_aggregate

from spmd.lowering import rules
from spmd.lowering.placements import Partial, Placement, Replicate, Shard
from spmd.lowering.redistribute import from_locals, to_locals

aten = torch.ops.aten
DTYPE = torch.float64
SIZES = st.sampled_from([2, 3])
DIMS = st.sampled_from([1, 2, 3, 4, 6])
SEEDS = st.integers(0, 2**16)
MAX_COMBOS = 12  # placement combinations tried per node; sampled beyond that

# the size argument is rewritten to the local output shape: the compiler's one rewrite
SHAPE_ARG = {aten.view.default, aten._unsafe_view.default, aten.reshape.default,
             aten.expand.default}
# values are random or undefined: only shapes are compared
SHAPES_ONLY = {aten.native_dropout.default, aten.empty_like.default, aten.rand_like.default,
               aten.randn_like.default, aten.bernoulli.p}


# -- the harness -----------------------------------------------------------------------


def trace(fn: Callable, *inputs: torch.Tensor) -> tuple[fx.GraphModule, dict[fx.Node, object]]:
    """``fn``'s aten graph (global shapes in ``meta["val"]``) and every node's real value
    on ``inputs``."""
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    values: dict[fx.Node, object] = {}

    class Record(fx.Interpreter):
        def run_node(self, n: fx.Node) -> object:
            values[n] = result = super().run_node(n)
            return result

    with torch.no_grad():
        Record(gm).run(*inputs)
    return gm, values


def options(node: fx.Node, size: int) -> list[Placement]:
    """The placements a value may have on a mesh dimension of ``size``."""
    val = node.meta["val"]
    found: list[Placement] = [Replicate()]
    found += [Shard(d) for d, n in enumerate(val.shape) if n > 0 and n % size == 0]
    if val.is_floating_point():
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


def local_shape(global_shape: Sequence[int], placement: Placement, size: int) -> list[int]:
    out = list(global_shape)
    if isinstance(placement, Shard):
        out[placement.dim] //= size
    return out


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    if not want.is_floating_point():
        return torch.equal(got, want)
    tol = 1e-6 if want.dtype == DTYPE else 1e-3
    return torch.allclose(got, want, rtol=tol, atol=tol, equal_nan=True)


def local_args(node: fx.Node, tensors: list[torch.Tensor], values: dict
               ) -> tuple[tuple, dict]:
    """The node's arguments on one rank: its tensor arguments (:func:`rules.tensor_args`
    order) replaced by ``tensors``, other nodes by their values."""
    position = iter(tensors)

    def local(x: object) -> object:
        if isinstance(x, fx.Node):
            return next(position) if isinstance(x.meta.get("val"), torch.Tensor) else values[x]
        return x

    return map_aggregate((node.args, node.kwargs), local)


def check_decision(node: fx.Node, values: dict, current: tuple[Placement, ...],
                   decision: rules.Decision, size: int, gen: torch.Generator) -> None:
    args = rules.tensor_args(node)
    required = decision.required(current)
    where = f"{node.format_node()} from {current} by {decision}"
    assert len(required) == len(args), where
    # a value kept as it is is the same local tensors at every use; redistributed, new ones
    kept: dict[fx.Node, list[torch.Tensor]] = {}
    per_arg = []
    for a, cur, req in zip(args, current, required):
        if req == cur:
            if a not in kept:
                kept[a] = to_locals(values[a], cur, size, gen)
            per_arg.append(kept[a])
        else:
            per_arg.append(to_locals(values[a], req, size, gen))

    val = node.meta["val"]
    multi = isinstance(val, (tuple, list))
    outputs = decision.output if isinstance(decision.output, tuple) else (decision.output,)
    assert len(outputs) == (len(val) if multi else 1), f"one placement per output: {where}"
    results = []
    for r in range(size):
        largs, lkwargs = local_args(node, [locals_[r] for locals_ in per_arg], values)
        if node.target in SHAPE_ARG:
            largs = (largs[0], local_shape(val.shape, outputs[0], size), *largs[2:])
        with torch.no_grad():
            out = node.target(*largs, **lkwargs)
        results.append(out if multi else (out,))

    expected = values[node] if multi else (values[node],)
    for i, (placement, want) in enumerate(zip(outputs, expected)):
        if not isinstance(want, torch.Tensor):
            continue
        pieces = [res[i] for res in results]
        for piece in pieces:
            assert list(piece.shape) == local_shape(want.shape, placement, size), \
                f"output {i} local shape {list(piece.shape)}: {where}"
        if node.target in SHAPES_ONLY:
            if isinstance(placement, Shard):
                assert from_locals(pieces, placement).shape == want.shape, where
            continue
        # replicas each compared (from_locals' exact check fails on a NaN, as in a mean
        # over no rows)
        for got in pieces if isinstance(placement, Replicate) else [
                from_locals(pieces, placement)]:
            assert got.shape == want.shape, f"output {i}: {where}"
            assert close(got, want), f"output {i} values: {where}"


def check_graph(gm: fx.GraphModule, values: dict, size: int, seed: int,
                expected_ops: Sequence[object]) -> None:
    """Check every node with a rule, under every (sampled) input placement and every
    decision; ``expected_ops`` must all be among them."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    seen = set()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        rule = rules.lookup(node.target)
        if rule is None:
            continue
        seen.add(node.target)
        args = rules.tensor_args(node)
        for current in combinations(args, size, rng):
            decisions = rule(node, current, size)
            decisions = decisions if isinstance(decisions, list) else [decisions]
            assert decisions, f"{node.format_node()}: no decision for {current}"
            for decision in decisions:
                check_decision(node, values, current, decision, size, gen)
    missing = [op for op in expected_ops if op not in seen]
    assert not missing, f"not in the traced graph (or without a rule): {missing}"


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
                aten.unbind.int(x, 1), aten.squeeze.dims(x, [0, 1]))

    gm, values = trace(fn, randn(b, t, h), randn(h, t), randn(b, 1, h))
    check_graph(gm, values, size, seed, [
        aten.view.default, aten._unsafe_view.default, aten.transpose.int, aten.permute.default,
        aten.t.default, aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim,
        aten.squeeze.default, aten.slice.Tensor, aten.select.int, aten.split.Tensor,
        aten.cat.default, aten.stack.default, aten.unbind.int, aten.squeeze.dims])
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
                torch.logsumexp(x, [0, 2]), x.var(dim=1, correction=0), x.mean())

    gm, values = trace(fn, randn(b, t, h), randn(b, t, h))
    check_graph(gm, values, size, seed, [
        aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.amax.default,
        aten._softmax.default, aten._log_softmax.default, aten._softmax_backward_data.default,
        aten._log_softmax_backward_data.default, aten.max.dim, aten.argmax.default,
        aten.logsumexp.default, aten.var.correction, aten.mean.default])


def test_reductions_over_other_dims_keep_the_shards():
    """Not only valid but kept: a reduction that names its dimensions (``amax`` takes a
    list) keeps a shard along another one, nothing gathered."""
    gm, _ = trace(lambda x: (x.amax(-1, keepdim=True), x.amax([1]), x.sum([1]), x.max(1)),
                  randn(4, 6))
    for node in gm.graph.nodes:
        if node.op == "call_function" and rules.lookup(node.target):
            outputs = [d.output for d in rules.lookup(node.target)(node, (Shard(0),), 2)]
            assert Shard(0) in outputs or (Shard(0), Shard(0)) in outputs, node.format_node()


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


MASKS = st.sampled_from([None, "2d", "4d", "heads"])


@settings(max_examples=10, deadline=None)
@given(size=SIZES, b=DIMS, nh=DIMS, seq=DIMS, kv=DIMS, e=st.sampled_from([1, 2, 4]),
       mask=MASKS, causal=st.booleans(), seed=SEEDS)
def test_attention(size, b, nh, seq, kv, e, mask, causal, seed):
    torch.manual_seed(seed)
    shapes = {None: None, "2d": (seq, kv), "4d": (b, nh, seq, kv), "heads": (1, nh, seq, kv)}
    m = None if mask is None else randn(*shapes[mask])
    causal = causal and m is None

    def fn(q, k, v, g, m):
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=m)
        grads = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            g, q, k, v, out, lse, 0.0, causal, attn_mask=m)
        return out, lse, grads

    q, g = randn(b, nh, seq, e), randn(b, nh, seq, e)
    k, v = randn(b, nh, kv, e), randn(b, nh, kv, e)  # keys and values of another length
    gm, values = trace(fn, q, k, v, g, m)
    check_graph(gm, values, size, seed, [
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default])


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
