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
- **overlap**: GPUs run collectives beside the compute (NCCL, on its own stream), so
  communication can hide behind all of it; NCCL's kernels take some of the SMs,
  which slows the compute beside them (the device's ``"overlap"`` efficiency);
- **compute from the graph** (:mod:`spmd.plan.roofline`): each node's FLOPs and the bytes it
  reads and writes, as a roofline on the device at the efficiency of its class (matrix
  products by dtype, fused attention, memory-bound ops; every preset figure sourced,
  :class:`Efficiency`), memory-bound chains fused for compiled runs; this sets the
  backward time the bucket size is derived from, and the step, MFU and tokens/s the
  summary predicts;
- **memory against capacity**: ``plan.memory()`` compares the predicted peak with the
  device's memory and warns when the plan would not fit.

Write your own with :class:`Device`, :class:`Link` and :class:`Hardware`, or start from a
preset and ``dataclasses.replace`` what differs; fit one to a profiled run of this
library (:func:`fit`: the links and the compute) or to one measured step of any run
(:func:`fit_step`: the compute).
"""

from __future__ import annotations

from spmd.lowering.cost_model import TwoLevelCostModel
from spmd.plan.fit import fit, fit_step, profile_record
from spmd.plan.hardware import (A100_80GB, H100_SXM, H200, Device, Efficiency, Hardware,
                                Link)
from spmd.plan.roofline import graph_flops, graph_seconds, throughput

__all__ = ["Device", "Efficiency", "Link", "Hardware", "A100_80GB", "H100_SXM", "H200",
           "graph_seconds", "graph_flops", "throughput", "fit", "fit_step", "profile_record",
           "TwoLevelCostModel"]
