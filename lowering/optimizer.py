"""fuse_optimizer: in a whole-step graph, apply the optimizer straight from each reduced
bucket instead of unpacking gradients and running ``torch.optim`` afterwards.

For a ``torch.optim.SGD`` or ``torch.optim.AdamW`` whose options the flat kernels cover,
each bucket's ``wait`` is followed by

    spmd.optimizer_step([p0, p1, ...], flat, handle)     # params updated in place

which calls ``spmd.kernels.sgd_step`` / ``adamw_step`` on the bucket as it is, reading the
optimizer's hyperparameters when it runs (so a learning-rate schedule takes effect) and
keeping state in ``optimizer.state[p]`` exactly as ``torch.optim`` does, so either can
take over from the other. The bucket's gradients are then unused and their unpacking is
dropped from the graph.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from spmd.kernels.layout import SUPPORTED_DTYPES
from spmd.lowering.collectives import collective_nodes
from spmd.lowering.context import LoweringContext
from spmd.lowering.graph import is_wait
from spmd.lowering.ops import _lib

__all__ = ["fusable", "register_optimizer", "fuse_optimizer", "optimizer_step"]


@dataclass(frozen=True, eq=False, kw_only=True)
class OptimizerSpec:
    optimizer: torch.optim.Optimizer
    kind: str  # "sgd" | "adamw"
    _owners: dict[tuple, tuple] = field(default_factory=dict, init=False, repr=False)

    def owners(self) -> dict[int, dict]:
        """``id(param) -> its param group``, rebuilt when the groups change: a group added,
        replaced (``load_state_dict`` makes new ones), or its parameter list replaced or
        resized."""
        groups = self.optimizer.param_groups
        key = tuple((id(g), id(g["params"]), len(g["params"])) for g in groups)
        cached = self._owners.get(key)
        if cached is None:
            self._owners.clear()
            # the map, and the lists it was built from, kept alive so their ids stay theirs
            cached = self._owners[key] = ({id(p): g for g in groups for p in g["params"]},
                                          [g["params"] for g in groups])
        return cached[0]


_OPTIMIZERS: dict[int, OptimizerSpec] = {}
_IDS = itertools.count(1)


def fusable(optimizer: Any) -> str | None:
    """``"sgd"``/``"adamw"`` when the flat kernels reproduce this optimizer, else None."""
    if type(optimizer) is torch.optim.SGD:
        kind = "sgd"
    elif type(optimizer) is torch.optim.AdamW:
        kind = "adamw"
    else:
        return None
    for group in optimizer.param_groups:
        if group.get("differentiable") or group.get("capturable") or group.get("fused"):
            return None
        if any(p.dtype not in SUPPORTED_DTYPES or not p.is_contiguous()
               for p in group["params"]):
            return None
    return kind


def register_optimizer(optimizer: torch.optim.Optimizer) -> int:
    kind = fusable(optimizer)
    if kind is None:
        raise ValueError(f"{type(optimizer).__name__} cannot run from flat buckets")
    handle = next(_IDS)
    _OPTIMIZERS[handle] = OptimizerSpec(optimizer=optimizer, kind=kind)
    return handle


_lib.define("optimizer_step(Tensor(a!)[] params, Tensor flat, int handle) -> ()")


def _group_runs(owner: dict[int, dict], params: list[torch.Tensor]):
    """Consecutive runs of ``params`` that share a param group: (group, start, members)."""
    run: list[torch.Tensor] = []
    group = None
    start = offset = 0
    for p in params:
        g = owner[id(p)]
        if g is not group and run:
            yield group, start, run
            run, start = [], offset
        group = g
        run.append(p)
        offset += p.numel()
    if run:
        yield group, start, run


def _optimizer_step(params: list[torch.Tensor], flat: torch.Tensor, handle: int) -> None:
    import spmd.kernels as kernels

    spec = _OPTIMIZERS[handle]
    opt = spec.optimizer
    for group, start, members in _group_runs(spec.owners(), list(params)):
        n = sum(p.numel() for p in members)
        chunk = flat[start:start + n]
        states = [opt.state[p] for p in members]
        if spec.kind == "sgd":
            buffers = [s.get("momentum_buffer") for s in states]
            kernels.sgd_step(members, chunk, buffers if group["momentum"] else None,
                             lr=group["lr"], momentum=group["momentum"],
                             dampening=group["dampening"], nesterov=group["nesterov"],
                             weight_decay=group["weight_decay"], maximize=group["maximize"])
            if group["momentum"]:
                for s, b in zip(states, buffers):
                    s["momentum_buffer"] = b
            continue
        for p, s in zip(members, states):
            if not s:
                s["step"] = torch.tensor(0.0)
                s["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                s["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if group["amsgrad"]:
                    s["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            s["step"] += 1
        kernels.adamw_step(
            members, chunk, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
            [s["max_exp_avg_sq"] for s in states] if group["amsgrad"] else None,
            step=int(states[0]["step"]), lr=group["lr"], betas=group["betas"], eps=group["eps"],
            weight_decay=group["weight_decay"], amsgrad=group["amsgrad"],
            maximize=group["maximize"])


def _fake_optimizer_step(params: list[torch.Tensor], flat: torch.Tensor, handle: int) -> None:
    return None


_lib.impl("optimizer_step", _optimizer_step, "CompositeExplicitAutograd")
torch.library.register_fake("spmd::optimizer_step", _fake_optimizer_step, lib=_lib)
optimizer_step = torch.ops.spmd.optimizer_step.default


def fuse_optimizer(gm: fx.GraphModule, ctx: LoweringContext) -> fx.GraphModule:
    """Apply the optimizer from each bucket; a no-op when the step has no fusable one."""
    handle = gm.meta.get("spmd_optimizer")
    if handle is None:
        return gm
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]  # in input order
    positions = gm.meta["spmd_grad_positions"]
    names = {info.name: i for i, info in enumerate(ctx.inputs)}
    out = gm.graph.output_node()
    outputs = list(out.args[0])
    for coll in collective_nodes(gm):
        params = coll.meta["spmd"]["spec"].params
        (wait,) = [u for u in coll.users if is_wait(u)]
        with gm.graph.inserting_after(wait):
            param_nodes = [placeholders[names[p]] for p in params]
            step = gm.graph.call_function(optimizer_step, (param_nodes, wait, handle))
        step.meta["spmd_unpack_of"] = coll.name
        for p in params:
            outputs[positions[p]] = None
    out.args = (tuple(outputs),)
    gm.graph.eliminate_dead_code()
    gm.meta["spmd_fused_optimizer"] = _OPTIMIZERS[handle].kind
    return gm
