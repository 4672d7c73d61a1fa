"""What the ranks of a parallelized module share while they compile: the backward-time
estimate that sizes gradient buckets, and the plans themselves.

Two facts shape it. A batch of another size recompiles only on the ranks that see it (the
uneven last batch of a ``DataLoader``); such a graph must plan without waiting for ranks
that are not compiling, and must plan the buckets the graph it replaces had. And
AOTAutograd plans a static graph's backward at its first backward but a dynamic one's
inside Dynamo's compile, so ranks whose graphs differ only there (a view of the batch at
another storage offset) reach the backward's planning at different points of the
program; thread ranks also share Dynamo's compile lock. So nothing waits inside a compile
for a rank that might not be compiling:

- the estimate is kept per graph *structure* (parameters and buffers by name, the data's
  dtypes and ranks: not its sizes); the group's first rank times each new structure's
  forward as it compiles and publishes twice that under the structure's place in the
  forward-compile order, which every rank numbers alike; the others read it when they plan
  the backward (the first rank never waits, so neither do they for long);
- plans are compared by a signature of their collectives (no graph names, no activation
  sizes) at the first run of their backward, where every rank is at the same point: a
  signature every rank already agreed on runs at once, a new one is compared, and
  differing plans raise naming the ranks;
- the ranks of a tensor- or context-parallel group are given the same batch: each
  forward first compares the shapes of its inputs over those groups (one small
  all-gather each, ``spmd.runtime.sizecheck``), so a rank fed another sequence length
  is named, with every rank's shapes, before anything runs (it would have recompiled
  alone, sent other sizes, or trained on alone on a path without collectives).
"""

from __future__ import annotations

import hashlib
import time
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_leaves

from spmd.lowering.capture import GraphRecord, time_forward
from spmd.lowering.graph import collective_nodes
from spmd.runtime import sizecheck
from spmd.runtime.errors import DistError

if TYPE_CHECKING:
    from spmd.program.setup import Setup

__all__ = ["Agreement", "collective_signature"]


class Agreement:
    """The shared estimates and agreed plans of one parallelized module (see the module
    doc); ``setup`` is its :class:`spmd.program.setup.Setup`."""

    def __init__(self, setup: Setup) -> None:
        self.group = setup.group
        self.index = setup.index  # the how-many-th parallelized model: its store keys
        self.communicates = setup.communicates
        # thread ranks share one process's cores (a measurement says little) and Dynamo's
        # compile lock (a rank waiting inside a compile would keep the first rank from
        # compiling what it waits for): every rank plans without a measured figure
        self.threaded = bool(getattr(self.group, "_threaded", False))
        self.estimates: dict[tuple, float | None] = {}  # structure -> backward seconds
        self.sequence: dict[tuple, int] = {}  # new structures in forward-compile order
        self.agreed: set[str] = set()  # collective signatures every rank has planned
        # the tensor- and context-parallel groups, whose ranks must be given the same batch
        strategy = setup.strategy
        mesh = strategy.mesh
        self.model_groups = [] if mesh.simulated else [
            g for g in (mesh.get_group(d) for d in strategy.tp_dims) if g.size() > 1]

    def check_inputs(self, args: tuple, kwargs: dict) -> None:
        """Every rank of each tensor- or context-parallel group is given inputs of the
        same shapes; raises on every rank, naming each rank's shapes, otherwise."""
        if not self.model_groups:
            return
        shapes = tuple((tuple(t.shape), str(t.dtype)) for t in tree_leaves((args, kwargs))
                       if isinstance(t, torch.Tensor))
        signature = int(hashlib.sha256(repr(shapes).encode()).hexdigest()[:15], 16)

        def describe() -> str:
            given = ", ".join(str(s).replace(" ", "") for s, _ in shapes) or "none"
            return (f"the model's forward on inputs of shapes {given} (every rank of a "
                    f"tensor- or context-parallel group must be given the same batch)")

        for group in self.model_groups:
            sizecheck.check_signature(group, "inputs", signature, describe)

    def forward_compiled(self, record: GraphRecord) -> None:
        """A training forward compiled: number a new structure, and on the first rank
        time it and publish the figure, before anything waits for it."""
        if not self.communicates or self.threaded:
            return
        structure = record.structure
        if structure in self.sequence:
            return
        self.sequence[structure] = at = len(self.sequence)
        if self.group.rank() == 0:
            timed = time_forward(record)
            self.group.store.set(f"spmd/measure/{self.index}/{at}",
                                 f"{_digest(structure)} "
                                 f"{'none' if timed is None else repr(2.0 * timed)}")

    def backward_estimate(self, record: GraphRecord) -> float | None:
        """Seconds of ``record``'s backward compute, the same on every rank (None: plan
        without a figure)."""
        structure = record.structure
        if structure in self.estimates:
            return self.estimates[structure]
        if not self.communicates:
            timed = time_forward(record)  # nothing to agree on: no collectives run
            seconds = None if timed is None else 2.0 * timed
        elif self.threaded or structure not in self.sequence:
            seconds = None  # (not in sequence: compiled in no training forward)
        else:
            key = f"spmd/measure/{self.index}/{self.sequence[structure]}"
            digest, raw = self._get(key, f"the timing of {record.name}").split()
            # another structure there: the ranks traced different graphs, which comparing
            # the plans reports by name; any figure will do until then
            seconds = None if raw == "none" or digest != _digest(structure) else float(raw)
        self.estimates[structure] = seconds
        return seconds

    def agree(self, record: GraphRecord) -> None:
        """Every rank must run identically planned collectives; called at the first run of
        ``record``'s backward."""
        if not self.communicates:
            return
        mine = collective_signature([record])
        if mine in self.agreed:
            return
        store, group = self.group.store, self.group
        key = f"spmd/plan/{self.index}/{len(self.agreed)}"
        store.set(f"{key}/{group.rank()}", mine)
        keys = [f"{key}/{r}" for r in range(group.size())]
        seconds = group.timeout.total_seconds()
        try:
            every = [v.decode() for v in store._multi_get(keys, seconds)]
        except TimeoutError:
            missing = [group.ranks[r] for r, k in enumerate(keys) if not store.check([k])]
            raise DistError(f"parallelize: rank(s) {', '.join(map(str, missing))} did not plan "
                            f"a new graph when this rank planned {record.name} (within the "
                            f"group's {seconds:g}s timeout); ranks are running different "
                            f"graphs (data-dependent control flow, or a rank that recompiled "
                            f"alone?)") from None
        differ = [group.ranks[r] for r, h in enumerate(every) if h != every[0]]
        if differ:
            # every rank has read every plan before any raises (the first rank's store
            # server goes down with it, which would turn the others' error into a lost
            # connection)
            _all_arrived(store, f"{key}/read", group.size())
            raise DistError(f"parallelize: ranks planned {record.name} differently (plan "
                            f"{every[0]} on rank {group.ranks[0]}, other plans on rank(s) "
                            f"{', '.join(map(str, differ))}); every rank must trace the same "
                            f"graph")
        self.agreed.add(mine)

    def _get(self, key: str, what: str) -> str:
        try:
            return self.group.store.get(key).decode()
        except TimeoutError:
            raise DistError(f"parallelize: {what} did not arrive from rank "
                            f"{self.group.ranks[0]} within the store timeout; ranks are "
                            f"compiling different graphs (data-dependent control flow, or "
                            f"a rank that stopped?)") from None


def collective_signature(records: list) -> str:
    """A hash of the collectives ``records``' graphs run, in order, without graph names
    or the sizes of activations: what every rank must run identically. A gradient bucket's
    size is its parameters'; an activation's (tensor parallelism) follows the batch, which
    may differ across data-parallel ranks, and is left out."""
    h = hashlib.sha256()
    for record in records:
        for phase, graph in (("forward", record.forward), ("backward", record.backward)):
            if graph is None:
                continue
            for node in collective_nodes(graph):
                info = node.meta["spmd_collective"]
                h.update(repr((phase, info.kind, info.params, str(info.dtype),
                               str(info.wire_dtype), info.mesh_dim,
                               sum(info.numels) if info.params else None)).encode())
    return h.hexdigest()[:16]


def _digest(structure: tuple) -> str:
    return hashlib.sha256(repr(structure).encode()).hexdigest()[:16]


def _all_arrived(store: Any, key: str, size: int, seconds: float = 10.0) -> None:
    """Count this rank in at ``key`` and wait (at most ``seconds``) until ``size`` have.
    Best effort: the caller raises what it knows either way (a rank whose store server
    went down first has already read what it needs)."""
    deadline = time.monotonic() + seconds
    try:
        count = store.add(key, 1)
        while count < size and time.monotonic() < deadline:
            time.sleep(0.01)
            count = store.add(key, 0)
        time.sleep(0.05)  # the server's last replies reach the others before it may go
    except Exception:
        return
