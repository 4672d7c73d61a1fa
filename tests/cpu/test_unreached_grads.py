"""A parameter the loss never reaches keeps ``.grad`` None, as in eager training, when a
compiled graph returns an output the caller ignores (BigBird's pooler: the model returns
its pooled output beside the logits, the loss reads the logits). AOTAutograd gives such an
output a zero gradient, so its parameters would get zero gradients, and AdamW would decay
weights that one process leaves alone: found by issue 43's sweep (``big_bird`` under ddp
differed by 2e-5)."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.nn.functional as F

import spmd
from spmd import runtime as dist

STEPS = 3


class Pooled(torch.nn.Module):
    """Logits and a pooled first token (through ``pooler``), like a BERT-style model."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 4)
        self.pooler = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.body(x))
        return self.head(h), torch.tanh(self.pooler(h[:, 0]))


class LogitsOnly(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Pooled()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        torch._dynamo.graph_break()  # both outputs leave the first graph: out is live
        return out[0]


def _model() -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LogitsOnly().double()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return (torch.randn(4, 3, 8, generator=g, dtype=torch.float64),
            torch.randint(0, 4, (4, 3), generator=g))


def _train(model, rows: slice) -> tuple[dict, list[bool]]:
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    unset = []
    for step in range(STEPS):
        x, y = _batch(step)
        F.cross_entropy(model(x[rows]).reshape(-1, 4), y[rows].reshape(-1)).backward()
        unset.append(all(p.grad is None for p in model.inner.pooler.parameters()))
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, unset


def _job(rank: int) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        found = {}
        for strategy, dim in (("ddp", "dp"), ("fsdp", "fsdp")):
            model = spmd.parallelize(_model(), mesh=spmd.Mesh((2,), dim_names=(dim,)),
                                     strategy=strategy)
            found[strategy] = _train(model, slice(2 * rank, 2 * rank + 2))
        return found
    finally:
        dist.destroy_process_group()


def test_a_parameter_the_loss_never_reaches_keeps_no_gradient():
    want, unset = _train(_model(), slice(0, 4))
    assert unset == [True] * STEPS
    ranks = dist.spawn(_job, nprocs=2, start_method="forkserver", timeout=110)
    for rank, found in enumerate(ranks):
        for strategy, (params, unset) in found.items():
            assert unset == [True] * STEPS, f"{strategy} rank {rank}: the pooler got a gradient"
            for key, value in want.items():
                diff = (params[key] - value).abs().max().item()
                assert diff <= 1e-12, f"{strategy} rank {rank}: {key} differs by {diff:.3g}"
