"""Every strategy on 2 hosts x 2 ranks, trained and compared with one process (float64):
the layouts tests/cpu/test_across_hosts.py runs, on loopback hosts (``SPMD_HOST``) and on
network namespaces under the launcher (``python tests/across_hosts.py OUT LAYOUT...``
inside each host, every rank writing its results to ``OUT/rank<r>.pt``).

Global rank ``r`` runs on host ``r // 2``; each layout puts its dimensions where a user
would: data parallelism across hosts, tensor and context parallelism within a host, the
pipeline across hosts, hsdp sharding within and replicating across.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Any

import torch

import spmd
from spmd import runtime as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.cpu.test_checkpoint_matrix import (STRIDED, batch, loss_fn, make, optimizer,  # noqa: E402
                                              train, whole)

LAYOUTS = ("ddp", "fsdp", "zero1", "zero2", "hsdp", "tp", "pp", "cp", "auto")
STEPS = 3


def build(layout: str) -> tuple[Any, int, int]:
    """(the model under ``layout`` on the 4 ranks of 2 hosts, this rank's data rank, data
    ranks)."""
    rank = dist.get_rank()
    if layout in ("ddp", "fsdp", "zero1", "zero2"):
        return spmd.parallelize(make(), strategy=layout), rank, 4
    if layout == "hsdp":  # shard within a host, replicate across
        mesh = spmd.Mesh((2, 2), dim_names=("dp", "fsdp"))
        return spmd.parallelize(make(), strategy="hsdp", mesh=mesh), rank, 4
    if layout == "tp":  # tensor parallel within a host, data parallel across
        mesh = spmd.Mesh((2, 2), dim_names=("dp", "tp"))
        return spmd.parallelize(make(), mesh=mesh, placements=STRIDED), rank // 2, 2
    if layout == "pp":  # the stages on different hosts, data parallel within one
        mesh = spmd.Mesh((2, 2), dim_names=("pp", "dp"))
        model = spmd.parallelize(make(), mesh=mesh, strategy="ddp",
                                 pipeline=spmd.pp.schedule("1f1b", 2, split_points=["proj"]))
        return model, mesh.coordinate()[1], 2
    if layout == "cp":  # the sequence split within a host, data parallel across
        mesh = spmd.Mesh((2, 2), dim_names=("dp", "cp"))
        return spmd.parallelize(make(), mesh=mesh, placements=spmd.cp.ring()), rank // 2, 2
    if layout == "auto":
        return spmd.parallelize(make(), strategy="auto"), rank, 4
    raise ValueError(f"unknown layout {layout!r}")


def run(rank: int, layouts: list[str], hosts: list[str] | None = None) -> dict:
    """Train each layout ``STEPS`` AdamW steps; its whole parameters and what the plan
    chose (per bucket: kind and algorithm; its summary). ``hosts``: name this rank's host
    (loopback hosts); None: the launcher or the namespaces say."""
    if hosts is not None:
        os.environ["SPMD_HOST"] = hosts[rank]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=90))
    out: dict = {"topology": dist.get_topology().hosts}
    try:
        for layout in layouts:
            try:
                model, data_rank, data_size = build(layout)
                opt = optimizer(model)
                train(model, opt, range(STEPS), data_rank, data_size)
                plan = spmd.inspect(model)
                out[layout] = {"params": whole(model), "summary": str(plan),
                               "buckets": [(b.kind, b.algorithm) for b in
                                           getattr(plan, "buckets", [])]}
            except Exception as e:  # one layout's failure is that layout's
                import traceback

                out[layout] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
    finally:
        dist.destroy_process_group()
    return out


def reference() -> dict:
    """One process on the whole batch, the same steps."""
    model = make()
    opt = optimizer(model)
    train(model, opt, range(STEPS))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def check(results: list[dict], layouts: list[str], tol: float = 1e-12) -> None:
    """Every rank's run of every layout ended within ``tol`` of :func:`reference`, on the
    topology of 2 hosts x 2 ranks."""
    expect = reference()
    for rank, out in enumerate(results):
        assert out["topology"] == (0, 0, 1, 1)
        for layout in layouts:
            got = out[layout]
            assert "error" not in got, f"{layout} on rank {rank}: {got.get('error')}"
            for name, value in expect.items():
                diff = (got["params"][name] - value).abs().max().item()
                assert diff <= tol, f"{layout}: {name} is {diff:.3g} off on rank {rank}"


if __name__ == "__main__":
    target, chosen = sys.argv[1], sys.argv[2:]
    result = run(int(os.environ["RANK"]), chosen)
    torch.save(result, os.path.join(target, f"rank{os.environ['RANK']}.pt"))
