"""What every pass sees: the mesh (a group or a simulated size), the options, the cost
model, and what the graph's inputs are."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from spmd.lowering.cost_model import CostModel
from spmd.lowering.ops import SyncState
from spmd.lowering.options import Options

__all__ = ["InputInfo", "LoweringContext"]


@dataclass(frozen=True, kw_only=True, slots=True)
class InputInfo:
    """One graph input: a parameter (with its name), a buffer, or data."""

    kind: str  # "param" | "buffer" | "data"
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = False


@dataclass(frozen=True, kw_only=True)
class LoweringContext:
    """The inputs of every pass. Frozen: passes communicate only through the graph.

    Attributes:
        group: the data-parallel process group, or None when planning for a simulated mesh.
        world_size: ranks in the data-parallel dimension.
        options: the user's options.
        cost_model: latency/bandwidth model for choosing bucket sizes.
        inputs: what each placeholder of the forward graph is, in order.
        graph_name: e.g. ``"graph0"`` (one per Dynamo graph).
        sync: the owner's no_sync switch shared with the ops at run time.
        backward_seconds: measured backward compute time, when a profile exists.
    """

    group: Any
    world_size: int
    options: Options
    cost_model: CostModel
    inputs: tuple[InputInfo, ...]
    graph_name: str = "graph0"
    sync: SyncState = field(default_factory=SyncState)
    backward_seconds: float | None = None
