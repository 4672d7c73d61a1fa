"""The hardware model's data: a device, its links, a cluster, and the presets with their
sources. The public face is :mod:`spmd.hardware`, which says how the planner uses them."""


from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from spmd.lowering.cost_model import CostModel, TwoLevelCostModel
from spmd.runtime.mesh import Mesh

__all__ = ["Device", "Efficiency", "Link", "Hardware", "A100_80GB", "H100_SXM", "H200",
           "COMPUTE_CLASSES", "EFFICIENCY_CLASSES"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Efficiency:
    """The share of a datasheet peak one class of kernels reaches (``value``), and where
    that figure comes from (``source``: a benchmark run, a published measurement, or a
    fit to a profiled run)."""

    value: float
    source: str

    def __post_init__(self) -> None:
        if not 0 < self.value <= 1:
            raise ValueError(f"Efficiency must be in (0, 1], got {self.value} ({self.source})")


# the classes a device's efficiencies are given for: the roofline's compute classes
# (spmd.plan.roofline), the bus bandwidth collectives reach on a link, and the share of the
# device's compute left to kernels while a collective runs beside them (NCCL's kernels
# occupy SMs)
COMPUTE_CLASSES = ("matmul", "attention", "memory")
EFFICIENCY_CLASSES = COMPUTE_CLASSES + ("collective", "overlap")


@dataclass(frozen=True, kw_only=True)
class Device:
    """One accelerator.

    Attributes:
        name: e.g. ``"NVIDIA H100 SXM5 80GB"``.
        flops: dense peak FLOP/s by dtype name (``"float32"``, ``"bfloat16"``, ...).
        memory_bytes: memory capacity.
        memory_bandwidth: bytes/s.
        efficiencies: the share of peak each class of kernels reaches, by class
            (``"matmul"``, ``"attention"``, ``"memory"``, ``"collective"``: the bus
            bandwidth NCCL reaches on a link, against its datasheet figure), optionally
            by class and dtype (``"matmul.bfloat16"``), each an :class:`Efficiency` with
            its source.
        efficiency: what a class not in ``efficiencies`` runs at (unsourced: the plan
            says so wherever it is used).
        source: where the datasheet figures come from.
        matmul_dtype: the dtype matrix products run in when it is not the values' own
            (``"float8_e4m3fn"`` for FP8 training, as Transformer Engine does), priced
            at that dtype's peak.
    """

    name: str
    flops: dict[str, float] = field(hash=False)
    memory_bytes: int
    memory_bandwidth: float
    efficiencies: dict[str, Efficiency] = field(default_factory=dict, hash=False)
    efficiency: float = 0.6
    source: str = ""
    matmul_dtype: str | None = None  # matrix products in this dtype (FP8 training: float8)

    def peak(self, dtype: torch.dtype) -> float:
        """Dense peak FLOP/s for ``dtype`` (float32 when none is given for it)."""
        name = str(dtype).removeprefix("torch.")
        return self.flops.get(name, self.flops["float32"])

    def efficiency_of(self, kind: str, dtype: torch.dtype | None = None) -> Efficiency:
        """The efficiency of class ``kind`` (in ``dtype``): the most specific entry of
        ``efficiencies``, else ``efficiency``, marked unsourced."""
        if dtype is not None:
            found = self.efficiencies.get(f"{kind}.{str(dtype).removeprefix('torch.')}")
            if found is not None:
                return found
        found = self.efficiencies.get(kind)
        if found is not None:
            return found
        return Efficiency(value=self.efficiency,
                          source="the device's default efficiency, unsourced")

    def overlap(self) -> Efficiency:
        """The share of compute throughput left while a collective runs beside it."""
        return self.efficiencies.get("overlap") or Efficiency(
            value=1.0, source="default, unsourced: collectives take nothing from the "
                              "kernels beside them")

    def efficiency_lines(self) -> list[str]:
        """One line per class and where its figure comes from, for the plan."""
        lines = [f"{k}: {e.value:.1%} ({e.source})" for k, e in sorted(self.efficiencies.items())]

        def given(kind: str) -> bool:
            return any(e == kind or e.startswith(kind + ".") for e in self.efficiencies)

        missing = [k for k in COMPUTE_CLASSES if not given(k)]
        if missing:
            lines.append(f"{', '.join(missing)}: {self.efficiency:.1%} (default, unsourced)")
        if not given("collective"):
            lines.append("collective: 100.0% (the links' datasheet figures)")
        if not given("overlap"):
            lines.append(f"overlap: 100.0% ({self.overlap().source})")
        return lines


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
        for kind in self.device.efficiencies:
            if kind.split(".")[0] not in EFFICIENCY_CLASSES:
                raise ValueError(f"Hardware {self.name}: efficiencies has {kind!r}; the "
                                 f"classes are {', '.join(EFFICIENCY_CLASSES)} (optionally "
                                 f"'.<dtype>')")
        if not 0 < self.device.efficiency <= 1:
            raise ValueError(f"Hardware {self.name}: efficiency must be in (0, 1], got "
                             f"{self.device.efficiency}")
        for link in (self.intra, self.inter):
            if link.latency < 0:
                raise ValueError(f"Hardware {self.name}: {link.name} latency must be >= 0")

    def link_for(self, mesh: Mesh, dim: str) -> Link:
        """The link mesh dimension ``dim`` communicates over: inside a node when all of one
        group's ranks share a node (row-major layout, ``ranks_per_node`` per node)."""
        index = mesh.dim_names.index(dim)
        stride = math.prod(mesh.shape[index + 1:])
        span = stride * (mesh.shape[index] - 1) + 1  # first to last rank of one group
        return self.intra if span <= self.ranks_per_node else self.inter

    def cost_model(self, mesh: Mesh, dim: str) -> Any:
        """The collective cost model of mesh dimension ``dim`` (NCCL on that link). A
        dimension whose groups span nodes with several of their ranks in each node is
        priced as the cheaper of a flat ring over the network and the two-level
        algorithm (within each node over NVLink, across nodes on a node's share of the
        bytes), as NCCL chooses among its algorithms."""
        link = self.link_for(mesh, dim)
        bus = self.bus_efficiency(link)
        fields = dict(backend="nccl", world_size=mesh.size(dim), alpha=link.latency,
                      beta=1.0 / (link.bandwidth * bus.value), gamma=0.0,
                      reference_world_size=2, overlap=self.device.overlap().value,
                      source=f"{self.name}, {link.name} ({link.bandwidth / 1e9:g} GB/s at "
                             f"{bus.value:.0%}: {bus.source}; α {link.latency * 1e6:g} µs; "
                             f"{link.source}); overlap {self.device.overlap().value:.0%}: "
                             f"{self.device.overlap().source}")
        index = mesh.dim_names.index(dim)
        stride = math.prod(mesh.shape[index + 1:])
        per_node = max(1, min(mesh.shape[index], self.ranks_per_node // stride))
        if link is self.inter and per_node > 1 and mesh.size(dim) % per_node == 0:
            inner = self.intra.bandwidth * self.bus_efficiency(self.intra).value
            return TwoLevelCostModel(per_node=per_node, inner_alpha=self.intra.latency,
                                     inner_beta=1.0 / inner, **fields)
        return CostModel(**fields)

    def bus_efficiency(self, link: Link) -> Efficiency:
        """The share of ``link``'s bandwidth NCCL's collectives reach: the device's
        ``"collective.intra"``/``"collective.inter"`` efficiency, else ``"collective"``,
        else the datasheet figure itself."""
        which = "intra" if link is self.intra else "inter"
        eff = self.device.efficiencies
        found = eff.get(f"collective.{which}") or eff.get("collective")
        return found or Efficiency(value=1.0, source="the link's datasheet figure")

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


_NVIDIA = "NVIDIA datasheet"
_MAMF = ("measured, published: Stas Bekman, Machine Learning Engineering, 'Maximum "
         "Achievable Matmul FLOPS comparison table' (github.com/stas00/ml-engineering, "
         "compute/accelerator/README.md), torch.matmul at its best shape, ")
_FA2_H100 = ("published: FlashAttention-3 (Shah et al., 2024), abstract: FlashAttention-2, "
             "torch's SDPA flash kernel, reaches 35% of the H100's peak")
_COPY = ("measured here: a device-to-device copy moved 4.20 of the H200's 4.8 TB/s "
         "(benchmarks/kernel_speed.py, 2026-11-26, BENCHMARKS.md)")
_NCCL_TESTS = ("published: nccl-tests all_reduce_perf -g 8 large-message busbw (Alaya New, "
               "'NCCL-tests in practice', 2026-05-06): ")


_NCCL_SMS = ("published: an ncclAllGather running beside a GEMM on an H100 occupied 24 "
             "of its 132 SMs, the share taken here (NVIDIA developer forum, 'Compute-"
             "Communication Overlap Causes Severe GEMM Performance Degradation because of "
             "Tail Effect'; the GEMM's extra wave can cost more)")


def _hopper(fp8: float, fp8_source: str, memory_source: str) -> dict[str, Efficiency]:
    return {
        "overlap": Efficiency(value=108 / 132, source=_NCCL_SMS),
        "matmul.bfloat16": Efficiency(value=794.5 / 989, source=_MAMF + "H100 SXM bf16 "
                                      "794.5 of 989 TFLOP/s (the H200 alike)"),
        "matmul.float16": Efficiency(value=794.5 / 989, source="taken as bf16's (the same "
                                     "tensor-core rate): " + _MAMF + "H100 SXM bf16"),
        "matmul.float8_e4m3fn": Efficiency(value=fp8, source=_MAMF + fp8_source),
        "attention": Efficiency(value=0.35, source=_FA2_H100),
        "memory": Efficiency(value=4.20 / 4.8, source=memory_source),
        "collective.intra": Efficiency(value=1.0, source=_NCCL_TESTS + "8x H100 SXM5 "
                                       "460-480 GB/s, at or above NVLink's 450 GB/s each "
                                       "way (NVLink SHARP reduces in the switch)"),
    }


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
    efficiencies = {
        "matmul.bfloat16": Efficiency(value=271.2 / 312, source=_MAMF + "A100 SXM bf16 "
                                      "271.2 of 312 TFLOP/s"),
        "matmul.float16": Efficiency(value=271.2 / 312, source="taken as bf16's: " + _MAMF
                                     + "A100 SXM bf16"),
        "attention": Efficiency(value=0.6, source="published: FlashAttention-2 (Dao, 2023), "
                                "abstract: 50-73% of the A100's peak; the range's middle"),
        "memory": Efficiency(value=4.20 / 4.8, source="the H200's copy efficiency, taken "
                             "for HBM2e: " + _COPY),
        "collective.intra": Efficiency(value=240 / 300, source=_NCCL_TESTS + "8x A100 SXM4 "
                                       "230-250 GB/s of NVLink's 300 GB/s each way"),
    }
    device = Device(name="NVIDIA A100 SXM4 80GB",
                    flops={"float32": 19.5e12, "tfloat32": 156e12, "bfloat16": 312e12,
                           "float16": 312e12},
                    memory_bytes=80 * 10**9, memory_bandwidth=2039e9,
                    efficiencies=efficiencies,
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
                    efficiencies=_hopper(1402.6 / 1979, "H100 SXM fp8 1402.6 of 1979 "
                                         "TFLOP/s", "the H200's copy efficiency, taken "
                                         "for the H100's HBM3: " + _COPY),
                    source=f"{_NVIDIA}: NVIDIA H100 Tensor Core GPU (dense, SXM5)")
    return _cluster(device, 450e9, f"{_NVIDIA}: NVLink 900 GB/s total, 450 GB/s each way",
                    nodes_of, network_gbps, "H100 SXM")


def H200(nodes_of: int = 8, network_gbps: float = 400) -> Hardware:
    """NVIDIA H200 SXM 141GB: the H100's compute (989 TFLOP/s dense bf16); 141 GB HBM3e at
    4.8 TB/s; NVLink 900 GB/s total (NVIDIA H200 datasheet)."""
    base = H100_SXM(nodes_of, network_gbps)
    device = replace(base.device, name="NVIDIA H200 SXM 141GB", memory_bytes=141 * 10**9,
                     memory_bandwidth=4.8e12,
                     efficiencies=_hopper(1453.4 / 1979, "H200 SXM fp8 1453.4 of 1979 "
                                          "TFLOP/s", _COPY),
                     source=f"{_NVIDIA}: NVIDIA H200 Tensor Core GPU (SXM)")
    return replace(base, name=base.name.replace("H100 SXM", "H200"), device=device)
