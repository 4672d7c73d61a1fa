"""The layouts ``strategy="auto"`` compares (:mod:`spmd.auto.search`): what each mesh dimension
does (:class:`Roles`), the data strategies tried, the memory budget, and one layout
planned for real on a copy of the model (:class:`Candidate`, :func:`plan_candidate`)."""

from __future__ import annotations

import copy
import math
import re
import types
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from spmd.plan.plan import Plan
from spmd.lowering.strategy import KINDS, kind_of
from spmd.runtime.mesh import Mesh

__all__ = ["Roles", "Candidate", "parse_budget", "checkpoint_modules", "plan_candidate",
           "layout_placements",
           "roles_of", "kinds_for", "strategy_mesh", "gib", "SEARCHED"]

# the data strategies tried on one data dimension: the rows of KINDS marked searched
SEARCHED = tuple(name for name, k in KINDS.items() if k.searched and not k.hybrid)


def parse_budget(budget: Any, where: str) -> float:
    """Bytes from ``memory_budget``: an int (bytes), or a string such as ``"70GiB"``,
    ``"512MiB"``, ``"80GB"``; None: no limit (a simulated cluster: its device's memory)."""
    if budget is None:
        return math.inf
    if isinstance(budget, bool):
        raise TypeError(f"{where}: memory_budget must be bytes or a string like '70GiB', got "
                        f"{budget!r}")
    if isinstance(budget, (int, float)):
        if not budget > 0 or not math.isfinite(budget):
            raise ValueError(f"{where}: memory_budget must be a positive number of bytes, got "
                             f"{budget!r}")
        return float(budget)
    if not isinstance(budget, str):
        raise TypeError(f"{where}: memory_budget must be bytes or a string like '70GiB', got "
                        f"{type(budget).__name__}")
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B|B)\s*", budget)
    if not m:
        raise ValueError(f"{where}: memory_budget {budget!r} is not a size; write e.g. '70GiB', "
                         f"'512MiB', '80GB' or a number of bytes")
    unit = m.group(2)
    power = "BKMGT".index(unit[0])
    base = 1024 if "i" in unit else 1000
    value = float(m.group(1)) * base ** power
    if value <= 0:
        raise ValueError(f"{where}: memory_budget must be positive, got {budget!r}")
    return value


def gib(n: float) -> str:
    if not math.isfinite(n):
        return "no limit"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.3f} {unit}"
    return f"{n:.0f} B"


# -- roles of the mesh's dimensions ---------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Roles:
    """What each of the user's mesh dimensions does: ``data`` (the batch split along them)
    and ``tp`` (the model split along it, or None). ``names`` renames the user's
    dimensions to the strategies' (``"dp"``, ``"fsdp"``, ``"tp"``)."""

    data: tuple[str, ...]
    tp: str | None
    names: tuple[str, ...]  # the renamed mesh's dimension names, in the user's order
    tile: int = 1  # rows each data rank holds per row of the example (the tp size)

    def describe(self, mesh: Mesh) -> str:
        return ", ".join(f"{u!r} ({mesh.size(u)}) " + ("tensor-parallel" if u == self.tp
                                                       else "data")
                         for u in mesh.dim_names)


def roles_of(mesh: Mesh, tp_candidates: tuple[str, ...]) -> list[Roles]:
    """Every assignment: all data; each of ``tp_candidates`` tensor-parallel, the rest data."""
    dims = mesh.dim_names
    if len(dims) > 2:
        raise ValueError(f"strategy='auto': meshes of one or two dimensions are searched; "
                         f"{mesh} has {len(dims)}")

    def data_names(data: list[str]) -> dict[str, str]:
        return ({data[0]: "dp"} if len(data) == 1 else
                {data[0]: "dp", data[1]: "fsdp"} if len(data) == 2 else {})

    out = []
    names = data_names(list(dims))
    out.append(Roles(data=dims, tp=None, names=tuple(names[d] for d in dims)))
    for tp in tp_candidates:
        data = [d for d in dims if d != tp]
        names = {**data_names(data), tp: "tp"}
        out.append(Roles(data=tuple(data), tp=tp, names=tuple(names[d] for d in dims),
                         tile=mesh.size(tp)))
    return out


def kinds_for(roles: Roles, mesh: Mesh, mixed: bool = False) -> list[str]:
    """The data strategies tried, the rows of ``KINDS`` marked ``searched``: on a data
    dimension of one rank those that store whole parameters (sharding buys nothing);
    hybrid rows where two data dimensions have several ranks; beside tensor parallelism
    those marked ``searched_with_tp`` (ddp, fsdp and zero2: zero1 keeps zero2's memory
    for more traffic). ``mixed`` (``param_dtype=``, which the sharded strategies apply):
    only the sharded rows."""
    several = [d for d in roles.data if mesh.size(d) > 1]
    rows = {name: k for name, k in KINDS.items() if k.searched}
    if not several:
        kinds = [name for name, k in rows.items() if not k.shards]
    elif len(several) == 2:
        kinds = list(rows)
    else:
        kinds = [name for name, k in rows.items() if not k.hybrid
                 and (roles.tp is None or k.searched_with_tp)]
    if mixed:
        kinds = ([k for k in kinds if rows[k].shards]
                 or [next(name for name, k in rows.items() if k.shards and not k.hybrid)])
    return kinds


def strategy_mesh(mesh: Mesh, roles: Roles, kind: str) -> Mesh:
    """The user's mesh renamed for ``kind`` (a row of ``KINDS``); a row that stores whole
    parameters (ddp) on two data dimensions runs on the two flattened into one (the
    sharded ones flatten them themselves, ``dims_to_flatten``)."""
    renamed = mesh.rename(roles.names)
    data = [n for n, u in zip(roles.names, mesh.dim_names) if u in roles.data]
    if (not kind_of(kind).shards and len(data) == 2
            and all(renamed.size(d) > 1 for d in data)):
        return renamed.flatten(tuple(data), "dp")
    return renamed


def checkpoint_modules(model: nn.Module, paths: tuple[str, ...]) -> None:
    """Recompute each module at ``paths`` in backward (torch's non-reentrant
    ``checkpoint`` around its forward), as torchtitan's activation checkpointing wraps
    blocks; the modules stay where they are, their parameters keep their names."""
    from torch.utils.checkpoint import checkpoint

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(type(self).forward, self, *args, use_reentrant=False, **kwargs)

    for path in paths:
        sub = model.get_submodule(path)
        sub.forward = types.MethodType(forward, sub)
        sub._spmd_recomputed = True


# -- candidates ------------------------------------------------------------------------


@dataclass(kw_only=True)
class Planned:
    """A layout the search planned (or failed to plan): its predicted step and peak."""

    label: str
    strategy: str
    plan: Plan | None = None
    seconds: float = math.inf
    peak: float = math.inf
    error: str = ""

    def fits(self, budget: float) -> bool:
        return not self.error and self.peak <= budget


@dataclass(kw_only=True)
class Candidate(Planned):
    """One layout planned for real: its strategy, placements on the tensor-parallel
    dimension, recomputed blocks, and its predicted step and peak."""

    roles: Roles
    pieces: dict[str, Any] = field(default_factory=dict)  # parameter -> tp placement
    recompute: tuple[str, ...] = ()
    source: str = "hand-written"  # or "solver"
    experts: Any = None  # spmd.ep.experts(): the experts split along the data dimension

    def row(self, budget: float, chosen: bool) -> str:
        if self.error:
            return f"  {self.label:<44} not plannable: {self.error}"
        mark = "<- chosen" if chosen else ("" if self.fits(budget) else "over budget")
        return f"  {self.label:<44} {self.seconds * 1e3:12.3f} ms {gib(self.peak):>14}  {mark}"


def tiled(args: tuple, factor: int) -> tuple:
    if factor == 1:
        return args
    leaves, spec = pytree.tree_flatten(args)
    out = [torch.cat([t] * factor) if isinstance(t, torch.Tensor) and t.dim() else t
           for t in leaves]
    return pytree.tree_unflatten(out, spec)


def layout_placements(roles: Roles, pieces: dict[str, Any], experts: Any) -> Any:
    """The ``placements`` of a layout: its pieces on the tensor-parallel dimension and its
    expert-parallel preset; None for neither."""
    given = ([{"tp": dict(pieces)}] if roles.tp is not None else []) + (
        [experts] if experts is not None else [])
    return given[0] if len(given) == 1 else (given or None)


def plan_candidate(model: nn.Module, args: tuple, mesh: Mesh, cand: Candidate,
                    options: dict, optimizer: str, ref: Candidate | None = None) -> Candidate:
    """Plan ``cand`` for real on a copy of ``model``. Without a hardware model the compute
    is measured on this machine; a layout that replicates the model (every dimension
    data) computes what ``ref`` computes, so it takes ``ref``'s measurement, and the
    candidates differ by their communication and memory, not by a timer's noise."""
    from spmd.plan.planning import plan_model

    copy_ = copy.deepcopy(model)
    checkpoint_modules(copy_, cand.recompute)
    kwargs = {**options, **kind_of(cand.strategy).arguments}
    strategy = kwargs.pop("strategy")
    placements = layout_placements(cand.roles, cand.pieces, cand.experts)
    if placements is not None:
        kwargs["placements"] = placements
    try:
        plan = plan_model(copy_, tiled(args, cand.roles.tile),
                          strategy_mesh(mesh, cand.roles, cand.strategy), strategy, kwargs)
    except (ValueError, TypeError, NotImplementedError, RuntimeError) as e:
        cand.error = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        return cand
    if plan.fallbacks and not cand.label.endswith("(reference)"):
        cand.error = (f"left to the eager safety net ({plan.fallbacks[0].reason[:120]}), "
                      f"which the prediction would not price")
        return cand
    if (ref is not None and ref.plan is not None and mesh.hardware is None
            and cand.roles.tp is None and not cand.recompute and cand.experts is None
            and set(plan.compute) == set(ref.plan.compute)):
        plan.compute = dict(ref.plan.compute)
    cand.plan = plan
    cand.seconds = plan.predicted_timeline(optimizer).step_seconds
    cand.peak = float(plan.memory(optimizer).peak)
    return cand
