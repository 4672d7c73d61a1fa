"""Sharding rules per op, per mesh dimension: where no strategy's boundary decides, a rule
gives an op's output placement on one mesh dimension from its inputs' placements there.

    @rules.register(torch.ops.aten.add.Tensor, torch.ops.aten.mul.Tensor)
    def pointwise(node: fx.Node, inputs: list[Placement]) -> Placement: ...

``propagate`` consults a rule only on a dimension where some input is not replicated and
the strategy does not run the model per rank (tensor parallelism's dimensions); an op
without a rule there is refused by name. Rules register next to their definitions, one
file per op family.
"""

from __future__ import annotations

from typing import Callable

import torch.fx as fx

from spmd.lowering.placements import Placement

__all__ = ["Rule", "register", "lookup"]

Rule = Callable[[fx.Node, list[Placement]], Placement]
_RULES: dict[object, Rule] = {}


def register(*targets: object) -> Callable[[Rule], Rule]:
    """Register the decorated rule for each op overload in ``targets``."""
    def decorate(rule: Rule) -> Rule:
        for target in targets:
            if target in _RULES:
                raise ValueError(f"a sharding rule for {target} is already registered")
            _RULES[target] = rule
        return rule
    return decorate


def lookup(target: object) -> Rule | None:
    return _RULES.get(target)
