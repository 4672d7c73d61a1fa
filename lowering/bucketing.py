"""bucketing: merge the per-gradient all-reduces into size-capped buckets.

Gradients are taken in the order the backward graph produces them; a bucket holds one
dtype, never splits a parameter, and closes when adding the next gradient would pass
the cap (a single gradient larger than the cap gets a bucket of its own). The cap is the
user's ``bucket_cap_mb``, or the cost model's optimum for the graph's gradient bytes;
``bucket_cap_mb=0`` keeps one collective per parameter. One collective per bucket then
runs on one flat buffer.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from spmd.lowering.annotate import gradient_outputs
from spmd.lowering.collectives import _set_outputs, build_bucket, collective_nodes
from spmd.lowering.context import LoweringContext
from spmd.lowering.passes import Provenance

__all__ = ["bucketing", "plan_buckets"]


def plan_buckets(sizes: list[int], dtypes: list[torch.dtype], cap: int) -> list[list[int]]:
    """Indices of consecutive items grouped into buckets of at most ``cap`` bytes.

    Items come in readiness order; a bucket holds one dtype; an item larger than the cap
    is alone. Each dtype keeps its own open bucket, so mixed dtypes interleave freely.
    """
    open_: dict[torch.dtype, tuple[list[int], int]] = {}
    done: list[tuple[int, list[int]]] = []  # (index of the last member, members)
    for i, (size, dtype) in enumerate(zip(sizes, dtypes)):
        members, used = open_.get(dtype, ([], 0))
        if members and used + size > cap:
            done.append((members[-1], members))
            members, used = [], 0
        members = members + [i]
        open_[dtype] = (members, used + size)
    done += [(m[-1], m) for m, _ in open_.values() if m]
    return [members for _, members in sorted(done)]


def bucketing(gm: fx.GraphModule, ctx: LoweringContext) -> fx.GraphModule:
    singles = collective_nodes(gm)  # in graph order: the order gradients become ready
    if not singles:
        gm.meta["spmd_bucket_cap"] = 0
        return gm
    sizes = [n.meta["spmd"]["bytes"] for n in singles]
    total = sum(sizes)
    cap = ctx.options.bucket_cap_bytes
    if cap is None:
        cap = ctx.cost_model.bucket_bytes(total, ctx.backward_seconds)
        reason = f"cap {cap / 2**20:.2f} MiB chosen by the cost model for {total / 2**20:.2f} MiB"
    else:
        reason = f"cap {cap / 2**20:.2f} MiB set by bucket_cap_mb"
    gm.meta["spmd_bucket_cap"] = cap
    if cap == 0:
        return gm  # bucketing off: every parameter keeps its own collective
    groups = plan_buckets(sizes, [n.meta["spmd"]["dtype"] for n in singles], cap)
    positions = gm.meta["spmd_grad_positions"]
    outputs = gradient_outputs(gm)
    for members in groups:
        nodes = [singles[i] for i in members]
        params = [n.meta["spmd"]["spec"].params[0] for n in nodes]
        infos = [ctx.inputs[positions[p]] for p in params]
        grads = [n.args[0][0] for n in nodes]
        why = Provenance(params=tuple(params), pass_name="bucketing",
                         reason=f"{len(params)} gradient(s) ready in this order, one dtype; "
                                f"{reason}")
        reduced = build_bucket(gm, ctx, grads, infos, why)
        for p, value in zip(params, reduced):
            outputs[positions[p]] = value
    _set_outputs(gm, outputs)
    gm.graph.eliminate_dead_code()  # the single collectives, now unused
    return gm
