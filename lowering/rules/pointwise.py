"""Pointwise ops, with broadcasting: an output dimension is sharded when the inputs that
span it are sharded the same way there (a replicated input is sliced locally, free; one
broadcast along that dimension is read whole). ``Partial`` values pass through ops that
are linear in them: a sum of partial sums, a partial times a replicated factor, an
average plus a replicated value; any other op needs them reduced first.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch.fx as fx

from spmd.lowering.placements import Partial, Placement, Replicate, Shard, StridedShard
from spmd.lowering.rules.registry import Decision, op, register, shape, tensor_args

__all__ = ["broadcast_decisions", "aligned_dim"]


def aligned_dim(arg_shape: Sequence[int], out_shape: Sequence[int], out_dim: int) -> int | None:
    """The dimension of an argument broadcast to ``out_shape`` that spans output dimension
    ``out_dim``; None where the argument is broadcast along it (absent or of size 1)."""
    k = out_dim - (len(out_shape) - len(arg_shape))
    if k < 0 or (arg_shape[k] == 1 and out_shape[out_dim] != 1):
        return None
    return k


PartialCheck = Callable[[tuple[Placement, ...]], "str | None"]


def broadcast_decisions(node: fx.Node, inputs: tuple[Placement, ...], size: int,
                        keeps_partial: PartialCheck | None = None,
                        outputs: int = 1) -> list[Decision]:
    """The decisions of a broadcasting pointwise op: keep ``Partial`` where
    ``keeps_partial`` says the op is linear in these placements, shard an output
    dimension some input is sharded along (where it divides), or replicate everything."""
    out = shape(node)
    args = tensor_args(node)
    shapes = [shape(a) for a in args]
    decisions = []

    def result(p: Placement) -> Placement | tuple[Placement, ...]:
        return (p,) * outputs if outputs > 1 else p

    if keeps_partial is not None and not any(isinstance(p, (Shard, StridedShard))
                                             for p in inputs):
        reduce_op = keeps_partial(inputs)
        if reduce_op is not None:
            decisions.append(Decision(output=result(Partial(reduce_op)),
                                      reason=f"linear in its Partial({reduce_op!r}) input"))
    candidates: list[tuple[int, int]] = []  # (output dimension, blocks: 1 for Shard)
    for s, p in zip(shapes, inputs):
        if isinstance(p, (Shard, StridedShard)):
            od = p.dim + len(out) - len(s)
            blocks = p.split if isinstance(p, StridedShard) else 1
            if (od, blocks) not in candidates and out[od] % (size * blocks) == 0 \
                    and out[od] > 0:
                candidates.append((od, blocks))
    for od, blocks in candidates:
        needed = []
        for s in shapes:
            k = aligned_dim(s, out, od)
            needed.append(Replicate() if k is None else
                          StridedShard(k, blocks) if blocks > 1 else Shard(k))
        placed = StridedShard(od, blocks) if blocks > 1 else Shard(od)
        decisions.append(Decision(output=result(placed), inputs=tuple(needed),
                                  reason=f"elementwise: output dim {od} {placed!r} like its "
                                         f"inputs"))
    decisions.append(Decision(output=result(Replicate()), inputs=(Replicate(),) * len(args),
                              reason="elementwise on whole inputs"))
    return decisions


def _same_partial(inputs: tuple[Placement, ...]) -> str | None:
    """add/sub: partial sums add up, and an average plus a replicated value is the average
    of each rank's part plus that value."""
    ops = {p.reduce_op for p in inputs if isinstance(p, Partial)}
    if len(ops) != 1:
        return None
    reduce_op = ops.pop()
    if all(isinstance(p, Partial) for p in inputs):
        return reduce_op
    return reduce_op if reduce_op == "avg" else None


def _one_partial(inputs: tuple[Placement, ...]) -> str | None:
    """mul: one Partial factor, the others replicated."""
    partials = [p for p in inputs if isinstance(p, Partial)]
    if len(partials) == 1 and all(isinstance(p, (Partial, Replicate)) for p in inputs):
        return partials[0].reduce_op
    return None


def _first_partial(inputs: tuple[Placement, ...]) -> str | None:
    """Linear in the first argument (div by a replicated value, the backward of an
    activation in its incoming gradient)."""
    if inputs and isinstance(inputs[0], Partial) and all(
            isinstance(p, Replicate) for p in inputs[1:]):
        return inputs[0].reduce_op
    return None


def _rule(check: PartialCheck | None) -> Callable:
    def rule(node: fx.Node, inputs: tuple[Placement, ...], size: int) -> list[Decision]:
        return broadcast_decisions(node, inputs, size, check)
    return rule


_ADDITIVE = ["add.Tensor", "sub.Tensor"]
_MULTIPLICATIVE = ["mul.Tensor"]
_LINEAR_IN_FIRST = [
    "div.Tensor", "mul.Scalar", "div.Scalar", "neg.default", "clone.default",
    "alias.default", "detach.default", "gelu_backward.default",
    "tanh_backward.default", "sigmoid_backward.default", "silu_backward.default",
    "threshold_backward.default", "native_dropout_backward.default",
    "masked_fill.Scalar", "where.self",
    # conjugation is linear over the reals: the conjugate of a sum of parts is the sum
    # of their conjugates (complex rotary embeddings' backward conjugates the angles)
    "_conj.default", "conj_physical.default", "resolve_conj.default", "resolve_neg.default",
]
_NONLINEAR = [
    "add.Scalar", "sub.Scalar", "rsub.Scalar", "pow.Tensor_Scalar", "pow.Tensor_Tensor",
    "gelu.default", "relu.default", "tanh.default", "sigmoid.default", "silu.default",
    "exp.default", "log.default", "sqrt.default", "rsqrt.default", "reciprocal.default",
    "abs.default", "sin.default", "cos.default", "erf.default", "sign.default",
    "maximum.default", "minimum.default", "clamp.default", "clamp_min.default",
    "le.Scalar", "lt.Scalar", "ge.Scalar", "gt.Scalar", "eq.Scalar", "ne.Scalar",
    "le.Tensor", "lt.Tensor", "ge.Tensor", "gt.Tensor", "eq.Tensor", "ne.Tensor",
    "logical_not.default", "logical_and.default", "bitwise_not.default",
    "mul.Tensor_Scalar", "square.default", "masked_fill.Tensor", "leaky_relu.default",
    "elu.default", "hardtanh.default", "log1p.default", "expm1.default", "fill.Scalar",
    "rand_like.default", "randn_like.default", "bernoulli.p", "type_as.default",
    "polar.default",
]
# masked_fill/where are linear in their first value only when the filled value is zero;
# they are treated as non-linear (a Partial input is reduced first)
_LINEAR_IN_FIRST.remove("masked_fill.Scalar")
_LINEAR_IN_FIRST.remove("where.self")
_NONLINEAR += ["masked_fill.Scalar", "where.self"]


@register(*[op(n) for n in _ADDITIVE], strided=True)
def additive(node: fx.Node, inputs: tuple[Placement, ...], size: int) -> list[Decision]:
    """add/sub; a number operand (``x + 1``: one tensor argument) is a replicated value,
    added once, not once per rank's partial sum."""
    numbers = (Replicate(),) * (2 - len(inputs))
    return broadcast_decisions(node, inputs, size, lambda ps: _same_partial(ps + numbers))




register(*[op(n) for n in _MULTIPLICATIVE], strided=True)(_rule(_one_partial))
register(*[op(n) for n in _LINEAR_IN_FIRST], strided=True)(_rule(_first_partial))
register(*[op(n) for n in _NONLINEAR], strided=True)(_rule(None))


@register(op("_to_copy.default"), strided=True)
def to_copy(node: fx.Node, inputs: tuple[Placement, ...], size: int) -> list[Decision]:
    """A copy or conversion: a Partial value stays partial converted to a floating type,
    not to an integer or boolean one (the parts would round, or clamp, each on its own)."""
    floating = node.meta["val"].is_floating_point() or node.meta["val"].is_complex()
    return broadcast_decisions(node, inputs, size, _first_partial if floating else None)




@register(op("copy.default"), strided=True)
def copy(node: fx.Node, inputs: tuple[Placement, ...], size: int) -> list[Decision]:
    """``self.copy_(src)`` made functional: ``src``'s values, broadcast, in a tensor
    shaped as ``self``: elementwise (an in-place write into a slice of an activation)."""
    return broadcast_decisions(node, inputs, size)


@register(op("new_zeros.default"), op("new_ones.default"), op("new_empty.default"),
          op("new_full.default"), op("new_empty_strided.default"), strided=True)
def new(node: fx.Node, inputs: tuple[Placement, ...], size: int) -> list[Decision]:
    """A new tensor of a size written for the whole tensor (``x.new_zeros(size)``) takes
    only its dtype and device from ``x``: whole on every rank, nothing sent."""
    return [Decision(output=Replicate(), reason="values and size do not depend on the input")]


@register(op("zeros_like.default"), op("ones_like.default"), op("empty_like.default"),
          op("full_like.default"), strided=True)
def like(node: fx.Node, inputs: tuple[Placement, ...], size: int) -> list[Decision]:
    """A new tensor shaped like its input: sharded like it; a Partial input's local tensor
    is whole-shaped, so the new one is replicated, nothing sent."""
    (p,) = inputs
    if isinstance(p, (Shard, StridedShard)):
        return [Decision(output=p, reason="a new tensor shaped like its sharded input")]
    return [Decision(output=Replicate(), reason="values do not depend on the input's")]
