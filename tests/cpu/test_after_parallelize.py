"""Changes after ``parallelize``: a model converted (``model.double()``,
``model.to(dtype)``) before its first step or between steps trains as one process
converted at the same point does, under ddp and every strategy that stores parameters as
shards, as a module and through a whole step; so does a plain attribute the forward
reads, changed by the loop; an optimizer hook registered after a whole step's first call
runs. A submodule's ``state_dict()`` and ``load_state_dict`` of a model stored in parts
(fsdp, tp) hold whole tensors as the plain submodule's do (they returned this rank's
shard, silently)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd
from spmd import runtime as dist

from ..jobs import Jobs, pack

STRATEGIES = ["ddp", "fsdp", "hsdp", "zero1", "zero2"]
STEPS = 4
# the forward's plain attribute, changed by the loop (at a step where nothing else changes)
GAINS = (1.0, 1.0, 1.0, 0.5)


class Scaled(nn.Module):
    """Parameters on the root itself (its class is swapped twice: placed, then parallel)
    and in children; 5 output rows, which 2 ranks' shards pad."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 10), nn.Linear(10, 5)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 5))
        self.gain = 1.0  # a plain attribute the loop changes (read by the forward)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x))) * self.scale * self.gain


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 5, generator=g)


def _train(model: nn.Module, rank: int, world: int, convert_at: int, how: str) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.0)
    for step in range(STEPS):
        model.gain = GAINS[step]
        if step == convert_at:
            model.double() if how == "double" else model.to(torch.float64)
        dtype = next(model.parameters()).dtype
        x, y = (t.to(dtype) for t in _data(step))
        rows = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
        F.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()
        opt.zero_grad()


def _mesh(strategy: str) -> spmd.Mesh | None:
    return spmd.Mesh((1, 2), dim_names=("dp", "fsdp")) if strategy == "hsdp" else None


def _whole_step(model: nn.Module, rank: int, world: int, strategy: str) -> list[int]:
    """Calls of a parallelized step: an optimizer hook registered after the first, the
    model converted before the third, its plain attribute changed before the fourth; the
    steps the hook saw."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[int] = []

    @spmd.parallelize(strategy=strategy, mesh=_mesh(strategy))
    def train_step(model, x, y, opt):
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    for step in range(STEPS):
        model.gain = GAINS[step]
        if step == 1:
            opt.register_step_post_hook(lambda *_: seen.append(step))
        if step == 2:
            model.double()
        dtype = next(model.parameters()).dtype
        x, y = (t.to(dtype) for t in _data(step))
        rows = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
        train_step(model, x[rows], y[rows], opt)
    return seen


def converted(rank: int, cases: list[str]) -> dict:
    """Each case: a strategy's trainings converted to float64 (before the first step,
    between steps, and a whole step traced again), or "submodule": the state dicts of
    a placed submodule under fsdp and tp."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=90))
    out: dict = {}
    try:
        for strategy in cases:
            if strategy == "submodule":
                out[strategy] = {layout: _submodule_state(layout) for layout in ("fsdp", "tp")}
                continue
            out[strategy] = mine = {}
            for convert_at, how in ((0, "double"), (1, "to")):
                torch.manual_seed(0)
                model = spmd.parallelize(Scaled(), strategy=strategy, mesh=_mesh(strategy))
                _train(model, rank, 2, convert_at, how)
                grads_dtype = {p.dtype for p in model.parameters()}
                mine[convert_at] = (
                    {k: v.clone() for k, v in model.state_dict().items()}, grads_dtype)
            torch.manual_seed(0)
            model = Scaled()
            seen = _whole_step(model, rank, 2, strategy)
            mine["step"] = ({k: v.clone() for k, v in model.state_dict().items()}, seen)
    finally:
        dist.destroy_process_group()
    return out


TP = {"tp": {"fc1.weight": spmd.Shard(0), "fc1.bias": spmd.Shard(0),
              "fc2.weight": spmd.Shard(1)}}


def _submodule_state(layout: str) -> dict:
    """``fc1.state_dict()`` as placed; then plain ``fc2`` weights (doubled) loaded into the
    placed ``fc2`` alone, and the whole model's state dict after."""
    torch.manual_seed(0)
    if layout == "tp":
        model = spmd.parallelize(Scaled(), mesh=spmd.Mesh((2,), dim_names=("tp",)),
                                 placements=TP)
    else:
        model = spmd.parallelize(Scaled(), strategy=layout)
    sub = {k: v.clone() for k, v in model.fc1.state_dict().items()}
    plain = _plain_with_doubled_fc2()
    model.fc2.load_state_dict(plain.fc2.state_dict())
    return {"fc1": sub, "after load": {k: v.clone() for k, v in model.state_dict().items()}}


def _plain_with_doubled_fc2() -> nn.Module:
    torch.manual_seed(0)
    plain = Scaled()
    with torch.no_grad():
        plain.fc2.weight.mul_(2.0)
        plain.fc2.bias.add_(1.0)
    return plain


# the six cases took 43 s as one job at a load of 3.5 on 2 cores (2026-11-29), 2.6x under
# its 110 s timeout; packed under tests.jobs' budget by an even share each: two jobs, of
# 20 s (the forkserver's start included) and 13 s at a load of 1-2
JOBS = Jobs(converted, pack({case: 25 / 6 for case in [*STRATEGIES, "submodule"]}), nprocs=2)


def _reference(convert_at: int) -> dict:
    torch.manual_seed(0)
    model = Scaled()
    _train(model, 0, 1, convert_at, "double")
    return model.state_dict()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_converted_before_the_first_step_equals_one_process(strategy):
    want = _reference(0)
    for run in JOBS.results(strategy):
        got, dtypes = run[0]
        assert dtypes == {torch.float64}
        for key, value in want.items():
            assert got[key].dtype == torch.float64, key
            torch.testing.assert_close(got[key], value, rtol=0, atol=1e-12, msg=key)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_converted_between_steps_equals_one_process(strategy):
    want = _reference(1)  # one float32 step (its all-reduce rounds), then float64
    for run in JOBS.results(strategy):
        got, dtypes = run[1]
        assert dtypes == {torch.float64}
        for key, value in want.items():
            assert got[key].dtype == torch.float64, key
            torch.testing.assert_close(got[key], value, rtol=0, atol=1e-6, msg=key)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_whole_step_traces_again_after_a_conversion_and_runs_later_hooks(strategy):
    want = _reference(2)
    for run in JOBS.results(strategy):
        got, seen = run["step"]
        assert seen == [1, 2, 3]  # registered before the second call, it ran at every step
        for key, value in want.items():
            assert got[key].dtype == torch.float64, key
            torch.testing.assert_close(got[key], value, rtol=0, atol=1e-6, msg=key)


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_a_submodules_state_dict_holds_whole_tensors(layout):
    torch.manual_seed(0)
    want = Scaled().fc1.state_dict()
    for run in JOBS.results("submodule"):
        got = run[layout]["fc1"]
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert got[key].shape == value.shape, key  # not this rank's shard
            torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_a_submodule_loads_the_plain_submodules_state_dict(layout):
    want = _plain_with_doubled_fc2().state_dict()
    for run in JOBS.results("submodule"):
        got = run[layout]["after load"]
        assert got.keys() == want.keys()
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)
