"""Expert parallelism's ops on a tensor-parallel dimension (``spmd.ep`` beside ``tp``:
expert tensor parallelism, as Megatron-Core's and torchtitan's) and on a context-parallel
one (beside ``cp``).

Along the expert-parallel (data) dimension every rank has its own rows
(:func:`spmd.lowering.experts.data_placement`); along a tensor-parallel one the routing
is the same on every rank (the tokens are), so the rows moved and multiplied can be
split by their features as any activation:

- ``ep_route``: whole; routing reads every choice of every token.
- ``ep_scatter``/``ep_gather`` move whole rows between ranks of the expert-parallel
  dimension: rows split by their features (``Shard(1)``), or partial sums, move as they
  are, and the row order (``order``, the counts) must be whole.
- ``grouped_mm`` is one matrix product per expert over contiguous rows: the ways of
  ``mm`` (``rules/matmul.py``) with rows never split (the offsets index them): a
  weight split by its output features gives a column-parallel product (the bias split
  with it), split by its input features with the rows' features a row-parallel one
  (each rank's product a partial sum; not with a bias, which would be added once per
  rank), a partial factor times a whole one a partial sum.
- ``grouped_mm_weight`` (a weight's gradient, ``rows.T @ grad`` per expert) and
  ``grouped_sum`` (a bias's) follow: split output features of the gradient give the
  weight's output features split, split input rows' features its input features.

Along a context dimension (``"cp"``: the sequence split, ``ExpertsSpec.context_dims``)
each rank routes its own part of the sequence over its expert-parallel group: ``ep_route``
keeps the tokens' rows split (``Shard(0)``, or ``StridedShard(0, b)`` where the batch is
merged with the sequence) and its counts and offsets are each rank's own (``Varying``);
``ep_scatter`` gives the rows this rank's experts receive as ``Shard(0)`` (the rows of
every rank, one after the other; its static bound is rewritten for the rank's share,
``ROWS_ARG``), which the grouped products keep; ``ep_gather`` returns them to the
tokens' split; the weights' gradients are partial sums over the sequence. The received
rows are no split of any whole tensor: ``tensor_parallel`` refuses to redistribute them
(:func:`spmd.lowering.experts.received_rows`).

The gate of a packed ``gate_up_proj`` split ``StridedShard(out, 2)`` (each rank its part
of the gate and of the up projection) is read by ``chunk`` on the strided features,
which the view rules place; so each placement here carries ``StridedShard`` too.
"""

from __future__ import annotations

import torch.fx as fx

from spmd.lowering import experts as ops
from spmd.lowering.placements import (Partial, Placement, Replicate, Shard, StridedShard,
                                     Varying)
from spmd.lowering.rules.registry import ROWS_ARG, Decision, register, shape, tensor_args
from spmd.lowering.specs import lookup

R, V = Replicate, Varying


def _features(p: Placement, dim: int, length: int, size: int) -> Placement | None:
    """``p`` (a ``Shard``/``StridedShard`` of some tensor's features) moved to dimension
    ``dim`` of another of ``length`` there; None when it is not one or does not divide."""
    if isinstance(p, StridedShard):
        return StridedShard(dim, p.split) if length % (p.split * size) == 0 else None
    if isinstance(p, Shard):
        return Shard(dim) if length % size == 0 else None
    return None


def _splits(p: Placement) -> bool:
    return isinstance(p, (Shard, StridedShard))


def _token_rows(p: Placement) -> Placement:
    """The placement of a (token, choice) pair's rows when the tokens' rows are ``p`` on a
    context dimension: split along the rows as they are (each token's ``k`` choices stay
    together), or, whole, as each rank's contiguous part."""
    if isinstance(p, (Shard, StridedShard)) and p.dim == 0:
        return p
    return Shard(0)


@register(ops.ep_route, strided=True, wants_dim=True)
def ep_route(node: fx.Node, inputs: tuple[Placement, ...], size: int, dim: str) -> Decision:
    if dim in lookup(node.args[1]).context_dims:
        rows = _token_rows(inputs[0])
        return Decision(output=(rows, V(), V(), V()), inputs=(rows,),
                        reason="each rank routes its own part of the sequence over its "
                               "expert-parallel group (the counts are its own)")
    return Decision(output=(R(), R(), R(), R()), inputs=(R(),),
                    reason="routing reads every choice of every token")


def _routed(metadata: tuple[Placement, ...]) -> bool:
    """The routing was this rank's own on this dimension (a context dimension:
    :func:`ep_route`): the rows the experts receive are this rank's alone, ``Shard(0)``
    of every rank's, and never redistributed (``tensor_parallel`` refuses to)."""
    return any(isinstance(p, V) for p in metadata)


def _moves(node: fx.Node, inputs: tuple[Placement, ...], size: int) -> list[Decision]:
    rows = inputs[0]
    whole_order = (R(),) * (len(inputs) - 1)
    if _routed(inputs[2:]):
        order = _token_rows(inputs[1])
        if node.target is ops.ep_scatter:
            return [Decision(output=Shard(0), inputs=(order, order, V(), V()),
                             reason="this rank's pairs sent to its experts' ranks; what "
                                    "its experts receive is its own")]
        return [Decision(output=order, inputs=(Shard(0), order, V(), V()),
                         reason="each rank's rows back to its own pairs")]
    found = []
    if isinstance(rows, Partial):
        found.append(Decision(output=rows, inputs=(rows, *whole_order),
                              reason="partial sums of rows move as they are"))
    elif _splits(rows) and rows.dim == 1:
        found.append(Decision(output=rows, inputs=(rows, *whole_order),
                              reason="rows split by their features move whole"))
    found.append(Decision(output=R(), inputs=(R(), *whole_order), reason="whole rows"))
    return found


register(ops.ep_scatter, strided=True)(_moves)
# its static row bound, traced for the whole sequence: a rank's share where its rows are
# split along a context dimension (``tensor_parallel`` rewrites it)
ROWS_ARG[ops.ep_scatter] = 4
register(ops.ep_gather, strided=True)(_moves)


@register(ops.grouped_mm, strided=True)
def grouped_mm(node: fx.Node, inputs: tuple[Placement, ...], size: int) -> list[Decision]:
    transposed = bool(node.args[4])
    w = shape(tensor_args(node)[1])
    out_dim, in_dim = (2, 1) if transposed else (1, 2)
    px, pw = inputs[0], inputs[1]
    has_bias = len(inputs) == 4
    if _routed(inputs[2:3]):
        return [Decision(output=Shard(0), inputs=(Shard(0), R(), V()) + ((R(),) if has_bias
                                                                     else ()),
                         reason="each rank's experts on the rows it received")]
    found = []

    def way(x: Placement, weight: Placement, bias: Placement | None, out: Placement,
            why: str) -> None:
        need = (x, weight, R()) + ((bias,) if has_bias else ())
        found.append(Decision(output=out, inputs=need, reason=why))

    if isinstance(px, Partial) and not has_bias and isinstance(pw, Replicate):
        way(px, R(), None, px, "a partial factor times whole weights")
    if isinstance(pw, Partial) and not has_bias and isinstance(px, Replicate):
        way(R(), pw, None, pw, "whole rows times partial weights")
    # the weight's output features split (or its bias's): column-parallel
    for source, at in ((pw, out_dim), *(((inputs[3], 1),) if has_bias else ())):
        if _splits(source) and source.dim == at:
            cols = _features(source, out_dim, w[out_dim], size)
            out = _features(source, 1, w[out_dim], size)
            if cols is not None and out is not None:
                way(R(), cols, out if has_bias else None, out,
                    "each expert's output features split (column-parallel)")
                break
    # the contraction split on both factors: row-parallel
    for source, at in ((px, 1), (pw, in_dim)):
        if not has_bias and _splits(source) and source.dim == at:
            rows_in = _features(source, 1, w[in_dim], size)
            weights_in = _features(source, in_dim, w[in_dim], size)
            if rows_in is not None and weights_in is not None:
                way(rows_in, weights_in, None, Partial("sum"),
                    "each expert's input features split (row-parallel): each rank's "
                    "product a partial sum")
                break
    way(R(), R(), R() if has_bias else None, R(), "whole factors")
    return found


@register(ops.grouped_mm_weight, strided=True)
def grouped_mm_weight(node: fx.Node, inputs: tuple[Placement, ...], size: int
                      ) -> list[Decision]:
    transposed = bool(node.args[3])
    out_dim, in_dim = (2, 1) if transposed else (1, 2)
    grad, rows = shape(tensor_args(node)[0]), shape(tensor_args(node)[1])
    pg, px = inputs[0], inputs[1]
    if _routed(inputs[2:3]):
        return [Decision(output=Partial("sum"), inputs=(Shard(0), Shard(0), V()),
                         reason="each rank's part of the sequence: a partial sum")]
    found = []
    if isinstance(pg, Partial) and isinstance(px, Replicate):
        found.append(Decision(output=pg, inputs=(pg, R(), R()),
                              reason="a partial gradient times whole rows"))
    if isinstance(px, Partial) and isinstance(pg, Replicate):
        found.append(Decision(output=px, inputs=(R(), px, R()),
                              reason="a whole gradient times partial rows"))
    if _splits(pg) and pg.dim == 1:
        out = _features(pg, out_dim, grad[1], size)
        if out is not None:
            found.append(Decision(output=out, inputs=(pg, R(), R()),
                                  reason="the gradient's output features split"))
    if _splits(px) and px.dim == 1:
        out = _features(px, in_dim, rows[1], size)
        if out is not None:
            found.append(Decision(output=out, inputs=(R(), px, R()),
                                  reason="the rows' input features split"))
    found.append(Decision(output=R(), inputs=(R(), R(), R()), reason="whole factors"))
    return found


@register(ops.grouped_sum, strided=True)
def grouped_sum(node: fx.Node, inputs: tuple[Placement, ...], size: int) -> list[Decision]:
    pg = inputs[0]
    if _routed(inputs[1:2]):
        return [Decision(output=Partial("sum"), inputs=(Shard(0), V()),
                         reason="each rank's part of the sequence: a partial sum")]
    if isinstance(pg, Partial) or (_splits(pg) and pg.dim == 1):
        return [Decision(output=pg, inputs=(pg, R()),
                         reason="each expert's rows summed, features as they are")]
    return [Decision(output=R(), inputs=(R(), R()), reason="whole rows")]
