"""The α–β–γ cost model of collectives, and the bucket size it implies.

Each collective's time is written symbolically (sympy) per algorithm, after Thakur,
Rabenseifner and Gropp, "Optimization of Collective Communication Operations in MPICH"
(IJHPCA 2005): α is the latency of one message, β the time per byte on a link, γ the
time per byte of reduction arithmetic, p the number of ranks, n the bytes of the buffer.

    ring all_reduce     2(p-1)α + 2(p-1)/p·nβ + (p-1)/p·nγ
    tree all_reduce     2⌈log2 p⌉(α + nβ) + ⌈log2 p⌉·nγ
    ring all_gather     (p-1)α + (p-1)/p·nβ             (n: output bytes)
    ring reduce_scatter (p-1)α + (p-1)/p·nβ + (p-1)/p·nγ (n: input bytes)
    tree broadcast      ⌈log2 p⌉(α + nβ)
    pairwise all_to_all (p-1)α + (p-1)/p·nβ             (n: each rank's local bytes)
    fp32 all_reduce     2(p-1)α + 2(p-1)/p·nβ + n·γ     (all-to-all, float32 addition of
                                                         the p received chunks, all-gather)

Gloo's reduce-scatter costs an all-reduce of its whole input, not the ring formula's half:
measured on 2 simulated hosts x 2 ranks over 1 Gbit/s (benchmarks/hosts.py, 2026-12-04),
a reduce-scatter of 0.25, 1, 4 and 16 MiB took 1.01, 1.03, 0.97 and 1.11 times the
all-reduce of the same buffer; the model prices it so for ``backend="gloo"``.

The bucket size is derived, not guessed: with S gradient bytes cut into buckets of b
bytes, each all-reduce costs A + B·b (A, B from the formula above), and all but the last
bucket can hide behind η·T seconds of backward compute (η, ``overlap``, is the share of
compute that communication can run beside; see :func:`overlap_share`). The exposed time

    E(b) = A + B·b + max(0, (S/b - 1)(A + B·b) - η·T)

falls with b while communication outruns compute and rises with b once it hides, so
the optimum is where the buckets' communication exactly fills the compute:
(S - b)(A + B·b) = η·T·b, a quadratic whose positive root :func:`_optimum` takes. With
η = 0 (nothing can run beside the compute) it gives b = S: one bucket, the fewest
latencies.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import sympy

if TYPE_CHECKING:
    from spmd.runtime.mesh import Mesh

__all__ = ["CostModel", "TwoLevelCostModel", "NetworkLink", "formula", "DEFAULTS",
           "overlap_share", "along"]

p, n, alpha, beta, gamma = sympy.symbols("p n alpha beta gamma", positive=True)
_log_p = sympy.ceiling(sympy.log(p, 2))

FORMULAS: dict[tuple[str, str], sympy.Expr] = {
    ("all_reduce", "ring"): 2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta
    + (p - 1) / p * n * gamma,
    ("all_reduce", "tree"): 2 * _log_p * (alpha + n * beta) + _log_p * n * gamma,
    ("all_gather", "ring"): (p - 1) * alpha + (p - 1) / p * n * beta,
    ("reduce_scatter", "ring"): (p - 1) * alpha + (p - 1) / p * n * beta
    + (p - 1) / p * n * gamma,
    ("broadcast", "tree"): _log_p * (alpha + n * beta),
    ("all_to_all", "pairwise"): (p - 1) * alpha + (p - 1) / p * n * beta,
    # spmd.runtime.all_reduce_compressed: a pairwise all-to-all of the n wire bytes, each
    # rank adding the p chunks it received (n bytes read), a ring all-gather of the result
    ("all_reduce", "fp32"): 2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta + n * gamma,
}

# Constants measured on this project's development machine: a 2-core x86_64 VM (AMD
# EPYC), Gloo over loopback, torch 2.13.0+cpu, 2 ranks, 2026-11-25, with
# benchmarks/collectives.py: a 4-byte all_reduce took ~190 µs and a 64 MiB one ~38 ms.
# Fitting the ring formula at p=2 (2(p-1)=2, 2(p-1)/p=1): α ≈ 95 µs, β ≈ 0.57 ns/B.
# γ is folded into β (Gloo reduces while it copies). Calibration replaces them.
DEFAULTS = {
    "gloo": dict(alpha=95e-6, beta=0.57e-9, gamma=0.0,
                 source="measured 2026-11-25, 2-core VM, Gloo loopback, 2 ranks"),
    # NCCL on one H100 node, order of magnitude from NVIDIA's nccl-tests reports
    # (≈10 µs latency, ≈150 GB/s bus bandwidth for large all_reduce over NVLink).
    "nccl": dict(alpha=10e-6, beta=1 / 150e9, gamma=0.0,
                 source="nccl-tests order of magnitude, NVLink; calibrate for real figures"),
}


_ALGORITHMS = {"broadcast": "tree", "all_to_all": "pairwise"}


def formula(kind: str, algorithm: str = "ring") -> sympy.Expr:
    """The symbolic time of one collective (symbols p, n, alpha, beta, gamma)."""
    try:
        return FORMULAS[(kind, algorithm)]
    except KeyError:
        known = ", ".join(f"{k}/{a}" for k, a in FORMULAS)
        raise ValueError(f"no cost formula for {kind}/{algorithm}; known: {known}") from None


@functools.lru_cache(maxsize=None)
def _lambdified(kind: str, algorithm: str):
    return sympy.lambdify((p, n, alpha, beta, gamma), formula(kind, algorithm), "math")


def _optimum(S: float, A: float, B: float, T: float) -> float:
    """The bucket size b solving (S - b)(A + B·b) = T·b, i.e.
    B·b² + (A + T - B·S)·b - A·S = 0: its root with the + sqrt, the positive one (the
    roots' product, -A·S/B, is negative). Written term for term as sympy's solution of
    the equation, so it gives the same floats."""
    return 0.5 * (-A + B * S - T + math.sqrt(
        A**2 + 2 * A * B * S + 2 * A * T + B**2 * S**2 - 2 * B * S * T + T**2)) / B


@dataclass(frozen=True, kw_only=True, slots=True)
class NetworkLink:
    """The link between hosts of a live job: α (s per message) and β (s per byte) of one
    flow on it, and where they came from (a probe at start-up)."""

    alpha: float
    beta: float
    source: str = ""
    # collectives over a whole group timed at start-up: (kind, algorithm, ranks, samples),
    # samples ((bytes, seconds), ...) by size ("ring": the flat one, "hierarchical": the
    # two-level one)
    lines: tuple[tuple[str, str, int, tuple[tuple[int, float], ...]], ...] = ()

    def timed(self, kind: str, algorithm: str, ranks: int, nbytes: int) -> float | None:
        """Seconds of ``kind`` run by ``algorithm`` over ``ranks`` ranks on ``nbytes``,
        where it was timed: the samples joined by straight lines, the end segments
        continued beyond them (measured costs are not one line: here a slow link's flat
        ring took 1.3x a fitted line's time at 1/4 MiB and 0.9x at 16 MiB)."""
        for what, name, size, samples in self.lines:
            if (what, name, size) == (kind, algorithm, ranks):
                return _piecewise(samples, nbytes)
        return None


def _piecewise(samples: tuple[tuple[int, float], ...], n: int) -> float:
    points = sorted(samples)
    if len(points) == 1:
        return points[0][1]
    i = 1
    while i < len(points) - 1 and points[i][0] < n:
        i += 1
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return max(0.0, y0 + (y1 - y0) * (n - x0) / (x1 - x0))


@dataclass(frozen=True, kw_only=True, slots=True)
class CostModel:
    """α, β, γ for one backend at one world size, and where they came from; ``network``:
    the link between hosts where the job spans several (None: one host)."""

    backend: str
    world_size: int
    alpha: float
    beta: float
    gamma: float = 0.0
    algorithm: str = "ring"
    source: str = ""
    reference_world_size: int = 2  # the world size the constants were measured at
    overlap: float = 1.0  # share of backward compute that communication can hide behind
    network: NetworkLink | None = None

    @classmethod
    def default(cls, backend: str, world_size: int) -> "CostModel":
        consts = DEFAULTS.get(backend, DEFAULTS["gloo"])
        return cls(backend=backend, world_size=world_size, **consts)

    def with_measurement(self, alpha: float, beta: float, source: str) -> "CostModel":
        return replace(self, alpha=alpha, beta=beta, gamma=0.0, source=source,
                       reference_world_size=self.world_size)

    def seconds(self, kind: str, nbytes: int, algorithm: str | None = None) -> float:
        """Predicted time of one ``kind`` collective over ``nbytes`` (by ``algorithm``, or
        the model's own for all-reduces and the usual one for the others)."""
        if self.world_size <= 1:
            return 0.0
        if kind == "reduce_scatter" and self.backend == "gloo" and algorithm in (None, "ring"):
            kind, algorithm = "all_reduce", None  # Gloo's: an all-reduce (module doc)
        if algorithm is None:
            algorithm = (self.algorithm if kind == "all_reduce"
                         else _ALGORITHMS.get(kind, "ring"))
        fn = _lambdified(kind, algorithm)
        return float(fn(self.world_size, nbytes, self.alpha, self.beta, self.gamma))

    def all_reduce_line(self, world_size: int | None = None) -> tuple[float, float]:
        """(A, B): an all-reduce of n bytes costs A + B·n under this model (at
        ``world_size`` ranks; by default the model's own)."""
        model = self if world_size is None else replace(self, world_size=world_size)
        zero = model.seconds("all_reduce", 0)
        return zero, (model.seconds("all_reduce", 1 << 20) - zero) / (1 << 20)

    def balanced_bytes(self) -> int:
        """The message size whose bandwidth time equals the latency (α/β): below it a
        collective mostly pays latency."""
        return int(self.alpha / self.beta) if self.beta > 0 else 0

    def bucket_bytes(self, total_bytes: int, backward_seconds: float | None,
                     minimum: int = 1 << 18) -> int:
        """The bucket cap that minimises exposed all-reduce time (see the module doc).

        The cap is derived at the world size the constants describe
        (``reference_world_size``), not the planned one, so one model and one set of
        options bucket alike whatever the number of ranks; only the predicted
        communication changes with it. Without a measured backward time the model
        assumes backward compute about as long as all the gradients' communication in
        one piece (compute and communication of one magnitude).
        """
        if total_bytes <= 0:
            return max(total_bytes, minimum)
        a, b = self.all_reduce_line(max(2, self.reference_world_size))
        if b <= 0:
            return total_bytes
        t = backward_seconds if backward_seconds is not None else a + b * total_bytes
        t *= self.overlap  # nothing hides behind compute that itself needs the same cores
        if t <= 0:
            return total_bytes  # E(b) then only falls with b: one bucket
        best = float(_optimum(float(total_bytes), a, b, t))
        if not math.isfinite(best):
            return total_bytes
        return int(min(max(best, minimum), total_bytes))


def overlap_share(backend: str, local_ranks: int, cpu_count: int | None,
                  compute_threads: int) -> tuple[float, str]:
    """How much of backward compute communication can hide behind, and why.

    Overlap needs something other than the compute to move the bytes: a GPU's copy
    engines and spare SMs under NCCL, or an idle CPU core under Gloo, whose threads
    reduce and copy on the CPU. Measured on this project's 2-core VM (2 ranks, one
    compute thread each, 2026-11-25, benchmarks/ddp.py): the transformer encoder ran
    26.4 ms per step with one bucket, 30.2 ms with 1 MiB buckets and 36.0 ms with 16
    small ones: every split cost, none hid.
    """
    if backend == "nccl":
        return 1.0, "NCCL moves data on the GPU's own engines"
    spare = (cpu_count or 1) // max(local_ranks, 1) - compute_threads
    if spare >= 1:
        return 1.0, f"{spare} spare CPU core(s) per rank run Gloo beside the compute"
    return 0.0, (f"no spare CPU core ({cpu_count} cores, {local_ranks} local ranks x "
                 f"{compute_threads} compute threads): Gloo competes with the compute")


@dataclass(frozen=True, kw_only=True, slots=True)
class TwoLevelCostModel(CostModel):
    """Collectives of a mesh dimension whose groups hold ``per_node`` ranks in each of
    several nodes: the cheaper of the flat ring over the network (α, β) and the
    two-level algorithm, a reduce-scatter (or all-gather) among a node's ranks over
    NVLink (``inner_alpha``, ``inner_beta``) around an all-reduce across nodes of
    1/``per_node`` of the bytes, run by every rank of a node at once."""

    per_node: int = 1
    inner_alpha: float = 0.0
    inner_beta: float = 0.0
    # β of one across-node group when the per_node groups run at once: beta where each
    # rank has its own network path (a NIC per GPU), per_node x beta where a host's ranks
    # share one link (this machine's simulated hosts)
    outer_beta: float | None = None

    def _measured(self, kind: str, algorithm: str, nbytes: int) -> float | None:
        """The collective's time from the line timed at start-up for this many ranks."""
        return (None if self.network is None
                else self.network.timed(kind, algorithm, self.world_size, nbytes))

    def seconds(self, kind: str, nbytes: int, algorithm: str | None = None) -> float:
        """The time of the cheaper algorithm (``algorithm`` None), of the flat ring
        (``"ring"``) or of the two-level one (``"hierarchical"``): timed at start-up
        where the job measured this group's collectives of this kind, else by the
        formulas. An all-to-all (pairwise) is priced per link: each rank's bytes for
        the other nodes' ranks on its network path, those for its own node's over
        NVLink at the same time."""
        if kind == "all_to_all" and algorithm in (None, "pairwise"):
            return self._all_to_all(nbytes)
        if algorithm is None:
            flat, two = self._both(kind, nbytes)
            return flat if two is None else min(flat, two)
        if algorithm in ("ring", "hierarchical"):
            timed = self._measured(kind, algorithm, nbytes)
            if timed is not None:
                return timed
        if algorithm == "hierarchical":
            two = self._two_level(kind, nbytes)
            if two is None:
                raise ValueError(f"{kind} has no two-level algorithm over {self.world_size} "
                                 f"ranks, {self.per_node} per node")
            return two
        return CostModel.seconds(self, kind, nbytes, algorithm)

    def choice(self, kind: str, nbytes: int) -> tuple[str, float, float | None]:
        """(``"hierarchical"`` or ``"ring"``, the flat ring's seconds, the two-level
        algorithm's or None where it has none): which the planner runs for ``nbytes``."""
        flat, two = self._both(kind, nbytes)
        return ("hierarchical" if two is not None and two < flat else "ring"), flat, two

    def _both(self, kind: str, nbytes: int) -> tuple[float, float | None]:
        """The flat ring's seconds and the two-level algorithm's (None where it has none),
        each timed at start-up where it was, else by its formula."""
        flat = self._measured(kind, "ring", nbytes)
        two = self._measured(kind, "hierarchical", nbytes)
        if flat is None:
            flat = CostModel.seconds(self, kind, nbytes, "ring")
        if two is None:
            two = self._two_level(kind, nbytes)
        return flat, two

    def all_to_all_links(self, nbytes: int) -> tuple[float, float]:
        """A pairwise all-to-all of each rank's ``nbytes`` by link: (the bytes for other
        nodes' ranks on each rank's network path, those for its own node's over NVLink),
        which run at the same time."""
        k, p = self.per_node, self.world_size
        beta = self.beta if self.outer_beta is None else self.outer_beta
        return ((p - k) * self.alpha + (p - k) / p * nbytes * beta,
                (k - 1) * self.inner_alpha + (k - 1) / p * nbytes * self.inner_beta)

    def _all_to_all(self, nbytes: int) -> float:
        if self.per_node <= 1 or self.world_size % self.per_node:
            return CostModel.seconds(self, "all_to_all", nbytes, "pairwise")
        return max(self.all_to_all_links(nbytes))

    def _two_level(self, kind: str, nbytes: int) -> float | None:
        k = self.per_node
        nodes = self.world_size // k
        if (k <= 1 or nodes <= 1 or self.world_size % k
                or kind not in ("all_reduce", "all_gather", "reduce_scatter")):
            return None
        inner = CostModel(backend=self.backend, world_size=k, alpha=self.inner_alpha,
                          beta=self.inner_beta)
        outer = CostModel(backend=self.backend, world_size=nodes, alpha=self.alpha,
                          beta=self.beta if self.outer_beta is None else self.outer_beta)
        share = nbytes // k
        if kind == "all_reduce":
            two = (inner.seconds("reduce_scatter", nbytes) + outer.seconds(
                "all_reduce", share) + inner.seconds("all_gather", nbytes))
        elif kind == "all_gather":
            two = outer.seconds("all_gather", share) + inner.seconds("all_gather", nbytes)
        else:
            two = inner.seconds("reduce_scatter", nbytes) + outer.seconds(
                "reduce_scatter", share)
        return two


def along(mesh: "Mesh", dim: str, measured: CostModel | None) -> CostModel:
    """The cost model of collectives along mesh dimension ``dim``: on a simulated cluster
    (``Mesh.simulated(..., hardware=...)``) the hardware model's link for it, else
    ``measured`` (this machine's, default or calibrated) at the dimension's size, priced
    on the link between hosts where the dimension crosses one (a live job's probe, or a
    simulated mesh's ``network``). The one
    place the planner asks what a collective costs; the mesh itself only carries the
    cluster description it was made with."""
    if mesh.hardware is not None:
        return mesh.hardware.cost_model(mesh, dim)
    if measured is None:
        raise ValueError(f"no cost model along {dim!r}: {mesh} has no hardware model and "
                         f"none was measured")
    size = mesh.size(dim)
    net = measured.network if measured.network is not None else mesh.network
    if net is None or size <= 1 or not mesh.crosses_hosts(dim):
        return replace(measured, world_size=size)
    return _across_hosts(mesh, dim, measured, net)


def _across_hosts(mesh: "Mesh", dim: str, measured: CostModel, net: NetworkLink) -> CostModel:
    """A live dimension whose groups span hosts: its flat ring runs at the network's speed,
    slowed by the flows that leave a host at once (one per host where each host's ranks
    are consecutive in the ring, more where hosts alternate); where each host holds the
    same number of the group's ranks, the two-level algorithm is priced beside it, its
    across-host groups sharing the host's one link."""
    topo = mesh.topology
    ranks = mesh.slices(dim)[0]
    hosts = [topo.host_of(r) for r in ranks]
    leaving = sum(1 for a, b in zip(hosts, hosts[1:] + hosts[:1]) if a != b)
    flows = max(1, -(-leaving // len(set(hosts))))  # ring edges leaving one host
    per = topo.per_host(ranks) or 1
    source = (f"{measured.source}; across hosts: α {net.alpha * 1e6:.1f} µs, β "
              f"{net.beta * 1e9:.3f} ns/B ({net.source}), {flows} flow(s) per host link")
    fields = dict(backend=measured.backend, world_size=len(ranks), alpha=net.alpha,
                  beta=net.beta * flows, gamma=0.0, algorithm="ring", source=source,
                  reference_world_size=measured.reference_world_size,
                  overlap=measured.overlap, network=net)
    if per < 2 or len(ranks) % per:
        return CostModel(**fields)
    return TwoLevelCostModel(per_node=per, inner_alpha=measured.alpha,
                             inner_beta=measured.beta, outer_beta=net.beta * per, **fields)
