"""fuse_optimizer: in a whole-step graph, apply the optimizer straight from each reduced
bucket instead of unpacking gradients and running ``torch.optim`` afterwards.

For a ``torch.optim.SGD`` or ``torch.optim.AdamW`` whose options the flat kernels cover,
each bucket's ``wait`` (a sharded strategy's reduce-scatter: the bucket's gradient
shards, in the same flat layout as the shards they update) is followed by

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
from spmd.lowering.collectives import bucket_results
from spmd.lowering.context import LoweringContext
from spmd.lowering.graph import collective_nodes, is_wait
from spmd.lowering import ops
from spmd.lowering.specs import Handles, lookup
from spmd.lowering.shard_params import scattered_results
from spmd.lowering.state import Boundary, OptimizerFusion, Role, needs, put

__all__ = ["fusable", "why_not_fusable", "register_optimizer", "fuse_optimizer",
           "optimizer_step"]


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


def fusable(optimizer: Any) -> str | None:
    """``"sgd"``/``"adamw"`` when the flat kernels reproduce this optimizer's step, else
    None (:func:`why_not_fusable` says why)."""
    if why_not_fusable(optimizer):
        return None
    return "sgd" if type(optimizer) is torch.optim.SGD else "adamw"


def why_not_fusable(optimizer: Any) -> str:
    """Why the flat kernels cannot stand in for ``optimizer.step()`` (empty if they can)."""
    if type(optimizer) not in (torch.optim.SGD, torch.optim.AdamW):
        return f"{type(optimizer).__name__} has no flat-bucket kernel"
    from torch.optim import optimizer as torch_optimizer

    hooks = (optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks,
             getattr(torch_optimizer, "_global_optimizer_pre_hooks", {}),
             getattr(torch_optimizer, "_global_optimizer_post_hooks", {}))
    if any(hooks):
        return "the optimizer has step hooks, which must run around its own step()"
    for group in optimizer.param_groups:
        for flag in ("differentiable", "capturable", "fused"):
            if group.get(flag):
                return f"{flag}=True"
        if any(p.dtype not in SUPPORTED_DTYPES or not p.is_contiguous()
               for p in group["params"]):
            return "a parameter's dtype or layout is not one the kernels take"
    return ""


def register_optimizer(optimizer: torch.optim.Optimizer, handles: Handles) -> int:
    """The handle graphs use for ``optimizer``, owned by ``handles``' owner."""
    why = why_not_fusable(optimizer)
    if why:
        raise ValueError(f"{type(optimizer).__name__} cannot run from flat buckets: {why}")
    kind = "sgd" if type(optimizer) is torch.optim.SGD else "adamw"
    return handles.add(OptimizerSpec(optimizer=optimizer, kind=kind))


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

    spec: OptimizerSpec = lookup(handle)
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
        # parameters at different step counts (a layer frozen for some steps) get their
        # own bias correction: one kernel call per run of equal counts
        at = 0
        for count, run in itertools.groupby(zip(members, states), lambda m: int(m[1]["step"])):
            run = list(run)
            n = sum(p.numel() for p, _ in run)
            kernels.adamw_step(
                [p for p, _ in run], chunk[at:at + n], [s["exp_avg"] for _, s in run],
                [s["exp_avg_sq"] for _, s in run],
                [s["max_exp_avg_sq"] for _, s in run] if group["amsgrad"] else None,
                step=count, lr=group["lr"], betas=group["betas"], eps=group["eps"],
                weight_decay=group["weight_decay"], amsgrad=group["amsgrad"],
                maximize=group["maximize"])
            at += n


def _fake_optimizer_step(params: list[torch.Tensor], flat: torch.Tensor, handle: int) -> None:
    return None


optimizer_step = ops.define("optimizer_step(Tensor(a!)[] params, Tensor flat, int handle) -> ()",
                            _optimizer_step, _fake_optimizer_step)


_BUCKET_KINDS = ("all_reduce", "reduce_scatter")  # what leaves a gradient's bucket


def _results(gm: fx.GraphModule, collective: fx.Node) -> list[fx.Node]:
    if collective.meta["spmd_collective"].kind == "reduce_scatter":
        return scattered_results(gm, collective)
    return bucket_results(gm, collective)


def _flat_result(collective: fx.Node) -> fx.Node:
    """The bucket's reduced values as one flat tensor in the parameters' dtype: the wait,
    or a reduce-scatter's cast after it."""
    (wait,) = [u for u in collective.users if is_wait(u)]
    if collective.meta["spmd_collective"].kind == "reduce_scatter":
        cast = [u for u in wait.users if u.target is torch.ops.aten._to_copy.default]
        if cast:
            return cast[0]
    return wait


def _gradient_readers(gm: fx.GraphModule, gradients: tuple) -> dict[str, list[str]]:
    """The nodes that read each parameter's (reduced, where reduced) gradient, besides the
    graph's output and its collective."""
    out = gm.graph.output_node()
    reduced = {p: value for c in collective_nodes(gm)
               if c.meta["spmd_collective"].kind in _BUCKET_KINDS
               for p, value in zip(c.meta["spmd_collective"].params, _results(gm, c))}
    nodes = {n.name: n for n in gm.graph.nodes}
    readers = {}
    for g in gradients:
        value = reduced.get(g.param, nodes.get(g.node))
        users = [] if value is None else [
            u.name for u in value.users if u is not out and u.meta.get("spmd_collective") is None]
        if users:
            readers[g.param] = users
    return readers


def fuse_optimizer(gm: fx.GraphModule, ctx: LoweringContext) -> fx.GraphModule:
    """Apply the optimizer from each bucket, when the step has one that can run there and
    nothing else in the step reads the reduced gradients; otherwise record why not."""
    boundary = needs(gm, Boundary, "fuse_optimizer")
    readers = _gradient_readers(gm, boundary.gradients)
    reading = tuple(sorted({r for rs in readers.values() for r in rs}))
    if readers and ctx.strategy.shards_parameters:
        from spmd.lowering.annotate import PlanningError

        param, who = next(iter(readers.items()))
        raise PlanningError(
            f"the step reads the gradient of {param} itself ({who[0]}), e.g. to clip it; with "
            f"strategy {ctx.strategy.name!r} each rank holds only its shard of every gradient, "
            f"so a norm computed from .grad would be this rank's part, not the whole "
            f"gradient's. Parallelize the model as a module and call model.clip_grad_norm_")

    def not_fused(why: str) -> fx.GraphModule:
        put(gm, OptimizerFusion(kind=None, reason=why, readers=reading))
        return gm

    if ctx.optimizer is None:
        return not_fused("no optimizer the step can run from buckets")
    spec: OptimizerSpec = lookup(ctx.optimizer)
    out = gm.graph.output_node()
    outputs = list(out.args[0])
    buckets = [c for c in collective_nodes(gm)
               if c.meta["spmd_collective"].kind in _BUCKET_KINDS]
    covered = {p for c in buckets for p in c.meta["spmd_collective"].params}
    missing = [g.param for g in boundary.gradients if g.param not in covered]
    if not buckets or missing:
        return not_fused(f"gradients not reduced in a bucket: {', '.join(missing) or 'all'}")
    if readers:
        param, who = next(iter(readers.items()))
        return not_fused(f"the step reads the gradient of {param} itself ({who[0]}), e.g. to "
                         f"clip it; the optimizer runs on .grad after the graph")
    position = {g.param: g.output for g in boundary.gradients}
    replaced = [p for p in covered if position.get(p) is None]
    if replaced:
        return not_fused(f"the step replaces the .grad of {replaced[0]}; the optimizer runs on "
                         f".grad after the graph")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]  # in input order
    names = {info.name: i for i, info in enumerate(ctx.inputs)}
    for coll in buckets:
        params = coll.meta["spmd_collective"].params
        flat = _flat_result(coll)  # a reduce-scatter's: the shards, in bucket order
        with gm.graph.inserting_after(flat):
            step = gm.graph.call_function(
                optimizer_step, ([placeholders[names[p]] for p in params], flat, ctx.optimizer))
        step.meta["val"] = None
        step.meta["sharding"] = flat.meta["sharding"]
        step.meta["spmd_role"] = Role(kind="optimizer", collective=coll.name)
        for p in params:
            outputs[position[p]] = None
    out.args = (tuple(outputs),)
    gm.graph.eliminate_dead_code()
    put(gm, OptimizerFusion(kind=spec.kind, reason=f"{spec.kind} runs from each reduced bucket"))
    return gm
