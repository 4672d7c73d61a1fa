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


def _median_time(run: Any, group: Any, repeats: int, warmup: int) -> float:
    """The median seconds of ``run()`` over ``repeats`` calls after ``warmup`` ones, the
    group's ranks starting each call together (a typical call, not the luckiest)."""
    from spmd.runtime.collectives import barrier

    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        barrier(group=group)
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
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


def measure_algorithms(group: Any, sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 5,
                       warmup: int = 1) -> dict[str, list[tuple[int, float]]]:
    """``(bytes, seconds)`` of the flat (``"ring"``) and the two-level
    (``"hierarchical"``) all-reduce over the whole ``group``, the median of ``repeats``
    per size, timed on its first rank and shared: what they really cost, fixed costs
    per call and per stage included, which a formula over the link's α and β misses on
    small messages. Every rank of ``group`` must call it (once per group and job; later
    calls return the first's); a group spanning hosts evenly only (else an empty dict).

    Example::

        lines = measure_algorithms(dist.new_group())   # {"ring": [...], "hierarchical": [...]}
    """
    from spmd.runtime.collectives import all_reduce
    from spmd.runtime.hierarchical import all_reduce_hierarchical, hierarchy

    if hierarchy(group) is None:
        return {}
    runs = {"ring": all_reduce, "hierarchical": all_reduce_hierarchical}

    def measure() -> dict[str, list[tuple[int, float]]]:
        samples: dict[str, list[tuple[int, float]]] = {name: [] for name in runs}
        for nbytes in sizes:
            t = torch.zeros(max(1, nbytes // 4))
            for name, run in runs.items():
                seconds = _median_time(lambda: run(t, group=group), group, repeats, warmup)
                samples[name].append((t.numel() * 4, seconds))
        return _shared(samples, group)

    return _once("measure_algorithms", group, (tuple(sizes), repeats), measure)
