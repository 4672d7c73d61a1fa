"""Lookups by index and their backward: ``embedding``, and ``index_select`` along any
dimension (``repeat_interleave`` with a tensor of counts traces to one) with its
backward ``index_add``.

A table sharded along its columns (the embedding dimension) gives each rank those
columns of every looked-up row; indices sharded along a dimension (a replicated table)
give the rows of those indices. A table sharded along its rows (vocabulary-parallel, as
Megatron-LM's ``VocabParallelEmbedding``) is looked up by each rank in its own rows, the
indices outside its range masked to zero (``spmd::vocab_embedding``): the ranks' outputs
are partial sums, reduced by one all-reduce (a reduce-scatter under sequence
parallelism). In backward, the table's gradient from column-sharded output gradients is
column-sharded; from row-sharded indices it is each rank's partial sum; for a
vocabulary-parallel table each rank sums the gradients of its own rows
(``spmd::vocab_embedding_backward``).
"""

from __future__ import annotations

import torch.fx as fx

from spmd.lowering import ops, ranked
from spmd.lowering.placements import Partial, Placement, Replicate, Shard
from spmd.lowering.rules.registry import Decision, norm_dim, op, register, replicate_all, shape
from spmd.lowering.specs import lookup


@register(op("embedding.default"))
def embedding(node: fx.Node, inputs: tuple[Placement, ...], size: int) -> list[Decision]:
    pw, pi = inputs
    last = len(shape(node)) - 1
    decisions = []
    if isinstance(pw, Partial) and isinstance(pi, Replicate):
        decisions.append(Decision(output=pw, reason="rows of a partial table are partial"))
    if isinstance(pw, Shard) and pw.dim == 1 or isinstance(pi, Replicate):
        if shape(node)[last] % size == 0:
            decisions.append(Decision(output=Shard(last), inputs=(Shard(1), Replicate()),
                                      reason="table sharded along its columns"))
    if isinstance(pi, Shard):
        decisions.append(Decision(output=Shard(pi.dim), inputs=(Replicate(), pi),
                                  reason="indices sharded, table whole"))
    if isinstance(pw, Shard) and pw.dim == 0 and shape(node.args[0])[0] % size == 0:
        decisions.append(Decision(output=Partial("sum"), inputs=(Shard(0), Replicate()),
                                  reason="vocabulary-parallel: each rank looks up its own "
                                         "rows, the others masked to zero",
                                  ranked=ranked.vocab_embedding))
    decisions.append(replicate_all(node, "table sharded along its rows: gathered first"))
    return decisions


def _rows_wanted(node: fx.Node, dim: str) -> bool:
    """Whether the gradient ends up sharded along the table's rows on ``dim`` (a
    vocabulary-parallel table's): then each rank computes its own rows, rather than a
    partial sum of the whole table reduce-scattered."""
    for user in node.users:
        if user.target is ops.tp_grad:
            want = lookup(user.args[1]).placements.get(dim, Replicate())
            return isinstance(want, Shard) and want.dim == 0
    return False


def embedding_backward(node: fx.Node, inputs: tuple[Placement, ...], size: int, dim: str
                       ) -> list[Decision]:
    pg, pi = inputs
    last = len(shape(node.args[0])) - 1
    by_freq = bool(node.args[4] if len(node.args) > 4 else node.kwargs.get(
        "scale_grad_by_freq", False))
    rows = int(node.args[2])
    if _rows_wanted(node, dim) and not by_freq and rows % size == 0:
        # (scaled by frequency, a rank's rows need every index's count: not offered)
        return [Decision(output=Shard(0), inputs=(Replicate(), Replicate()),
                         reason="vocabulary-parallel: each rank sums the gradients of its "
                                "own rows", ranked=ranked.vocab_embedding_backward),
                replicate_all(node, "whole gradient")]
    decisions = []
    if isinstance(pg, Partial) and isinstance(pi, Replicate):
        decisions.append(Decision(output=pg, reason="linear in the output gradient"))
    if isinstance(pg, Shard) and pg.dim == last:
        decisions.append(Decision(output=Shard(1), inputs=(pg, Replicate()),
                                  reason="output gradient sharded along the embedding "
                                         "dimension: the table's gradient by columns"))
    # scaled by each index's frequency, a rank's rows need the whole batch's counts
    if not by_freq and (isinstance(pg, Shard) and pg.dim < last or isinstance(pi, Shard)):
        d = pg.dim if isinstance(pg, Shard) and pg.dim < last else pi.dim  # type: ignore
        decisions.append(Decision(output=Partial("sum"), inputs=(Shard(d), Shard(d)),
                                  reason="indices sharded: each rank's rows add up"))
    decisions.append(replicate_all(node, "whole gradient"))
    return decisions


register(op("embedding_dense_backward.default"), wants_dim=True)(embedding_backward)


def _dim(node: fx.Node) -> int:
    return norm_dim(int(node.args[1]), len(shape(node.args[0])))


@register(op("index_select.default"))
def index_select(node: fx.Node, inputs: tuple[Placement, ...], size: int) -> list[Decision]:
    """``index_select(x, dim, index)``: the selected entries of ``x`` along ``dim``. Sharded
    along another dimension, each rank selects from its piece; with the indices sharded
    (a whole ``x``), each rank selects its part of the result along ``dim``. Indices are
    positions in the whole ``x``: an ``x`` sharded along ``dim`` is gathered first (the
    key/value heads repeated by ``repeat_interleave(counts, dim=1)`` are)."""
    px, pi = inputs
    dim = _dim(node)
    decisions = []
    if isinstance(px, Partial) and isinstance(pi, Replicate):
        decisions.append(Decision(output=px, reason="entries of a partial value are partial"))
    if isinstance(px, Shard) and px.dim != dim:
        decisions.append(Decision(output=px, inputs=(px, Replicate()),
                                  reason=f"selected along {dim}, sharded along {px.dim}"))
    if shape(node)[dim] % size == 0 and len(shape(node.args[2])) == 1:
        decisions.append(Decision(output=Shard(dim), inputs=(Replicate(), Shard(0)),
                                  reason="each rank its indices, the source whole"))
    decisions.append(replicate_all(node, "indices into the whole tensor"))
    return decisions


@register(op("index_add.default"))
def index_add(node: fx.Node, inputs: tuple[Placement, ...], size: int) -> list[Decision]:
    """``index_add(x, dim, index, source)``: ``x`` plus the rows of ``source`` added at
    ``index`` along ``dim`` (``index_select``'s backward, into zeros). Linear in ``x`` and
    ``source`` together: partial sums add up; sharded alike along another dimension, each
    rank adds its piece; with ``source`` sharded along ``dim`` and the indices with it,
    each rank adds its rows, and the sum over ranks (``x`` counted once) is the result."""
    px, pi, ps = inputs
    dim = _dim(node)
    decisions = []
    if isinstance(ps, Partial) and isinstance(pi, Replicate) and not isinstance(px, Shard):
        decisions.append(Decision(output=ps, inputs=(ps, pi, ps),
                                  reason="linear in the value and the added rows"))
    if isinstance(ps, Shard) and ps.dim != dim and shape(node)[ps.dim] % size == 0:
        decisions.append(Decision(output=ps, inputs=(ps, Replicate(), ps),
                                  reason=f"added along {dim}, sharded along {ps.dim}"))
    if len(shape(node.args[2])) == 1 and shape(node.args[2])[0] % size == 0:
        decisions.append(Decision(output=Partial("sum"),
                                  inputs=(Partial("sum"), Shard(0), Shard(dim)),
                                  reason="each rank adds its rows: a partial sum"))
    decisions.append(replicate_all(node, "rows added into the whole tensor"))
    return decisions


@register(op("repeat_interleave.Tensor"))
def repeat_interleave(node: fx.Node, inputs: tuple[Placement, ...], size: int
                      ) -> list[Decision]:
    """The indices ``repeat_interleave(counts)`` makes for ``index_select``: each depends on
    every count before it."""
    return [replicate_all(node, "each index depends on every count before it")]


def _single_index(node: fx.Node) -> fx.Node | None:
    """The one index tensor of ``x[index]`` (``index.Tensor``/``index_put`` with one
    index, into dimension 0), or None for any other indexing."""
    indices = node.args[1]
    if isinstance(indices, (list, tuple)) and len(indices) == 1 and \
            isinstance(indices[0], fx.Node):
        return indices[0]
    return None


@register(op("index.Tensor"))
def index(node: fx.Node, inputs: tuple[Placement, ...], size: int) -> list[Decision]:
    """``x[index]`` with one index tensor (rows of ``x``, e.g. an MoE's experts' weights
    gathered per token): with ``x`` whole and the indices sharded along a dimension, each
    rank gathers its part of the result there (the index's dimensions come first)."""
    idx = _single_index(node)
    if idx is not None and len(inputs) == 2:
        px, pi = inputs
        if isinstance(pi, Shard) and isinstance(px, Replicate) and \
                shape(idx)[pi.dim] % size == 0:
            return [Decision(output=Shard(pi.dim), inputs=(Replicate(), pi),
                             reason="each rank its indices, the source whole")]
        if isinstance(px, Partial) and isinstance(pi, Replicate):
            return [Decision(output=px, reason="entries of a partial value are partial")]
    return [replicate_all(node, "indices into the whole tensor")]


@register(op("index_put.default"))
def index_put(node: fx.Node, inputs: tuple[Placement, ...], size: int) -> list[Decision]:
    """``x.index_put([index], values, accumulate=True)`` (``x[index]``'s backward, into
    zeros): with the indices and values sharded alike along a dimension of the index,
    each rank adds its rows, and the sum over ranks (``x`` counted once) is the result."""
    idx = _single_index(node)
    accumulate = bool(node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate"))
    if idx is not None and accumulate and len(inputs) == 3:
        px, pi, pv = inputs
        if isinstance(pi, Shard) and pv == pi and shape(idx)[pi.dim] % size == 0:
            return [Decision(output=Partial("sum"), inputs=(Partial("sum"), pi, pi),
                             reason="each rank adds its rows: a partial sum")]
    return [replicate_all(node, "rows put into the whole tensor")]
