"""What a planned graph sends, checked across ranks at each of its runs.

A planned graph's collectives (and ring attention's exchanges) move what its static
shapes say. Ranks whose graphs differ (another sequence length on one tensor-parallel
rank, a rank that recompiled alone) would send other sizes, and Gloo aborts the process
that receives too many bytes. So each run of a graph with such ops first exchanges one
header per process group they use, holding a hash of every ``spmd`` op's shapes in the
graph (``spmd.runtime.sizecheck.check_signature``); its collectives then skip their own
headers. One small all-gather per group per run, against one per collective, launched
as the run starts and waited for by the group's first collective (the compute before
it, a backward's first layers, hides the round trip).
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
    """The groups ``graph``'s ``spmd`` ops communicate over, each with the hash of the
    shapes of the ops that use it (a data-parallel group's gradient buckets do not follow
    the batch, which may differ across it); calling it checks them across each group's
    ranks (``describe``: this rank's words) and returns the groups checked."""

    def __init__(self, graph: fx.GraphModule | None, describe: Callable[[], str]) -> None:
        self.describe = describe
        hashes: dict[int, Any] = {}
        groups: dict[int, Any] = {}
        for node in [] if graph is None else graph.graph.nodes:
            if node.op != "call_function" or node.target not in ops.IMPLEMENTATIONS:
                continue
            what = repr((str(node.target), _shapes(node.args),
                         _shapes(node.meta.get("val")))).encode()
            for group in _groups(node):
                # a group with the size check off (the default) has nothing to compare:
                # no groups, and the compiled graph's calls skip the check entirely
                if group.size() > 1 and getattr(group, "size_check", True):
                    groups.setdefault(id(group), group)
                    hashes.setdefault(id(group), hashlib.sha256()).update(what)
        self.groups = list(groups.values())
        self.signatures = [int(hashes[id(g)].hexdigest()[:15], 16) for g in self.groups]

    def __call__(self) -> list[Any]:
        if not sending():
            return []
        checked: list[Any] = []
        for group, signature in zip(self.groups, self.signatures):
            if group.join_log is not None:
                continue  # under spmd.Join a joined rank shadows each collective alone
            sizecheck.check_signature(group, "graph", signature, self.describe, defer=True)
            checked.append(group)
        return checked


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
