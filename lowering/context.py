"""What every pass sees: the strategy on its mesh, the options, the cost model, what the
graph's inputs are, and the owner's runtime objects (sync switch, handle table)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from spmd.lowering.cost_model import CostModel, along
from spmd.lowering.specs import Handles, SyncState
from spmd.lowering.options import Options
from spmd.lowering.state import InputInfo

if TYPE_CHECKING:
    from spmd.lowering.placements import Sharding
    from spmd.lowering.strategy import Strategy

__all__ = ["InputInfo", "LoweringContext", "ROLES"]

ROLES = ("forward", "backward", "step")


@dataclass(frozen=True, kw_only=True)
class LoweringContext:
    """The inputs of every pass. Frozen: passes communicate through the graph and the
    typed records on it (``spmd.lowering.state``).

    Attributes:
        strategy: where inputs live on the mesh (the mesh is ``strategy.mesh``).
        options: the user's options.
        cost_model: latency/bandwidth model for choosing bucket sizes.
        inputs: what each input of the traced region (or step) is, in order.
        role: ``"forward"`` and ``"backward"`` graphs of a module's region, or a whole
            ``"step"``.
        graph_name: e.g. ``"graph0"`` (one per Dynamo region) or ``"step0"``.
        sync: the owner's no_sync switch shared with the ops at run time.
        handles: the owner's table of the specs graphs refer to.
        backward_seconds: measured backward compute time, when a profile exists.
        saved: for a backward graph, the sharding of each forward value by node name (a
            backward graph's inputs are values its forward saved).
        optimizer: the handle of an optimizer the step may run from its buckets.
    """

    strategy: "Strategy"
    options: Options
    cost_model: CostModel
    inputs: tuple[InputInfo, ...]
    role: str = "backward"
    graph_name: str = "graph0"
    sync: SyncState = field(default_factory=SyncState)
    handles: Handles = field(default_factory=Handles)
    backward_seconds: float | None = None
    saved: Mapping[str, "Sharding"] = field(default_factory=dict)
    optimizer: int | None = None
    compute: str = "emit"  # how the planned graph runs: "emit" or "inductor"

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"LoweringContext role must be one of {ROLES}, got {self.role!r}")

    @property
    def mesh(self) -> Any:
        return self.strategy.mesh

    def cost_model_along(self, dim: str) -> CostModel:
        """The cost model of collectives along mesh dimension ``dim``: the hardware
        model's link for it on a simulated cluster, else this model at its size."""
        return along(self.mesh, dim, self.cost_model)

    def group(self, dim: str) -> Any:
        """The process group along mesh dimension ``dim``; None on a simulated mesh."""
        return None if self.mesh.simulated else self.mesh.get_group(dim)
