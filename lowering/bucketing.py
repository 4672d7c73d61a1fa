"""bucketing: merge the per-gradient all-reduces into size-capped buckets.

Gradients are taken in the order the graph produces them; a bucket holds one dtype and
one wire dtype, never splits a parameter, and closes when adding the next gradient would
pass the cap (a single gradient larger than the cap gets a bucket of its own). The cap is
the user's ``bucket_cap_mb``, or the cost model's optimum for the graph's gradient bytes;
``bucket_cap_mb=0`` keeps one collective per parameter. One collective per bucket then
runs on one flat buffer, and every reader of a gradient reads the bucket's result.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Hashable

import torch.fx as fx

from spmd.lowering.collectives import build_bucket, bucket_results
from spmd.lowering.context import LoweringContext
from spmd.lowering.graph import collective_nodes
from spmd.lowering.passes import Provenance
from spmd.lowering.propagate import derive
from spmd.lowering.redistribute import Step
from spmd.lowering.state import Buckets, put

__all__ = ["bucketing", "plan_buckets"]


def plan_buckets(sizes: list[int], keys: list[Hashable], cap: int) -> list[list[int]]:
    """Indices of consecutive items grouped into buckets of at most ``cap`` bytes.

    Items come in readiness order; a bucket holds items of one key (a dtype, say); an item
    larger than the cap is alone. Each key keeps its own open bucket, so items of
    different keys interleave freely.
    """
    open_: dict[Hashable, tuple[list[int], int]] = {}
    done: list[tuple[int, list[int]]] = []  # (index of the last member, members)
    for i, (size, key) in enumerate(zip(sizes, keys)):
        members, used = open_.get(key, ([], 0))
        if members and used + size > cap:
            done.append((members[-1], members))
            members, used = [], 0
        members = members + [i]
        open_[key] = (members, used + size)
    done += [(m[-1], m) for m, _ in open_.values() if m]
    return [members for _, members in sorted(done)]


def bucketing(gm: fx.GraphModule, ctx: LoweringContext) -> fx.GraphModule:
    singles = [n for n in collective_nodes(gm)  # graph order: the order gradients are ready
               if n.meta["spmd_collective"].kind == "all_reduce"]
    infos = [n.meta["spmd_collective"] for n in singles]
    total = sum(i.bytes for i in infos)
    cap = ctx.options.bucket_cap_bytes
    if cap is None:
        cap = ctx.cost_model.bucket_bytes(total, ctx.backward_seconds)
        reason = f"cap {cap / 2**20:.2f} MiB chosen by the cost model for {total / 2**20:.2f} MiB"
    else:
        reason = f"cap {cap / 2**20:.2f} MiB set by bucket_cap_mb"
    put(gm, Buckets(cap=cap, reason=reason))
    if cap == 0 or not singles:
        return gm  # bucketing off: every parameter keeps its own collective
    keys = [(i.dtype, i.wire_dtype, i.mesh_dim, i.src) for i in infos]
    groups = plan_buckets([i.bytes for i in infos], keys, cap)
    for members in groups:
        nodes = [singles[i] for i in members]
        params = [infos[i].params[0] for i in members]
        first = infos[members[0]]
        why = Provenance(params=tuple(params), pass_name="bucketing",
                         reason=f"{len(params)} gradient(s) ready in this order, one dtype; "
                                f"{reason}")
        if len(nodes) == 1:  # a bucket of one is the collective already there
            nodes[0].meta["spmd_collective"] = replace(first, provenance=why)
            continue
        step = Step(src=first.src, dst=first.dst, kind="all_reduce", mesh_dim=first.mesh_dim)
        _, reduced = build_bucket(gm, ctx, [n.args[0][0] for n in nodes], params, step, why)
        for node, value in zip(nodes, reduced):
            (old,) = bucket_results(gm, node)
            old.replace_all_uses_with(value)
    gm.graph.eliminate_dead_code()  # the single collectives, now unused
    derive(gm, ctx)
    return gm
