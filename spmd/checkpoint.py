"""Sharded checkpoints of sharded models, through ``torch.distributed.checkpoint`` (DCP).

``model.state_dict()`` of an ``fsdp``/``hsdp`` model gathers whole tensors: simple, but
every rank then holds the whole model. For big models each rank should write only its
shards, and a checkpoint saved on N ranks should load on M. DCP does exactly that for
DTensors, so these functions present a sharded model's parameters (and its optimizer's
state) as DTensors over this rank's shards, with torch's names for the same job
(``torch.distributed.checkpoint.state_dict.get_state_dict``/``set_state_dict``)::

    import torch.distributed.checkpoint as dcp

    model_sd, optim_sd = spmd.checkpoint.get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)

    # later, on any number of ranks, into a fresh model and optimizer
    model_sd, optim_sd = spmd.checkpoint.get_state_dict(model, opt)   # destinations
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    spmd.checkpoint.set_state_dict(model, opt, model_state_dict=model_sd,
                                   optim_state_dict=optim_sd)

Each DTensor's local tensor is this rank's rows of the parameter (its shard without the
padding), ``Shard(0)`` on the sharding dimension and ``Replicate()`` on hybrid
sharding's other one, in torch's chunking (``ceil(rows / N)`` rows a rank, the last
ranks fewer), so DCP reshards between any numbers of ranks. Optimizer state is keyed by
parameter name, as torch's ``get_optimizer_state_dict`` does; a fresh optimizer gets its
state made first (one step with zero gradients and a zero learning rate, as torch does)
so DCP has somewhere to load into. DCP needs torch.distributed to see our groups, which
``spmd.runtime.init_process_group`` arranges for process ranks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from spmd.lowering.specs import ShardSpec

__all__ = ["get_state_dict", "set_state_dict"]


def _state(model: nn.Module, where: str) -> Any:
    state = getattr(model, "_spmd", None)
    if state is None or not getattr(state, "sharded", False):
        raise TypeError(f"spmd.checkpoint.{where}: expected a model parallelized with strategy "
                        f"'fsdp' or 'hsdp'; for a plain or ddp model use model.state_dict() "
                        f"(or torch.distributed.checkpoint.state_dict.get_state_dict)")
    if not state.communicates and state.setup.group is None:
        raise RuntimeError(f"spmd.checkpoint.{where}: the model was planned on a simulated "
                           f"mesh; checkpoints need live ranks")
    return state


def _device_mesh(state: Any) -> tuple[Any, list[Any]]:
    from torch.distributed.tensor import Replicate, Shard

    strategy = state.setup.strategy
    mesh = strategy.mesh
    placements = [Shard(0) if d == strategy.shard_dim else Replicate() for d in mesh.dim_names]
    return mesh.to_torch(), placements


def _as_dtensor(shard: torch.Tensor, spec: ShardSpec, device_mesh: Any,
                placements: list[Any]) -> Any:
    from torch.distributed.tensor import DTensor, Replicate

    if not spec.shape:  # a 0-dim parameter: one row, rank 0's; every rank gets the value
        return DTensor.from_local(spec.gather(shard).clone(), device_mesh,
                                  [Replicate()] * len(placements), run_check=False)
    local = shard.detach().narrow(spec.dim, 0, spec.valid_rows())
    stride = torch.empty(spec.shape, device="meta").stride()
    return DTensor.from_local(local, device_mesh, placements, run_check=False,
                              shape=torch.Size(spec.shape), stride=stride)


def _along(placements: list[Any], spec: ShardSpec) -> list[Any]:
    """The mesh's placements with the sharding dimension's ``Shard`` along the dimension
    this parameter is cut along."""
    from torch.distributed.tensor import Shard

    return [Shard(spec.dim) if p.is_shard() else p for p in placements]


def _init_state(optimizer: torch.optim.Optimizer) -> None:
    """Make the optimizer's state (a step with zero gradients and a zero learning rate),
    so a checkpoint has tensors to load into."""
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
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


def get_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None = None
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model state dict, optimizer state dict) of a sharded model, as DTensors over this
    rank's shards (see the module doc); both also serve as DCP's load destinations.
    Every rank must call it (0-dim parameters are gathered)."""
    state = _state(model, "get_state_dict")
    device_mesh, placements = _device_mesh(state)
    by_id: dict[int, tuple[str, ShardSpec]] = {}
    model_sd: dict[str, Any] = {}
    for name, param in model.named_parameters():
        spec = state.shards[name]
        by_id[id(param)] = (name, spec)
        model_sd[name] = _as_dtensor(param, spec, device_mesh, _along(placements, spec))
    for name, buf in model.named_buffers():
        model_sd[name] = buf.detach()
    optim_sd: dict[str, Any] = {}
    if optimizer is not None:
        _init_state(optimizer)
        entries: dict[str, Any] = {}
        groups = []
        for group in optimizer.param_groups:
            names = []
            for p in group["params"]:
                if id(p) not in by_id:
                    raise ValueError("spmd.checkpoint.get_state_dict: the optimizer holds a "
                                     "tensor that is not a parameter of this model")
                name, spec = by_id[id(p)]
                names.append(name)
                values = {}
                for key, value in optimizer.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor) and tuple(value.shape) == spec.local_shape:
                        values[key] = _as_dtensor(value, spec, device_mesh,
                                                  _along(placements, spec))
                    else:
                        values[key] = value
                entries[name] = values
            groups.append({**{k: v for k, v in group.items() if k != "params"},
                           "params": names})
        optim_sd = {"state": entries, "param_groups": groups}
    return model_sd, optim_sd


def _copy_into(target: torch.Tensor, value: Any, spec: ShardSpec) -> None:
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        if isinstance(value, DTensor) and spec.shape:
            local = value.to_local()
            rows = spec.valid_rows()
            if local.data_ptr() != target.data_ptr():
                target.narrow(spec.dim, 0, rows).copy_(local)
            target.narrow(spec.dim, rows, spec.rows - rows).zero_()
            return
        whole = value.full_tensor() if isinstance(value, DTensor) else value
        target.copy_(spec.shard_of(whole.to(target.dtype)))


def set_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                   model_state_dict: dict[str, Any] | None = None,
                   optim_state_dict: dict[str, Any] | None = None) -> None:
    """Put loaded state dicts (from :func:`get_state_dict` after ``dcp.load``) back into
    the model's shards and the optimizer's state."""
    state = _state(model, "set_state_dict")
    params = dict(model.named_parameters())
    if model_state_dict is not None:
        buffers = dict(model.named_buffers())
        unknown = sorted(set(model_state_dict) - set(params) - set(buffers))
        if unknown:
            raise KeyError(f"spmd.checkpoint.set_state_dict: not in the model: "
                           f"{', '.join(unknown[:5])}")
        for name, value in model_state_dict.items():
            if name in params:
                _copy_into(params[name], value, state.shards[name])
            else:
                with torch.no_grad():
                    buffers[name].copy_(value)
    if optimizer is None or not optim_state_dict:
        return
    entries = optim_state_dict.get("state", {})
    for group, saved in zip(optimizer.param_groups, optim_state_dict.get("param_groups", [])):
        for key, value in saved.items():
            if key != "params":
                group[key] = value
        for name in saved.get("params", []):
            param = params[name]
            spec = state.shards[name]
            slot = optimizer.state[param]
            for key, value in entries.get(name, {}).items():
                current = slot.get(key)
                if isinstance(current, torch.Tensor) and tuple(current.shape) == spec.local_shape:
                    _copy_into(current, value, spec)
                elif isinstance(value, torch.Tensor):
                    slot[key] = value.detach().clone()
                else:
                    slot[key] = value
