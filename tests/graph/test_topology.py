"""Topology: which ranks share a host, and which mesh dimensions cross hosts (no
processes: names as ranks would publish them, and simulated meshes)."""

from __future__ import annotations

import pytest

import spmd
from spmd.runtime.topology import Topology, host_name


def test_hosts_are_numbered_by_first_rank():
    topo = Topology.from_names(["b", "b", "a", "a", "c", "b"])
    assert topo.hosts == (0, 0, 1, 1, 2, 0)
    assert topo.names == ("b", "a", "c")
    assert topo.ranks_on(0) == [0, 1, 5]
    assert topo.split([5, 2, 3, 0]) == [[5, 0], [2, 3]]
    assert topo.per_host([0, 1, 2, 3]) == 2
    assert topo.per_host([0, 1, 2, 4]) is None  # 2, 1 and 1: not even
    assert topo.describe() == "3 host(s) (discovered); b: ranks 0-1,5; a: ranks 2-3; c: ranks 4"
    with pytest.raises(ValueError, match="outside"):
        topo.host_of(6)


def test_uniform_layout():
    topo = Topology.uniform(8, 4)
    assert topo.hosts == (0, 0, 0, 0, 1, 1, 1, 1)
    assert topo.num_hosts == 2


def test_host_name_follows_the_launcher(monkeypatch):
    monkeypatch.delenv("SPMD_HOST", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    own = host_name()
    assert "/net:" in own  # machine and network namespace
    monkeypatch.setenv("GROUP_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert host_name() == "node3"  # torchrun's node rank
    monkeypatch.setenv("SPMD_HOST", "rack1/host7")
    assert host_name() == "rack1/host7"


def test_simulated_mesh_dimensions_cross_hosts_by_the_hardware_model():
    hw = spmd.hardware.H100_SXM(nodes_of=8)
    mesh = spmd.Mesh.simulated((4, 8), ("dp", "tp"), hardware=hw)
    assert mesh.topology.num_hosts == 4
    assert mesh.crosses_hosts("dp") and not mesh.crosses_hosts("tp")
    assert mesh.hosts_along("dp") == 4
    mesh = spmd.Mesh.simulated((8, 4), ("tp", "dp"), hardware=hw)
    assert mesh.hosts_along("tp") == 4 and mesh.hosts_along("dp") == 1
    assert not spmd.Mesh.simulated(16).crosses_hosts("dp")  # no hardware model: one host


def _planned(strategy: str, mesh):
    import torch

    from tests.cpu.test_checkpoint_matrix import batch, make

    ids, _ = batch(0)
    return spmd.inspect(make(), ids, mesh=mesh, strategy=strategy)


def test_a_simulated_job_across_hosts_is_priced_on_the_link():
    from spmd.lowering.cost_model import NetworkLink

    slow = NetworkLink(alpha=200e-6, beta=8e-9, source="1 Gbit/s, given")
    blocked = Topology.from_names(["a", "a", "b", "b"], "given")
    mesh = spmd.Mesh.simulated(4, ("dp",), topology=blocked, network=slow)
    plan = _planned("ddp", mesh)
    text = plan.summary()
    assert "hosts: 2 host(s) (given); a: ranks 0-1; b: ranks 2-3" in text
    assert "mesh dimension 'dp' crosses 2 hosts" in text and "1 Gbit/s, given" in text
    assert {b.algorithm for b in plan.buckets} == {"hierarchical"}  # latency-bound: 2 vs 6 α
    one_host = _planned("ddp", spmd.Mesh.simulated(4, ("dp",)))
    assert plan.predicted_communication_seconds() > one_host.predicted_communication_seconds()
    # hsdp sharding within each host prices less than sharding across them
    within = spmd.Mesh.simulated((2, 2), ("dp", "fsdp"), topology=blocked, network=slow)
    across = spmd.Mesh.simulated((2, 2), ("dp", "fsdp"), network=slow,
                                 topology=Topology.from_names(["a", "b", "a", "b"], "given"))
    assert within.crosses_hosts("dp") and not within.crosses_hosts("fsdp")
    assert across.crosses_hosts("fsdp") and not across.crosses_hosts("dp")
    assert (_planned("hsdp", within).predicted_communication_seconds()
            < _planned("hsdp", across).predicted_communication_seconds())


def test_simulated_topology_arguments_are_checked():
    from spmd.lowering.cost_model import NetworkLink

    link = NetworkLink(alpha=1e-4, beta=1e-9)
    with pytest.raises(ValueError, match="together"):
        spmd.Mesh.simulated(4, topology=Topology.uniform(4, 2))
    with pytest.raises(ValueError, match="Topology of 4 ranks"):
        spmd.Mesh.simulated(4, topology=Topology.uniform(8, 2), network=link)
    with pytest.raises(ValueError, match="not both"):
        spmd.Mesh.simulated(4, hardware=spmd.hardware.H100_SXM(nodes_of=2),
                            topology=Topology.uniform(4, 2), network=link)


def test_collectives_timed_at_start_up_price_their_group():
    """Where the job timed its group's flat and two-level collectives, those samples
    price them (joined by straight lines, the end segments continued) and choose between
    them per kind; the kinds and algorithms not timed keep the formulas."""
    from spmd.lowering.cost_model import NetworkLink, along

    K, M = 1 << 10, 1 << 20
    timed = NetworkLink(alpha=1e-4, beta=8e-9, lines=(
        ("all_reduce", "ring", 4, ((K, 5e-3), (M, 6e-3), (4 * M, 9e-3))),
        ("all_reduce", "hierarchical", 4, ((K, 9e-3), (M, 9.5e-3), (4 * M, 11e-3))),
        ("reduce_scatter", "ring", 4, ((K, 2e-3), (M, 4e-3)))))
    mesh = spmd.Mesh.simulated(4, ("dp",), topology=Topology.uniform(4, 2), network=timed)
    model = along(mesh, "dp", spmd.lowering.cost_model.CostModel.default("gloo", 4))
    small, large = K, 16 * M
    assert model.seconds("all_reduce", small, "ring") == pytest.approx(5e-3)
    assert model.seconds("all_reduce", 2 * M, "ring") == pytest.approx(7e-3)  # between
    assert model.seconds("all_reduce", large, "ring") == pytest.approx(9e-3 + 12e-3)
    assert model.seconds("all_reduce", large, "hierarchical") == pytest.approx(11e-3 + 6e-3)
    assert model.choice("all_reduce", small)[0] == "ring"       # 5 ms against 9 ms
    assert model.choice("all_reduce", large)[0] == "hierarchical"
    assert model.seconds("reduce_scatter", 2 * M, "ring") == pytest.approx(6e-3, rel=1e-3)
    assert model.seconds("reduce_scatter", large, "hierarchical") == model._two_level(
        "reduce_scatter", large)                                 # only its flat one timed
    formula = model.seconds("all_gather", large, "ring")        # no sample: the formula
    assert formula == pytest.approx(3 * 1e-4 + 3 / 4 * large * 8e-9)
