"""Plans for a simulated cluster (``Mesh.simulated(..., hardware=)``): presets are data
that validates, each mesh dimension's collectives are priced on the link its ranks use,
compute comes from the graphs' FLOPs on the device, and memory is checked against its
capacity."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import spmd
from spmd.hardware import A100_80GB, H100_SXM, H200, Hardware, graph_seconds

from ..models import Transformer, tokens


@pytest.mark.parametrize("preset", [A100_80GB, H100_SXM, H200])
def test_presets_are_data_with_sources(preset):
    hw = preset(nodes_of=8, network_gbps=400)
    assert isinstance(hw, Hardware) and hw.ranks_per_node == 8
    assert "datasheet" in hw.device.source and "datasheet" in hw.intra.source
    assert hw.inter.bandwidth == 400e9 / 8
    assert hw.device.peak(torch.bfloat16) > hw.device.peak(torch.float32) > 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        hw.ranks_per_node = 4  # type: ignore[misc]


def test_bad_hardware_is_refused():
    hw = H100_SXM()
    with pytest.raises(ValueError, match="ranks_per_node"):
        dataclasses.replace(hw, ranks_per_node=0)
    with pytest.raises(ValueError, match="bandwidth"):
        dataclasses.replace(hw, inter=dataclasses.replace(hw.inter, bandwidth=0.0))
    with pytest.raises(ValueError, match="network_gbps"):
        H100_SXM(network_gbps=-1)
    with pytest.raises(TypeError, match="Hardware"):
        spmd.Mesh.simulated(8, hardware="H100")


def test_a_dimension_inside_a_node_uses_nvlink_and_one_across_nodes_the_network():
    hw = H100_SXM(nodes_of=8)
    mesh = spmd.Mesh.simulated((8, 8), dim_names=("dp", "tp"))
    assert hw.link_for(mesh, "tp") is hw.intra and hw.link_for(mesh, "dp") is hw.inter
    assert hw.link_for(spmd.Mesh.simulated((2, 4), dim_names=("a", "b")), "a") is hw.intra
    assert hw.link_for(spmd.Mesh.simulated(64), "dp") is hw.inter
    fast = hw.cost_model(mesh, "tp").seconds("all_reduce", 1 << 26)
    slow = hw.cost_model(mesh, "dp").seconds("all_reduce", 1 << 26)
    assert slow > 5 * fast  # 50 GB/s against 450 GB/s


def test_the_same_model_is_bucketed_for_the_cluster_not_this_machine():
    model, x = Transformer(layers=4, dim=128, vocab=256), tokens(rows=16, length=32,
                                                                 vocab=256)[0]
    here = spmd.inspect(model, x, mesh=spmd.Mesh.simulated(64))
    there = spmd.inspect(model, x, mesh=spmd.Mesh.simulated(64, hardware=H100_SXM()))
    # this machine's Gloo figures and compute against the cluster's links and roofline
    assert [b.params for b in here.buckets] != [b.params for b in there.buckets]
    assert here.cost_model.backend == "gloo" and len(there.buckets) > 1
    assert there.cost_model.backend == "nccl" and there.cost_model.overlap == pytest.approx(
        108 / 132)  # NCCL takes 24 of an H100's 132 SMs from the compute beside it
    forward, backward = there.compute["graph0"]
    assert 0 < forward < backward < 1e-2  # microseconds on an H100, not this CPU's ms
    line = next(ln for ln in there.summary().splitlines() if ln.startswith("on NVIDIA"))
    step = there.predicted_timeline().step_seconds
    assert f"predicted step {step * 1e3:.3f} ms" in line and "MFU" in line
    assert f"{16 * 32 / step:,.0f} tokens/s per device" in line  # 16 x 32 token ids
    assert "MFU" not in here.summary()


def test_tensor_parallel_collectives_are_priced_on_their_link():
    hw = H100_SXM(nodes_of=8)
    mesh = spmd.Mesh.simulated((2, 8), dim_names=("dp", "tp"), hardware=hw)
    plan = spmd.inspect(Transformer(layers=1, dim=64), tokens()[0], mesh=mesh,
                        placements=spmd.tp.megatron())
    tp = [c for c in plan.collectives if c.mesh_dim == "tp"]
    dp = [c for c in plan.collectives if c.mesh_dim == "dp"]
    assert tp and dp
    for c in tp:
        assert c.predicted_seconds == pytest.approx(
            hw.cost_model(mesh, "tp").seconds(c.kind, c.bytes))
    for c in dp:
        assert c.predicted_seconds == pytest.approx(
            hw.cost_model(mesh, "dp").seconds(c.kind, c.bytes))


def test_compute_is_the_roofline_of_the_graph():
    from torch.utils.flop_counter import FlopCounterMode

    model, x = Transformer(layers=2, dim=128, vocab=256), tokens(rows=8, length=32,
                                                                 vocab=256)[0]
    hw = H100_SXM()
    plan = spmd.inspect(model, x, mesh=spmd.Mesh.simulated(8, hardware=hw))
    seconds = graph_seconds(plan.graphs["graph0.forward"], hw.device)
    with FlopCounterMode(display=False) as counter:
        model(x)
    flops = counter.get_total_flops()
    floor = flops / (hw.device.peak(torch.float32) * hw.device.efficiency)
    assert floor <= seconds < floor + 1e-3  # the matmuls' time, plus memory-bound ops


def test_memory_is_checked_against_the_device():
    small = dataclasses.replace(H100_SXM(), device=dataclasses.replace(
        H100_SXM().device, memory_bytes=1 << 20))  # a 1 MiB device
    model, x = Transformer(layers=2, dim=128, vocab=256), tokens(rows=8, vocab=256)[0]
    fits = spmd.inspect(model, x, mesh=spmd.Mesh.simulated(8, hardware=H100_SXM())).memory()
    assert fits.fits and "fits" in str(fits)
    plan = spmd.inspect(model, x, mesh=spmd.Mesh.simulated(8, hardware=small))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        view = plan.memory()
    assert view.fits is False and "DOES NOT FIT" in str(view)
    assert view.comm_buffers == max(b.bytes for b in plan.buckets) > 0
    assert any("does not fit" in str(w.message) for w in caught)
    assert spmd.inspect(model, x, mesh=spmd.Mesh.simulated(8)).memory().fits is None


_META_PLAN = r"""
import math, resource, sys, torch, spmd
sys.path.insert(0, {root!r})
from tests.models import Transformer
with torch.device("meta"):
    model = Transformer(layers=8, dim=2048, vocab=32000)
for block in model.layers:
    block.heads = 16
shapes = [tuple(p.shape) for p in model.parameters()]
x = torch.randint(0, 32000, (1, 512), device="meta")
mesh = spmd.Mesh.simulated((8, 8), dim_names=("dp", "fsdp"),
                           hardware=spmd.hardware.H100_SXM(nodes_of=8))
view = spmd.inspect(model, x, mesh=mesh, strategy="hsdp").memory("adamw")
local = sum(math.ceil(s[0] / 8) * math.prod(s[1:]) * 4 for s in shapes)
print(sum(math.prod(s) for s in shapes), view.params == local, view.grads == local,
      view.optimizer_state == 2 * local, view.fits,
      resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
"""


def test_a_model_on_the_meta_device_plans_without_allocating():
    """A 0.45B-parameter transformer built on the meta device (1.8 GB if it were real)
    plans for 64 simulated H100s in a fresh process that never holds its weights; the
    memory view's parameters, gradients and AdamW state are exactly this rank's shards."""
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    out = subprocess.run([sys.executable, "-c", _META_PLAN.format(root=root)],
                         capture_output=True, text=True, timeout=110, check=True)
    numel, params, grads, state, fits, max_rss_mib = out.stdout.split()[-6:]
    assert int(numel) > 400_000_000
    assert params == grads == state == fits == "True"
    assert int(max_rss_mib) < 1200, out.stdout  # weights alone would be 1.8 GB


def test_a_dimension_spanning_nodes_takes_the_cheaper_of_flat_and_two_level():
    from spmd.hardware import TwoLevelCostModel
    from spmd.lowering.cost_model import CostModel

    hw = H100_SXM(nodes_of=8, network_gbps=400)
    wide = hw.cost_model(spmd.Mesh.simulated(64), "dp")  # 8 ranks in each of 8 nodes
    assert isinstance(wide, TwoLevelCostModel) and wide.per_node == 8
    flat = CostModel(backend="nccl", world_size=64, alpha=wide.alpha, beta=wide.beta)
    big = 1 << 30
    # within a node over NVLink, across nodes on an eighth of the bytes: far cheaper
    assert wide.seconds("all_reduce", big) < 0.5 * flat.seconds("all_reduce", big)
    assert wide.seconds("all_gather", big) < flat.seconds("all_gather", big)
    assert wide.seconds("all_reduce", 8) == pytest.approx(
        min(flat.seconds("all_reduce", 8), wide.seconds("all_reduce", 8)))
    # one rank of each group per node: the network ring is all there is
    across = hw.cost_model(spmd.Mesh.simulated((8, 8), dim_names=("dp", "tp")), "dp")
    assert type(across) is CostModel


def test_matmuls_can_be_priced_in_another_dtype():
    """FP8 training: matrix products at the FP8 peak, everything else as it is."""
    hw = H100_SXM()
    fp8 = dataclasses.replace(hw.device, matmul_dtype="float8_e4m3fn")
    with torch.device("meta"):  # wide enough that the matrix products are compute-bound
        model = Transformer(layers=1, dim=1024, vocab=256).to(torch.bfloat16)
    plan = spmd.inspect(model, torch.randint(0, 256, (16, 256), device="meta"),
                        mesh=spmd.Mesh.simulated(8, hardware=hw))
    graph = plan.graphs["graph0.forward"]
    from spmd.hardware import graph_flops

    assert set(graph_flops(graph, fp8)) >= {torch.float8_e4m3fn}
    assert sum(graph_flops(graph, fp8).values()) == sum(graph_flops(graph).values())
    assert graph_seconds(graph, fp8) < graph_seconds(graph, hw.device)
