"""Sharded checkpoints of parallelized models, through ``torch.distributed.checkpoint`` (DCP).

``model.state_dict()`` of a model whose parameters are stored in parts (fsdp, hsdp, zero1,
zero2, tensor-parallel pieces, pipeline stages, and their compositions) gathers whole
tensors (a pipeline rank: its stages'): simple, but every rank then holds the whole model.
For big models each rank should write only what it stores, and a checkpoint saved under
one layout should load under any other, on any number of ranks, and into a plain module.
These functions, with torch's names for the same job
(``torch.distributed.checkpoint.state_dict.get_state_dict``/``set_state_dict``), do that
for every layout::

    import torch.distributed.checkpoint as dcp

    model_sd, optim_sd = spmd.checkpoint.get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)

    # later, under any layout and number of ranks, into a fresh model and optimizer
    model_sd, optim_sd = spmd.checkpoint.get_state_dict(model, opt)   # destinations
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    spmd.checkpoint.set_state_dict(model, opt, model_state_dict=model_sd,
                                   optim_state_dict=optim_sd)

The keys are exactly the plain module's ``state_dict()`` keys (the module's own
state-dict machinery makes them: tied aliases kept, non-persistent buffers left out) and,
for the optimizer, torch's ``get_optimizer_state_dict`` format (state and param groups
keyed by each parameter's first name), so checkpoints saved by torch's own functions on a
plain model load here and ours load there. A placed tensor is a :class:`ChunkedTensor`:
the whole tensor's shape, this rank's stored part, and where each piece of that part lies
in the whole (DCP's chunk offsets). A tensor-parallel piece cut again by fsdp is one
block of the whole; a ``StridedShard`` piece (fused query-key-value) is several; padding
is never written, and replicas write once (DCP deduplicates equal chunks). Everything
else (replicated parameters, buffers, optimizer steps) is a plain tensor.

A pipeline (``parallelize(..., pipeline=)``) rank holds its stages' parameters once the
first step has cut the model: its model state dict still has every key of the plain
module, another stage's tensor as a ``ChunkedTensor`` of the whole shape with no chunk
(nothing written, nothing read), a weight tied across stages written by each holder (DCP
keeps one; the holders step it alike), what no stage reads by the first pipeline rank;
its optimizer state covers the parameters it holds (the ranks' together: every one), and
each stage composed with fsdp or tensor parallelism is chunked as that layout is. Before
the cut every rank holds (and loads) the whole model; the optimizer state loaded then is
cut with the model at the first step (``PipelineModule.release_with``). No collective
runs: any rank may call these alone. DCP needs torch.distributed to see our groups,
which ``spmd.runtime.init_process_group`` arranges for process ranks. ``dcp.async_save``
is not supported: its staging copies each tensor whole (a ``ChunkedTensor`` refuses).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn as nn

from spmd.state.chunked import Chunk, ChunkedTensor
from spmd.state.layout import Layout, layout_of, local_state_dicts, stored_part
from spmd.lowering.specs import ShardSpec, TPSpec

__all__ = ["ChunkedTensor", "get_state_dict", "set_state_dict", "chunks_of"]


def _runs(idx: torch.Tensor) -> list[tuple[int, int, int]]:
    """(local start, global start, length) of each run of consecutive positions."""
    if not len(idx):
        return []
    starts = [0, *((idx[1:] - idx[:-1] != 1).nonzero().flatten() + 1).tolist(), len(idx)]
    return [(a, int(idx[a]), b - a) for a, b in zip(starts, starts[1:])]


def chunks_of(shape: tuple[int, ...], shard: ShardSpec | None, piece: TPSpec | None
              ) -> tuple[Chunk, ...]:
    """Where this rank's stored part of a tensor of ``shape`` lies in the whole: along
    each dimension, the positions the piece (``TPSpec.positions``) and then the shard
    (``ShardSpec.positions``) keep, cut into runs; a chunk per combination of runs."""
    simulated = (shard is not None and shard.size > 1 and shard.group is None) or (
        piece is not None and any(piece.groups.get(d) is None
                                  for d, n in piece.sizes.items() if n > 1))
    if simulated:  # every rank would claim rank 0's part
        raise RuntimeError(f"spmd.checkpoint: {(shard or piece).param} was placed on a "
                           f"simulated mesh; checkpoints need live ranks")
    if not shape:
        held = shard is None or shard.valid_rows() > 0
        return (((0,), (), ()),) if held else ()
    per_dim = []
    for dim, n in enumerate(shape):
        idx = torch.arange(n)
        if piece is not None:
            idx = piece.positions(dim, idx)
        if shard is not None:
            idx = shard.positions(dim, idx)
        per_dim.append(_runs(idx))
    return tuple((tuple(r[0] for r in combo), tuple(r[1] for r in combo),
                  tuple(r[2] for r in combo)) for combo in itertools.product(*per_dim))


def _chunked(name: str, stored: torch.Tensor, shard: ShardSpec | None,
             piece: TPSpec | None) -> ChunkedTensor:
    spec = piece or shard
    return ChunkedTensor(stored.detach(), spec.shape, chunks_of(spec.shape, shard, piece))


def _pipeline(model: nn.Module) -> Any:
    """``model`` if it is a pipelined model (``spmd.pipeline.module.PipelineModule``), else None."""
    from spmd.pipeline.module import PipelineModule
    from spmd.program.program import program_of

    program = program_of(model)
    return program if isinstance(program, PipelineModule) else None


def _plain(model: nn.Module) -> nn.Module:
    """The module whose names are the checkpoint's: a pipeline's model, else ``model``."""
    pipe = _pipeline(model)
    return model if pipe is None else pipe.module


def _layout(model: nn.Module) -> Layout | None:
    """The model's :class:`Layout` (a pipeline's: its stages' merged)."""
    pipe = _pipeline(model)
    return layout_of(model) if pipe is None else pipe.layout()


def _others(pipe: Any) -> dict[str, ChunkedTensor]:
    """A pipeline rank's entries for what other stages hold: the whole tensor's shape,
    no chunk (nothing written, nothing read), so that every rank's state dict has the plain
    module's keys."""
    return {key: ChunkedTensor(torch.empty(0, dtype=dtype, device=device), shape, ())
            for key, (shape, dtype, device) in pipe.others().items()}


def _check_live(model: nn.Module, where: str) -> None:
    pipe = _pipeline(model)
    if pipe is not None and pipe._planning:
        raise RuntimeError(f"spmd.checkpoint.{where}: the pipeline was planned on a simulated "
                           f"mesh; checkpoints need live ranks")
    state = getattr(model, "_spmd", None)
    if state is not None and not getattr(state, "communicates", True) \
            and getattr(getattr(state, "setup", None), "group", 1) is None:
        raise RuntimeError(f"spmd.checkpoint.{where}: the model was planned on a simulated "
                           f"mesh; checkpoints need live ranks")


def _names(model: nn.Module) -> dict[int, str]:
    """Each distinct parameter -> its first name (torch's key for its optimizer state)."""
    return {id(p): name for name, p in model.named_parameters()}


def _init_state(optimizer: torch.optim.Optimizer, held: set[int] | None) -> None:
    """Make the optimizer's state (a step with zero gradients and a zero learning rate),
    so a checkpoint has tensors to load into; only of the parameters in ``held`` (by id;
    None: all), which a pipeline rank holds."""
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad
              and (held is None or id(p) in held)]
    if any(p.grad is not None for p in params):
        return
    for p in params:
        p.grad = torch.zeros_like(p)
    rates = []
    for group in optimizer.param_groups:
        rates.append(group.get("lr"))
        if "lr" in group:
            group["lr"] = 0.0 if not isinstance(group["lr"], torch.Tensor) else torch.tensor(0.0)
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, rates):
        if lr is not None:
            group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def _held(model: nn.Module) -> set[int] | None:
    """The ids of the parameters this rank holds: a pipeline rank's stages'; None: all."""
    pipe = _pipeline(model)
    held = None if pipe is None else pipe.held()
    if held is None:
        return None
    return {id(p) for n, p in pipe.module.named_parameters() if n in held}


def _optim_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer,
                      layout: Layout | None) -> dict[str, Any]:
    names = _names(_plain(model))
    held = _held(model)
    _init_state(optimizer, held)
    entries: dict[str, Any] = {}
    groups = []
    for group in optimizer.param_groups:
        keys = []
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError("spmd.checkpoint.get_state_dict: the optimizer holds a "
                                 "tensor that is not a parameter of this model")
            name = names[id(p)]
            keys.append(name)
            if held is not None and id(p) not in held:
                continue  # another pipeline rank's: its state is that rank's to write
            shard = piece = None
            if layout is not None:
                shard, piece = layout.shards.get(name), layout.pieces.get(name)
            values = {}
            for key, value in optimizer.state.get(p, {}).items():
                if (isinstance(value, torch.Tensor) and (shard or piece) is not None
                        and value.shape == p.shape):
                    values[key] = _chunked(name, value, shard, piece)
                else:
                    values[key] = value
            if values:
                entries[name] = values
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": keys})
    return {"state": entries, "param_groups": groups}


def get_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None = None
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model state dict, optimizer state dict) of a model under any layout (or a plain
    one), for ``dcp.save`` and as ``dcp.load``'s destinations: the plain module's keys,
    each placed tensor a :class:`ChunkedTensor` over what this rank stores, the rest plain
    tensors sharing memory with the model (see the module doc). No collective runs.

    Example::

        model_sd, optim_sd = spmd.checkpoint.get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    """
    _check_live(model, "get_state_dict")
    with local_state_dicts(_chunked):
        model_sd = model.state_dict()
    pipe = _pipeline(model)
    if pipe is not None:
        if optimizer is not None:
            pipe.release_with(optimizer)
        model_sd.update(_others(pipe))
        order = {k: i for i, k in enumerate(pipe.module.state_dict(keep_vars=True))}
        model_sd = dict(sorted(model_sd.items(),
                               key=lambda kv: order.get(kv[0], len(order))))
    optim_sd = {} if optimizer is None else _optim_state_dict(model, optimizer,
                                                              _layout(model))
    return model_sd, optim_sd


def set_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                   model_state_dict: dict[str, Any] | None = None,
                   optim_state_dict: dict[str, Any] | None = None) -> None:
    """Put loaded state dicts (from :func:`get_state_dict` after ``dcp.load``, or whole
    tensors) back into the model and the optimizer's state. The model's part is its
    strict ``load_state_dict``: every key of the plain module, and no other."""
    _check_live(model, "set_state_dict")
    if model_state_dict is not None:
        model.load_state_dict(model_state_dict)
    if optimizer is None or not optim_state_dict:
        return
    pipe = _pipeline(model)
    if pipe is not None:
        pipe.release_with(optimizer)
    layout = _layout(model)
    params = dict(_plain(model).named_parameters())
    held = _held(model)
    entries = optim_state_dict.get("state", {})
    saved_groups = optim_state_dict.get("param_groups", [])
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(f"spmd.checkpoint.set_state_dict: the optimizer has "
                         f"{len(optimizer.param_groups)} parameter groups, the state dict "
                         f"{len(saved_groups)}")
    for group, saved in zip(optimizer.param_groups, saved_groups):
        for key, value in saved.items():
            if key != "params":
                group[key] = value
        for name in saved.get("params", []):
            if name not in params:
                raise KeyError(f"spmd.checkpoint.set_state_dict: optimizer state for "
                               f"{name}, which is not a parameter of the model")
            param = params[name]
            if held is not None and id(param) not in held:
                continue  # another pipeline rank's
            placed = layout is not None and name in layout.records and (
                name in layout.shards or name in layout.pieces)
            slot = optimizer.state[param]
            for key, value in entries.get(name, {}).items():
                current = slot.get(key)
                # laid out like the parameter: the state this rank holds has its stored
                # shape (a step count, say, does not)
                like = (current.shape == param.shape if isinstance(current, torch.Tensor)
                        else isinstance(value, torch.Tensor) and value.dim() > 0
                        and tuple(value.shape) == layout.records[name].shape) if placed else False
                if isinstance(value, torch.Tensor) and like:
                    value = stored_part(layout, name, value, f"state.{name}.{key}")
                elif isinstance(value, ChunkedTensor):
                    value = value.to_local()
                if isinstance(current, torch.Tensor) and isinstance(value, torch.Tensor) \
                        and current.shape == value.shape:
                    if current.data_ptr() != value.data_ptr():
                        with torch.no_grad():
                            current.copy_(value)
                elif isinstance(value, torch.Tensor):
                    slot[key] = value.detach().clone()
                else:
                    slot[key] = value

