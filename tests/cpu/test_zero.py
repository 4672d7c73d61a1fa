"""``strategy="zero1"`` and ``"zero2"`` (DeepSpeed's ZeRO stages 1 and 2) on 2 process
ranks, in float64 against one process on the whole batch: the same parameters after
AdamW steps with clipping and accumulation, optimizer state kept as 1/N shards,
parameters gathered once per optimizer step (not at every forward), a state dict loaded
or an in-place init after parallelizing seen by the next forward, and each record saying
so (``placement_of``, the plan)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd
from spmd import runtime as dist
from spmd.runtime import collectives

from .test_training_loops import plain_step as _whole_step

WORLD = 2
STRATEGIES = ("zero1", "zero2")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # 5 rows: dim 0 does not divide over 2 ranks (padded shards)
        self.fc1, self.fc2, self.out = nn.Linear(8, 16), nn.Linear(16, 5), nn.Linear(5, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.relu(self.fc2(F.relu(self.fc1(x)))))


def make() -> Net:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Net().double()


def batch(i: int, rank: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    x, y = torch.randn(8, 8, generator=g, dtype=torch.float64), torch.randn(
        8, 4, generator=g, dtype=torch.float64)
    if rank is None:
        return x, y
    return x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]


def state(model: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(model: nn.Module, rank: int | None, steps: int = 3, accumulate: int = 2) -> dict:
    """AdamW with weight decay, gradients clipped the torch way, ``accumulate`` backward
    passes per step (each on its own batch)."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    for i in range(steps):
        for k in range(accumulate):
            x, y = batch(10 * i + k, rank)
            (F.mse_loss(model(x), y) / accumulate).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    return state(model)


def assert_trained_like_one_process(runs: list[dict], key: str) -> None:
    """Every rank's ``runs[rank][key]`` state dict is one process's after :func:`train`."""
    want = train(make(), None)
    for rank, out in enumerate(runs):
        for name, value in want.items():
            assert torch.allclose(out[key][name], value, rtol=1e-12, atol=1e-12), \
                (rank, name)


class _Counter:
    """Counts the all-gathers this process starts (the real ones run underneath)."""

    def __init__(self) -> None:
        self.gathers = 0
        self._real = collectives.all_gather_into_tensor

    def __enter__(self) -> "_Counter":
        def counted(*args, **kwargs):
            self.gathers += 1
            return self._real(*args, **kwargs)

        collectives.all_gather_into_tensor = counted
        return self

    def __exit__(self, *exc) -> None:
        collectives.all_gather_into_tensor = self._real


def _gathers_per_step(strategy: str) -> dict:
    """All-gathers started by 3 forwards without a step between, by an evaluation forward
    (another graph, the same buckets: the kept copy is shared), then by the forward after
    a step."""
    model = spmd.parallelize(make(), strategy=strategy)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch(0, dist.get_rank())
    F.mse_loss(model(x), y).backward()  # the first forward compiles and gathers
    opt.step()
    opt.zero_grad()
    with _Counter() as first:
        F.mse_loss(model(x), y).backward()  # the shards changed: gathered again
    with _Counter() as again:
        for _ in range(3):  # accumulation: nothing changed, nothing gathered
            F.mse_loss(model(x), y).backward()
    model.eval()
    with _Counter() as evaluated, torch.no_grad():
        model(x)
    model.train()
    opt.step()
    with _Counter() as after:
        model(x)
    return {"first": first.gathers, "again": again.gathers, "eval": evaluated.gathers,
            "after": after.gathers}


def _loaded(strategy: str) -> dict:
    """A state dict loaded after training, and an in-place init, reach the next forward."""
    model = spmd.parallelize(make(), strategy=strategy)
    train(model, dist.get_rank(), steps=1, accumulate=1)
    x, _ = batch(7, None)
    model.load_state_dict(make().state_dict())
    loaded = model(x).detach().clone()
    with torch.no_grad():
        nn.init.constant_(model.fc2.weight, 0.25)
    initialised = model(x).detach().clone()
    return {"loaded": loaded, "initialised": initialised}


def job(rank: int) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    out: dict = {}
    for strategy in STRATEGIES:
        model = spmd.parallelize(make(), strategy=strategy)
        out[strategy] = train(model, rank)
        placed = spmd.placement_of(model.fc2.weight)
        out[(strategy, "placement")] = (placed.shape, placed.local_shape, placed.padding,
                                        placed.gathered, placed.reduced,
                                        repr(placed.stored), repr(placed.computed))
        opt = torch.optim.AdamW(model.parameters())
        x, y = batch(0, rank)
        F.mse_loss(model(x), y).backward()
        opt.step()
        out[(strategy, "state")] = {n: tuple(opt.state[p]["exp_avg"].shape)
                                    for n, p in model.named_parameters()}
        plan = spmd.inspect(model)
        out[(strategy, "plan")] = [(c.kind, c.provenance.reason) for c in plan.collectives]
        out[(strategy, "gathers")] = _gathers_per_step(strategy)
        out[(strategy, "loaded")] = _loaded(strategy)
    step = spmd.parallelize(_whole_step, strategy="zero2")
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    for i in range(3):
        step(model, *batch(i, rank), opt)
    out["step"] = state(model)
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def runs():
    return dist.spawn(job, nprocs=WORLD, start_method="forkserver", timeout=110)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_trains_like_one_process(runs, strategy):
    assert_trained_like_one_process(runs, strategy)


def test_whole_step_trains_like_one_process(runs):
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    for i in range(3):
        _whole_step(model, *batch(i, None), opt)
    for out in runs:
        for key, value in state(model).items():
            assert torch.allclose(out["step"][key], value, rtol=1e-12, atol=1e-12), key


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_optimizer_state_is_sharded(runs, strategy):
    for out in runs:
        shapes = out[(strategy, "state")]
        assert shapes["fc1.weight"] == (8, 8)  # 16 rows over 2 ranks
        assert shapes["fc2.weight"] == (3, 16)  # 5 rows: 3 per rank, padded


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_parameters_are_gathered_once_per_step(runs, strategy):
    for out in runs:
        counts = out[(strategy, "gathers")]
        assert counts["first"] >= 1, counts
        assert counts["again"] == 0 and counts["eval"] == 0, counts
        assert counts["after"] == counts["first"], counts


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_loaded_and_initialised_values_reach_the_forward(runs, strategy):
    x, _ = batch(7, None)
    fresh = make()
    want_loaded = fresh(x).detach()
    with torch.no_grad():
        nn.init.constant_(fresh.fc2.weight, 0.25)
    want_init = fresh(x).detach()
    for out in runs:
        got = out[(strategy, "loaded")]
        assert torch.allclose(got["loaded"], want_loaded, rtol=1e-12, atol=1e-12)
        assert torch.allclose(got["initialised"], want_init, rtol=1e-12, atol=1e-12)


def test_records_say_how_each_parameter_lives(runs):
    for out in runs:
        shape, local, padding, gathered, reduced, stored, computed = out[("zero1",
                                                                          "placement")]
        assert shape == (5, 16) and local == (3, 16)
        assert gathered == "per step" and reduced == "all-reduce, own rows kept"
        assert "Shard(0)" in stored and "Shard(0)" not in computed and "Replicate()" in computed
        assert out[("zero2", "placement")][4] == "reduce-scatter"
        assert padding == (0 if out is runs[0] else 1)  # rank 1 holds rows 3-4 and a pad


def test_plan_explains_the_zero1_all_reduce(runs):
    for out in runs:
        reasons = [r for kind, r in out[("zero1", "plan")] if kind == "reduce_scatter"]
        assert reasons and all("all-reduce of the whole gradient" in r for r in reasons)
        gathers = [r for kind, r in out[("zero2", "plan")] if kind == "all_gather"]
        assert gathers and all("once per optimizer step" in r for r in gathers), gathers


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_options_that_do_not_apply_are_refused(strategy):
    with pytest.raises(ValueError, match="keeps them whole between steps"):
        spmd.parallelize(make(), strategy=strategy, reshard_after_forward=False,
                         mesh=spmd.Mesh.simulated(2))
    with pytest.raises(ValueError, match="comm_hook"):
        spmd.parallelize(make(), strategy=strategy, mesh=spmd.Mesh.simulated(2),
                         comm_hook=lambda state, bucket: None)
