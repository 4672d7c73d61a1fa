"""A sharding decision checked on real shards: run an op on the whole inputs, and on each
rank's pieces as a decision places them, and compare.

    verdict = on_shards(node, [q, k, v], required, output, size=2, generator=g)

Every argument's global value is cut into the placement the decision requires
(:func:`~spmd.lowering.redistribute.to_locals`: a ``Partial`` into random parts that
reduce back to it), the op runs on each rank's local arguments (the size argument of
``view``/``reshape``/``expand`` rewritten to the local output shape, the compiler's one
rewrite), and the ranks' outputs, put back together with the decision's output placement
(:func:`~spmd.lowering.redistribute.from_locals`), must equal the op on the global
values. The plan verifier (``spmd.lowering.verify``) runs this on the graph's own shapes;
the rule tests (``tests/graph/test_tp_rules.py``) on random ones.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch.fx.node import map_aggregate

from spmd.lowering import rules
from spmd.lowering.placements import Placement, Replicate, divides
from spmd.lowering.redistribute import from_locals, to_locals

__all__ = ["on_shards", "run_op", "random_like", "is_random", "local_shape"]

aten = torch.ops.aten

# values are undefined: only shapes are compared
_SHAPES_ONLY = frozenset({aten.empty_like.default, aten.empty.memory_format,
                          aten.new_empty.default, aten.new_empty_strided.default})


def is_random(node: fx.Node) -> bool:
    """Whether ``node`` draws random numbers (its values then cannot be compared): an op
    torch tags as seeded, unless its dropout probability is 0 or it runs in eval mode (the
    attention kernels carry a ``dropout_p`` they are traced with at 0), or one whose
    values are undefined (``empty_like``)."""
    target = node.target
    if target in _SHAPES_ONLY:
        return True
    if torch.Tag.nondeterministic_seeded not in getattr(target, "tags", ()):
        return False
    schema = getattr(target, "_schema", None)
    if schema is None:
        return True
    given = dict(node.kwargs)
    for k, arg in enumerate(schema.arguments):
        if k < len(node.args):
            given[arg.name] = node.args[k]
        elif arg.name not in given and arg.has_default_value():
            given[arg.name] = arg.default_value
    if given.get("train") is False:
        return False
    p = given.get("dropout_p", given.get("p"))
    return not (isinstance(p, (int, float)) and p == 0)


def local_shape(global_shape: Sequence[int], placement: Placement, size: int) -> list[int]:
    out = list(global_shape)
    if divides(placement):
        out[placement.dim] //= size
    return out


def random_like(shape: Sequence[int], dtype: torch.dtype, generator: torch.Generator
                ) -> torch.Tensor:
    """A random CPU tensor of ``shape`` for checking an op: floating values in float64
    (complex in complex128) so that a difference is a wrong rule, not rounding; integers
    0 or 1 (valid indices into any dimension an op indexes); booleans at random."""
    shape = [int(s) for s in shape]
    if dtype.is_complex:
        return torch.randn(shape, dtype=torch.complex128, generator=generator)
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=torch.float64, generator=generator)
    if dtype == torch.bool:
        return torch.rand(shape, generator=generator) > 0.5
    return torch.randint(0, 2, shape, dtype=dtype, generator=generator)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    if not (want.is_floating_point() or want.is_complex()):
        return torch.equal(got, want)
    tol = 1e-6 if want.dtype in (torch.float64, torch.complex128) else 1e-3
    return torch.allclose(got, want, rtol=tol, atol=tol, equal_nan=True)


def run_op(node: fx.Node, tensors: Sequence[torch.Tensor], others: dict[fx.Node, Any],
          shape: list[int] | None, op: Callable[..., Any] | None = None) -> Any:
    """``node``'s op on ``tensors`` (its :func:`rules.tensor_args`, in order), other node
    arguments by their values, the size argument of a reshape replaced by ``shape``."""
    position = iter(tensors)

    def value(x: Any) -> Any:
        if isinstance(x, fx.Node):
            return next(position) if isinstance(x.meta.get("val"), torch.Tensor) else others[x]
        return x

    args, kwargs = map_aggregate((node.args, node.kwargs), value)
    if shape is not None and node.target in rules.SHAPE_ARG:
        args = (args[0], shape, *args[2:])
    if shape is not None and node.target in rules.ROWS_ARG:
        k = rules.ROWS_ARG[node.target]
        args = (*args[:k], shape[0], *args[k + 1:])
    with torch.no_grad():
        return (op or node.target)(*args, **kwargs)


def on_shards(node: fx.Node, tensors: Sequence[torch.Tensor],
              required: Sequence[Placement], output: Placement | tuple[Placement, ...],
              size: int, generator: torch.Generator, others: dict[fx.Node, Any] | None = None,
              global_shape: list[int] | None = None,
              op: Callable[..., Any] | None = None,
              rank_op: Callable[[int], Callable[..., Any]] | None = None,
              peers: bool = False) -> str | None:
    """Whether running ``node``'s op on each of ``size`` ranks' pieces, the inputs placed as
    ``required`` and the output read as ``output``, gives the op's result on the whole
    ``tensors``; None when it does, else what differs.

    Args:
        node: the op (its target, non-tensor arguments and output count are used).
        tensors: the global value of each of its tensor arguments (:func:`rules.
            tensor_args` order; a repeated argument repeats its value).
        required: the placement each argument has on the ranks.
        output: the output's placement (a tuple for several outputs).
        size: ranks along the mesh dimension.
        generator: for the random parts of ``Partial`` inputs.
        others: values of non-tensor node arguments (symbolic sizes).
        global_shape: a reshape's whole output shape (its size argument on global values).
        op: what runs in place of the node's target (an op with no CPU kernel: torch's
            decomposition of it).
        rank_op: ``rank_op(r)`` is what rank ``r`` runs on its pieces, where the ranks
            compute differently (``spmd.lowering.ranked.RANKED``); ``op`` is then the
            meaning on whole tensors.
        peers: ``rank_op(r)`` takes every rank's pieces (a list per tensor argument), as
            an op that communicates along the dimension sees them.
    """
    others = others or {}
    args = rules.tensor_args(node)
    if len(required) != len(args) or len(tensors) != len(args):
        return f"{len(required)} placements for {len(args)} tensor arguments"
    want = run_op(node, tensors, others, global_shape, op)
    multi = isinstance(want, (tuple, list))
    wants = tuple(want) if multi else (want,)
    values = not is_random(node)  # a random op's shapes alone are compared
    outputs = output if isinstance(output, tuple) else (output,)
    if len(outputs) != len(wants):
        return f"{len(outputs)} output placements for {len(wants)} outputs"
    # one value kept as it is has the same local tensors at every use; brought, new ones
    kept: dict[tuple[int, Placement], list[torch.Tensor]] = {}
    per_arg = []
    for a, t, p in zip(args, tensors, required):
        key = (id(a), p)
        if key not in kept:
            kept[key] = to_locals(t, p, size, generator)
        per_arg.append(kept[key])
    results = []
    for r in range(size):
        shape = None
        if node.target in rules.SHAPE_ARG and isinstance(wants[0], torch.Tensor):
            shape = local_shape(wants[0].shape, outputs[0], size)
        out = run_op(node, [pieces if peers else pieces[r] for pieces in per_arg], others,
                     shape, rank_op(r) if rank_op is not None else op)
        results.append(tuple(out) if multi else (out,))
    for i, (placement, whole) in enumerate(zip(outputs, wants)):
        if not isinstance(whole, torch.Tensor):
            continue
        pieces = [res[i] for res in results]
        expected = local_shape(whole.shape, placement, size)
        for piece in pieces:
            if list(piece.shape) != expected:
                return (f"output {i}: a rank's piece has shape {list(piece.shape)}, "
                        f"{placement!r} of {list(whole.shape)} is {expected}")
        if not values:
            continue
        # replicas each compared (from_locals' exact check fails on a NaN)
        for got in pieces if isinstance(placement, Replicate) else [
                from_locals(pieces, placement)]:
            if got.shape != whole.shape or not _close(got, whole):
                diff = ((got - whole).abs().max().item() if got.shape == whole.shape
                        and (whole.is_floating_point() or whole.is_complex())
                        else f"shape {list(got.shape)}" if got.shape != whole.shape
                        else "not equal")
                return (f"output {i}: the pieces put together as {placement!r} differ from "
                        f"the op on whole inputs (max difference {diff})")
    return None
