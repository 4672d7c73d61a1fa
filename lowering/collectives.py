"""insert_collectives: turn every ``Partial`` gradient into ``Replicate`` with an all-reduce.

For each gradient output with a ``Partial("avg")`` placement this pass inserts

    flat = spmd.bucket_all_reduce([g], handle)   # right after g is computed
    red  = spmd.wait(flat)                       # right before the output
    g'   = view(red, shape) [-> _to_copy(dtype) when the wire dtype differs]

and returns ``g'`` in place of ``g``. Each collective starts as a bucket of one; the
bucketing pass merges them. :func:`build_bucket` is the one place that writes this
node pattern, used by both passes.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from spmd.lowering import ops
from spmd.lowering.annotate import gradient_outputs
from spmd.lowering.context import InputInfo, LoweringContext
from spmd.lowering.graph import is_collective
from spmd.lowering.passes import Provenance

__all__ = ["insert_collectives", "build_bucket", "collective_nodes"]

aten = torch.ops.aten


def _set_outputs(gm: fx.GraphModule, outputs: list) -> None:
    out = gm.graph.output_node()
    old = out.args[0]
    out.args = (type(old)(outputs) if isinstance(old, (list, tuple)) else outputs[0],)


def build_bucket(gm: fx.GraphModule, ctx: LoweringContext, grads: list[fx.Node],
                 infos: list[InputInfo], provenance: Provenance) -> list[fx.Node]:
    """Insert one bucket's collective, wait and unpacking; the reduced gradients' nodes."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    wire = ctx.options.reduce_dtype
    last = max(grads, key=order.__getitem__)
    number = len(collective_nodes(gm))
    with graph.inserting_after(last):
        flat = graph.create_node("call_function", ops.bucket_all_reduce, (list(grads), 0),
                                 name=f"all_reduce_{number}")
    spec = ops.CollectiveSpec(group=ctx.group, world_size=ctx.world_size, wire_dtype=wire,
                              params=tuple(i.name for i in infos), sync=ctx.sync,
                              name=f"{ctx.graph_name}:{flat.name}")
    handle = ops.register_spec(spec)
    flat.args = (list(grads), handle)
    numels = [int(torch.Size(i.shape).numel()) for i in infos]
    wire_dtype = wire or infos[0].dtype
    flat.meta["spmd"] = {"provenance": provenance, "spec": spec, "handle": handle,
                         "numels": numels, "dtype": infos[0].dtype, "wire_dtype": wire_dtype,
                         "bytes": sum(numels) * wire_dtype.itemsize}
    created: list[fx.Node] = []

    def add(target, args, kwargs=None) -> fx.Node:
        node = graph.call_function(target, args, kwargs or {})
        node.meta["spmd_unpack_of"] = flat.name  # the schedule pass moves these together
        created.append(node)
        return node

    with graph.inserting_before(graph.output_node()):
        done = add(ops.wait, (flat,))
        done.meta["spmd"] = {"provenance": provenance, "collective": flat.name}
        if len(grads) == 1:
            pieces = [done]
        else:
            split = add(aten.split_with_sizes.default, (done, numels))
            pieces = [add(operator.getitem, (split, k)) for k in range(len(grads))]
        results = []
        for piece, info in zip(pieces, infos):
            value = add(aten.view.default, (piece, list(info.shape)))
            if wire_dtype != info.dtype:
                value = add(aten._to_copy.default, (value,), {"dtype": info.dtype})
            results.append(value)
    return results


def insert_collectives(gm: fx.GraphModule, ctx: LoweringContext) -> fx.GraphModule:
    placements = gm.meta["spmd_grad_placements"]
    outputs = gradient_outputs(gm)
    for position, name in gm.meta["spmd_param_grads"].items():
        if not placements[position].is_partial():
            continue
        info = ctx.inputs[position]
        why = Provenance(params=(name,), pass_name="insert_collectives",
                         reason=f"gradient of replicated parameter is {placements[position]}; "
                                f"all_reduce makes it Replicate()")
        (outputs[position],) = build_bucket(gm, ctx, [outputs[position]], [info], why)
    _set_outputs(gm, outputs)
    gm.meta["spmd_grad_positions"] = {name: pos for pos, name in gm.meta["spmd_param_grads"].items()}
    return gm


def collective_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if is_collective(n)]
