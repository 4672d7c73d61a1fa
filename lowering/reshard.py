"""reshard: free gathered parameters after the forward, gather them again in backward.

AOTAutograd splits a region into a forward and a backward graph and saves, for the
backward, whatever forward values it reads: for a sharded parameter that is its gathered
(whole) tensor, or a view of it such as the transpose a linear layer multiplies by. Kept
from forward to backward, every layer's whole parameters would be alive at once at the
end of the forward, which is what sharding is meant to avoid (``reshard_after_forward=
True``, FSDP's default, ZeRO-3).

:func:`reshard_saved` runs after AOTAutograd's partitioner
(``spmd.lowering.partition``): for each saved value that is a
parameter's gather followed only by ops of one input (views, transposes), the forward
saves the parameter's shard instead, and the backward starts by replaying the gather and
those ops on it. The number and order of saved values stay the same, so the runtime
wrapper around the two graphs is unchanged; the schedule pass then prefetches the
backward's gathers like the forward's.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from spmd.lowering import ops

__all__ = ["reshard_saved", "RESHARDED", "SAVED_AS", "forward_name"]

RESHARDED = "spmd_resharded"  # backward placeholder meta: the forward shard it now holds
SAVED_AS = "spmd_saved_as"  # backward placeholder meta: the forward value that replaced it


def forward_name(placeholder: fx.Node) -> str:
    """The name of the forward value a backward placeholder receives: its own, unless a
    rewrite of the pair made the forward save another (a shard instead of the gathered
    parameter, an intermediate instead of its dropped copy)."""
    return placeholder.meta.get(RESHARDED) or placeholder.meta.get(SAVED_AS) or placeholder.name


def _chain_to_gather(node: fx.Node) -> list[fx.Node] | None:
    """``[gather, op1, ..., node]`` when ``node`` is a sharded parameter's gather followed
    only by ops of that one tensor; else None."""
    chain = [node]
    while node.target is not ops.shard_gather:
        if node.op != "call_function":
            return None
        inputs = node.all_input_nodes
        if len(inputs) != 1 or not isinstance(node.meta.get("val"), torch.Tensor):
            return None
        node = inputs[0]
        chain.append(node)
    if node.args[0].op != "placeholder":
        return None
    return chain[::-1]


def reshard_saved(fw: fx.GraphModule, bw: fx.GraphModule) -> list[str]:
    """Rewrite a partitioned pair so no gathered parameter is saved (see the module doc);
    the names of the backward inputs now holding a shard."""
    nodes = {n.name: n for n in fw.graph.nodes}
    output = fw.graph.output_node()
    values = list(output.args[0])
    position = {id(v): i for i, v in enumerate(values) if isinstance(v, fx.Node)}
    placeholders = [n for n in bw.graph.nodes if n.op == "placeholder"]
    order = {n: i for i, n in enumerate(bw.graph.nodes)}
    changed: list[str] = []
    for ph in placeholders:
        saved = nodes.get(ph.name)
        if saved is None or id(saved) not in position or not ph.users:
            continue
        chain = _chain_to_gather(saved)
        if chain is None:
            continue
        shard = chain[0].args[0]
        values[position[id(saved)]] = shard
        ph.meta["val"] = shard.meta["val"]
        ph.meta[RESHARDED] = shard.name
        first_use = min(ph.users, key=order.__getitem__)
        replayed: dict[fx.Node, fx.Node] = {shard: ph}
        for op in chain:  # right before the first use: the schedule prefetches the gather
            with bw.graph.inserting_before(first_use):
                replayed[op] = bw.graph.node_copy(op, lambda n: replayed[n])
        ph.replace_all_uses_with(replayed[chain[-1]], delete_user_cb=lambda user, first=replayed[
            chain[0]]: user is not first)
        changed.append(ph.name)
    if changed:
        output.args = (tuple(values),) + tuple(output.args[1:])
        fw.graph.eliminate_dead_code()
        fw.recompile()
        bw.graph.lint()
        bw.recompile()
    return changed
