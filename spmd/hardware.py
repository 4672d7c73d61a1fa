"""Hardware models: plan for the cluster the job will run on, not for this machine.

    mesh = spmd.Mesh.simulated((8, 8), dim_names=("dp", "fsdp"),
                               hardware=spmd.hardware.H100_SXM(nodes_of=8, network_gbps=400))
    plan = spmd.inspect(model, x, mesh=mesh, strategy="hsdp")

A :class:`Hardware` is frozen data: the device (dense peak FLOP/s by dtype, memory
bandwidth and capacity) and two links, the one inside a node (NVLink) and the network
between nodes, with the ranks per node. Every figure names its source. With a hardware
model on a simulated mesh the planner uses, instead of what it would measure here:

- **collective costs per mesh dimension** from where that dimension's ranks sit: ranks
  are laid out row-major, a node holding ``ranks_per_node`` consecutive ones, so a
  dimension whose ranks stay inside one node uses the NVLink figures and one that spans
  nodes the network's (α latency per step, β seconds per byte of the link);
- **overlap**: GPUs run collectives on their own engines beside the compute (NCCL), so
  communication can hide behind all of it;
- **compute from the graph**: each node's FLOPs (``torch.utils.flop_counter``'s formulas)
  and the bytes it reads and writes, as a roofline on the device at an efficiency that
  can be calibrated; this sets the backward time the bucket size is derived from;
- **memory against capacity**: ``plan.memory()`` compares the predicted peak with the
  device's memory and warns when the plan would not fit.

Write your own with :class:`Device`, :class:`Link` and :class:`Hardware`, or start from a
preset and ``dataclasses.replace`` what differs.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from spmd.lowering.cost_model import CostModel

__all__ = ["Device", "Link", "Hardware", "A100_80GB", "H100_SXM", "H200", "graph_seconds",
           "graph_flops", "throughput", "fit", "profile_record", "TwoLevelCostModel"]


@dataclass(frozen=True, kw_only=True)
class Device:
    """One accelerator.

    Attributes:
        name: e.g. ``"NVIDIA H100 SXM5 80GB"``.
        flops: dense peak FLOP/s by dtype name (``"float32"``, ``"bfloat16"``, ...).
        memory_bytes: memory capacity.
        memory_bandwidth: bytes/s.
        efficiency: the share of peak FLOP/s and bandwidth a real kernel reaches (the
            roofline's calibration; 1.0 is the datasheet).
        source: where the figures come from.
        matmul_dtype: the dtype matrix products run in when it is not the values' own
            (``"float8_e4m3fn"`` for FP8 training, as Transformer Engine does), priced
            at that dtype's peak.
    """

    name: str
    flops: dict[str, float] = field(hash=False)
    memory_bytes: int
    memory_bandwidth: float
    efficiency: float = 0.6
    source: str = ""
    matmul_dtype: str | None = None  # matrix products in this dtype (FP8 training: float8)

    def peak(self, dtype: torch.dtype) -> float:
        """Dense peak FLOP/s for ``dtype`` (float32 when none is given for it)."""
        name = str(dtype).removeprefix("torch.")
        return self.flops.get(name, self.flops["float32"])


@dataclass(frozen=True, kw_only=True)
class Link:
    """A link between ranks: ``latency`` (s, α per step of an algorithm) and
    ``bandwidth`` (bytes/s each way per rank)."""

    name: str
    bandwidth: float
    latency: float
    source: str = ""


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """A cluster: ``device`` on every rank, ``ranks_per_node`` of them joined by ``intra``,
    nodes joined by ``inter``."""

    name: str
    device: Device
    ranks_per_node: int
    intra: Link
    inter: Link

    def __post_init__(self) -> None:
        if not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1:
            raise ValueError(f"Hardware {self.name}: ranks_per_node must be a positive int, "
                             f"got {self.ranks_per_node!r}")
        for what, value in (("device memory_bytes", self.device.memory_bytes),
                            ("device memory_bandwidth", self.device.memory_bandwidth),
                            ("intra bandwidth", self.intra.bandwidth),
                            ("inter bandwidth", self.inter.bandwidth)):
            if not value > 0:
                raise ValueError(f"Hardware {self.name}: {what} must be positive, got {value}")
        if "float32" not in self.device.flops or any(
                not v > 0 for v in self.device.flops.values()):
            raise ValueError(f"Hardware {self.name}: device flops need a positive 'float32' "
                             f"entry, got {self.device.flops}")
        if not 0 < self.device.efficiency <= 1:
            raise ValueError(f"Hardware {self.name}: efficiency must be in (0, 1], got "
                             f"{self.device.efficiency}")
        for link in (self.intra, self.inter):
            if link.latency < 0:
                raise ValueError(f"Hardware {self.name}: {link.name} latency must be >= 0")

    def link_for(self, mesh: Any, dim: str) -> Link:
        """The link mesh dimension ``dim`` communicates over: inside a node when all of one
        group's ranks share a node (row-major layout, ``ranks_per_node`` per node)."""
        index = mesh.dim_names.index(dim)
        stride = math.prod(mesh.shape[index + 1:])
        span = stride * (mesh.shape[index] - 1) + 1  # first to last rank of one group
        return self.intra if span <= self.ranks_per_node else self.inter

    def cost_model(self, mesh: Any, dim: str) -> Any:
        """The collective cost model of mesh dimension ``dim`` (NCCL on that link). A
        dimension whose groups span nodes with several of their ranks in each node is
        priced as the cheaper of a flat ring over the network and the two-level
        algorithm (within each node over NVLink, across nodes on a node's share of the
        bytes), as NCCL chooses among its algorithms."""
        link = self.link_for(mesh, dim)
        fields = dict(backend="nccl", world_size=mesh.size(dim), alpha=link.latency,
                      beta=1.0 / link.bandwidth, gamma=0.0, reference_world_size=2,
                      overlap=1.0,
                      source=f"{self.name}, {link.name} ({link.bandwidth / 1e9:g} GB/s, "
                             f"α {link.latency * 1e6:g} µs; {link.source}); overlap 1: "
                             f"NCCL moves data on the GPU's own engines")
        index = mesh.dim_names.index(dim)
        stride = math.prod(mesh.shape[index + 1:])
        per_node = max(1, min(mesh.shape[index], self.ranks_per_node // stride))
        if link is self.inter and per_node > 1 and mesh.size(dim) % per_node == 0:
            return TwoLevelCostModel(per_node=per_node, inner_alpha=self.intra.latency,
                                     inner_beta=1.0 / self.intra.bandwidth, **fields)
        return CostModel(**fields)

    def check_fits(self, peak_bytes: int, what: str) -> str:
        """A line saying whether ``peak_bytes`` fits the device; warns when it does not."""
        capacity = self.device.memory_bytes
        share = peak_bytes / capacity
        line = (f"{what}: predicted peak {peak_bytes / 2**30:.2f} GiB of "
                f"{capacity / 2**30:.0f} GiB on {self.device.name} ({share:.0%})")
        if peak_bytes > capacity:
            warnings.warn(f"the plan does not fit: {line}", RuntimeWarning, stacklevel=3)
            return line + ": DOES NOT FIT"
        return line + ": fits"


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

    def seconds(self, kind: str, nbytes: int, algorithm: str | None = None) -> float:
        flat = CostModel.seconds(self, kind, nbytes, algorithm)
        k = self.per_node
        nodes = self.world_size // k
        if (algorithm not in (None, "ring") or k <= 1 or nodes <= 1
                or kind not in ("all_reduce", "all_gather", "reduce_scatter")):
            return flat
        inner = CostModel(backend=self.backend, world_size=k, alpha=self.inner_alpha,
                          beta=self.inner_beta)
        outer = CostModel(backend=self.backend, world_size=nodes, alpha=self.alpha,
                          beta=self.beta)
        share = nbytes // k
        if kind == "all_reduce":
            two = (inner.seconds("reduce_scatter", nbytes) + outer.seconds(
                "all_reduce", share) + inner.seconds("all_gather", nbytes))
        elif kind == "all_gather":
            two = outer.seconds("all_gather", share) + inner.seconds("all_gather", nbytes)
        else:
            two = inner.seconds("reduce_scatter", nbytes) + outer.seconds(
                "reduce_scatter", share)
        return min(flat, two)


_NVIDIA = "NVIDIA datasheet"


def _cluster(device: Device, nvlink: float, nvlink_source: str, nodes_of: int,
             network_gbps: float, name: str) -> Hardware:
    if not isinstance(nodes_of, int) or nodes_of < 1:
        raise ValueError(f"{name}: nodes_of (GPUs per node) must be a positive int, got "
                         f"{nodes_of!r}")
    if not network_gbps > 0:
        raise ValueError(f"{name}: network_gbps must be positive, got {network_gbps!r}")
    return Hardware(
        name=f"{name} x{nodes_of} per node, {network_gbps:g} Gb/s per GPU between nodes",
        device=device, ranks_per_node=nodes_of,
        intra=Link(name="NVLink", bandwidth=nvlink, latency=5e-6,
                   source=f"{nvlink_source}; α assumed 5 µs, the order of nccl-tests' "
                          f"small-message latency in one node; calibrate for real figures"),
        inter=Link(name="network", bandwidth=network_gbps * 1e9 / 8, latency=15e-6,
                   source=f"{network_gbps:g} Gb/s per GPU (the NIC given); α assumed 15 µs, "
                          f"an InfiniBand/RoCE order of magnitude; calibrate"))


def A100_80GB(nodes_of: int = 8, network_gbps: float = 200) -> Hardware:
    """NVIDIA A100 SXM4 80GB: 312 TFLOP/s dense bf16/fp16, 156 tf32, 19.5 fp32; 80 GB
    HBM2e at 2,039 GB/s; NVLink 600 GB/s total, 300 GB/s each way (NVIDIA A100
    datasheet)."""
    device = Device(name="NVIDIA A100 SXM4 80GB",
                    flops={"float32": 19.5e12, "tfloat32": 156e12, "bfloat16": 312e12,
                           "float16": 312e12},
                    memory_bytes=80 * 10**9, memory_bandwidth=2039e9,
                    source=f"{_NVIDIA}: NVIDIA A100 Tensor Core GPU (dense, SXM4 80GB)")
    return _cluster(device, 300e9, f"{_NVIDIA}: NVLink 600 GB/s total, 300 GB/s each way",
                    nodes_of, network_gbps, "A100 80GB")


def H100_SXM(nodes_of: int = 8, network_gbps: float = 400) -> Hardware:
    """NVIDIA H100 SXM5 80GB: 989 TFLOP/s dense bf16/fp16, 1,979 fp8, 494.5 tf32, 67 fp32;
    80 GB HBM3 at 3.35 TB/s; NVLink 900 GB/s total, 450 GB/s each way (NVIDIA H100
    datasheet; its sparse figures are twice these)."""
    device = Device(name="NVIDIA H100 SXM5 80GB",
                    flops={"float32": 67e12, "tfloat32": 494.5e12, "bfloat16": 989e12,
                           "float16": 989e12, "float8_e4m3fn": 1979e12},
                    memory_bytes=80 * 10**9, memory_bandwidth=3.35e12,
                    source=f"{_NVIDIA}: NVIDIA H100 Tensor Core GPU (dense, SXM5)")
    return _cluster(device, 450e9, f"{_NVIDIA}: NVLink 900 GB/s total, 450 GB/s each way",
                    nodes_of, network_gbps, "H100 SXM")


def H200(nodes_of: int = 8, network_gbps: float = 400) -> Hardware:
    """NVIDIA H200 SXM 141GB: the H100's compute (989 TFLOP/s dense bf16); 141 GB HBM3e at
    4.8 TB/s; NVLink 900 GB/s total (NVIDIA H200 datasheet)."""
    base = H100_SXM(nodes_of, network_gbps)
    device = replace(base.device, name="NVIDIA H200 SXM 141GB", memory_bytes=141 * 10**9,
                     memory_bandwidth=4.8e12,
                     source=f"{_NVIDIA}: NVIDIA H200 Tensor Core GPU (SXM)")
    return replace(base, name=base.name.replace("H100 SXM", "H200"), device=device)


# -- compute from the graph -------------------------------------------------------------


def _node_flops(node: Any) -> int:
    from torch.utils.flop_counter import flop_registry

    fn = flop_registry.get(getattr(node.target, "overloadpacket", None))
    if fn is None:
        return 0

    def val(a: Any) -> Any:
        return a.meta.get("val") if hasattr(a, "meta") else a

    import torch.fx as fx
    from torch.fx.node import map_aggregate

    args = map_aggregate(node.args, lambda a: val(a) if isinstance(a, fx.Node) else a)
    kwargs = map_aggregate(node.kwargs, lambda a: val(a) if isinstance(a, fx.Node) else a)
    try:
        return int(fn(*args, **kwargs, out_val=node.meta.get("val")))
    except Exception:  # a formula that needs what the graph does not carry: no FLOPs
        return 0


def _node_bytes(node: Any) -> int:
    from spmd.lowering.graph import tensor_vals

    total = 0
    for arg in node.all_input_nodes:
        total += sum(t.numel() * t.element_size() for t in tensor_vals(arg.meta.get("val")))
    total += sum(t.numel() * t.element_size() for t in tensor_vals(node.meta.get("val")))
    return total


_FREE = ("view", "_unsafe_view", "t", "transpose", "permute", "expand", "alias", "detach",
         "unsqueeze", "squeeze", "slice", "select", "split", "split_with_sizes", "getitem",
         "reshape")


def graph_seconds(gm: Any, device: Device) -> float:
    """Predicted seconds of a graph's compute on ``device``: per node the roofline
    ``max(FLOPs / (peak · efficiency), bytes / (bandwidth · efficiency))``, views free,
    summed (one stream)."""
    from spmd.lowering.graph import is_collective, is_wait

    total = 0.0
    eff = device.efficiency
    for node in gm.graph.nodes:
        if node.op != "call_function" or is_collective(node) or is_wait(node):
            continue
        name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
        if name in _FREE:
            continue
        flops = _node_flops(node)
        compute = flops / (device.peak(_compute_dtype(node, device)) * eff)
        memory = _node_bytes(node) / (device.memory_bandwidth * eff)
        total += max(compute, memory)
    return total


_MATMULS = ("mm", "addmm", "bmm", "baddbmm")


def _compute_dtype(node: Any, device: Device | None) -> torch.dtype:
    """The dtype ``node``'s arithmetic runs in on ``device``."""
    if device is not None and device.matmul_dtype is not None:
        name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
        if name in _MATMULS:
            return getattr(torch, device.matmul_dtype)
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else torch.float32


def graph_flops(gm: Any, device: Device | None = None) -> dict[torch.dtype, int]:
    """The graph's FLOPs by the dtype they run in (torch's flop_counter formulas)."""
    out: dict[torch.dtype, int] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        flops = _node_flops(node)
        if flops:
            dtype = _compute_dtype(node, device)
            out[dtype] = out.get(dtype, 0) + flops
    return out


def throughput(plan: Any) -> str:
    """One line for a plan on a simulated cluster: the predicted step time (compute and
    exposed communication), the model FLOPs per device and the model FLOPs utilisation
    (the share of the step the device would need at peak for them), tokens/s per device
    when the model's first input is token ids."""
    hardware = plan.mesh.hardware
    timeline = plan.predicted_timeline()
    step = timeline.step_seconds
    flops: dict[torch.dtype, int] = {}
    for gm in plan.graphs.values():
        for dtype, n in graph_flops(gm, hardware.device).items():
            flops[dtype] = flops.get(dtype, 0) + n
    total = sum(flops.values())
    at_peak = sum(n / hardware.device.peak(d) for d, n in flops.items())
    mfu = at_peak / step if step > 0 else 0.0
    line = (f"on {hardware.device.name}: predicted step {step * 1e3:.3f} ms (exposed "
            f"communication {timeline.exposed_seconds * 1e3:.3f} ms), {total / 1e12:.3f} "
            f"TFLOP per device per step, MFU {mfu:.1%}")
    if plan.tokens_per_step and step > 0:
        line += f", {plan.tokens_per_step / step:,.0f} tokens/s per device"
    return line


# -- fitting a hardware model from a profiled run ---------------------------------------

# (α coefficient, β coefficient) of each collective's time, as the cost model's formulas
# give them for p ranks and n bytes
_TERMS = {
    "all_reduce": lambda p, n: (2 * (p - 1), 2 * (p - 1) / p * n),
    "all_gather": lambda p, n: (p - 1, (p - 1) / p * n),
    "reduce_scatter": lambda p, n: (p - 1, (p - 1) / p * n),
    "all_to_all": lambda p, n: (p - 1, (p - 1) / p * n),
}


def profile_record(plan: Any) -> dict:
    """What :func:`fit` needs from a profiled plan (``spmd.profile``, then
    ``spmd.inspect``): each collective's kind, bytes, ranks and measured seconds (median
    over the profiled steps), and each graph's measured compute with its nodes' FLOPs
    and bytes. JSON-ready; ``plan.save_profile(path)`` writes it."""
    import statistics

    timelines = list(getattr(plan, "measured_steps", None) or
                     ([plan.measured] if plan.measured is not None else []))
    if not timelines:
        raise ValueError("save_profile: the plan has no measured step; run spmd.profile("
                         "model, steps=N) and N training steps first")
    measured: dict[tuple[str, str], list[float]] = {}
    for timeline in timelines:
        for span in timeline.spans:
            measured.setdefault((span.lane, span.label), []).append(span.seconds)
    collectives = []
    for c in plan.collectives:
        seconds = measured.get(("communication", c.name))
        if seconds:
            collectives.append({"name": c.name, "kind": c.kind, "bytes": c.bytes,
                                "ranks": plan.mesh.size(c.mesh_dim) if c.mesh_dim else
                                plan.world_size, "mesh_dim": c.mesh_dim,
                                "seconds": statistics.median(seconds)})
    compute = []
    for key, gm in plan.graphs.items():
        region, phase = key.rsplit(".", 1)
        seconds = measured.get(("compute", f"{region} {phase}"))
        if not seconds:
            continue
        nodes = []
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
            if name in _FREE:
                continue
            val = node.meta.get("val")
            dtype = str(val.dtype if isinstance(val, torch.Tensor) else torch.float32)
            nodes.append([_node_flops(node), _node_bytes(node), dtype.removeprefix("torch.")])
        compute.append({"graph": key, "seconds": statistics.median(seconds), "nodes": nodes})
    return {"format": "spmd-profile-1", "mesh": {"shape": list(plan.mesh.shape),
                                                 "dim_names": list(plan.mesh.dim_names)},
            "backend": plan.cost_model.backend, "collectives": collectives,
            "compute": compute}


def fit(profile: Any, base: Hardware, *, link: str | None = None) -> Hardware:
    """``base`` with the link the profiled collectives ran on, and the device's
    efficiency, fitted to a profiled run of this library.

    Args:
        profile: a path to what ``plan.save_profile(path)`` wrote, or that dict.
        base: the hardware the run was on (its datasheet figures: peak FLOP/s, memory
            bandwidth, the other link).
        link: ``"intra"`` or ``"inter"``; by default ``"intra"`` when the profiled groups
            fit in one of ``base``'s nodes.

    The link's latency α and seconds per byte β are the least-squares fit of every
    measured collective's time to the cost model's formula for its kind (at least two
    sizes are needed); the efficiency is the graphs' roofline at full efficiency over
    their measured compute time.
    """
    import json

    import numpy as np

    where = "spmd.hardware.fit"
    if not isinstance(base, Hardware):
        raise TypeError(f"{where}: base must be a Hardware (the datasheet to start from), got "
                        f"{type(base).__name__}")
    name = "a profile"
    if isinstance(profile, (str, bytes)) or hasattr(profile, "__fspath__"):
        name = str(profile)
        with open(profile) as f:
            profile = json.load(f)
    if not isinstance(profile, dict) or profile.get("format") != "spmd-profile-1":
        raise ValueError(f"{where}: {name} is not a profile written by plan.save_profile()")
    samples = [c for c in profile["collectives"] if c["kind"] in _TERMS and c["ranks"] > 1]
    if len({c["bytes"] for c in samples}) < 2:
        raise ValueError(f"{where}: {name} holds collectives of {len({c['bytes'] for c in samples})} "
                         f"size(s); fitting latency and bandwidth needs at least two (profile "
                         f"with bucket_cap_mb=0, or a model with buckets of different sizes)")
    rows = [_TERMS[c["kind"]](c["ranks"], c["bytes"]) for c in samples]
    times = [c["seconds"] for c in samples]
    (alpha, beta), *_ = np.linalg.lstsq(np.array(rows, dtype=float), np.array(times),
                                        rcond=None)
    if not float(beta) > 0:
        largest = max(c["bytes"] for c in samples)
        raise ValueError(f"{where}: the collectives in {name} do not determine a bandwidth "
                         f"(the fit gives {float(beta):.3g} s/B: their times are latency and "
                         f"noise; the largest is {largest:,} bytes). Profile larger buckets, "
                         f"megabytes at least")
    alpha, beta = max(float(alpha), 0.0), float(beta)
    ranks = max(c["ranks"] for c in samples)
    which = link or ("intra" if ranks <= base.ranks_per_node else "inter")
    if which not in ("intra", "inter"):
        raise ValueError(f"{where}: link must be 'intra' or 'inter', got {link!r}")
    fitted = Link(name=getattr(base, which).name, bandwidth=1.0 / beta, latency=alpha,
                  source=f"fitted from {name}: {len(samples)} collectives over {ranks} ranks "
                         f"({profile.get('backend', '?')})")
    roofline = measured = 0.0
    for graph in profile["compute"]:
        for flops, nbytes, dtype in graph["nodes"]:
            peak = base.device.peak(getattr(torch, dtype, torch.float32))
            roofline += max(flops / peak, nbytes / base.device.memory_bandwidth)
        measured += graph["seconds"]
    device = base.device
    if measured > 0 and roofline > 0:
        device = replace(device, efficiency=min(1.0, roofline / measured),
                         source=f"{device.source}; efficiency fitted from {name}")
    return replace(base, name=f"{base.name}, fitted from {name}", device=device,
                   **{which: fitted})
