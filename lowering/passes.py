"""Passes: each ``(gm: fx.GraphModule, ctx: LoweringContext) -> fx.GraphModule``, run in a
plain list.

A pass can be switched off by name (``disabled=``). With ``SPMD_DEBUG=plan`` every pass
logs its time and the graph it produced under the ``spmd.lowering`` logger.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterable

import torch.fx as fx

from spmd.lowering.context import LoweringContext
from spmd.lowering.state import Provenance
from spmd.runtime import config

__all__ = ["Pass", "Provenance", "run_passes", "debug_plan"]

log = logging.getLogger("spmd.lowering")

Pass = Callable[[fx.GraphModule, LoweringContext], fx.GraphModule]


def debug_plan() -> bool:
    return "plan" in config.debug_levels()


def run_passes(gm: fx.GraphModule, ctx: LoweringContext,
               passes: Iterable[tuple[str, Pass]], disabled: Iterable[str] = ()) -> fx.GraphModule:
    """Run ``passes`` in order on ``gm``, but those named in ``disabled``; each one's
    time is recorded in the graph's state (``state_of(gm).pass_seconds``)."""
    from spmd.lowering.state import state_of

    skip = set(disabled)
    verbose = debug_plan()
    state = state_of(gm)
    state.handles = ctx.handles  # the graph keeps the specs its nodes name alive
    state.context = ctx
    timings = state.pass_seconds
    for name, fn in passes:
        if name in skip:
            continue
        start = time.perf_counter()
        gm = fn(gm, ctx)
        gm.graph.lint()
        elapsed = time.perf_counter() - start
        timings[name] = elapsed
        if verbose:
            log.info("pass %s on %s: %.2f ms\n%s", name, ctx.graph_name, elapsed * 1e3, gm.graph)
    gm.recompile()
    return gm
