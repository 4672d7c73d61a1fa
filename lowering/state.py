"""What passes hand to each other: typed, frozen records kept on the graph module.

Each record names the pass that produces it (``producer``). A pass reads another's
result with :func:`needs`, which raises :class:`PassOrderError` naming the missing pass
instead of a ``KeyError``; ``Plan`` and the views read the same records. Per-node facts
live on the nodes themselves: ``meta["sharding"]`` (a :class:`Sharding`),
``meta["val"]``, ``meta["spmd_collective"]`` (a :class:`CollectiveInfo`) and
``meta["spmd_role"]`` (a :class:`Role`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch
import torch.fx as fx

if TYPE_CHECKING:
    from spmd.lowering.placements import Placement

__all__ = ["InputInfo", "Provenance", "Record", "Boundary", "Gradient", "Buckets", "OptimizerFusion", "CollectiveInfo",
           "Role", "GraphState", "PassOrderError", "put", "needs", "find", "state_of"]


class PassOrderError(RuntimeError):
    """A pass ran without the result of a pass it depends on."""


@dataclass(frozen=True, kw_only=True, slots=True)
class InputInfo:
    """One input of a traced region or step: a parameter (with its name), a buffer, or
    data."""

    kind: str  # "param" | "buffer" | "data"
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = False
    tensor: bool = True  # False: a symbolic size (a graph compiled for dynamic shapes)


@dataclass(frozen=True, kw_only=True, slots=True)
class Provenance:
    """Why a node exists: which parameters, which pass, and the reason in words."""

    params: tuple[str, ...]
    pass_name: str
    reason: str

    def __str__(self) -> str:
        shown = ", ".join(self.params[:4]) + (f" (+{len(self.params) - 4})"
                                              if len(self.params) > 4 else "")
        return f"{self.pass_name}: {self.reason} [{shown}]"


@dataclass(frozen=True, kw_only=True, slots=True)
class Record:
    producer: ClassVar[str] = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class Gradient:
    """A parameter's gradient as the graph computes it: the node (each rank's own,
    before any reduction) and the graph output it leaves through (None when only the
    step's optimizer reads it)."""

    param: str
    node: str
    output: int | None


@dataclass(frozen=True, kw_only=True, slots=True)
class Boundary(Record):
    """What the graph's inputs and gradients are (``annotate``)."""

    producer: ClassVar[str] = "annotate"
    role: str  # "forward" | "backward" | "step"
    gradients: tuple[Gradient, ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class Buckets(Record):
    """The byte cap buckets were cut at, and why (``bucketing``)."""

    producer: ClassVar[str] = "bucketing"
    cap: int
    reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerFusion(Record):
    """Whether the step's optimizer runs from the reduced buckets (``fuse_optimizer``)."""

    producer: ClassVar[str] = "fuse_optimizer"
    kind: str | None  # "sgd" | "adamw" when fused
    reason: str
    readers: tuple[str, ...] = ()  # nodes that read the (reduced) gradients themselves

    @property
    def fused(self) -> bool:
        return self.kind is not None


@dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveInfo:
    """What one inserted collective node moves, and why (``node.meta["spmd_collective"]``).

    Attributes:
        kind: ``"all_reduce"``, ``"reduce_scatter"``, ``"all_gather"``, ``"all_to_all"``.
        mesh_dim: the mesh dimension it runs along.
        src, dst: the placements on that dimension before and after.
        params: the parameters whose values it carries, in bucket order.
        numels: elements of each, in order.
        dtype: the values' dtype; ``wire_dtype``: the dtype on the wire.
        bytes: the bytes the cost formula of ``kind`` takes: an all-reduce's buffer, an
            all-gather's output, a reduce-scatter's or all-to-all's input.
        handle: the runtime spec's handle (group, scale, pending work).
        provenance: which pass inserted it and why.
        sent_as: the collective that runs when it is not ``kind`` (zero1's reduce-scatter
            is an all-reduce of the same buffer); priced as that.
        within: the ranks it runs among when fewer than ``mesh_dim``'s (the backward
            gathers of ``reshard_after_forward=N``: N consecutive ranks); 0 for all.
    """

    kind: str
    mesh_dim: str
    src: "Placement"
    dst: "Placement"
    params: tuple[str, ...]
    numels: tuple[int, ...]
    dtype: torch.dtype
    wire_dtype: torch.dtype
    bytes: int
    handle: int
    provenance: Provenance
    sent_as: str = ""
    within: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class Role:
    """A node a pass inserted around a collective: its ``"wait"``, the ``"unpack"`` nodes
    that turn the flat result back into tensors, or the ``"optimizer"`` step run from it.
    The schedule pass moves them with their collective."""

    kind: str
    collective: str


@dataclass(eq=False)
class GraphState:
    """Everything the passes recorded on one graph module (``gm.meta["spmd"]``)."""

    records: dict[type, Record] = field(default_factory=dict)
    pass_seconds: dict[str, float] = field(default_factory=dict)
    handles: Any = None  # the specs the graph's nodes refer to: alive while the graph is
    context: Any = None  # the LoweringContext it was planned with (for Plan.verify())


R = TypeVar("R", bound=Record)


def state_of(gm: fx.GraphModule) -> GraphState:
    state = gm.meta.get("spmd")
    if state is None:
        state = gm.meta["spmd"] = GraphState()
    return state


def put(gm: fx.GraphModule, record: Record) -> None:
    state_of(gm).records[type(record)] = record


def find(gm: fx.GraphModule, kind: type[R]) -> R | None:
    state = gm.meta.get("spmd")
    return None if state is None else state.records.get(kind)  # type: ignore[return-value]


def needs(gm: fx.GraphModule, kind: type[R], by: str) -> R:
    """The record of type ``kind``; :class:`PassOrderError` naming its pass if absent."""
    record = find(gm, kind)
    if record is None:
        raise PassOrderError(f"pass {by!r} needs the result of pass {kind.producer!r}, which "
                             f"has not run on this graph; run {kind.producer!r} first")
    return record
