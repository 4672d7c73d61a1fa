"""``parallelize(model, strategy="auto")`` on a live mesh (:mod:`spmd.auto.search`): the search
at the first call on the first rank, its finalists sent to every rank and measured there
when several are close, the fastest applied to the model in place."""

from __future__ import annotations

import copy
import hashlib
import os
import time
import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from spmd.auto.search import AutoPlan, plan_auto
from spmd.auto.candidates import (Candidate, checkpoint_modules, layout_placements,
                                  parse_budget, strategy_mesh)
from spmd.lowering.strategy import kind_of
from spmd.runtime.mesh import Mesh

__all__ = ["Searched", "parallelize_auto"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Searched:
    """What a live model's search chose, as the first rank sent it (the plans it made
    stay there): the table of candidates and the layout's fingerprint."""

    summary: str
    fingerprint: str
    runs: str = ""  # the layout it runs (the fastest measured of the close ones)

    def explain(self, name: str) -> None:
        return None  # the program stayed on the first rank: the plan explains the rest

    def __str__(self) -> str:
        return self.summary


def parallelize_auto(module: nn.Module, mesh: Mesh | None, memory_budget: Any,
                     placements: Any, options: dict, where: str) -> nn.Module:
    """``parallelize(module, strategy="auto")``: the layout is searched at the first call
    (it needs the batch's shapes), on the first rank, and sent to the others; then the
    module is parallelized with it in place and the call goes on. Until then the module is
    itself (an optimizer made now keeps stepping the same parameters)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"{where}: strategy='auto' takes a model instance (the layout is "
                        f"searched on it), got {type(module).__name__}")
    parse_budget(memory_budget, where)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise TypeError(f"{where}: strategy='auto' searches on positional inputs; got "
                            f"keyword inputs {sorted(kwargs)}")
        del self.forward
        return _first_call(self, mesh, memory_budget, placements, options, where,
                           args)

    module.forward = types.MethodType(forward, module)
    return module


_FINALISTS = 3  # layouts measured on a live mesh at most
_WITHIN = 1.25  # ... whose predicted step is within this factor of the best's
_STEPS = 3  # measured steps of each (after one that compiles)


def _layout(c: Candidate) -> tuple:
    return (c.strategy, c.roles, dict(c.pieces), tuple(c.recompute), c.label, c.experts)


def _free_bytes(module: nn.Module) -> int:
    """Memory free now where the model lives: the GPU's (``mem_get_info``), else the
    host's available physical memory."""
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def _finalists(auto: AutoPlan, model_bytes: int, free: int) -> list[Candidate]:
    """The fitting layouts worth measuring: predicted within ``_WITHIN`` of the best, at
    most ``_FINALISTS``, where a whole copy of the model and its predicted peak fit in
    half the memory free now (measuring runs copies); else the predicted best alone."""
    fitting = sorted((c for c in auto.candidates if auto.admits(c)), key=lambda c: c.seconds)
    best = auto.chosen
    close = [c for c in fitting if c.seconds <= best.seconds * _WITHIN][:_FINALISTS]
    if best not in close:
        close = [best] + close[:_FINALISTS - 1]
    if len(close) < 2 or any(2 * (model_bytes + c.peak) > free for c in close):
        return [best]
    return close


def _measure(module: nn.Module, mesh: Mesh, layouts: list[tuple], args: tuple,
             options: dict, where: str) -> list[float]:
    """Each layout's step on this mesh, every rank at once: a copy of ``module``
    parallelized with it runs one step that compiles, then ``_STEPS`` forward-backward
    passes on ``args`` (gradients of the sum of the outputs; the model's own and the
    random state are untouched); the slowest rank's median, the same on every rank."""
    import statistics

    from spmd.program.wrapper import parallelize_instance
    from spmd.lowering.options import Options
    from spmd.runtime import collectives
    from spmd.runtime.reduction import ReduceOp

    out = []
    for kind, roles, pieces, recompute, _, experts in layouts:
        copy_ = copy.deepcopy(module)
        checkpoint_modules(copy_, recompute)
        kwargs = dict(options)
        placements = layout_placements(roles, pieces, experts)
        if placements is not None:
            kwargs["placements"] = placements
        opts = Options.from_kwargs(where, **{**kwargs, **kind_of(kind).arguments})
        run = parallelize_instance(copy_, opts, strategy_mesh(mesh, roles, kind))
        times = []
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            for step in range(_STEPS + 1):
                start = time.perf_counter()
                leaves = [t for t in pytree.tree_leaves(run(*args))
                          if isinstance(t, torch.Tensor) and t.requires_grad]
                sum(t.float().sum() for t in leaves).backward()
                if step:
                    times.append(time.perf_counter() - start)
        mine = torch.tensor([statistics.median(times)], dtype=torch.float64)
        for d in range(mesh.ndim):
            collectives.all_reduce(mine, op=ReduceOp.MAX, group=mesh.get_group(d))
        out.append(float(mine))
        del run, copy_
    return out


def _across_hosts(mesh: Mesh) -> dict:
    """What the search needs to price a live mesh across hosts (its ranks' hosts and the
    link between them, probed once per job; every rank of the world calls it), as
    ``Mesh.simulated``'s arguments; nothing where the mesh is on one host or is not the
    whole world."""
    from spmd.lowering.calibrate import probe_network
    from spmd.lowering.cost_model import CostModel
    from spmd.runtime import groups
    from spmd.runtime.topology import Topology, get_topology

    topo = get_topology()
    names = [topo.names[topo.host_of(r)] for r in mesh.ranks]
    if len(set(names)) < 2 or len(mesh.ranks) != groups.get_world_size():
        return {}
    world = groups.world("strategy='auto'").default
    probed = probe_network(world, CostModel.default(world.backend, world.size()))
    if probed.network is None:
        return {}
    return {"topology": Topology.from_names(names, topo.source), "network": probed.network}


def _first_call(module: nn.Module, mesh: Mesh | None, memory_budget: Any,
                placements: Any, options: dict, where: str, args: tuple) -> Any:
    """The search on the first rank, its finalists sent to every rank and, when several
    are close, measured there; the fastest measured is applied to ``module``."""
    from spmd.program.wrapper import parallelize_instance
    from spmd.lowering.options import Options
    from spmd.runtime import groups
    from spmd.runtime.objects import broadcast_object_list

    if mesh is None:
        mesh = Mesh(groups.get_world_size())
    first = mesh.rank_at([0] * mesh.ndim)
    choice: list[Any] = [None]
    across = _across_hosts(mesh)  # (every rank: the link probe is a collective)
    if groups.get_rank() == first:
        planning = Mesh.simulated(mesh.shape, mesh.dim_names, **across)
        try:
            with torch.enable_grad():  # (a first call under no_grad plans training too)
                auto = plan_auto(module, args, mesh=planning, memory_budget=memory_budget,
                                 placements=placements, search_roles=False, where=where,
                                 **options)
            model_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
            finalists = _finalists(auto, model_bytes, _free_bytes(module))
            choice[0] = ("ok", [_layout(c) for c in finalists],
                         auto.summary())
        except Exception as e:  # every rank raises it, not only this one
            choice[0] = ("error", type(e).__name__, str(e))
    # from the first rank along each dimension in turn: after dimension d, every rank whose
    # coordinates after d are 0 holds it (a group's first rank along d has coordinate 0)
    for d in range(mesh.ndim):
        group = mesh.get_group(d)
        broadcast_object_list(choice, src=group.ranks[0], group=group)
    if choice[0][0] == "error":
        from spmd.lowering.annotate import PlanningError

        raise PlanningError(f"{where}: strategy='auto' (searched on rank {first}): "
                            f"{choice[0][1]}: {choice[0][2]}")
    _, layouts, summary = choice[0]
    pick = 0
    if len(layouts) > 1:
        with torch.enable_grad():
            measured = _measure(module, mesh, layouts, args, options, where)
        pick = min(range(len(layouts)), key=lambda i: (measured[i], i))
        summary += ("\n  measured here, the slowest rank's median of "
                    f"{_STEPS} steps (the predictions within {_WITHIN}x of the best): "
                    + ", ".join(f"{lay[4]} {t * 1e3:.2f} ms" for lay, t in zip(layouts, measured))
                    + f"; runs {layouts[pick][4]}")
    kind, roles, pieces, recompute, label, experts = layouts[pick]
    checkpoint_modules(module, recompute)
    kwargs = dict(options)
    placements = layout_placements(roles, pieces, experts)
    if placements is not None:
        kwargs["placements"] = placements
    opts = Options.from_kwargs(where, **{**kwargs, **kind_of(kind).arguments})
    parallelize_instance(module, opts, strategy_mesh(mesh, roles, kind))
    key = layouts[pick][:4] + (layouts[pick][5],)
    fingerprint = hashlib.sha256(repr(key).encode()).hexdigest()[:16]
    module._spmd.auto = Searched(summary=summary, fingerprint=fingerprint, runs=label)
    return module(*args)
