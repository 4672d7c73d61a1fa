"""``reshard_after_forward=N`` (FSDP2's integer) on 4 process ranks, in float64 against one
process on the whole batch: after the forward's all-gather each rank keeps 1/N of every
parameter, and the backward gathers those parts among N consecutive ranks instead of
gathering every rank's shard. Checked on two model families (an MLP whose rows pad, and a
Hugging Face LLaMA from a tiny config) with AdamW, clipping and accumulation, on changing
batch sizes and in a whole training-step function, by the
groups each all-gather really ran on, and by the plan; N = 1 (the whole kept: no
backward gather) too. (N = 4, the whole dimension, is ``True``: the spec keeps no part;
``tests/graph/test_strategy_kinds.py`` plans it.)"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd
from spmd import runtime as dist
from spmd.runtime import collectives

from ..jobs import Jobs
from ..zoo import entry
from .test_training_loops import plain_step
from .test_zero import make

WORLD = 4
ROWS = 8  # the batch: 2 rows per rank


def _batch(i: int, rank: int | None, rows: int = ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + i)
    x = torch.randn(rows, 8, generator=g, dtype=torch.float64)
    y = torch.randn(rows, 4, generator=g, dtype=torch.float64)
    if rank is None:
        return x, y
    per = rows // WORLD
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def _changing(model: nn.Module, rank: int | None) -> dict:
    """SGD steps on batches of 8, 4 and 12 rows in turn (the graph traced again for each
    shape), the optimizer made before the first."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for i, rows in enumerate((8, 4, 12, 8)):
        x, y = _batch(50 + i, rank, rows)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _whole_steps(model: nn.Module, step, rank: int | None) -> dict:
    """Three AdamW steps of a whole training-step function."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    for i in range(3):
        step(model, *_batch(70 + i, rank), opt)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _tokens(i: int, rank: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = entry("llama").make_batch(i, ROWS)
    if rank is None:
        return x, y
    per = ROWS // WORLD
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


CASES = [("mlp", 2), ("llama", 2), ("mlp", 1)]
FAMILIES = {
    "mlp": (make, _batch, F.mse_loss),
    "llama": (lambda: entry("llama").model(), _tokens, entry("llama").loss_fn),
}


def _train(family: str, model: nn.Module, rank: int | None, steps: int = 3,
           accumulate: int = 2) -> dict:
    """AdamW with weight decay, clipping the torch way, ``accumulate`` backward passes per
    step (each on its own batch)."""
    _, batch, loss_fn = FAMILIES[family]
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    for i in range(steps):
        for k in range(accumulate):
            x, y = batch(10 * i + k, rank)
            (loss_fn(model(x), y) / accumulate).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class _Groups:
    """The size of the group of every all-gather this process starts (the real ones run
    underneath)."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self._real = collectives.all_gather_into_tensor

    def __enter__(self) -> "_Groups":
        def counted(out, src, group=None, async_op=False):
            self.sizes.append(group.size())
            return self._real(out, src, group=group, async_op=async_op)

        collectives.all_gather_into_tensor = counted
        return self

    def __exit__(self, *exc) -> None:
        collectives.all_gather_into_tensor = self._real


def _gathers(model: nn.Module, family: str, rank: int) -> dict:
    """The groups of the forward's and the backward's all-gathers in one training step
    (after the first, which compiles)."""
    _, batch, loss_fn = FAMILIES[family]
    x, y = batch(0, rank)
    with _Groups() as forward:
        loss = loss_fn(model(x), y)
    with _Groups() as backward:
        loss.backward()
    model.zero_grad()
    return {"forward": sorted(set(forward.sizes)), "backward": sorted(set(backward.sizes)),
            "backward_count": len(backward.sizes)}


def _case(case: tuple, rank: int, mesh: spmd.Mesh) -> dict:
    """What the tests read of one case: a (family, N) run, or "changing" / "whole step"."""
    if case == ("changing",):
        model = spmd.parallelize(make(), strategy="fsdp", reshard_after_forward=2, mesh=mesh)
        return {"state": _changing(model, rank)}
    if case == ("whole step",):
        step = spmd.parallelize(plain_step, strategy="fsdp", reshard_after_forward=2,
                                mesh=mesh)
        return {"state": _whole_steps(make(), step, rank)}
    family, n = case
    model = spmd.parallelize(FAMILIES[family][0](), strategy="fsdp",
                             reshard_after_forward=n, mesh=mesh)
    out = {"state": _train(family, model, rank), "gathers": _gathers(model, family, rank)}
    plan = spmd.inspect(model)
    out["plan"] = [(c.phase, c.kind, c.group_ranks, c.provenance.reason)
                   for c in plan.collectives if c.kind == "all_gather"]
    out["gathered"] = {str(spmd.placement_of(p).gathered) for p in model.parameters()}
    return out


def job(rank: int, cases: list) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=90))
    try:
        mesh = spmd.Mesh(WORLD, ("fsdp",))
        return {case: _case(case, rank, mesh) for case in cases}
    finally:
        dist.destroy_process_group()


# two jobs, each within tests.jobs.BUDGET quiet seconds on 2 cores (all in one: 18 s)
JOBS = Jobs(job, [[("mlp", 2), ("llama", 2)], [("mlp", 1), ("changing",), ("whole step",)]],
            nprocs=WORLD)


def runs(case: tuple) -> list[dict]:
    """Each rank's result of ``case``."""
    return JOBS.results(case)


@pytest.mark.parametrize("family,n", CASES, ids=[f"{f}-{n}" for f, n in CASES])
def test_trains_like_one_process(family, n):
    want = _train(family, FAMILIES[family][0](), None)
    for rank, out in enumerate(runs((family, n))):
        for name, value in want.items():
            assert torch.allclose(out["state"][name], value, rtol=1e-12, atol=1e-12), \
                (rank, name)


@pytest.mark.parametrize("family", ["mlp", "llama"])
def test_the_backward_gathers_among_n_ranks(family):
    for rank, out in enumerate(runs((family, 2))):
        counts = out["gathers"]
        assert counts["forward"] == [WORLD], counts  # the whole dimension
        assert counts["backward"] == [2], counts  # the parts, among 2 ranks
        backward = [c for c in out["plan"] if c[0] == "backward"]
        assert backward, out["plan"]
        for _, _, ranks, reason in backward:
            assert ranks == ((0, 1) if rank < 2 else (2, 3)), ranks  # consecutive ranks
            assert "gathered among 2 rank(s)" in reason, reason
        assert out["gathered"] == {"per forward, again in backward within a smaller group"}


def test_one_keeps_the_whole_and_gathers_nothing_in_backward():
    for out in runs(("mlp", 1)):
        assert out["gathers"]["forward"] == [WORLD]
        assert out["gathers"]["backward_count"] == 0  # nothing sent


@pytest.mark.parametrize("case", ["changing", "whole step"])
def test_changing_batch_sizes_and_a_whole_step_train_like_one_process(case):
    want = (_changing(make(), None) if case == "changing"
            else _whole_steps(make(), plain_step, None))
    for rank, out in enumerate(runs((case,))):
        for name, value in want.items():
            assert torch.allclose(out["state"][name], value, rtol=1e-12, atol=1e-12), \
                (rank, case, name)
