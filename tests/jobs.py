"""Spawned jobs that a module's tests share: its cases grouped into jobs small enough to
finish well inside a spawn's timeout on a loaded 2-core machine, each job spawned once, on
its first case's use, and its failure kept for all its cases (a failed job is not spawned
again for each of them).

One spawn per module was the old way: amortised start-up, but a module that grew past the
timeout failed as a whole on a loaded machine (CI lost 45 tests of one module to one 110 s
timeout). Here a module names its groups; each stays under ``BUDGET`` seconds quiet."""

from __future__ import annotations

from typing import Any, Callable, Hashable, Sequence

from spmd import runtime as dist

# A job's quiet run time should stay below this: its spawn's timeout (below pytest's
# 120 s per test, since a job runs inside its first case's test) then leaves 7x room, for
# a machine loaded by other work (a 25 s job missed 110 s at a load of 12 on 2 cores).
BUDGET = 15.0
TIMEOUT = 110.0


def selected(costs: dict[Hashable, float], nodeid: Callable[[Hashable], str]
             ) -> dict[Hashable, float]:
    """``costs`` without the cases this run leaves to the long profile (``tests/tiers.py``;
    ``nodeid(case)``: the test that reads the case): a job must not spend its spawn on a
    case no selected test reads."""
    import os

    from tests.tiers import is_long

    if os.environ.get("SPMD_TESTS", "ci") == "all":
        return costs
    return {case: cost for case, cost in costs.items() if not is_long(nodeid(case))}


def pack(costs: dict[Hashable, float], budget: float = BUDGET) -> list[list[Hashable]]:
    """The cases grouped, in their order, into runs of at most ``budget`` quiet seconds
    (``costs``: each case's, measured); a case over the budget is a group of its own."""
    groups: list[list[Hashable]] = []
    total = budget
    for case, cost in costs.items():
        if total + cost > budget:
            groups.append([])
            total = 0.0
        groups[-1].append(case)
        total += cost
    return groups


class Jobs:
    """``fn(rank, cases, *args)`` spawned on ``nprocs`` ranks once per group of cases;
    ``results(case)`` is each rank's result for ``case`` (what ``fn`` returned for it
    under that key, in rank order)."""

    def __init__(self, fn: Callable[..., dict], groups: Sequence[Sequence[Hashable]], *,
                 nprocs: int | Callable[[Sequence[Hashable]], int], args: tuple = (),
                 timeout: float = TIMEOUT) -> None:
        self.fn, self.groups, self.args, self.timeout = fn, [list(g) for g in groups], args, timeout
        self._nprocs = nprocs
        self._found: dict[int, Any] = {}
        seen: set = set()
        for group in self.groups:
            for case in group:
                if case in seen:
                    raise ValueError(f"case {case!r} is in two groups")
                seen.add(case)

    @property
    def cases(self) -> list[Hashable]:
        return [case for group in self.groups for case in group]

    def results(self, case: Hashable) -> list:
        index = next((i for i, g in enumerate(self.groups) if case in g), None)
        if index is None:
            raise KeyError(f"case {case!r} is in no group")
        if index not in self._found:
            group = self.groups[index]
            n = self._nprocs(group) if callable(self._nprocs) else self._nprocs
            try:
                self._found[index] = dist.spawn(self.fn, args=(group, *self.args), nprocs=n,
                                                start_method="forkserver", timeout=self.timeout)
            except Exception as e:  # kept: every case of the group reports it
                self._found[index] = e
        found = self._found[index]
        if isinstance(found, Exception):
            raise found
        return [ranks[case] for ranks in found]
