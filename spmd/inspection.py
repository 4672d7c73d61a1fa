"""``spmd.inspect``: the plan of a parallelized model or step."""

from __future__ import annotations

from typing import Any

from spmd.plan import Plan

__all__ = ["inspect"]


def inspect(obj: Any) -> Plan:
    """The :class:`~spmd.plan.Plan` of a parallelized model (or step function) as of its
    last captured step: graphs, buckets, collectives with provenance, fallbacks.

    Example::

        model = spmd.parallelize(Net())
        loss_fn(model(x), y).backward()
        print(spmd.inspect(model))        # the bucket table
    """
    state = getattr(obj, "_spmd", None)
    if state is None:
        raise TypeError(f"spmd.inspect: {type(obj).__name__} was not parallelized; pass the "
                        f"object spmd.parallelize returned")
    return state.plan()
