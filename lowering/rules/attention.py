"""Scaled dot-product attention (the fused aten kernels ``scaled_dot_product_attention``
lowers to, forward and backward). Queries, keys and values ``[batch, heads, length,
head_dim]`` sharded alike along heads (Megatron's attention: each rank its heads) or
along the batch give outputs, log-sum-exps and gradients sharded the same way; any other
placement is gathered first (a sequence-sharded attention needs ring communication
this rule does not do). An attention mask is sharded along the same dimension where it
spans it, else replicated.

Grouped-query attention (``enable_gqa=True``) leaves no flag in the graph: the kernels
take keys and values with fewer heads than the query (``Hq = g * Hkv``), and query head
``h`` reads key/value head ``h // g``. Along heads, rank ``r``'s contiguous query heads
then read exactly rank ``r``'s contiguous key/value heads when both counts divide by the
mesh size: both sharded, each on its own head count. Keys and values left whole while
the queries are sharded would pair each rank's query heads with the first key/value
heads, not theirs: never offered, except for a single key/value head (multi-query
attention), which every query head reads; each rank's gradient of it then covers only
its query heads, a partial sum.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.fx as fx

from spmd.lowering.meta_trace import attention as _meta_attention
from spmd.lowering.meta_trace import attention_backward as _meta_attention_backward
from spmd.lowering.placements import Partial, Placement, Replicate, Shard
from spmd.lowering.rules.registry import Decision, op, register, replicate_all, shape, tensor_args

_FORWARD = [op("_scaled_dot_product_flash_attention_for_cpu.default"),
            op("_scaled_dot_product_flash_attention.default"),
            op("_scaled_dot_product_efficient_attention.default"),
            op("_scaled_dot_product_cudnn_attention.default"),
            _meta_attention]  # the fused kernel as traced on meta for a GPU plan
_BACKWARD = [op("_scaled_dot_product_flash_attention_for_cpu_backward.default"),
             op("_scaled_dot_product_flash_attention_backward.default"),
             op("_scaled_dot_product_efficient_attention_backward.default"),
             op("_scaled_dot_product_cudnn_attention_backward.default"),
             _meta_attention_backward]

Role = Literal["query", "key", "mask", "debug", "other"]
# what each tensor argument (by its schema name) and output spans: the query's heads,
# the keys' heads, the mask's broadcast shape, the attention weights when asked for
# (else an empty tensor), or nothing per head (sequence offsets, random seeds)
_ROLES: dict[str, Role] = {
    "query": "query", "grad_out": "query", "grad_out_": "query", "out": "query",
    "logsumexp": "query", "key": "key", "value": "key", "attn_mask": "mask",
    "attn_bias": "mask", "output": "query", "log_sumexp": "query",
    "debug_attn_mask": "debug"}
# backward outputs, by position (some kernels leave them unnamed)
_BACKWARD_OUTPUTS: tuple[Role, ...] = ("query", "key", "key", "mask")


def _arg_roles(node: fx.Node) -> list[Role]:
    """The role of each tensor argument, in :func:`tensor_args` order."""
    schema = node.target._schema.arguments  # type: ignore[union-attr]
    roles: list[Role] = []
    for name, value in [(schema[i].name, a) for i, a in enumerate(node.args)] + list(
            node.kwargs.items()):
        if isinstance(value, fx.Node) and isinstance(value.meta.get("val"), torch.Tensor):
            roles.append(_ROLES.get(name, "other"))
    return roles


def _named(node: fx.Node, name: str) -> fx.Node:
    """The argument the op's schema calls ``name`` (query and key are positional)."""
    names = [a.name for a in node.target._schema.arguments]  # type: ignore[union-attr]
    return node.args[names.index(name)]


def _output_roles(node: fx.Node, count: int) -> list[Role]:
    if node.target in _BACKWARD:
        return list(_BACKWARD_OUTPUTS[:count])
    returns = node.target._schema.returns  # type: ignore[union-attr]
    return [_ROLES.get(r.name, "other") for r in returns][:count]


def _mask_placed(mask: torch.Tensor, d: int, extent: int) -> Placement:
    """A mask broadcasts against ``[batch, heads, length, key length]`` from the right: it is
    sharded along its dimension that spans ``d`` (not one of size 1), else whole."""
    k = d - (4 - mask.dim())
    return Shard(k) if k >= 0 and mask.shape[k] == extent else Replicate()


def _spanned(value: torch.Tensor, d: int, extent: int) -> Placement:
    """``Shard(d)`` for a tensor that spans the sharded extent at ``d``, else whole."""
    return Shard(d) if value.dim() > d and value.shape[d] == extent else Replicate()


def _key_placed(hq: int, hkv: int, d: int, size: int) -> Placement | None:
    """Where keys and values go when the queries are ``Shard(d)``: sharded alike (as many
    heads, or along heads a count that divides: each rank the heads its queries read),
    whole for a single head every query head reads; None where no placement pairs them."""
    if hkv == hq or (d == 1 and hkv % size == 0):
        return Shard(d)
    if d == 1 and hkv == 1:
        return Replicate()
    return None


@register(*_FORWARD, *_BACKWARD)
def attention(node: fx.Node, inputs: tuple[Placement, ...], size: int) -> list[Decision]:
    args = tensor_args(node)
    roles = _arg_roles(node)
    query, key = _named(node, "query"), _named(node, "key")
    val = node.meta["val"]
    multi = isinstance(val, (tuple, list))
    outs = list(val) if multi else [val]
    out_roles = _output_roles(node, len(outs))
    decisions = []
    for d, what in ((1, "heads"), (0, "batch")):
        hq, hkv = shape(query)[d], shape(key)[d]
        kv = _key_placed(hq, hkv, d, size)
        if hq % size or kv is None:
            continue
        where: dict[Role, Placement] = {"query": Shard(d), "key": kv, "other": Replicate()}
        needed = tuple(_mask_placed(a.meta["val"], d, hq) if r == "mask" else where[r]
                       for a, r in zip(args, roles))
        mask = next((p for p, r in zip(needed, roles) if r == "mask"), Replicate())
        if node.target in _BACKWARD:
            # the gradient of a value read whole (a single key/value head, a broadcast
            # mask) sums over every rank's queries: each rank holds its part of it
            placed = {"query": Shard(d), "key": kv if isinstance(kv, Shard) else Partial("sum"),
                      "mask": mask if isinstance(mask, Shard) else Partial("sum")}
        else:
            placed = {"query": Shard(d), "other": Replicate()}
        out = [Replicate() if not isinstance(o, torch.Tensor) else
               _spanned(o, d, hq) if r == "debug" else placed[r]
               for o, r in zip(outs, out_roles)]
        reason = f"each rank its {what}"
        if d == 1 and hkv != hq:
            reason += (f" ({hq} query heads read {hkv} key/value heads: "
                       + ("each rank the key/value heads its queries read)"
                          if isinstance(kv, Shard) else "the one key/value head, whole)"))
        decisions.append(Decision(output=tuple(out) if multi else out[0], inputs=needed,
                                  reason=reason))
    ring = _ring_decision(node, size)
    if ring is not None:
        decisions.append(ring)
    decisions.append(replicate_all(node, "queries, keys and values whole"))
    return decisions


# the kernels ring attention stands in for (forward -> backward's op): the CPU kernel and
# the fused node of a GPU plan traced on meta
_RING = {op("_scaled_dot_product_flash_attention_for_cpu.default"): "forward",
         op("_scaled_dot_product_flash_attention_for_cpu_backward.default"): "backward",
         _meta_attention: "forward", _meta_attention_backward: "backward"}


def _arg(node: fx.Node, name: str, default: object = None) -> object:
    names = [a.name for a in node.target._schema.arguments]  # type: ignore[union-attr]
    if name in node.kwargs:
        return node.kwargs[name]
    i = names.index(name)
    return node.args[i] if i < len(node.args) else default


def _ring_decision(node: fx.Node, size: int) -> Decision | None:
    """Queries, keys and values sharded alike along the sequence (context parallelism):
    each rank attends its queries to every rank's keys and values, passed around the ring
    (``spmd::ring_attention``); outputs, log-sum-exps and gradients stay sharded along the
    sequence. Self-attention without dropout; a causal mask by ``is_causal``, or an
    explicit mask read whole (each rank applies its rows and each block's columns)."""
    from spmd.lowering import ranked

    phase = _RING.get(node.target)
    if phase is None or size < 2:
        return None
    names = {a.name for a in node.target._schema.arguments}  # type: ignore[union-attr]
    masked = any(m in names and _arg(node, m) is not None for m in ("attn_mask", "attn_bias"))
    if float(_arg(node, "dropout_p", 0.0) or 0.0) != 0.0:  # type: ignore[arg-type]
        return None
    q, k = shape(_named(node, "query")), shape(_named(node, "key"))
    if q[2] != k[2] or q[2] % size or q[1] % k[1]:
        return None
    roles = _arg_roles(node)
    count = 2 if phase == "forward" else 3
    causal = " (causal: load-balanced halves)" if _arg(node, "is_causal", False) else ""
    if masked:
        causal = " (the explicit mask whole on each rank, each block its part of it)"
    inputs = tuple(Replicate() if role == "mask" else Shard(2) for role in roles)
    return Decision(output=(Shard(2),) * count, inputs=inputs,
                    reason=f"ring attention: each rank its part of the sequence, keys and "
                           f"values passed around the ring{causal}",
                    ranked=ranked.ring_attention if phase == "forward"
                    else ranked.ring_attention_backward)
