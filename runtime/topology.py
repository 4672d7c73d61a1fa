"""Which ranks share a host: discovered at start-up, or given by the launcher.

Collectives between ranks of one host run over its fast path (loopback and shared
memory here, NVLink on a GPU node); between hosts they cross the network, which is
slower by an order of magnitude or more. The planner prices each collective on the link
it really uses and may split one into a part within hosts and a part across them, so it
needs to know where every rank is.

Each rank names its host when it joins (``init_process_group`` writes it to the store):

- ``SPMD_HOST`` when set (``python -m spmd.runtime.run`` sets it to the node rank and the
  host's address; set it yourself to group ranks differently);
- else torchrun's ``GROUP_RANK`` (its node rank) when ``LOCAL_WORLD_SIZE`` says the
  launcher started several ranks per host;
- else the machine's name and its network namespace: ranks in two network namespaces
  of one machine (the many-host harness, containers) do not share loopback, so they are
  on different hosts as far as the network goes.

:func:`get_topology` reads every rank's name once and numbers the hosts in order of their
first rank.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Iterable, Sequence

__all__ = ["Topology", "host_name", "get_topology", "local_address"]

KEY = "topology/host/"


def host_name() -> str:
    """This process's host, as :func:`get_topology` groups ranks (see the module doc)."""
    from spmd.runtime.context import getenv

    given = getenv("SPMD_HOST")
    if given:
        return given
    group, local = getenv("GROUP_RANK"), getenv("LOCAL_WORLD_SIZE")
    if group and local and getenv("TORCHELASTIC_RUN_ID"):
        return f"node{group}"
    try:
        namespace = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        namespace = 0
    return f"{socket.gethostname()}/net:{namespace}"


def local_address(peer: str, port: int = 9) -> str:
    """This host's address on the route to ``peer``: what the others reach it by.

    A UDP socket connected to the peer sends nothing; the kernel only picks the route and
    its source address, so no name is looked up backwards and no packet leaves."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((peer, port))
        except OSError as e:
            raise OSError(f"no route from this host to {peer}: {e}") from None
        return s.getsockname()[0]


@dataclass(frozen=True, kw_only=True, slots=True)
class Topology:
    """Where each rank runs.

    Attributes:
        hosts: each global rank's host index; hosts are numbered in the order of their
            first rank.
        names: each host's name (index: host).
        source: how it was learnt ("SPMD_HOST", "discovered", "simulated", ...).
    """

    hosts: tuple[int, ...]
    names: tuple[str, ...]
    source: str = "discovered"

    @classmethod
    def from_names(cls, per_rank: Sequence[str], source: str = "discovered") -> "Topology":
        """A topology from each rank's host name."""
        order: dict[str, int] = {}
        for name in per_rank:
            order.setdefault(name, len(order))
        return cls(hosts=tuple(order[n] for n in per_rank), names=tuple(order), source=source)

    @classmethod
    def uniform(cls, world_size: int, per_host: int, source: str = "simulated") -> "Topology":
        """``world_size`` ranks laid out ``per_host`` consecutive ranks to a host."""
        if per_host < 1 or world_size < 1:
            raise ValueError(f"Topology.uniform needs positive sizes, got {world_size}, {per_host}")
        count = -(-world_size // per_host)
        return cls(hosts=tuple(r // per_host for r in range(world_size)),
                   names=tuple(f"host{i}" for i in range(count)), source=source)

    @property
    def num_hosts(self) -> int:
        return len(self.names)

    @property
    def world_size(self) -> int:
        return len(self.hosts)

    def host_of(self, rank: int) -> int:
        if not 0 <= rank < len(self.hosts):
            raise ValueError(f"rank {rank} is outside this topology's [0, {len(self.hosts)})")
        return self.hosts[rank]

    def ranks_on(self, host: int) -> list[int]:
        """The global ranks on ``host``, in order."""
        return [r for r, h in enumerate(self.hosts) if h == host]

    def split(self, ranks: Iterable[int]) -> list[list[int]]:
        """``ranks`` grouped by host, hosts in order of their first rank here."""
        groups: dict[int, list[int]] = {}
        for r in ranks:
            groups.setdefault(self.host_of(r), []).append(r)
        return list(groups.values())

    def per_host(self, ranks: Iterable[int]) -> int | None:
        """How many of ``ranks`` each host holds when every host they touch holds the
        same number (what a hierarchical collective over them needs), else None."""
        counts = {len(g) for g in self.split(ranks)}
        return counts.pop() if len(counts) == 1 else None

    def describe(self) -> str:
        """One line: hosts and their ranks."""
        parts = [f"{self.names[h]}: ranks {_ranges(self.ranks_on(h))}"
                 for h in range(self.num_hosts)]
        return f"{self.num_hosts} host(s) ({self.source}); " + "; ".join(parts)


def _ranges(ranks: list[int]) -> str:
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ",".join(out)


def publish(store: object, rank: int) -> None:
    """Write this rank's host name (``init_process_group`` calls it as it joins)."""
    store.set(f"{KEY}{rank}", host_name())  # type: ignore[attr-defined]


def get_topology() -> Topology:
    """Where every rank of the default group runs (read once per job, then kept).

    Example::

        dist.init_process_group("gloo")
        topo = dist.get_topology()
        topo.num_hosts, topo.host_of(dist.get_rank())
    """
    from spmd.runtime.context import getenv
    from spmd.runtime.groups import world

    state = world("get_topology")
    found = getattr(state, "topology", None)
    if found is None:
        keys = [f"{KEY}{r}" for r in range(state.size)]
        state.store.wait(keys)
        names = [v.decode() for v in state.store.multi_get(keys)]
        source = "SPMD_HOST" if getenv("SPMD_HOST") else "discovered"
        found = Topology.from_names(names, source)
        state.topology = found
    return found
