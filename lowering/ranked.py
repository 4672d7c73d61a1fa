"""Ops whose ranks compute differently, put in place of an aten op by a sharding decision
(``Decision.ranked``): each rank runs its own part and learns its coordinate on the mesh
dimension at run time through a handle.

- ``vocab_embedding`` and its backward: a table split along its rows, each rank looking
  up the tokens of its range (the others read as zeros);
- ``ring_attention`` and its backward: attention over a sequence split across the ranks,
  key/value blocks passed around the ring (``spmd.lowering.ring``);
- ``sharded_log_softmax``, ``sharded_nll_loss`` and their backwards: cross-entropy on
  logits split along the classes (loss parallelism), the row maximum and sum of
  exponentials reduced inside the op.

:data:`RANKED` maps each op to its :class:`Ranked` entry: how the aten node's arguments
become the op's, the op's meaning on whole tensors, and each rank's part from its pieces
(every rank's pieces, for an op that communicates), which the plan verifier and the rule
tests run against the whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from spmd.lowering import ring
from spmd.lowering.ops import define
from spmd.lowering.specs import RankSpec, lookup, sending
from spmd.lowering.strategy import Strategy
from spmd.runtime import collectives

__all__ = ["Ranked", "RANKED", "vocab_embedding", "vocab_embedding_backward",
           "ring_attention", "ring_attention_backward", "sharded_log_softmax",
           "sharded_log_softmax_backward", "sharded_nll_loss", "sharded_nll_loss_backward",
           "vocab_lookup", "vocab_lookup_backward"]


def vocab_lookup(rank: int, weight: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Rank ``rank``'s part of ``embedding(whole table, indices)`` from its rows of the
    table (``weight``, rows ``rank * len(weight)`` on): the rows of the indices in its
    range, zeros elsewhere. The ranks' parts add up to the lookup."""
    rows = weight.shape[0]
    local = indices - rank * rows
    inside = (local >= 0) & (local < rows)
    out = torch.nn.functional.embedding(torch.where(inside, local, 0), weight)
    return torch.where(inside.unsqueeze(-1), out, out.new_zeros(()))


def vocab_lookup_backward(rank: int, grad: torch.Tensor, indices: torch.Tensor, rows: int,
                          padding_idx: int) -> torch.Tensor:
    """Rank ``rank``'s rows (``rows`` of them) of the table's gradient: the output
    gradients of the indices in its range, summed per row (the padding row gets none)."""
    local = indices - rank * rows
    inside = (local >= 0) & (local < rows)
    if padding_idx >= 0:
        inside = inside & (indices != padding_idx)
    kept = torch.where(inside.unsqueeze(-1), grad, grad.new_zeros(()))
    return torch.ops.aten.embedding_dense_backward(kept, torch.where(inside, local, 0), rows,
                                                   -1, False)


def _vocab_embedding(weight: torch.Tensor, indices: torch.Tensor, padding_idx: int,
                     handle: int) -> torch.Tensor:
    return vocab_lookup(lookup(handle).rank(), weight, indices)


def _fake_vocab_embedding(weight: torch.Tensor, indices: torch.Tensor, padding_idx: int,
                          handle: int) -> torch.Tensor:
    return weight.new_empty((*indices.shape, weight.shape[1]))


def _vocab_embedding_backward(grad: torch.Tensor, indices: torch.Tensor, num_weights: int,
                              padding_idx: int, handle: int) -> torch.Tensor:
    s: RankSpec = lookup(handle)
    return vocab_lookup_backward(s.rank(), grad, indices, num_weights // s.size, padding_idx)


def _fake_vocab_embedding_backward(grad: torch.Tensor, indices: torch.Tensor,
                                   num_weights: int, padding_idx: int, handle: int
                                   ) -> torch.Tensor:
    s: RankSpec = lookup(handle)
    return grad.new_empty((num_weights // s.size, grad.shape[-1]))


vocab_embedding = define(
    "vocab_embedding(Tensor weight, Tensor indices, int padding_idx, int handle) -> Tensor",
    _vocab_embedding, _fake_vocab_embedding)
vocab_embedding_backward = define(
    "vocab_embedding_backward(Tensor grad, Tensor indices, int num_weights, int padding_idx, "
    "int handle) -> Tensor", _vocab_embedding_backward, _fake_vocab_embedding_backward)


def _ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attn_mask: torch.Tensor | None, is_causal: bool, scale: float | None,
                    lse_float: bool, handle: int) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = ring.ring_forward(query, key, value, is_causal, scale, lookup(handle),
                                 attn_mask)
    return out.to(query.dtype), lse.to(_lse_dtype(query, lse_float))


def _lse_dtype(query: torch.Tensor, lse_float: bool) -> torch.dtype:
    return torch.float32 if lse_float else query.dtype


def _fake_ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attn_mask: torch.Tensor | None, is_causal: bool,
                         scale: float | None, lse_float: bool, handle: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    return (query.new_empty((*query.shape[:-1], value.shape[-1])),
            query.new_empty(query.shape[:-1], dtype=_lse_dtype(query, lse_float)))


def _ring_attention_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, out: torch.Tensor, logsumexp: torch.Tensor,
                             attn_mask: torch.Tensor | None, is_causal: bool,
                             scale: float | None, handle: int
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grads = ring.ring_backward(grad_out, query, key, value, out, logsumexp, is_causal, scale,
                               lookup(handle), attn_mask)
    return tuple(g.contiguous() for g in grads)  # type: ignore[return-value]


def _fake_ring_attention_backward(grad_out: torch.Tensor, query: torch.Tensor,
                                  key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
                                  logsumexp: torch.Tensor, attn_mask: torch.Tensor | None,
                                  is_causal: bool, scale: float | None, handle: int
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


ring_attention = define(
    "ring_attention(Tensor query, Tensor key, Tensor value, Tensor? attn_mask, "
    "bool is_causal, float? scale, bool lse_float, int handle) -> (Tensor, Tensor)", _ring_attention, _fake_ring_attention)
ring_attention_backward = define(
    "ring_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, "
    "Tensor out, Tensor logsumexp, Tensor? attn_mask, bool is_causal, float? scale, "
    "int handle) -> "
    "(Tensor, Tensor, Tensor)", _ring_attention_backward, _fake_ring_attention_backward)


def _attention_arg(node: Any, name: str, default: Any = None) -> Any:
    """An attention node's argument by its schema name (positional or keyword); the mask
    by either name (``attn_mask``, the meta op's ``attn_bias``)."""
    names = [a.name for a in node.target._schema.arguments]
    if name == "attn_mask" and name not in names:
        name = "attn_bias"
    if name in node.kwargs:
        return node.kwargs[name]
    i = names.index(name)
    return node.args[i] if i < len(node.args) else default


def _ring_args(node: Any) -> tuple:
    val = node.meta["val"]
    lse_float = val[1].dtype == torch.float32 and val[0].dtype != torch.float32
    return (_attention_arg(node, "query"), _attention_arg(node, "key"),
            _attention_arg(node, "value"), _attention_arg(node, "attn_mask"),
            bool(_attention_arg(node, "is_causal", False)), _attention_arg(node, "scale"),
            lse_float)


def _ring_backward_args(node: Any) -> tuple:
    return (*(_attention_arg(node, n) for n in ("grad_out", "query", "key", "value", "out",
                                                "logsumexp", "attn_mask")),
            bool(_attention_arg(node, "is_causal", False)), _attention_arg(node, "scale"))


def _whole_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor | None, causal: bool, scale: float | None,
                     lse_float: bool, handle: Any = None) -> tuple:
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    return out, lse.to(_lse_dtype(q, lse_float))


def _whole_attention_backward(g: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                              v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                              mask: torch.Tensor | None, causal: bool, scale: float | None,
                              handle: Any = None) -> tuple:
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        g, q, k, v, out, lse.to(ring._lse_dtype(q, lse)), 0.0, causal, attn_mask=mask,
        scale=scale)


def _ring_local(r: int, size: int, qs: list, ks: list, vs: list, masks: list | None,
                causal: bool, scale: float | None, lse_float: bool, handle: Any = None
                ) -> tuple:
    """Rank ``r``'s part of the whole attention, from every rank's pieces (the mask is
    whole on each)."""
    out, lse = _whole_attention(*(torch.cat(t, dim=2) for t in (qs, ks, vs)),
                                None if masks is None else masks[0], causal, scale,
                                lse_float)
    return out.chunk(size, dim=2)[r], lse.chunk(size, dim=2)[r]


def _ring_backward_local(r: int, size: int, *args: Any) -> tuple:
    tensors = [torch.cat(t, dim=2) for t in args[:6]]
    mask = None if args[6] is None else args[6][0]
    grads = _whole_attention_backward(*tensors, mask, *args[7:9])
    return tuple(g.chunk(size, dim=2)[r] for g in grads)


def _ring_spec(dim: str, size: int, group: Any, strategy: Strategy) -> Any:
    return ring.RingSpec(dim=dim, size=size, group=group,
                         load_balance=strategy.load_balance.get(dim, True))


# -- loss parallelism: cross-entropy over logits split along the classes ---------------


def _reduce_over(t: torch.Tensor, spec: RankSpec, op: str) -> torch.Tensor:
    """``t`` reduced in place over ``spec``'s group (max or sum); as it is on a simulated
    mesh or inside ``dry_run``."""
    if spec.group is not None and spec.size > 1 and sending():
        from spmd.runtime.reduction import ReduceOp

        collectives.all_reduce(t, ReduceOp.MAX if op == "max" else ReduceOp.SUM,
                               group=spec.group)
    return t


def sharded_log_softmax_local(x: torch.Tensor, dim: int, half_to_float: bool,
                              reduce: Any) -> torch.Tensor:
    """``log_softmax`` along ``dim`` of a tensor split along it, from this rank's piece:
    the row maximum and the sum of exponentials are reduced over the ranks
    (``reduce(t, op)``), never the logits."""
    acc = torch.float32 if half_to_float or x.dtype in (torch.float16, torch.bfloat16) \
        else x.dtype
    xf = x.to(acc)
    top = reduce(xf.amax(dim, keepdim=True).detach().clone(), "max")
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    total = reduce((xf - top).exp().sum(dim, keepdim=True), "sum")
    out = xf - top - total.log()
    return out if half_to_float else out.to(x.dtype)


def sharded_log_softmax_backward_local(grad: torch.Tensor, output: torch.Tensor, dim: int,
                                       input_dtype: torch.dtype, reduce: Any
                                       ) -> torch.Tensor:
    """``log_softmax``'s backward on pieces split along ``dim``: ``grad - exp(output) *
    sum(grad)``, the sum reduced over the ranks."""
    total = reduce(grad.sum(dim, keepdim=True).clone(), "sum")
    return (grad - output.exp() * total).to(input_dtype)


def sharded_nll_local(rank: int, logp: torch.Tensor, target: torch.Tensor, reduction: int,
                      ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s part of ``nll_loss`` over log-probabilities split along the classes
    (its ``logp.shape[1]`` classes from ``rank * logp.shape[1]``): the targets in its range
    picked, the others read as 0, so the ranks' losses add up to the loss; the total
    weight (the targets counted) is every rank's alike."""
    classes = logp.shape[1]
    local = target - rank * classes
    valid = target != ignore_index
    inside = valid & (local >= 0) & (local < classes)
    picked = logp.gather(1, torch.where(inside, local, 0).unsqueeze(1)).squeeze(1)
    picked = torch.where(inside, picked, picked.new_zeros(()))
    total_weight = valid.sum().to(logp.dtype)
    if reduction == 0:
        return -picked, total_weight
    loss = -picked.sum()
    return (loss / total_weight if reduction == 1 else loss), total_weight


def sharded_nll_backward_local(rank: int, grad: torch.Tensor, logp: torch.Tensor,
                               target: torch.Tensor, reduction: int, ignore_index: int,
                               total_weight: torch.Tensor) -> torch.Tensor:
    """Rank ``rank``'s columns of ``nll_loss``'s input gradient: ``-grad`` (over the total
    weight for a mean) at each target in its range, zeros elsewhere."""
    classes = logp.shape[1]
    local = target - rank * classes
    valid = target != ignore_index
    inside = valid & (local >= 0) & (local < classes)
    scale = -grad if reduction == 0 else (-grad / total_weight if reduction == 1 else -grad)
    values = torch.where(inside, scale.expand(target.shape).to(logp.dtype),
                         logp.new_zeros(()))
    out = torch.zeros_like(logp)
    return out.scatter_(1, torch.where(inside, local, 0).unsqueeze(1), values.unsqueeze(1))


def _spec_reduce(handle: int) -> Any:
    spec: RankSpec = lookup(handle)
    return lambda t, op: _reduce_over(t, spec, op)


sharded_log_softmax = define(
    "sharded_log_softmax(Tensor x, int dim, bool half_to_float, int handle) -> Tensor",
    lambda x, dim, half, handle: sharded_log_softmax_local(x, dim, half, _spec_reduce(handle)),
    lambda x, dim, half, handle: x.new_empty(
        x.shape, dtype=torch.float32 if half else x.dtype))
sharded_log_softmax_backward = define(
    "sharded_log_softmax_backward(Tensor grad_output, Tensor output, int dim, "
    "ScalarType input_dtype, int handle) -> Tensor",
    lambda g, o, dim, dtype, handle: sharded_log_softmax_backward_local(
        g, o, dim, dtype, _spec_reduce(handle)),
    lambda g, o, dim, dtype, handle: g.new_empty(g.shape, dtype=dtype))
sharded_nll_loss = define(
    "sharded_nll_loss(Tensor logp, Tensor target, int reduction, int ignore_index, "
    "int handle) -> (Tensor, Tensor)",
    lambda logp, t, red, ig, handle: sharded_nll_local(lookup(handle).rank(), logp, t, red,
                                                       ig),
    lambda logp, t, red, ig, handle: (
        logp.new_empty(t.shape if red == 0 else ()), logp.new_empty(())))
sharded_nll_loss_backward = define(
    "sharded_nll_loss_backward(Tensor grad_output, Tensor logp, Tensor target, "
    "int reduction, int ignore_index, Tensor total_weight, int handle) -> Tensor",
    lambda g, logp, t, red, ig, tw, handle: sharded_nll_backward_local(
        lookup(handle).rank(), g, logp, t, red, ig, tw),
    lambda g, logp, t, red, ig, tw, handle: logp.new_empty(logp.shape))


def _softmax_local(r: int, size: int, xs: list, dim: int, half: bool, h: Any = None) -> Any:
    whole = torch.ops.aten._log_softmax(torch.cat(xs, dim=dim), dim, half)
    return whole.chunk(size, dim=dim)[r]


def _softmax_backward_local(r: int, size: int, gs: list, outs: list, dim: int,
                            dtype: torch.dtype, h: Any = None) -> Any:
    whole = torch.ops.aten._log_softmax_backward_data(torch.cat(gs, dim=dim),
                                                      torch.cat(outs, dim=dim), dim, dtype)
    return whole.chunk(size, dim=dim)[r]


def _weightless(n: Any) -> bool:
    """The meta trace's fused ``spmd::nll`` / ``spmd::nll_backward``: aten's arguments
    without the class weights."""
    return "weight" not in [a.name for a in n.target._schema.arguments]


def _nll_args(n: Any) -> tuple:
    if _weightless(n):
        return (n.args[0], n.args[1], int(n.args[2]), int(n.args[3]))
    args = list(n.args) + [None] * 5
    return (args[0], args[1], int(args[3] if args[3] is not None else
                                  n.kwargs.get("reduction", 1)),
            int(args[4] if args[4] is not None else n.kwargs.get("ignore_index", -100)))


def _nll_backward_args(n: Any) -> tuple:
    a = n.args
    if _weightless(n):
        return (a[0], a[1], a[2], int(a[3]), int(a[4]), a[5])
    return (a[0], a[1], a[2], int(a[4]), int(a[5]), a[6])


@dataclass(frozen=True)
class Ranked:
    """An op whose ranks compute differently, put in place of an aten op by a sharding
    decision (``Decision.ranked``).

    Attributes:
        op: the ``spmd`` op; its last argument is a :class:`RankSpec` handle.
        args: the aten node's arguments -> the op's, without the handle.
        whole: the aten op's meaning on whole tensors, from the op's arguments (what the
            verifier compares with).
        local: ``local(rank, size, *args)``: rank ``rank``'s output from its pieces (the
            verifier runs it for every rank).
        peers: ``local`` takes every rank's pieces (a list per tensor argument): the op
            communicates along the dimension (ring attention).
        spec: ``spec(dim, size, group, strategy)``, the handle's object; None: a
            :class:`RankSpec`.
    """

    op: Any
    args: Any
    whole: Any
    local: Any
    peers: bool = False
    spec: Any = None


RANKED: dict[Any, Ranked] = {
    vocab_embedding: Ranked(
        op=vocab_embedding,
        args=lambda n: (n.args[0], n.args[1], int(n.args[2]) if len(n.args) > 2 else -1),
        whole=lambda w, i, p=-1, h=None: torch.ops.aten.embedding(w, i, p),
        local=lambda r, size, w, i, p=-1, h=None: vocab_lookup(r, w, i)),
    vocab_embedding_backward: Ranked(
        op=vocab_embedding_backward,
        args=lambda n: (n.args[0], n.args[1], int(n.args[2]), int(n.args[3])),
        whole=lambda g, i, n, p, h=None: torch.ops.aten.embedding_dense_backward(
            g, i, n, p, False),
        local=lambda r, size, g, i, n, p, h=None: vocab_lookup_backward(r, g, i, n // size,
                                                                       p)),
    sharded_log_softmax: Ranked(
        op=sharded_log_softmax, args=lambda n: (n.args[0], int(n.args[1]), bool(n.args[2])),
        whole=lambda x, dim, half, h=None: torch.ops.aten._log_softmax(x, dim, half),
        local=_softmax_local, peers=True),
    sharded_log_softmax_backward: Ranked(
        op=sharded_log_softmax_backward,
        args=lambda n: (n.args[0], n.args[1], int(n.args[2]), n.args[3]),
        whole=lambda g, o, dim, dtype, h=None: torch.ops.aten._log_softmax_backward_data(
            g, o, dim, dtype),
        local=_softmax_backward_local, peers=True),
    sharded_nll_loss: Ranked(
        op=sharded_nll_loss, args=_nll_args,
        whole=lambda x, t, red, ig, h=None: torch.ops.aten.nll_loss_forward(x, t, None, red,
                                                                            ig),
        local=lambda r, size, x, t, red, ig, h=None: sharded_nll_local(r, x, t, red, ig)),
    sharded_nll_loss_backward: Ranked(
        op=sharded_nll_loss_backward, args=_nll_backward_args,
        whole=lambda g, x, t, red, ig, tw, h=None: torch.ops.aten.nll_loss_backward(
            g, x, t, None, red, ig, tw),
        local=lambda r, size, g, x, t, red, ig, tw, h=None: sharded_nll_backward_local(
            r, g, x, t, red, ig, tw)),
    ring_attention: Ranked(op=ring_attention, args=_ring_args, whole=_whole_attention,
                           local=_ring_local, peers=True, spec=_ring_spec),
    ring_attention_backward: Ranked(op=ring_attention_backward, args=_ring_backward_args,
                                    whole=_whole_attention_backward,
                                    local=_ring_backward_local, peers=True, spec=_ring_spec),
}
