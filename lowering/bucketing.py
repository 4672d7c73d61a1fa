"""bucketing: merge the per-gradient all-reduces into size-capped buckets, and the
per-parameter all-gathers and reduce-scatters of sharded strategies the same way.

Gradients are taken in the order the graph produces them; a bucket holds one dtype and
one wire dtype, never splits a parameter, and closes when adding the next gradient would
pass the cap (a single gradient larger than the cap gets a bucket of its own). The cap is
the user's ``bucket_cap_mb``, or the cost model's optimum for the graph's gradient bytes;
``bucket_cap_mb=0`` keeps one collective per parameter. One collective per bucket then
runs on one flat buffer, and every reader of a gradient reads the bucket's result.

Sharded parameters' all-gathers are grouped in the order the graph first uses them, so
one bucket is the parameters of the next few layers; their gradients' reduce-scatters
in the order they are ready, like all-reduces. For both the cap is also at most an
eighth of the graph's bytes of that kind: gathering one bucket ahead (the schedule's
prefetch) then never holds more than about a quarter of the model whole, and a
reduce-scatter in flight holds at most an eighth of the whole gradients (one bucket of
the whole model would keep every whole gradient alive to the end of backward, as DDP
does, which is what sharding avoids).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Hashable

import torch.fx as fx

from spmd.lowering.collectives import GRADIENT_PASS, build_bucket, bucket_results
from spmd.lowering import ops
from spmd.lowering.specs import lookup
from spmd.lowering.context import LoweringContext
from spmd.lowering.graph import collective_nodes, restore_order
from spmd.lowering.passes import Provenance
from spmd.lowering.propagate import derive
from spmd.lowering.redistribute import Step
from spmd.lowering.shard_params import (build_gather, build_scatter, gathered_results,
                                        scattered_results, strategy_note)
from spmd.lowering.state import Buckets, put

__all__ = ["bucketing", "plan_buckets", "gather_cap"]


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
    # graph order: the order gradients are ready. Tensor parallelism's and batch-norm
    # statistics' collectives move values a node needs right away: never merged; a
    # parameter gradient's reduction over a tensor-parallel dimension (a norm's weight
    # under sequence parallelism, every weight under context parallelism) leaves the
    # graph: merged as the data dimension's are, and never skipped by no_sync()
    ours = [n for n in collective_nodes(gm) if n.meta["spmd_collective"].provenance.pass_name
            not in ("tensor_parallel", "sync_batchnorm")]
    singles = [n for n in ours if n.meta["spmd_collective"].kind == "all_reduce"]
    infos = [n.meta["spmd_collective"] for n in singles]
    every = [n.meta["spmd_collective"] for n in ours]
    # gradient bytes (all-reduced or reduce-scattered); a forward graph's gathered bytes
    total = (sum(i.bytes for i in every if i.kind in ("all_reduce", "reduce_scatter"))
             or sum(i.bytes for i in every))
    cap = ctx.options.bucket_cap_bytes
    if cap is None:
        cap = ctx.cost_model.bucket_bytes(total, ctx.backward_seconds)
        reason = f"cap {_size(cap)} chosen by the cost model for {_size(total)}"
    else:
        reason = f"cap {_size(cap)} set by bucket_cap_mb"
    put(gm, Buckets(cap=cap, reason=reason))
    if cap == 0:
        _number_buckets(gm, ctx)
        return gm  # bucketing off: every parameter keeps its own collective
    _bucket_shards(gm, ctx, cap, reason, fixed=ctx.options.bucket_cap_bytes is not None)
    if not singles:
        derive(gm, ctx)
        return gm  # no gradient all-reduce to number
    keys = [(i.dtype, i.wire_dtype, i.mesh_dim, i.src, i.provenance.pass_name) for i in infos]
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
        _, reduced = build_bucket(gm, ctx, [n.args[0][0] for n in nodes], params, step, why,
                                  gradients=first.provenance.pass_name != GRADIENT_PASS)
        for node, value in zip(nodes, reduced):
            (old,) = bucket_results(gm, node)
            if "sharding" in old.meta:  # (a later bucket may read it: another dimension's)
                value.meta.setdefault("sharding", old.meta["sharding"])
            old.replace_all_uses_with(value)
    # a reduction over another mesh dimension that read a single one now reads the
    # bucket's result, placed after the bucket's last gradient: moved after it
    restore_order(gm.graph)
    gm.graph.eliminate_dead_code()  # the single collectives, now unused
    _number_buckets(gm, ctx)
    derive(gm, ctx)
    return gm


def _number_buckets(gm: fx.GraphModule, ctx: LoweringContext) -> None:
    """Each gradient bucket's index (unique across the model's graphs, stable from step to
    step: communication hooks keep state per bucket) and which one is the graph's last."""
    buckets = [lookup(n.meta["spmd_collective"].handle) for n in collective_nodes(gm)
               if n.target is ops.bucket_all_reduce]
    buckets = [b for b in buckets if b.sync is not None]
    base = 1000 * int("".join(c for c in ctx.graph_name if c.isdigit()) or 0)
    for k, spec in enumerate(buckets):
        spec.index, spec.last = base + k, k == len(buckets) - 1


# on a simulated GPU cluster a sharded bucket holds at most this share of device memory
DEVICE_SHARE = 32


def gather_cap(cap: int, total: int, floor: int = 1) -> int:
    """The cap of sharded parameters' buckets: ``cap``, at most an eighth of the bytes
    the graph moves of that kind, but not below ``floor`` (the cost model's size at which
    a collective's bandwidth time equals its latency: smaller buckets mostly pay
    latency)."""
    return max(1, min(cap, max(total // 8, floor)))


def _size(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def _bucket_shards(gm: fx.GraphModule, ctx: LoweringContext, cap: int, reason: str,
                   fixed: bool) -> None:
    """Merge the single-parameter all-gathers (in first-use order) and reduce-scatters
    (in readiness order) of sharded parameters."""
    for kind, op in ops.SHARD_OPS.items():
        singles = [n for n in collective_nodes(gm) if n.target is op]
        if len(singles) < 2:
            if singles:  # a bucket of one: say why it is alone
                info = singles[0].meta["spmd_collective"]
                singles[0].meta["spmd_collective"] = replace(info, provenance=Provenance(
                    params=info.params, pass_name=info.provenance.pass_name,
                    reason=info.provenance.reason + "; the graph's only one"))
            continue
        infos = [n.meta["spmd_collective"] for n in singles]
        specs = [lookup(i.handle).shards[0] for i in infos]
        total = sum(i.bytes for i in infos)
        # a bucket's parameters share their dtypes, the dimension they are sharded along
        # and whether they are averaged across replicas (hsdp; an expert is not)
        keys = [(i.dtype, i.wire_dtype, i.mesh_dim, s.dim, s.replicate_size)
                for i, s in zip(infos, specs)]
        if fixed:
            limit, why_cap = cap, reason
        else:
            floor = ctx.cost_model.balanced_bytes()
            limit = gather_cap(cap, total, floor)
            moved = "gathered" if kind == "all_gather" else "reduce-scattered"
            why_cap = (f"cap {_size(limit)}: an eighth of the {_size(total)} {moved}, at "
                       f"least {_size(floor)} (latency = bandwidth time), at most {reason}")
            hardware = getattr(ctx.strategy.mesh, "hardware", None)
            if hardware is not None and limit > hardware.device.memory_bytes // DEVICE_SHARE:
                limit = hardware.device.memory_bytes // DEVICE_SHARE
                why_cap = (f"cap {_size(limit)}: 1/{DEVICE_SHARE} of the "
                           f"{hardware.device.name}'s memory (a bucket gathered ahead "
                           f"beside the one in use and the one being freed stays under a "
                           f"tenth of the device), below an eighth of the "
                           f"{_size(total)} {moved}")
        for members in plan_buckets([i.bytes for i in infos], keys, limit):
            if len(members) == 1:
                info = infos[members[0]]
                singles[members[0]].meta["spmd_collective"] = replace(info, provenance=Provenance(
                    params=info.params, pass_name=info.provenance.pass_name,
                    reason=f"{info.provenance.reason}; alone in its bucket ({why_cap})"))
                continue
            nodes = [singles[i] for i in members]
            params = tuple(infos[i].params[0] for i in members)
            order = ("first used in this order" if kind == "all_gather"
                     else "gradients ready in this order")
            why = Provenance(params=params, pass_name="bucketing",
                             reason=f"{len(params)} parameter(s) {order}, one dtype; {why_cap}"
                                    + strategy_note(specs[members[0]], kind))
            member_specs = [specs[i] for i in members]
            if kind == "all_gather":
                _, results = build_gather(gm, ctx, [n.args[0][0] for n in nodes],
                                          member_specs, why, before=nodes[0])
                old = [gathered_results(gm, n)[0] for n in nodes]
            else:
                _, results = build_scatter(gm, ctx, [n.args[0][0] for n in nodes],
                                           member_specs, why)
                old = [scattered_results(gm, n)[0] for n in nodes]
            for before, after in zip(old, results):
                before.replace_all_uses_with(after)
        gm.graph.eliminate_dead_code()
