"""Data-parallel replicas hold the same bits after every step, whatever path a gradient
took: accumulated under ``no_sync()``, averaged by the eager safety net (a graph break,
eager code reading a parameter), or both. Averages that are equal only up to rounding
make replicas drift apart (a ulp a step, amplified by Adam where a gradient is near
zero), and a restart that reads rank 0's parameters then differs from the run that
went on: found by tests/cpu/test_checkpoint_manager.py's restart of the loops users
write (BatchNorm, tied weights, accumulation), which differed by 8e-11 under ddp."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import spmd
from spmd import runtime as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests import checkpoint_job as job  # noqa: E402


class Broken(torch.nn.Module):
    """The rich model behind a graph break, and eager code reading a weight: parts of
    its gradients come from a graph and parts from eager code."""

    def __init__(self) -> None:
        super().__init__()
        self.rich = job.model("rich")
        self.scale = torch.nn.Parameter(torch.ones(job.WIDTH, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.rich(x)
        torch._dynamo.graph_break()
        return h * self.scale + self.rich.out.weight.sum() * 1e-3  # eager: out.weight again


def _run(rank: int, kind: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = spmd.parallelize(job.model("rich") if kind == "rich" else Broken().double(),
                           strategy="ddp")
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    for step in range(4):
        x, y = job.batch(step)
        x, y = x.chunk(2)[rank], y.chunk(2)[rank]
        with net.no_sync():  # two halves accumulated, the first without a sync
            ((net(x[:2]) - y[:2]).square().mean() / 2).backward()
        ((net(x[2:]) - y[2:]).square().mean() / 2).backward()
        opt.step()
        opt.zero_grad()
        for name, p in net.named_parameters():
            every = [torch.empty_like(p) for _ in range(2)]
            dist.all_gather(every, p.detach().contiguous())
            assert torch.equal(every[0], every[1]), f"step {step}: {name} differs across ranks"
    dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["rich", "broken"])
def test_replicas_hold_the_same_bits_after_every_step(kind):
    dist.spawn(_run, args=(kind,), nprocs=2)
