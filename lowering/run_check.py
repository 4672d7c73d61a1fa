"""What a planned graph sends, checked across ranks at each of its runs.

A planned graph's collectives (and ring attention's exchanges) move what its static
shapes say. Ranks whose graphs differ (another sequence length on one tensor-parallel
rank, a rank that recompiled alone) would send other sizes, and Gloo aborts the process
that receives too many bytes. So each run of a graph with such ops first exchanges one
header per process group they use, holding a hash of every ``spmd`` op's shapes in the
graph (``spmd.runtime.sizecheck.check_signature``); its collectives then skip their own
headers. One small all-gather per group per run, against one per collective.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable

import torch
import torch.fx as fx

from spmd.lowering import ops
from spmd.lowering.specs import lookup, sending
from spmd.runtime import sizecheck

__all__ = ["RunCheck"]


class RunCheck:
    """The groups ``graph``'s ``spmd`` ops communicate over and the hash of their shapes;
    calling it checks them across each group's ranks (``describe``: this rank's words)."""

    def __init__(self, graph: fx.GraphModule | None, describe: Callable[[], str]) -> None:
        self.describe = describe
        h = hashlib.sha256()
        groups: dict[int, Any] = {}
        for node in [] if graph is None else graph.graph.nodes:
            if node.op != "call_function" or node.target not in ops.IMPLEMENTATIONS:
                continue
            h.update(repr((str(node.target), _shapes(node.args), _shapes(node.meta.get("val"))))
                     .encode())
            for group in _groups(node):
                groups.setdefault(id(group), group)
        self.groups = [g for g in groups.values() if g.size() > 1]
        self.signature = int(h.hexdigest()[:15], 16)

    def __call__(self) -> None:
        if not sending():
            return
        for group in self.groups:
            sizecheck.check_signature(group, "graph", self.signature, self.describe)


def _shapes(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), str(value.dtype))
    if isinstance(value, (list, tuple)):
        return tuple(_shapes(v) for v in value)
    if isinstance(value, fx.Node):
        return _shapes(value.meta.get("val"))
    return None


def _groups(node: fx.Node) -> list[Any]:
    """The live process groups of the spec ``node``'s ``handle`` argument names."""
    schema = node.target._schema
    names = [a.name for a in schema.arguments]
    if "handle" not in names:
        return []
    at = names.index("handle")
    handle = node.args[at] if at < len(node.args) else node.kwargs.get("handle")
    if not isinstance(handle, int):
        return []
    try:
        spec = lookup(handle)
    except RuntimeError:
        return []
    groups = getattr(spec, "groups", None)
    found = [getattr(spec, "group", None), getattr(spec, "replicate_group", None),
             *(groups.values() if isinstance(groups, dict) else ())]
    return [g for g in found if g is not None and hasattr(g, "size_check")]
