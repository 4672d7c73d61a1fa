"""``Plan.memory()``: what one rank holds, persistently and at the peak of a step.

Persistent bytes come from the model's parameters as this rank stores them (whole for
``ddp``, one padded shard for ``fsdp``/``hsdp``), as many again for their gradients,
and the optimizer's state (AdamW: two tensors per parameter; SGD with momentum: one).
The step's transient bytes come from walking the planned graphs in the order they run
(forward, then backward) and keeping every value alive from the node that makes it to
its last reader (a view keeps its base alive; values the forward saves stay until the
backward's last read): the largest total is the predicted peak, reported with the node
where it happens. Gathered parameters (all-gather results) are counted apart, so the
effect of resharding and prefetch is visible.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from spmd.lowering import ops
from spmd.lowering.strategy import Gathered

if TYPE_CHECKING:
    from spmd.plan.plan import Plan

__all__ = ["MemoryView", "memory_view", "OPTIMIZER_STATES"]

# tensors of optimizer state per parameter, in the parameter's dtype
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd_momentum": 1, "sgd": 0, None: 0}

_aten = torch.ops.aten
_VIEWS = {_aten.view.default, _aten._unsafe_view.default, _aten.t.default,
          _aten.transpose.int, _aten.permute.default, _aten.expand.default,
          _aten.detach.default, _aten.alias.default, _aten.slice.Tensor,
          _aten.select.int, _aten.unsqueeze.default, _aten.squeeze.dim,
          _aten.squeeze.default, _aten.as_strided.default, _aten.split.Tensor,
          _aten.split_with_sizes.default, _aten.unbind.int, ops.wait}


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryView:
    """One rank's predicted memory for one step, in bytes.

    Attributes:
        world_size: ranks the plan is for.
        params, grads, optimizer_state, buffers: persistent, as this rank stores them.
        optimizer: the optimizer the state was counted for.
        activations: the forward's values saved for backward (at the forward's end).
        peak_gathered: the most parameter bytes held gathered (whole) at once.
        peak_transient: the most bytes of values alive at once during the step.
        peak: persistent + transient at the peak; ``peak_at``: ``graph:node`` there.
        unsharded_params: what the parameters take whole (``ddp``'s ``params``).
        comm_buffers: the largest collective's flat buffer (every bucket alive at the
            peak is already in ``peak``).
        capacity: against the simulated cluster's device memory, when planned for one.
        saved_by_layer: the forward's saved activations by layer (``layers.3``, ``norm``;
            values the model's root computes or reads are ``"(model)"``), with whether
            the layer is activation-checkpointed (torch's ``checkpoint``: it saves its
            inputs and the backward recomputes the rest), in forward order.
    """

    world_size: int
    params: int
    grads: int
    optimizer_state: int
    optimizer: str | None
    buffers: int
    activations: int
    peak_gathered: int
    peak_transient: int
    peak: int
    peak_at: str
    unsharded_params: int
    comm_buffers: int = 0  # the largest collective's buffer (the peak counts those alive)
    capacity: str = ""  # against the simulated cluster's device memory, when planned for one
    saved_by_layer: tuple[tuple[str, int, bool], ...] = ()
    kept_whole: int = 0  # zero1/zero2: parameters gathered once per step and kept whole

    @property
    def persistent(self) -> int:
        return self.params + self.grads + self.optimizer_state + self.buffers + self.kept_whole

    def __str__(self) -> str:
        def mib(n: int) -> str:
            return f"{n / 2**20:10.3f} MiB"

        rows = [
            f"Memory per rank at {self.world_size} rank(s) (optimizer {self.optimizer}):",
            f"  parameters        {mib(self.params)}   (whole: {mib(self.unsharded_params)})",
            f"  gradients         {mib(self.grads)}",
            f"  optimizer state   {mib(self.optimizer_state)}",
            f"  buffers           {mib(self.buffers)}",
            *([f"  kept whole        {mib(self.kept_whole)}   (gathered once per step, held "
               f"until the shards change)"] if self.kept_whole else []),
            f"  persistent        {mib(self.persistent)}",
            f"  activations saved {mib(self.activations)}",
            f"  peak gathered     {mib(self.peak_gathered)}",
            f"  largest bucket    {mib(self.comm_buffers)}",
            f"  predicted peak    {mib(self.peak)}   at {self.peak_at}",
        ]
        if self.capacity:
            rows.append(f"  {self.capacity}")
        if self.saved_by_layer:
            rows.append("  activations saved by layer:")
            for first, last, count, n, ckpt in _runs(self.saved_by_layer):
                name = first if count == 1 else f"{first} .. {last.rsplit('.', 1)[-1]}"
                rows.append(f"    {name:<24} {mib(n)}" + (f" each ({count} layers)"
                                                          if count > 1 else "")
                            + ("   checkpointed: recomputed in backward" if ckpt else ""))
        return "\n".join(rows)

    @property
    def fits(self) -> bool | None:
        """Whether the peak fits the simulated cluster's device (None: no hardware)."""
        return None if not self.capacity else not self.capacity.endswith("DOES NOT FIT")


def _runs(rows: tuple[tuple[str, int, bool], ...]) -> list[tuple[str, str, int, int, bool]]:
    """Consecutive numbered layers that save alike (``layers.3`` .. ``layers.31``), as
    (first, last, count, bytes, checkpointed)."""
    out: list[list] = []
    for layer, n, ckpt in rows:
        stem, _, index = layer.rpartition(".")
        prev = out[-1] if out else None
        if (prev is not None and index.isdigit() and prev[3] == n and prev[4] == ckpt
                and prev[1].rpartition(".")[0] == stem
                and prev[1].rpartition(".")[2] == str(int(index) - 1)):
            prev[1], prev[2] = layer, prev[2] + 1
        else:
            out.append([layer, layer, 1, n, ckpt])
    return [tuple(r) for r in out]


def _bytes(val: Any) -> int:
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(_bytes(v) for v in val)
    return 0


def _walk(gm: fx.GraphModule, label: str, held: dict[str, int], end_held: set[str],
          kept_gathers: bool = False) -> tuple[int, str, int, dict[str, int]]:
    """Live bytes through ``gm``: (peak, node at the peak, peak gathered bytes, bytes of
    the values named in ``end_held`` that stay alive after the graph). ``held``: bytes
    alive on entry by placeholder name (freed after their last read here).
    ``kept_gathers``: gathered parameters are kept whole across steps (zero1, zero2),
    counted as persistent by the caller, so not here."""
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    root: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        base = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        viewish = node.target in _VIEWS or (node.target.__name__ == "getitem"
                                            if callable(node.target) else False)
        root[node] = root.get(base, base) if (viewish and base is not None) else node
    last: dict[fx.Node, int] = {}
    for node in nodes:
        for arg in node.all_input_nodes:
            r = root[arg]
            last[r] = max(last.get(r, -1), index[node])
    output = nodes[-1]
    kept = {root[a] for a in output.all_input_nodes if a.name in end_held}
    size: dict[fx.Node, int] = {}
    gathered: set[fx.Node] = set()
    for node in nodes:
        if root[node] is not node or node.op == "output":
            continue
        if node.op == "placeholder":
            size[node] = held.get(node.name, 0)
        else:
            size[node] = _bytes(node.meta.get("val"))
        if node.target in (ops.bucket_all_gather, ops.unpack_gathered, ops.shard_gather):
            gathered.add(node)
            if kept_gathers:
                size[node] = 0
    alive = sum(size[n] for n in nodes if n.op == "placeholder")
    live_gathered = 0
    peak, peak_at, peak_gathered = alive, f"{label}:start", 0
    ends: dict[int, list[fx.Node]] = {}
    for r, i in last.items():
        if r not in kept:
            ends.setdefault(i, []).append(r)
    for node in nodes:
        if node.op != "placeholder" and root[node] is node and node.op != "output":
            alive += size[node]
            if node in gathered:
                live_gathered += size[node]
        if alive > peak:
            peak, peak_at = alive, f"{label}:{node.name}"
        peak_gathered = max(peak_gathered, live_gathered)
        for dead in ends.get(index[node], ()):
            alive -= size.get(dead, 0)
            if dead in gathered:
                live_gathered -= size[dead]
    kept_bytes = {n.name: size.get(n, 0) for n in kept}
    return peak, peak_at, peak_gathered, kept_bytes


def layer_of(path: str) -> str:
    """The layer a module path belongs to: through its first numbered part
    (``layers.3.attention.wq`` -> ``layers.3``), else its first part; ``"(model)"`` for
    the root."""
    if not path:
        return "(model)"
    parts = path.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return parts[0]


def _saved_by_layer(forward: fx.GraphModule, saved: dict[str, int]
                    ) -> list[tuple[str, int, bool]]:
    """Saved bytes per layer of ``forward``, and which layers are checkpointed. A saved
    value is charged to the checkpointed layer that reads it (what a checkpointed layer
    saves is its input), else to the layer that computed it."""
    from torch.utils.checkpoint import CheckpointPolicy

    from spmd.lowering.propagate import module_of

    recompute = (CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_RECOMPUTE)
    checkpointed: set[str] = set()
    order: dict[str, int] = {}
    layer: dict[fx.Node, str] = {}
    for node in forward.graph.nodes:
        if node.op != "call_function":
            layer[node] = "(model)"
            continue
        layer[node] = layer_of(module_of(node) or "")
        order.setdefault(layer[node], len(order))
        if node.meta.get("recompute") in recompute and layer[node] != "(model)":
            checkpointed.add(layer[node])
    by_layer: dict[str, int] = {}
    nodes = {n.name: n for n in forward.graph.nodes}
    for name, nbytes in saved.items():
        node = nodes.get(name)
        if node is None:
            continue
        readers = [layer[u] for u in node.users if layer.get(u) in checkpointed]
        charged = readers[0] if readers else layer[node]
        by_layer[charged] = by_layer.get(charged, 0) + nbytes
    return sorted(((layer, n, layer in checkpointed) for layer, n in by_layer.items()),
                  key=lambda row: order.get(row[0], -1))


def memory_view(plan: Plan, optimizer: str | None = "adamw") -> MemoryView:
    """The :class:`MemoryView` of ``plan`` (see the module doc)."""
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"Plan.memory: optimizer must be one of "
                         f"{', '.join(repr(k) for k in OPTIMIZER_STATES)}, got {optimizer!r}")
    params = sum(local for local, _, _ in plan.parameters.values())
    whole = sum(full for _, full, _ in plan.parameters.values())
    trainable = sum(local for local, _, grad in plan.parameters.values() if grad)
    transient, at, gathered, activations = 0, "-", 0, 0
    layers: dict[str, list] = {}
    # zero1/zero2: the gathered parameters stay whole from one optimizer step to the next
    kept = plan.options is not None and plan.options.gathered is Gathered.PER_STEP
    held_whole = sum(b.bytes for b in plan.buckets
                     if kept and b.kind == "all_gather" and b.phase == "forward")
    kept_part = plan.kept_part
    peak_forward = 0
    regions = sorted({name.rsplit(".", 1)[0] for name in plan.graphs})
    for region in regions:
        forward = plan.graphs.get(f"{region}.forward")
        backward = plan.graphs.get(f"{region}.backward")
        saved: dict[str, int] = {}
        if forward is not None:
            names = ({n.name for n in backward.graph.nodes if n.op == "placeholder"}
                     if backward is not None else set())
            peak, where, g, saved = _walk(forward, f"{region}.forward", {}, names, kept)
            peak_forward = peak
            if peak > transient:
                transient, at = peak, where
            gathered = max(gathered, g)
            activations += sum(saved.values())
            for layer, n, ckpt in _saved_by_layer(forward, saved):
                row = layers.setdefault(layer, [0, False])
                row[0] += n
                row[1] = row[1] or ckpt
        if backward is not None:
            held = dict(saved)
            parts = 0  # reshard_after_forward=N: the parts kept from forward to backward
            for node in backward.graph.nodes:  # a resharded input holds a forward shard
                if node.op == "placeholder" and "spmd_resharded" in node.meta:
                    shard = _bytes(node.meta.get("val"))
                    part = int(shard * kept_part)
                    held[node.name] = shard + part  # (the part until its gather)
                    parts += part
            if parts:  # alive from the forward's gathers: at its end, all of them
                activations += parts
                fw_peak = peak_forward + parts
                if fw_peak > transient:
                    transient, at = fw_peak, f"{region}.forward:end (+ parts kept for backward)"
            peak, where, g, _ = _walk(backward, f"{region}.backward", held, set(), kept)
            if peak > transient:
                transient, at = peak, where
            gathered = max(gathered, g)
    state = OPTIMIZER_STATES[optimizer] * trainable
    persistent = params + trainable + state + plan.buffer_bytes + held_whole
    peak = persistent + transient
    hardware = plan.mesh.hardware if plan.mesh is not None else None
    capacity = "" if hardware is None else hardware.check_fits(peak, "device memory")
    return MemoryView(world_size=plan.world_size, params=params, grads=trainable,
                      optimizer_state=state, optimizer=optimizer, buffers=plan.buffer_bytes,
                      activations=activations, peak_gathered=gathered,
                      peak_transient=transient, peak=peak, peak_at=at,
                      unsharded_params=whole, capacity=capacity,
                      comm_buffers=max((b.bytes for b in plan.buckets), default=0),
                      saved_by_layer=tuple((k, n, c) for k, (n, c) in layers.items()),
                      kept_whole=held_whole)
