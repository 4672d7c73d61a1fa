"""Sharding rules per op, per mesh dimension: how an op's output is placed given its inputs'
placements on one mesh dimension, and which placements its inputs must be brought to.

    @rules.register(aten.mm.default)
    def mm(node: fx.Node, inputs: tuple[Placement, ...], size: int) -> list[Decision]: ...

A rule sees the node (its inputs' and output's global shapes are in ``meta["val"]``),
the placement of each of its tensor arguments (:func:`tensor_args` order: every
``fx.Node`` among its arguments, repeats included) and the size of the mesh dimension.
It returns the valid :class:`Decision` s: the output placement (one per output for ops
with several) and the placement each input must have first. Where several are valid,
``propagate`` prices each one's redistributions with the cost model, takes the cheapest
(the rule's order breaks ties) and records why in the plan.

``propagate`` consults a rule only on a dimension the model is split along by tensor
parallelism and only where some input is not replicated. An op without a rule is
replicated there (its inputs gathered or reduced first), which the plan lists with the
reason; never guessed. Rules live one file per op family, next to this one, and register
on import.
"""

from spmd.lowering.rules.registry import (FAMILIES, ROWS_ARG, SHAPE_ARG, _FAMILY, _RULES,
                                          Decision, Rule, Traits, is_shard, lookup, norm_dim,
                                          op, outputs_of, partial_op, register, registered,
                                          replicate_all, shape, tensor_args, traits)

__all__ = ["Decision", "Rule", "Traits", "register", "lookup", "traits", "tensor_args",
           "shape", "replicate_all", "registered", "FAMILIES", "SHAPE_ARG",
           "ROWS_ARG"]

# the families register their rules on import
from spmd.lowering.rules import (attention, dropout, embedding, experts, losses, matmul,
                                 norms, parameters, pointwise, reductions, views)

del attention, dropout, embedding, experts, losses, matmul, norms, parameters, pointwise
del reductions, views
