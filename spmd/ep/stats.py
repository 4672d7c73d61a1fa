"""``spmd.ep``'s statistics over the expert-parallel group: each expert's load and what a
capacity factor dropped in the last forward, and the router's load-balancing loss over
every data rank's tokens."""

from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F


def expert_load(model: nn.Module) -> dict[str, torch.Tensor]:
    """The last forward's token count per expert of each expert-parallel layer (module
    path -> ``(E,)`` counts over every rank), gathered over the expert-parallel group and,
    where each rank routed its part of the sequence (beside context parallelism),
    summed over the parts: every rank must call it."""
    from spmd.runtime.collectives import all_gather_into_tensor, all_reduce

    out: dict[str, torch.Tensor] = {}
    for path, spec in _layers(model):
        whole = spec.load.new_zeros(spec.num_experts)
        if spec.communicates:
            all_gather_into_tensor(whole, spec.load.contiguous(), group=spec.group)
        else:
            whole.copy_(spec.load.repeat(spec.size))
        if spec.parts > 1:  # (a sum over a product of dimensions: one after another)
            for group in spec.context_groups:
                all_reduce(whole, group=group)
        out[path] = whole
    return out


def dropped_tokens(model: nn.Module) -> dict[str, torch.Tensor]:
    """Under a capacity factor (:func:`experts`), the (token, choice) pairs the last
    forward dropped per expert of each expert-parallel layer (module path -> ``(E,)``
    counts summed over the expert-parallel group; zeros when dropless or nothing was
    dropped); every rank must call it."""
    from spmd.runtime.collectives import all_reduce

    out: dict[str, torch.Tensor] = {}
    for path, spec in _layers(model):
        total = (spec.dropped.clone() if spec.dropped is not None
                 else spec.load.new_zeros(spec.num_experts))
        if spec.communicates:
            all_reduce(total, group=spec.group)
        out[path] = total
    return out


def _layers(model: nn.Module) -> Iterator[tuple[str, Any]]:
    """(module path, its ``ExpertsSpec``) of each expert-parallel layer of ``model`` that
    has run a forward."""
    from spmd.lowering.specs import lookup

    for path, module in model.named_modules():
        handle = getattr(module, "_spmd_ep_handle", None)
        if handle is not None and lookup(handle).load is not None:
            yield path, lookup(handle)


def load_balancing_loss(router_logits: Any, top_k: int, model: nn.Module | None = None,
                        num_experts: int | None = None) -> torch.Tensor:
    """The Switch Transformer / Mixtral load-balancing loss (transformers'
    ``load_balancing_loss_func``, without a padding mask) over the tokens of every data
    rank of ``model``, as one process computes it on the whole batch.

    ``E · Σ_e f_e · P_e`` (``f_e``: the share of choices routed to expert ``e``, per
    choice slot; ``P_e``: the mean router probability of ``e``) is a product of two means
    over tokens, not a mean over tokens: computed on each rank's rows and averaged (what
    ddp does to a loss) it is not the whole batch's. Here both means are averaged over
    the data ranks first (``spmd::data_mean``: an all-reduce forward, each rank's
    gradient passed on unscaled, so that ddp's average gives the whole batch's).
    Every rank must call it with the same number of tokens. A z-loss (the mean of
    ``logsumexp(logits)²``) is a mean over tokens, exact without this.

    Args:
        router_logits: ``(tokens, experts)`` logits, or a sequence of them (one per
            layer, as transformers returns ``router_logits``): concatenated, as
            transformers does.
        top_k: choices per token.
        model: the parallelized model whose data ranks hold the batch (None, or a model
            not parallelized: this process's tokens alone).
        num_experts: defaults to the logits' last dimension.
    """
    from spmd.lowering.experts import data_mean

    logits = (torch.cat([torch.as_tensor(t) for t in router_logits], dim=0)
              if isinstance(router_logits, (list, tuple)) else router_logits)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"spmd.ep.load_balancing_loss: router_logits must be (tokens, "
                         f"experts) logits or a sequence of them, got "
                         f"{getattr(logits, 'shape', type(logits).__name__)}")
    experts = num_experts or logits.shape[-1]
    if not isinstance(top_k, int) or not 0 < top_k <= experts:
        raise ValueError(f"spmd.ep.load_balancing_loss: top_k must be in 1..{experts}, "
                         f"got {top_k!r}")
    probs = logits.softmax(dim=-1)
    _, selected = probs.topk(top_k, dim=-1)
    mask = F.one_hot(selected, experts).to(probs.dtype)
    tokens_per_expert = mask.mean(dim=0)          # (k, E)
    router_prob = probs.mean(dim=0)               # (E,)
    handle = _mean_handle(model)
    if handle is not None:
        tokens_per_expert = data_mean(tokens_per_expert, handle)
        router_prob = data_mean(router_prob, handle)
    return (tokens_per_expert * router_prob.unsqueeze(0)).sum() * experts


def _mean_handle(model: nn.Module | None) -> int | None:
    """The handle of a :class:`~spmd.lowering.experts.MeanSpec` over ``model``'s data
    ranks (made once per model); None for no model or one not parallelized."""
    from spmd.lowering.experts import MeanSpec

    program = getattr(model, "_spmd", None) if model is not None else None
    if program is None:
        return None
    handle = getattr(program, "_spmd_mean_handle", None)
    if handle is None:
        setup = program.setup
        spec = MeanSpec(group=setup.group, size=setup.world_size)
        handle = program.handles.add(spec)
        program._spmd_mean_handle = handle
    return handle
