"""Collectives of a group that spans hosts, in two levels: within each host over its fast
path, across hosts on a share of the bytes.

For a group of ``h`` hosts holding ``k`` of its ranks each, an all-reduce of ``n`` bytes:

1. reduce-scatter within each host: the host's ``i``-th rank holds the host's sum of
   chunk ``i`` (``n/k`` bytes);
2. all-reduce across hosts among the ranks holding chunk ``i`` (``k`` of these run at
   once, one per local rank, each over ``n/k`` bytes);
3. all-gather within each host: every rank holds the whole sum.

An all-gather gathers across hosts first (each rank's piece travels the network once to
each other host) and then within; a reduce-scatter reduces within the host first and
then across, so the network carries each host's partial sums once.

A flat ring over the same ``h·k`` ranks crosses the network on ``h`` of its edges, each
carrying ``2(p-1)/p·n`` bytes; here each host sends ``2(h-1)/h·n`` bytes in all, split over
its ``k`` ranks, and the latency across hosts is paid ``2(h-1)`` times instead of
``2(hk-1)``. Where the link between hosts is the bottleneck that is the saving NCCL's
tree and CollNet algorithms, Horovod's hierarchical all-reduce and torch's HSDP go for.
The cost model (``spmd.lowering.cost_model.TwoLevelCostModel``) prices both and the
compiler picks per bucket.

The three stages of one collective run in order on one thread per group (so every rank
issues them on the sub-groups in the same order, whatever the caller does meanwhile);
``async_op=True`` returns at once with a :class:`HierarchicalWork`.

The sub-groups are made on the group's first hierarchical collective (by every member,
which a collective's members all call) and kept: ``<group>/within/<host>`` and
``<group>/across/<local rank>``.
"""

from __future__ import annotations

import math
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch

from spmd.runtime import checks
from spmd.runtime.groups import new_group, resolve_group, world
from spmd.runtime.process_group import ProcessGroup
from spmd.runtime.reduction import ReduceOp
from spmd.runtime.topology import get_topology

__all__ = ["Hierarchy", "hierarchy", "all_reduce_hierarchical", "all_gather_hierarchical",
           "reduce_scatter_hierarchical", "then_all_reduce", "HierarchicalWork"]


@dataclass(frozen=True, eq=False)
class Hierarchy:
    """A group's two levels as seen from this rank.

    Attributes:
        within: this rank's host's ranks of the group (``per_host`` of them).
        across: the group's ranks at this rank's local index, one per host.
        hosts: how many hosts the group spans.
        per_host: the group's ranks on each host.
    """

    within: ProcessGroup
    across: ProcessGroup
    hosts: int
    per_host: int
    # each group rank's (local index, index in its across group): where its piece sits
    # in the two-level layouts ``[local][across index]``
    places: tuple[tuple[int, int], ...] = ()


def layout(ranks: list[int]) -> tuple[list[list[int]], int] | None:
    """(the group's ranks by host, ranks per host) when ``ranks`` span two or more hosts
    with the same number (two or more) on each, else None: a two-level collective
    over them would gain nothing, or could not split the bytes evenly."""
    topo = get_topology()
    by_host = topo.split(ranks)
    per = topo.per_host(ranks)
    if len(by_host) < 2 or per is None or per < 2:
        return None
    return by_host, per


def hierarchy(group: ProcessGroup | None = None) -> Hierarchy | None:
    """``group``'s two levels (made on first call and kept), or None when it does not span
    hosts evenly (see :func:`layout`). Every member of the group must call it (it may make
    groups), as for a collective."""
    pg = resolve_group(group, "hierarchy")
    cached = getattr(pg, "_hierarchy", False)
    if cached is not False:
        return cached
    found = layout(list(pg.ranks))
    if found is None:
        pg._hierarchy = None  # type: ignore[attr-defined]
        return None
    by_host, per = found
    me = world("hierarchy").rank
    host = next(i for i, ranks in enumerate(by_host) if me in ranks)
    local = by_host[host].index(me)
    within = new_group(by_host[host], group_name=f"{pg.name}/within/{host}")
    across = new_group([ranks[local] for ranks in by_host],
                       group_name=f"{pg.name}/across/{local}")
    where = {}
    for index in range(per):  # an across group's members in its own (sorted) rank order
        members = sorted(ranks[index] for ranks in by_host)
        where.update({r: (index, j) for j, r in enumerate(members)})
    made = Hierarchy(within=within, across=across, hosts=len(by_host), per_host=per,
                     places=tuple(where[r] for r in pg.ranks))
    pg._hierarchy = made  # type: ignore[attr-defined]
    return made


class HierarchicalWork:
    """A two-level collective in flight on its group's thread; ``wait()`` blocks until its
    last stage is done and raises what a stage raised (naming the failed peer)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._future: Any = None

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self._done.set()
        if self._future is not None:
            if error is None:
                self._future.set_result(None)
            else:
                self._future.set_exception(error)

    def wait(self, timeout: Any = None) -> bool:
        seconds = None if timeout is None else getattr(timeout, "total_seconds", lambda: timeout)()
        if not self._done.wait(seconds):
            from spmd.runtime.errors import DistTimeoutError

            raise DistTimeoutError(f"{self._name}: not finished within {seconds} s")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def exception(self) -> BaseException | None:
        return self._error

    def get_future(self) -> Any:
        if self._future is None:
            self._future = torch.futures.Future()
            if self._done.is_set():
                self._finish(self._error)
        return self._future

    def __repr__(self) -> str:
        return f"HierarchicalWork({self._name}, {'done' if self._done.is_set() else 'pending'})"


class _Runner:
    """One thread per group running its two-level collectives' stages in issue order."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=f"spmd-hier-{name}",
                                        daemon=True)
        self._thread.start()

    def submit(self, stages: Callable[[], None], work: HierarchicalWork) -> None:
        self._queue.put((stages, work))

    def close(self, timeout: float = 30.0) -> None:
        """End the thread once what was submitted has run (the group is being destroyed),
        and wait for it: a thread left inside a C++ call when the interpreter exits
        aborts the process ("terminate called without an active exception")."""
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            stages, work = item
            try:
                stages()
            except BaseException as e:  # handed to the caller's wait()
                work._finish(e)
            else:
                work._finish(None)


def _runner(pg: ProcessGroup) -> _Runner:
    runner = getattr(pg, "_hier_runner", None)
    if runner is None:
        runner = _Runner(pg.name)
        pg._hier_runner = runner  # type: ignore[attr-defined]
    return runner


def all_reduce_hierarchical(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
                            group: ProcessGroup | None = None,
                            async_op: bool = False) -> HierarchicalWork | None:
    """``all_reduce`` in two levels (see the module doc): the same result, fewer bytes and
    latencies across hosts. A group that does not span hosts evenly gets the plain
    ``all_reduce`` (same result; its work is returned).

    Args:
        tensor: reduced in place (any shape; contiguous or not).
        op: any ``ReduceOp`` the backend supports (``AVG``: summed, then divided).
        group: the group (default: the world).
        async_op: return a work at once; ``wait()`` it before reading ``tensor``.

    Example::

        grads = torch.randn(1 << 20)
        dist.all_reduce_hierarchical(grads)   # same as dist.all_reduce(grads)
    """
    from spmd.runtime.collectives import (all_gather_into_tensor, all_reduce,
                                          reduce_scatter_tensor)

    name = "all_reduce_hierarchical"
    pg = resolve_group(group, name)
    checks.tensor(tensor, name, pg)
    rop = ReduceOp.of(op)
    levels = hierarchy(pg)
    if levels is None:
        return all_reduce(tensor, op, group=pg, async_op=async_op)
    _begin(pg, name, tensor, rop)
    k = levels.per_host
    average = rop is ReduceOp.AVG
    inner_op = ReduceOp.SUM if average else rop
    n = tensor.numel()
    m = max(1, math.ceil(n / k))
    flat = torch.zeros(k * m, dtype=tensor.dtype, device=tensor.device)
    flat[:n].copy_(tensor.reshape(-1))
    size = pg.size()

    def stages() -> None:
        chunk = torch.empty(m, dtype=flat.dtype, device=flat.device)
        reduce_scatter_tensor(chunk, flat, inner_op, group=levels.within)
        all_reduce(chunk, inner_op, group=levels.across)
        all_gather_into_tensor(flat, chunk, group=levels.within)
        if average:
            flat.div_(size)
        tensor.view(-1).copy_(flat[:n]) if tensor.is_contiguous() else tensor.copy_(
            flat[:n].view(tensor.shape))

    return _submit(pg, name, stages, async_op, levels)


def _begin(pg: ProcessGroup, name: str, tensor: torch.Tensor, op: ReduceOp | None) -> None:
    """The call's one size check, on ``pg`` itself (skipped where a compiled graph
    checked its run already): its stages then run unchecked on the sub-groups, whose
    sizes follow from it, instead of paying a round trip each."""
    from spmd.runtime import sizecheck

    code = -1 if op is None else list(ReduceOp).index(op)
    pg._begin(name, lambda: f"{checks.describe(tensor)}",
              sizecheck.header(name, tensor.numel(), tensor.dtype, -1, code))


def _submit(pg: ProcessGroup, name: str, stages: Callable[[], None],
            async_op: bool, levels: "Hierarchy | None" = None,
            private: ProcessGroup | None = None) -> HierarchicalWork | None:
    from spmd.runtime import sizecheck

    quiet = [g for g in (levels.within, levels.across) if g is not None] if levels else []
    quiet += [private] if private is not None else []

    def run() -> None:
        with sizecheck.agreed(quiet):  # checked once on the parent group (_begin)
            stages()

    work = HierarchicalWork(f"{name} on {pg.name}")
    _runner(pg).submit(run, work)
    if async_op:
        return work
    work.wait()
    return None


def _checked(name: str, group: ProcessGroup | None, whole: torch.Tensor, part: torch.Tensor,
             names: tuple[str, str]) -> ProcessGroup:
    """The group, once ``whole`` and ``part`` are tensors it can move and ``whole`` holds
    a ``part`` for each of its ranks (else the error, before anything is sent)."""
    pg = resolve_group(group, name)
    checks.tensor(whole, name, pg, names[0])
    checks.tensor(part, name, pg, names[1])
    if whole.numel() != pg.size() * part.numel():
        raise ValueError(f"{name}: {names[0]} has {whole.numel()} elements; it needs "
                         f"{pg.size()} x {part.numel()} (group size x {names[1]})")
    return pg


def all_gather_hierarchical(output: torch.Tensor, input: torch.Tensor,
                            group: ProcessGroup | None = None,
                            async_op: bool = False) -> HierarchicalWork | Any:
    """``all_gather_into_tensor`` in two levels: across hosts among the ranks of one local
    index, then within each host; ``output`` (group size x ``input``, in group rank
    order) as the flat one gives it. A group that does not span hosts evenly gets the flat
    all-gather."""
    from spmd.runtime.collectives import all_gather_into_tensor

    name = "all_gather_hierarchical"
    pg = _checked(name, group, output, input, ("output", "input"))
    levels = hierarchy(pg)
    if levels is None:
        return all_gather_into_tensor(output, input, group=pg, async_op=async_op)
    _begin(pg, name, output, None)
    h, k, m = levels.hosts, levels.per_host, input.numel()
    piece = input.reshape(-1).clone()

    def stages() -> None:
        mine = torch.empty(h * m, dtype=piece.dtype, device=piece.device)
        all_gather_into_tensor(mine, piece, group=levels.across)  # [across index][m]
        every = torch.empty(k * h * m, dtype=piece.dtype, device=piece.device)
        all_gather_into_tensor(every, mine, group=levels.within)  # [local][across index][m]
        grid = every.view(k, h, m)
        rows = output.view(pg.size(), m)
        for g, (local, j) in enumerate(levels.places):
            rows[g].copy_(grid[local, j])

    return _submit(pg, name, stages, async_op, levels)


def reduce_scatter_hierarchical(output: torch.Tensor, input: torch.Tensor,
                                op: ReduceOp = ReduceOp.SUM,
                                group: ProcessGroup | None = None,
                                async_op: bool = False) -> HierarchicalWork | Any:
    """``reduce_scatter_tensor`` in two levels: within each host (the rows bound for each
    local index), then across hosts; group rank ``g`` keeps the reduced row ``g`` as the
    flat one gives it. A group that does not span hosts evenly gets the flat one."""
    from spmd.runtime.collectives import reduce_scatter_tensor

    name = "reduce_scatter_hierarchical"
    pg = _checked(name, group, input, output, ("input", "output"))
    levels = hierarchy(pg)
    if levels is None:
        return reduce_scatter_tensor(output, input, op, group=pg, async_op=async_op)
    rop = ReduceOp.of(op)
    _begin(pg, name, input, rop)
    average = rop is ReduceOp.AVG
    inner_op = ReduceOp.SUM if average else rop
    h, k, m = levels.hosts, levels.per_host, output.numel()
    rows = input.reshape(pg.size(), m)
    grid = torch.empty((k, h, m), dtype=input.dtype, device=input.device)
    for g, (local, j) in enumerate(levels.places):  # [local][across index][m]
        grid[local, j].copy_(rows[g])
    size = pg.size()

    def stages() -> None:
        mine = torch.empty(h * m, dtype=grid.dtype, device=grid.device)
        reduce_scatter_tensor(mine, grid.view(-1), inner_op, group=levels.within)
        out = torch.empty(m, dtype=grid.dtype, device=grid.device)
        reduce_scatter_tensor(out, mine, inner_op, group=levels.across)
        if average:
            out.div_(size)
        output.view(-1).copy_(out)

    return _submit(pg, name, stages, async_op, levels)


def then_all_reduce(first: Any, tensor: torch.Tensor, group: ProcessGroup,
                    scale: float | None = None) -> HierarchicalWork:
    """Once ``first`` (a collective's work writing ``tensor``) is done, all-reduce
    ``tensor`` over ``group`` (then multiply it by ``scale``), on a thread of its own:
    hybrid sharding's average across replicas chained right after the reduce-scatter, so
    it overlaps whatever the caller does until it waits. Runs on a private copy of
    ``group`` (made on first use; every member calls this in the same order), so the
    caller's own collectives on ``group`` never interleave with it differently on
    different ranks."""
    from spmd.runtime.collectives import all_reduce

    pg = resolve_group(group, "then_all_reduce")
    private = getattr(pg, "_chained", None)
    if private is None:
        name = f"{pg.name}/chained"
        private = world("then_all_reduce").groups.get(name) or new_group(
            list(pg.ranks), group_name=name)
        pg._chained = private  # type: ignore[attr-defined]

    def stages() -> None:
        first.wait()
        all_reduce(tensor, group=private)
        if scale is not None:
            tensor.mul_(scale)

    # unchecked: its size follows from the collective it follows, which a compiled graph's
    # run check (that covers the replicate group) or that collective's own row checked
    work = _submit(private, "then_all_reduce", stages, async_op=True, private=private)
    assert work is not None
    return work
