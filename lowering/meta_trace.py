"""Tracing on the meta device what a GPU would run.

A model built on ``torch.device("meta")`` and planned for a simulated cluster
(``spmd.inspect(model, x, mesh=Mesh.simulated(..., hardware=H100_SXM()))``) is traced
by Dynamo and AOTAutograd on meta tensors. Two of torch's dispatch decisions then differ
from the GPU's, and both would make the plan wrong:

- **Attention.** ``scaled_dot_product_attention`` picks its kernel by device; on meta it
  picks the unfused math path: two batched matrix products around a softmax over the
  whole ``(batch, heads, seq, seq)`` score tensor, upcast, with no causal skipping. A
  GPU runs one fused kernel (FlashAttention or the memory-efficient one) that never
  materialises the scores. Priced as the math path, attention costs several times what
  it does, and the memory view finds its peak inside a softmax the GPU never stores. On
  a plan for GPU hardware, each call is traced as one fused node, ``spmd::attention``
  (forward: output and float32 log-sum-exp; ``spmd::attention_backward``: the three
  input gradients), with what a fused kernel reads, writes and saves: grouped-query
  attention native, as FlashAttention-2 takes it; a mask as an additive bias read in
  full, as the memory-efficient kernel does. torch's own fused ops cannot stand in on
  meta: they are random ops (dropout's seed), and activation checkpointing wraps random
  ops in an RNG-state save that has no meta kernel. The attention sharding rule knows
  both ops; their CPU implementation is the exact math, so they are tested against
  ``F.scaled_dot_product_attention``.
- **The loss.** Under torch 2.13 ``F.cross_entropy`` and ``F.nll_loss`` of meta tensors
  trace to a forward without a backward (``aten::nll_loss`` reaches autograd without a
  kernel): the backward graph comes out empty and the plan would price no backward at
  all. On meta they are traced as their decomposition (``log_softmax``, ``gather``,
  masking, the weighted mean), which has one.

Nothing changes for real tensors: a GPU traces its own kernels, a CPU runs what it runs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from spmd.lowering import ops, ranked, ring

__all__ = ["rewrite_for_meta", "fused_attention", "cross_entropy", "nll_loss", "ATTENTION",
           "ATTENTION_FORWARD", "ATTENTION_BACKWARD",
           "attention_causal", "attention", "attention_backward", "nll", "nll_backward"]

_aten = torch.ops.aten


def _attention(query, key, value, bias, dropout_p, is_causal, scale):
    if dropout_p > 0 and not query.is_meta:  # on meta only shapes run: dropout is free
        raise NotImplementedError("spmd::attention is the meta-tracing stand-in of a GPU's "
                                  "fused attention; it runs dropout only as a shape")
    out, lse = ring.math_attention(query, key, value, bias, is_causal, scale)
    return out.contiguous(), lse.contiguous()


def _fake_attention(query, key, value, bias, dropout_p, is_causal, scale):
    return (query.new_empty(*query.shape[:-1], value.shape[-1]),
            query.new_empty(query.shape[:-1], dtype=torch.float32))


def _attention_backward(grad_out, query, key, value, bias, out, logsumexp, dropout_p,
                        is_causal, scale):
    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in (query, key, value))
        o, _ = _attention(q, k, v, bias, dropout_p, is_causal, scale)
        return tuple(g.contiguous() for g in torch.autograd.grad(o, (q, k, v), grad_out))


def _fake_attention_backward(grad_out, query, key, value, bias, out, logsumexp, dropout_p,
                             is_causal, scale):
    return (query.new_empty(query.shape), key.new_empty(key.shape),
            value.new_empty(value.shape))


def _keep_attention(ctx: Any, inputs: tuple, output: Any) -> None:
    query, key, value, bias, dropout_p, is_causal, scale = inputs
    ctx.save_for_backward(query, key, value, bias, output[0], output[1])
    ctx.args = (dropout_p, is_causal, scale)


def _attention_grad(ctx: Any, grad_out: torch.Tensor, _grad_lse: Any) -> tuple:
    query, key, value, bias, out, lse = ctx.saved_tensors
    grads = attention_backward(grad_out, query, key, value, bias, out, lse, *ctx.args)
    return (*grads, None, None, None, None)


attention_backward = ops.define(
    "attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, "
    "Tensor? attn_bias, Tensor out, Tensor logsumexp, float dropout_p, bool is_causal, "
    "float? scale) -> (Tensor, Tensor, Tensor)", _attention_backward,
    _fake_attention_backward)
attention = ops.define(
    "attention(Tensor query, Tensor key, Tensor value, Tensor? attn_bias, float dropout_p, "
    "bool is_causal, float? scale) -> (Tensor output, Tensor logsumexp)", _attention,
    _fake_attention, backward=_attention_grad, setup_context=_keep_attention)

# the fused attention kernels, forward and backward (any device's, and ours)
# (ring attention, context parallelism's: each rank's queries against the whole sequence)
ATTENTION_FORWARD = (attention, ranked.ring_attention,
                     _aten._scaled_dot_product_flash_attention.default,
                     _aten._scaled_dot_product_efficient_attention.default,
                     _aten._scaled_dot_product_cudnn_attention.default,
                     _aten._scaled_dot_product_flash_attention_for_cpu.default)
ATTENTION_BACKWARD = (attention_backward, ranked.ring_attention_backward,
                      _aten._scaled_dot_product_flash_attention_backward.default,
                      _aten._scaled_dot_product_efficient_attention_backward.default,
                      _aten._scaled_dot_product_cudnn_attention_backward.default,
                      _aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
ATTENTION = ATTENTION_FORWARD + ATTENTION_BACKWARD


def attention_causal(node: fx.Node) -> bool:
    """Whether a fused attention node is causal (its ``is_causal`` argument)."""
    schema = node.target._schema.arguments  # type: ignore[union-attr]
    for i, arg in enumerate(schema):
        if arg.name == "is_causal":
            if i < len(node.args):
                return bool(node.args[i])
            return bool(node.kwargs.get("is_causal", arg.default_value or False))
    return False


def fused_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                    is_causal: bool = False, scale: float | None = None,
                    enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` as one fused node (see the module doc); same
    arguments, same result."""
    if key.shape[-3] != query.shape[-3] and not enable_gqa:
        raise RuntimeError(f"scaled_dot_product_attention: the query has {query.shape[-3]} "
                           f"heads and the key {key.shape[-3]}; pass enable_gqa=True for "
                           f"grouped-query attention")
    bias = attn_mask
    if bias is not None and bias.requires_grad:  # a learned bias: torch's own, whose
        return F.scaled_dot_product_attention(  # backward gives its gradient too
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa=enable_gqa)
    if bias is not None and bias.dtype == torch.bool:  # the kernel takes an additive bias
        bias = torch.zeros_like(bias, dtype=query.dtype).masked_fill(
            bias.logical_not(), float("-inf"))
    return attention(query, key, value, bias, dropout_p, is_causal, scale)[0]


def _reduction(size_average: Any, reduce: Any, reduction: str) -> str:
    if size_average is None and reduce is None:
        return reduction
    from torch.nn import _reduction as legacy

    return legacy.legacy_get_string(size_average, reduce)


_REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}


def _nll(logp: torch.Tensor, target: torch.Tensor, reduction: int, ignore_index: int
         ) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.aten.nll_loss_forward(logp, target, None, reduction, ignore_index)


def _fake_nll(logp: torch.Tensor, target: torch.Tensor, reduction: int, ignore_index: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    return (logp.new_empty(target.shape if reduction == 0 else ()), logp.new_empty(()))


def _nll_backward(grad: torch.Tensor, logp: torch.Tensor, target: torch.Tensor,
                  reduction: int, ignore_index: int, total_weight: torch.Tensor
                  ) -> torch.Tensor:
    return torch.ops.aten.nll_loss_backward(grad, logp, target, None, reduction,
                                            ignore_index, total_weight)


def _fake_nll_backward(grad: torch.Tensor, logp: torch.Tensor, target: torch.Tensor,
                       reduction: int, ignore_index: int, total_weight: torch.Tensor
                       ) -> torch.Tensor:
    return logp.new_empty(logp.shape)


def _keep_nll(ctx: Any, inputs: tuple, output: Any) -> None:
    logp, target, reduction, ignore_index = inputs
    ctx.save_for_backward(logp, target, output[1])
    ctx.args = (reduction, ignore_index)


def _nll_grad(ctx: Any, grad: torch.Tensor, _grad_weight: Any) -> tuple:
    logp, target, total_weight = ctx.saved_tensors
    reduction, ignore_index = ctx.args
    return (nll_backward(grad, logp, target, reduction, ignore_index, total_weight), None,
            None, None)


nll_backward = ops.define(
    "nll_backward(Tensor grad_output, Tensor logp, Tensor target, int reduction, "
    "int ignore_index, Tensor total_weight) -> Tensor", _nll_backward, _fake_nll_backward)
nll = ops.define(
    "nll(Tensor logp, Tensor target, int reduction, int ignore_index) -> "
    "(Tensor output, Tensor total_weight)", _nll, _fake_nll, backward=_nll_grad,
    setup_context=_keep_nll)


def nll_loss(input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
             size_average: Any = None, ignore_index: int = -100, reduce: Any = None,
             reduction: str = "mean") -> torch.Tensor:
    """``F.nll_loss`` written with differentiable primitives: the picked log-probability
    per target, weighted, ignored targets masked, then the weighted mean (or sum). Rows of
    classes without class weights: one fused node (``spmd::nll``, torch's kernel; its
    backward ``spmd::nll_backward``), which loss parallelism splits along the classes
    like torch's own."""
    reduction = _reduction(size_average, reduce, reduction)
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"nll_loss: {reduction} is not a valid value for reduction")
    if weight is None and input.dim() == 2:
        return nll(input, target, _REDUCTIONS[reduction], ignore_index)[0]
    channel = 1 if input.dim() > 1 else 0
    keep = target != ignore_index
    safe = torch.where(keep, target, torch.zeros_like(target))
    picked = input.gather(channel, safe.unsqueeze(channel)).squeeze(channel)
    w = keep.to(input.dtype)
    if weight is not None:
        w = w * weight[safe]
    losses = -picked * w
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / w.sum()


def cross_entropy(input: torch.Tensor, target: torch.Tensor,
                  weight: torch.Tensor | None = None, size_average: Any = None,
                  ignore_index: int = -100, reduce: Any = None, reduction: str = "mean",
                  label_smoothing: float = 0.0) -> torch.Tensor:
    """``F.cross_entropy`` as ``log_softmax`` then :func:`nll_loss` (class indices) or
    the weighted sum against probabilities (a floating target), label smoothing as torch
    defines it."""
    reduction = _reduction(size_average, reduce, reduction)
    channel = 1 if input.dim() > 1 else 0
    logp = torch.log_softmax(input, channel)
    classes = input.shape[channel]
    if target.is_floating_point():  # class probabilities
        if label_smoothing > 0:
            target = target * (1 - label_smoothing) + label_smoothing / classes
        if weight is not None:
            shape = [1] * input.dim()
            shape[channel] = classes
            logp = logp * weight.view(shape)
        losses = -(logp * target).sum(channel)
        if reduction == "none":
            return losses
        if reduction == "sum":
            return losses.sum()
        return losses.sum() / (losses.numel() if input.dim() > 1 else 1)
    loss = nll_loss(logp, target, weight, ignore_index=ignore_index, reduction=reduction)
    if label_smoothing <= 0:
        return loss
    keep = target != ignore_index
    if weight is not None:
        shape = [1] * input.dim()
        shape[channel] = classes
        smooth = -(logp * weight.view(shape)).sum(channel)
    else:
        smooth = -logp.sum(channel)
    smooth = smooth * keep.to(smooth.dtype)
    if reduction == "none":
        pass
    elif reduction == "sum":
        smooth = smooth.sum()
    elif weight is not None:
        safe = torch.where(keep, target, torch.zeros_like(target))
        smooth = smooth.sum() / (weight[safe] * keep.to(weight.dtype)).sum()
    else:
        smooth = smooth.sum() / keep.sum()
    return (1 - label_smoothing) * loss + label_smoothing / classes * smooth


_REDUCTION_NAMES = {0: "none", 1: "mean", 2: "sum"}


def _aten_cross_entropy(input: torch.Tensor, target: torch.Tensor,
                        weight: torch.Tensor | None = None, reduction: int = 1,
                        ignore_index: int = -100, label_smoothing: float = 0.0) -> torch.Tensor:
    """``aten.cross_entropy_loss`` (what a graph traced above autograd holds, a pipeline
    stage's) as :func:`cross_entropy`."""
    return cross_entropy(input, target, weight, ignore_index=ignore_index,
                         reduction=_REDUCTION_NAMES[reduction], label_smoothing=label_smoothing)


def _aten_nll_loss(input: torch.Tensor, target: torch.Tensor,
                   weight: torch.Tensor | None = None, reduction: int = 1,
                   ignore_index: int = -100) -> torch.Tensor:
    return nll_loss(input, target, weight, ignore_index=ignore_index,
                    reduction=_REDUCTION_NAMES[reduction])


_LOSSES = {F.cross_entropy: cross_entropy, F.nll_loss: nll_loss,
           _aten.cross_entropy_loss.default: _aten_cross_entropy,
           _aten.nll_loss.default: _aten_nll_loss, _aten.nll_loss_nd.default: _aten_nll_loss}
_SDPA = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention,
         _aten.scaled_dot_product_attention.default)


def rewrite_for_meta(gm: fx.GraphModule, example_inputs: list[Any],
                     fused_attention_kernels: bool) -> list[str]:
    """Rewrite a Dynamo graph whose inputs are meta tensors (see the module doc) in
    place; returns one line per kind of call rewritten, for the plan. A graph of real
    tensors is left alone."""
    if not any(isinstance(t, torch.Tensor) and t.is_meta for t in example_inputs):
        return []
    counts: dict[str, int] = {}
    graphs = [m for m in gm.modules() if isinstance(m, fx.GraphModule)]  # checkpoint bodies
    for node in (n for g in graphs for n in g.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in _LOSSES:
            node.target = _LOSSES[node.target]
            key = f"{node.target.__name__} traced as its decomposition (on meta torch " \
                  f"{torch.__version__.split('+')[0]} gives it no backward)"
        elif fused_attention_kernels and node.target in _SDPA:
            node.target = fused_attention
            masked = len(node.args) > 3 and node.args[3] is not None or \
                node.kwargs.get("attn_mask") is not None
            key = ("scaled_dot_product_attention traced as the fused kernel a GPU runs ("
                   + ("memory-efficient, with a mask" if masked else "FlashAttention") + ")")
        else:
            continue
        counts[key] = counts.get(key, 0) + 1
    if counts:
        for g in graphs:
            g.recompile()
    return [f"{what}: {n} call(s)" for what, n in counts.items()]
