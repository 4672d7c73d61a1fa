"""What every rule file uses (``spmd.lowering.rules``): the :class:`Decision` a rule
returns, the registry (:func:`register`, :func:`lookup`) and the helpers that read a
node's arguments and shapes. The family files import it; the package imports them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.fx as fx
from torch.fx.node import map_aggregate

from spmd.lowering.placements import Partial, Placement, Replicate, Shard

__all__ = ["Decision", "Rule", "Traits", "register", "lookup", "traits", "tensor_args", "shape",
           "replicate_all",
           "registered", "FAMILIES", "SHAPE_ARG"]

aten = torch.ops.aten

# ops whose second argument is their output's shape, written for the whole tensor: the
# one rewrite the compiler makes to run an op on local pieces (``tensor_parallel``), and
# the one the verifier and the rule tests make to run it on real shards
SHAPE_ARG = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default,
                       aten.expand.default, aten.slice_backward.default,
                       aten.select_backward.default})
# ops with an argument that is their output's row count (dimension 0), written for the
# whole tensor, by its position: rewritten as SHAPE_ARG's are (``spmd::ep_scatter``'s
# static bound, its rows split along a context dimension); filled in by the rules that
# register such ops (``rules/experts.py``)
ROWS_ARG: dict[object, int] = {}


@dataclass(frozen=True, kw_only=True, slots=True)
class Decision:
    """One valid way to run an op on one mesh dimension.

    Attributes:
        output: the output's placement, or a tuple of them for an op with several outputs.
        inputs: the placement each tensor argument must have (:func:`tensor_args` order);
            empty: every argument as it is.
        reason: why, in words, for the plan.
        ranked: an ``spmd`` op (``spmd.lowering.ranked.RANKED``) each rank runs in the
            node's place, computing its own part (a vocabulary-parallel lookup masks the
            rows outside its range); None: the node's op on the pieces.
    """

    output: Placement | tuple[Placement, ...]
    inputs: tuple[Placement, ...] = ()
    reason: str = ""
    ranked: object = None

    def required(self, current: Sequence[Placement]) -> tuple[Placement, ...]:
        return tuple(self.inputs) if self.inputs else tuple(current)


Rule = Callable[[fx.Node, tuple[Placement, ...], int], "Decision | list[Decision]"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Traits:
    """What ``propagate`` needs to know of a rule beyond its decisions.

    Attributes:
        strided: it reads ``StridedShard`` inputs as such (a rule written without them
            would read one as a plain ``Shard``: its inputs are gathered first instead).
        wants_dim: it is called with the mesh dimension's name as a fourth argument
            (``rule(node, inputs, size, dim)``): it places its output whatever its
            inputs (a tensor-parallel parameter's gradient takes the parameter's placement).
        merges: a reshape merging dimensions, whose strided output a value read by several
            reshapes should not get on a tensor-parallel dimension (gathered once instead).
    """

    strided: bool = False
    wants_dim: bool = False
    merges: bool = False


_RULES: dict[object, Rule] = {}
_TRAITS: dict[object, Traits] = {}
_FAMILY: dict[object, str] = {}


def register(*targets: object, strided: bool = False, wants_dim: bool = False,
             merges: bool = False) -> Callable[[Rule], Rule]:
    """Register the decorated rule for each op overload in ``targets`` (missing ones, as
    ops this torch build lacks, are passed as None and skipped), with its
    :class:`Traits`."""
    found = Traits(strided=strided, wants_dim=wants_dim, merges=merges)

    def decorate(rule: Rule) -> Rule:
        family = rule.__module__.rsplit(".", 1)[-1]
        for target in targets:
            if target is None:
                continue
            if target in _RULES:
                raise ValueError(f"a sharding rule for {target} is already registered")
            _RULES[target] = rule
            _TRAITS[target] = found
            _FAMILY[target] = family
        return rule
    return decorate


def lookup(target: object) -> Rule | None:
    return _RULES.get(target)


def traits(target: object) -> Traits:
    """The :class:`Traits` of ``target``'s rule (all False where it has none)."""
    return _TRAITS.get(target, _NO_TRAITS)


_NO_TRAITS = Traits()


def registered() -> dict[object, str]:
    """Every op with a rule -> the family file it is registered in."""
    return dict(_FAMILY)


def op(name: str) -> object | None:
    """``torch.ops.aten.<name>`` (``"packet.overload"``), or None where this torch has no
    such op."""
    packet, _, overload = name.partition(".")
    found = getattr(aten, packet, None)
    if found is None:
        return None
    return getattr(found, overload or "default", None)


def tensor_args(node: fx.Node) -> list[fx.Node]:
    """The node's tensor arguments in order (positional, then keyword), repeats kept: the
    order rules take placements in."""
    found: list[fx.Node] = []

    def visit(value: object) -> None:
        if isinstance(value, fx.Node) and isinstance(value.meta.get("val"), torch.Tensor):
            found.append(value)

    map_aggregate((node.args, node.kwargs), visit)
    return found


def shape(value: object) -> tuple[int, ...]:
    """The global shape of a node's (first) value."""
    val = value.meta["val"] if isinstance(value, fx.Node) else value
    if isinstance(val, (tuple, list)):
        val = val[0]
    return tuple(int(d) for d in val.shape)


def outputs_of(node: fx.Node) -> int:
    """How many values the node returns (1 for a single tensor)."""
    val = node.meta.get("val")
    return len(val) if isinstance(val, (tuple, list)) else 1


def replicate_all(node: fx.Node, why: str) -> Decision:
    """Every input ``Replicate()`` first (gathered or reduced), the output(s) replicated."""
    n = len(tensor_args(node))
    count = outputs_of(node)
    out: Placement | tuple[Placement, ...] = (Replicate(),) * count if count > 1 else Replicate()
    return Decision(output=out, inputs=(Replicate(),) * n, reason=why)


def norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def partial_op(inputs: Sequence[Placement]) -> str | None:
    """The reduce op shared by every ``Partial`` among ``inputs`` (None: none, or mixed)."""
    ops = {p.reduce_op for p in inputs if isinstance(p, Partial)}
    return ops.pop() if len(ops) == 1 else None


def is_shard(p: Placement) -> bool:
    return isinstance(p, Shard)


FAMILIES = ("pointwise", "matmul", "views", "reductions", "norms", "embedding", "dropout",
            "losses", "attention", "parameters", "experts")
