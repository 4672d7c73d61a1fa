"""spmd: compiler-driven SPMD training for PyTorch.

Trace, plan, lower, run. Names are resolved lazily so that ``import spmd.runtime`` does
not drag in the compiler.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "parallelize": "spmd.api",
    "inspect": "spmd.inspection",
    "profile": "spmd.plan.profiling",
    "Plan": "spmd.plan.plan",
    "Mesh": "spmd.runtime.mesh",
    "Replicate": "spmd.lowering.placements",
    "Shard": "spmd.lowering.placements",
    "StridedShard": "spmd.lowering.placements",
    "Partial": "spmd.lowering.placements",
    "Options": "spmd.lowering.options",
    "placement_of": "spmd.state.layout",
    "shard_evenly": "spmd.state.layout",
    "Join": "spmd.eager.join",
    "ParameterPlacement": "spmd.state.layout",
    "PlanVerificationError": "spmd.lowering.verify",
    "ShardingError": "spmd.lowering.annotate",
    "EmptyBackwardError": "spmd.lowering.annotate",
}
# public submodule -> where it lives
_SUBMODULES: dict[str, str] = {name: f"spmd.{name}" for name in (
    "runtime", "lowering", "kernels", "checkpoint", "tp", "cp", "ep", "pp", "hardware")}
_SUBMODULES["roofline"] = "spmd.plan.roofline"

__all__ = [*_SUBMODULES, *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(_SUBMODULES[name])
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'spmd' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
