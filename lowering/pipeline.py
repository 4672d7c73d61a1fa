"""The pass list every graph goes through, module regions and whole steps alike:

    annotate -> shard_params -> propagate -> sync_batchnorm -> tensor_parallel
             -> insert_collectives -> bucketing -> fuse_optimizer -> schedule -> verify

Each pass is ``(gm, ctx) -> gm`` in a file of its own; a pass with nothing to do on a
graph (no gradients in a forward, no optimizer in a module's backward) leaves it as is.
``overlap=False`` runs the list without ``schedule``: every wait then stays right after
its collective. ``verify`` runs only when ``SPMD_VERIFY`` asks for it (it re-derives every
placement and checks the plan; ``spmd.lowering.verify``).
"""

from __future__ import annotations

import torch.fx as fx

from spmd.lowering.annotate import annotate
from spmd.lowering.bucketing import bucketing
from spmd.lowering.collectives import insert_collectives
from spmd.lowering.context import LoweringContext
from spmd.lowering.optimizer import fuse_optimizer
from spmd.lowering.passes import Pass, run_passes
from spmd.lowering.propagate import propagate
from spmd.lowering.schedule import schedule
from spmd.lowering.shard_params import shard_params
from spmd.lowering.sync_batchnorm import sync_batchnorm
from spmd.lowering.tensor_parallel import tensor_parallel
from spmd.lowering.verify import verify_pass
from spmd.runtime import config

__all__ = ["PASSES", "plan_graph"]

PASSES: list[tuple[str, Pass]] = [
    ("annotate", annotate),
    ("shard_params", shard_params),
    ("propagate", propagate),
    ("sync_batchnorm", sync_batchnorm),
    ("tensor_parallel", tensor_parallel),
    ("insert_collectives", insert_collectives),
    ("bucketing", bucketing),
    ("fuse_optimizer", fuse_optimizer),
    ("schedule", schedule),
    ("verify", verify_pass),
]


def plan_graph(gm: fx.GraphModule, ctx: LoweringContext) -> fx.GraphModule:
    """``gm`` through :data:`PASSES`, as the options say (``overlap=False``: no
    ``schedule``) and ``SPMD_VERIFY`` (unset: no ``verify``)."""
    disabled = () if ctx.options.overlap else ("schedule",)
    if config.verify_plans() is None:
        disabled += ("verify",)
    return run_passes(gm, ctx, PASSES, disabled)
