"""``strategy="auto"`` on real ranks over Gloo: under a memory budget that rules out ddp,
the layout the compiler chooses trains three model families (an MLP, our transformer, a
LLaMA-style model) exactly as one process does on the whole batch, in float64, with an
optimizer made before the first call and a batch whose size changes."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F

import spmd
import spmd.runtime as dist
from tests.llama import Llama
from tests.models import MLP, Transformer

from ..jobs import Jobs

FAMILIES = ("mlp", "transformer", "llama")
ROWS = (4, 2)  # rows per rank in each step: the second step's batch is smaller


def build(family: str) -> torch.nn.Module:
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        if family == "mlp":
            return MLP(width=32)
        if family == "transformer":
            return Transformer(layers=2, dim=16, vocab=32)
        return Llama(vocab=32, dim=16, layers=2, heads=4, kv_heads=2, hidden=32, length=8)
    finally:
        torch.set_default_dtype(default)


def batch(family: str, rows: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    if family == "mlp":
        return (torch.randn(rows, 8, generator=g, dtype=torch.float64),
                torch.randn(rows, 4, generator=g, dtype=torch.float64))
    seq = torch.randint(0, 32, (rows, 7), generator=g)
    return seq[:, :-1], seq[:, 1:]


def loss_of(family: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if family == "mlp":
        return F.mse_loss(out, y)
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def ddp_peak(family: str, ranks: int) -> int:
    """The predicted peak of plain ddp for one rank's first batch (what the budget rules
    out)."""
    x, _ = batch(family, ROWS[0], 0)
    plan = spmd.inspect(build(family), x, mesh=spmd.Mesh.simulated(ranks), strategy="ddp")
    return plan.memory().peak


def auto_job(rank: int, families: list[str], ranks: int) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=90))
    out = {}
    try:
        for family in families:
            budget = ddp_peak(family, ranks) - 1
            reference = build(family)
            ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
            model = spmd.parallelize(build(family), strategy="auto", memory_budget=budget)
            opt = torch.optim.AdamW(model.parameters(), lr=0.01)  # before the first call
            for step, rows in enumerate(ROWS):
                x, y = batch(family, rows * ranks, step)
                loss_of(family, reference(x), y).backward()
                ref_opt.step()
                ref_opt.zero_grad()
                mine = slice(rank * rows, (rank + 1) * rows)
                loss_of(family, model(x[mine]), y[mine]).backward()
                opt.step()
                opt.zero_grad()
            whole = model.state_dict()
            diff = max((whole[n] - p).abs().max().item()
                       for n, p in reference.state_dict().items())
            plan = spmd.inspect(model)
            out[family] = {"diff": diff, "strategy": plan.strategy, "summary": str(plan.auto),
                           "budget": budget, "peak": plan.memory().peak}
    finally:
        dist.destroy_process_group()
    return out


# a job per family (the three as one job, 88 s quiet, went past its 115 s timeout on a
# loaded machine, failing all three). A family, which cannot be split, took 39-60 s on 2
# cores at a load of 4-5 (2026-11-29), so about 30 s quiet: its spawn gets 180 s, its
# test 200 s to hold it
JOBS = Jobs(auto_job, [[family] for family in FAMILIES], nprocs=2, args=(2,), timeout=180)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("family", FAMILIES)
def test_auto_under_a_budget_that_rules_out_ddp_is_one_process(family):
    runs = JOBS.results(family)
    for rank, run in enumerate(runs):
        assert run["diff"] < 1e-12, (rank, family, run["diff"])
        # plain ddp does not fit: the choice shards something, or recomputes blocks
        assert run["strategy"] != "ddp" or "recomputed" in run["summary"], run["summary"]
        assert "<- chosen" in run["summary"]
    # every rank runs the layout the first rank chose
    assert len({run["summary"] for run in runs}) == 1
