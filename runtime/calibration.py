"""A short measurement of a live group's all-reduce, for the compiler's cost model.

Every rank takes part in the timed all-reduces (they are collectives), but only the
first rank's clock counts: its samples are broadcast, so every rank fits the same
constants and reaches the same plan.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Sequence

import torch

__all__ = ["measure_all_reduce", "measure_network", "measure_algorithms"]

# Bucket-sized messages: Gloo takes another path below a few KiB (a 4-byte all-reduce
# measured 173 µs here against 440 µs for 11 KiB), so tiny sizes would skew the fit.
DEFAULT_SIZES = (8 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)


def _median_time(run: Any, group: Any, repeats: int, warmup: int, burst: int = 1) -> float:
    """The median seconds of one ``run()`` over ``repeats`` samples after ``warmup``
    calls, the group's ranks starting each sample together (a typical call, not the
    luckiest); a sample is ``burst`` calls back to back, divided by ``burst``: as a
    step's buckets follow each other, each call starting while the ranks still finish
    the last (back to back, small calls measured 1.3x their time alone)."""
    from spmd.runtime.collectives import barrier

    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        barrier(group=group)
        start = time.perf_counter()
        for _ in range(burst):
            run()
        times.append((time.perf_counter() - start) / burst)
    return statistics.median(times)


def _shared(value: Any, group: Any) -> Any:
    """``value`` as the group's first rank has it, on every rank."""
    from spmd.runtime.objects import broadcast_object_list

    box = [value]
    broadcast_object_list(box, src=group.ranks[0], group=group)
    return box[0]


def _once(what: str, group: Any, key: tuple, measure: Any) -> Any:
    """``measure()`` the first time this job asks ``what`` of ``group`` with ``key``, its
    result after that: every rank of the group asks in the same order, so every rank
    measures (a collective) or answers from memory alike."""
    from spmd.runtime.groups import world

    state = world(what)
    known = getattr(state, "probes", None)
    if known is None:
        known = state.probes = {}  # type: ignore[attr-defined]
    full = (what, tuple(group.ranks), *key)
    if full not in known:
        known[full] = measure()
    return known[full]


def measure_all_reduce(group: Any, sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 7,
                       warmup: int = 2) -> list[tuple[int, float]]:
    """``(bytes, seconds)`` of one float32 all-reduce per size: the median of ``repeats``
    (a typical call, not the luckiest), timed on the group's first rank and shared with
    every rank.

    Example::

        samples = measure_all_reduce(dist.new_group())   # [(4, 1.9e-4), ...]
    """
    from spmd.runtime.collectives import all_reduce

    samples = []
    for nbytes in sizes:
        t = torch.zeros(max(1, nbytes // 4))
        samples.append((t.numel() * 4, _median_time(lambda: all_reduce(t, group=group),
                                                    group, repeats, warmup)))
    return _shared(samples, group)


def measure_network(group: Any, sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 5,
                    warmup: int = 1) -> tuple[int, list[tuple[int, float]]] | None:
    """(hosts, ``(bytes, seconds)`` samples) of all-reduces across the hosts ``group``
    spans, run by its first rank on each host while the others wait (one flow per host
    link), shared with every rank of the group; None when the group is on one host.
    Every rank of ``group`` must call it; a group is probed once per job (the planner
    asks at every ``parallelize``).

    Example::

        hosts, samples = measure_network(dist.new_group())
    """
    from spmd.runtime.groups import new_group, world
    from spmd.runtime.topology import get_topology

    by_host = get_topology().split(group.ranks)
    if len(by_host) < 2:
        return None
    firsts = [ranks[0] for ranks in by_host]

    def measure() -> tuple[int, list[tuple[int, float]]]:
        state = world("measure_network")
        samples = None
        if state.rank in firsts:
            name = f"{group.name}/network-probe"
            probe = state.groups.get(name) or new_group(firsts, group_name=name)
            samples = measure_all_reduce(probe, sizes, repeats, warmup)
        return len(by_host), _shared(samples, group)

    return _once("measure_network", group, (tuple(sizes), repeats), measure)


KINDS = ("all_reduce", "all_gather", "reduce_scatter")


def measure_algorithms(group: Any, sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 5,
                       warmup: int = 1, kinds: Sequence[str] = ("all_reduce",)
                       ) -> dict[tuple[str, str], list[tuple[int, float]]]:
    """``(bytes, seconds)`` per ``(kind, algorithm)`` of each collective in ``kinds``
    (``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"``; bytes: the whole tensor,
    the gathered output or the scattered input) run flat (``"ring"``) and two-level
    (``"hierarchical"``) over the whole ``group``, the median of ``repeats`` per size,
    timed on its first rank and shared: what they really cost, fixed costs per call and
    per stage included, which a formula over the link's α and β misses on small
    messages. Every rank of ``group`` must call it with the same arguments (once per
    group, kinds and job; later calls return the first's); a group spanning hosts evenly
    only (else an empty dict).

    Example::

        lines = measure_algorithms(dist.new_group())   # {("all_reduce", "ring"): [...], ...}
    """
    from spmd.runtime import hierarchical as two
    from spmd.runtime.collectives import all_gather_into_tensor, all_reduce, reduce_scatter_tensor

    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise ValueError(f"measure_algorithms: no collective kind {unknown}; kinds are {KINDS}")
    if two.hierarchy(group) is None:
        return {}
    p = group.size()
    runs = {
        "all_reduce": {"ring": lambda t, s: all_reduce(t, group=group),
                       "hierarchical": lambda t, s: two.all_reduce_hierarchical(t, group=group)},
        "all_gather": {"ring": lambda t, s: all_gather_into_tensor(t, s, group=group),
                       "hierarchical": lambda t, s: two.all_gather_hierarchical(t, s, group=group)},
        "reduce_scatter": {
            "ring": lambda t, s: reduce_scatter_tensor(s, t, group=group),
            "hierarchical": lambda t, s: two.reduce_scatter_hierarchical(s, t, group=group)},
    }

    def measure() -> dict[tuple[str, str], list[tuple[int, float]]]:
        samples: dict[tuple[str, str], list[tuple[int, float]]] = {}
        for nbytes in sizes:
            n = max(p, nbytes // 4 // p * p)  # whole shards for gathers and scatters
            t, shard = torch.zeros(n), torch.zeros(n // p)
            burst = max(1, min(8, (2 << 20) // (n * 4)))  # calls of 2 MiB in all, at most 8
            for kind in kinds:
                for name, run in runs[kind].items():
                    seconds = _median_time(lambda: run(t, shard), group, repeats, warmup, burst)
                    samples.setdefault((kind, name), []).append((n * 4, seconds))
        return _shared(samples, group)

    return _once("measure_algorithms", group, (tuple(sizes), repeats, tuple(kinds)), measure)
