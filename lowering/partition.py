"""partition: how AOTAutograd splits a captured region into forward and backward graphs,
and the two rewrites of the pair made there, where both graphs and the list of values
the forward saves for the backward are in hand.

1. Copies that only duplicate memory are dropped (:func:`drop_copies`). Functionalized
   graphs never write in place, so ``clone(x)`` of a contiguous intermediate ``x`` holds
   the same values in new memory; where the forward saves both (dropout with ``p=0`` in
   training decomposes to a clone, and a transformer layer then keeps its feed-forward
   activation twice, once for the ReLU's backward and once for the next matmul's), the
   copy costs a whole activation per layer until the backward runs. A copy that reaches
   a value the caller receives is kept: the caller may write into it.
2. A reshape of a placed activation (``spmd::place``: sequence parallelism's norm
   outputs) is saved as the placed value and reshaped again in the backward
   (:func:`save_placed`). Flattening (batch, sequence) of a sequence-sharded value needs
   the whole sequence, so the forward gathers it first; saving the reshape would keep the
   gathered copy (one per projection reading it) until the backward, more than tensor
   parallelism without sequence parallelism saves. Saved as placed, the backward gathers
   it again, as Megatron-LM's sequence-parallel linear layers do.
3. For sharded parameters, ``reshard_after_forward``: the forward saves shards, not
   gathered parameters (:func:`spmd.lowering.reshard.reshard_saved`).

The number and order of saved values never change, so AOTAutograd's runtime wrapper
around the pair is unaffected.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from spmd.lowering.reshard import SAVED_AS, reshard_saved

__all__ = ["partition", "drop_copies", "save_placed"]

aten = torch.ops.aten
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.t.default, aten.transpose.int,
          aten.permute.default, aten.expand.default, aten.detach.default, aten.alias.default,
          aten.slice.Tensor, aten.select.int, aten.unsqueeze.default, aten.squeeze.dim,
          aten.squeeze.default, aten.as_strided.default}
_FORMATS = (None, torch.preserve_format, torch.contiguous_format)


def _reaches(node: fx.Node, targets: set[fx.Node]) -> bool:
    """Whether ``node``, or a view of it, is one of ``targets``."""
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n in targets:
            return True
        if n in seen:
            continue
        seen.add(n)
        stack.extend(u for u in n.users if u.target in _VIEWS)
    return False


def drop_copies(fw: fx.GraphModule, bw: fx.GraphModule) -> list[str]:
    """Replace every ``clone`` of a contiguous forward intermediate by the intermediate
    itself where neither reaches a value the caller receives; the clones dropped."""
    saved = {n.name for n in bw.graph.nodes if n.op == "placeholder"}
    output = fw.graph.output_node()
    given = {a for a in output.all_input_nodes if a.name not in saved}  # the caller's
    placeholders = {n.name: n for n in bw.graph.nodes if n.op == "placeholder"}
    dropped = []
    for node in list(fw.graph.nodes):
        if node.op != "call_function" or node.target is not aten.clone.default:
            continue
        source = node.args[0]
        val = source.meta.get("val") if isinstance(source, fx.Node) else None
        if (source.op == "placeholder" or not isinstance(val, torch.Tensor)
                or not val.is_contiguous()
                or node.kwargs.get("memory_format") not in _FORMATS):
            continue
        if _reaches(node, given) or _reaches(source, given):
            continue
        node.replace_all_uses_with(source)
        fw.graph.erase_node(node)
        dropped.append(node.name)
        for ph in placeholders.values():  # the backward now receives the source
            if ph.meta.get(SAVED_AS, ph.name) == node.name:
                ph.meta[SAVED_AS] = source.name
    if dropped:
        fw.graph.lint()
        fw.recompile()
    return dropped


_RESHAPES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}


def save_placed(fw: fx.GraphModule, bw: fx.GraphModule, saved_from: int) -> list[str]:
    """Where the forward saves a reshape (a chain of them) of an ``spmd::place`` output,
    save the placed value instead and redo the reshapes where the backward first reads
    it; the names of the values no longer saved. ``saved_from``: the index of the first saved
    value among the forward's outputs."""
    from spmd.lowering import ops

    output = fw.graph.output_node()
    values = list(output.args[0])
    placeholders = {n.name: n for n in bw.graph.nodes if n.op == "placeholder"}
    order = {n: k for k, n in enumerate(bw.graph.nodes)}  # (readers are original nodes)
    moved = []
    for i in range(saved_from, len(values)):
        value = values[i]
        chain = []
        node = value
        while isinstance(node, fx.Node) and node.target in _RESHAPES:
            chain.append(node)
            node = node.args[0]
        if not chain or not isinstance(node, fx.Node) or node.target is not ops.place:
            continue
        if any(len(step.all_input_nodes) > 1 for step in chain):
            continue  # sizes computed in the forward (dynamic shapes): saved as it is
        ph = next((p for p in placeholders.values()
                   if p.meta.get(SAVED_AS, p.name) == value.name), None)
        if ph is None or not ph.users:
            continue
        # reshaped where the backward first reads it: a gather made earlier would hold a
        # whole activation of every layer from the backward's start
        readers = list(ph.users)
        with bw.graph.inserting_before(min(readers, key=order.__getitem__)):
            current = ph
            for step in reversed(chain):  # innermost reshape first
                # (a reshape: the saved piece's layout at run time is the forward's, which
                # the backward's inputs do not record; it copies only where a view cannot)
                current = bw.graph.call_function(aten.reshape.default,
                                                 (current, *step.args[1:]), dict(step.kwargs))
                current.meta.update({k: v for k, v in step.meta.items()
                                     if k in ("val", "tensor_meta", "nn_module_stack",
                                              "stack_trace")})
        for reader in readers:
            reader.replace_input_with(ph, current)
        ph.meta["val"] = node.meta["val"]
        if "tensor_meta" in node.meta:
            ph.meta["tensor_meta"] = node.meta["tensor_meta"]
        ph.meta[SAVED_AS] = node.name
        values[i] = node
        moved.append(value.name)
    if moved:
        output.args = (type(output.args[0])(values),)
        fw.graph.eliminate_dead_code()
        fw.graph.lint()
        fw.recompile()
        bw.graph.lint()
        bw.recompile()
    return moved


def partition(joint: fx.GraphModule, joint_inputs: Any, *, reshard: bool = False,
              **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
    """AOTAutograd's default partition, then :func:`drop_copies` and (``reshard``) the
    resharding of saved parameters."""
    from torch._functorch.partitioners import default_partition

    fw, bw = default_partition(joint, joint_inputs, **kwargs)
    if "num_fwd_outputs" in kwargs:  # the rest are saved for the backward
        from spmd.lowering.tensor_parallel import USER_OUTPUTS

        fw.meta[USER_OUTPUTS] = kwargs["num_fwd_outputs"]
    drop_copies(fw, bw)
    if "num_fwd_outputs" in kwargs:
        save_placed(fw, bw, kwargs["num_fwd_outputs"])
    if reshard:
        reshard_saved(fw, bw)
    return fw, bw
