"""``reshard_after_forward=N`` (FSDP2's integer) on 4 process ranks, in float64 against one
process on the whole batch: after the forward's all-gather each rank keeps 1/N of every
parameter, and the backward gathers those parts among N consecutive ranks instead of
gathering every rank's shard. Checked on two model families (an MLP whose rows pad, and a
Hugging Face LLaMA from a tiny config) with AdamW, clipping and accumulation, by the
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

from ..zoo import entry
from .test_zero import make

WORLD = 4
ROWS = 8  # the batch: 2 rows per rank


def _batch(i: int, rank: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + i)
    x = torch.randn(ROWS, 8, generator=g, dtype=torch.float64)
    y = torch.randn(ROWS, 4, generator=g, dtype=torch.float64)
    if rank is None:
        return x, y
    per = ROWS // WORLD
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


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


def job(rank: int) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=90))
    out: dict = {}
    mesh = spmd.Mesh(WORLD, ("fsdp",))
    for family, n in CASES:
        build = FAMILIES[family][0]
        model = spmd.parallelize(build(), strategy="fsdp", reshard_after_forward=n, mesh=mesh)
        out[(family, n)] = _train(family, model, rank)
        out[(family, n, "gathers")] = _gathers(model, family, rank)
        plan = spmd.inspect(model)
        out[(family, n, "plan")] = [(c.phase, c.kind, c.group_ranks, c.provenance.reason)
                                    for c in plan.collectives if c.kind == "all_gather"]
        out[(family, n, "gathered")] = {str(spmd.placement_of(p).gathered)
                                        for p in model.parameters()}
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def runs():
    return dist.spawn(job, nprocs=WORLD, start_method="forkserver", timeout=240)


@pytest.mark.parametrize("family,n", CASES, ids=[f"{f}-{n}" for f, n in CASES])
def test_trains_like_one_process(runs, family, n):
    want = _train(family, FAMILIES[family][0](), None)
    for rank, out in enumerate(runs):
        for name, value in want.items():
            assert torch.allclose(out[(family, n)][name], value, rtol=1e-12, atol=1e-12), \
                (rank, name)


@pytest.mark.parametrize("family", ["mlp", "llama"])
def test_the_backward_gathers_among_n_ranks(runs, family):
    for out in runs:
        counts = out[(family, 2, "gathers")]
        assert counts["forward"] == [WORLD], counts  # the whole dimension
        assert counts["backward"] == [2], counts  # the parts, among 2 ranks
    for rank, out in enumerate(runs):
        backward = [c for c in out[(family, 2, "plan")] if c[0] == "backward"]
        assert backward, out[(family, 2, "plan")]
        for _, _, ranks, reason in backward:
            assert ranks == ((0, 1) if rank < 2 else (2, 3)), ranks  # consecutive ranks
            assert "gathered among 2 rank(s)" in reason, reason
        assert out[(family, 2, "gathered")] == {
            "per forward, again in backward within a smaller group"}


def test_one_keeps_the_whole_and_gathers_nothing_in_backward(runs):
    for out in runs:
        assert out[("mlp", 1, "gathers")]["forward"] == [WORLD]
        assert out[("mlp", 1, "gathers")]["backward_count"] == 0  # nothing sent
