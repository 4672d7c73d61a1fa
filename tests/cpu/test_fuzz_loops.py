"""A differential fuzzer of training loops: hypothesis draws loops from the moves users make
(change the batch size, an uneven last batch, accumulation with ``no_sync`` around the
forward and/or the backward, freeze and unfreeze a layer, a scalar loss weight, an eval
pass, a loss term reading a parameter outside the compiled forward, two optimizers, a
learning-rate schedule, whole-step functions with accumulation over calls), runs each on
2 process ranks under ``ddp``, ``fsdp``, ``zero1`` or ``zero2``, and compares the parameters with one process
training on the whole batch. Module loops may use a model with a mixture of experts whose
experts are split by expert index over the ranks (``spmd.ep.experts()``; even batches,
the same tokens on every rank).

``SPMD_FUZZ=ci`` (the default) runs five fixed loops that make every move, then two
batches of three drawn loops, the same every run (derandomized), in under a minute;
``SPMD_FUZZ=full`` draws 25 random batches of 8 loops (``SPMD_FUZZ_EXAMPLES`` sets the
number of batches) and prints how many loops it ran.

The module path runs in float64, where the parallel arithmetic is exact: any difference is
a bug. Whole steps run in float32, so that SGD and AdamW run fused from the buckets (their
kernels take no float64), compared within float32 rounding.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import spmd
from spmd import runtime as dist

WORLD = 2
PROFILE = os.environ.get("SPMD_FUZZ", "ci")
if PROFILE not in ("ci", "full"):
    raise ValueError(f"SPMD_FUZZ must be 'ci' or 'full', got {PROFILE!r}")
EXAMPLES = int(os.environ.get("SPMD_FUZZ_EXAMPLES", "25")) if PROFILE == "full" else 2
LOOPS_PER_EXAMPLE = 8 if PROFILE == "full" else 3
TRIED: list[int] = []  # loops run in this session (the full profile reports it)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(8, 16), nn.Linear(16, 12), nn.Linear(12, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.relu(self.fc2(F.relu(self.fc1(x)))))


class MoENet(Net):
    """Net with a routed mixture of 4 experts (top-2) after fc1, a residual around it:
    the loops with ``experts`` split them by expert over the ranks (``spmd.ep``)."""

    def __init__(self) -> None:
        from ..moe import Experts

        super().__init__()
        self.router = nn.Linear(16, 4, bias=False)
        self.experts = Experts(experts=4, hidden=16, inter=8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc1(x))
        weights, index = self.router(h).softmax(-1).topk(2, dim=-1)
        h = h + self.experts(h, index, weights / weights.sum(-1, keepdim=True))
        return self.out(F.relu(self.fc2(h)))


@dataclass(frozen=True)
class Move:
    """One optimizer step of a loop."""

    batch: int  # rows of the whole batch (odd: the ranks' shares differ by one)
    micro: int  # micro-batches accumulated into this step
    no_sync: str  # around the micro-batches before the last: "none", "both", "forward", "backward"
    frozen: bool  # fc1 frozen for this step
    weight: float  # a scalar loss weight
    extra: bool  # a loss term on fc2.weight outside the compiled forward, different per rank
    evaluate: bool  # an eval forward after the step


@dataclass(frozen=True)
class Loop:
    path: str  # "module": parallelize(model); "step": parallelize(train_step)
    strategy: str
    optimizer: str  # "sgd", "momentum", "adamw"
    two_optimizers: bool  # fc1 stepped by an SGD of its own
    schedule: bool  # a StepLR after every step
    moves: tuple[Move, ...]
    experts: bool = False  # MoENet, its experts split by expert index (spmd.ep.experts())


def moves(path: str, experts: bool = False) -> st.SearchStrategy:
    # expert parallelism needs the same tokens on every rank: even batches only
    sizes = [2, 4, 6, 8, 12] if experts else [2, 4, 6, 8, 11, 12]
    return st.builds(
        Move, batch=st.sampled_from(sizes), micro=st.integers(1, 2),
        no_sync=st.sampled_from(["none", "both", "forward", "backward"] if path == "module"
                                else ["none"]),
        frozen=st.booleans(), weight=st.sampled_from([0.5, 1.0, 2.0]),
        extra=st.booleans() if path == "module" else st.just(False), evaluate=st.booleans())


@st.composite
def loops(draw: st.DrawFn) -> Loop:
    path = draw(st.sampled_from(["module", "step"]))
    experts = path == "module" and draw(st.booleans())
    return Loop(path=path, strategy=draw(st.sampled_from(["ddp", "fsdp", "zero1", "zero2"])),
                optimizer=draw(st.sampled_from(["sgd", "momentum", "adamw"])),
                two_optimizers=path == "module" and draw(st.booleans()),
                schedule=draw(st.booleans()),
                moves=tuple(draw(st.lists(moves(path, experts), min_size=2, max_size=4))),
                experts=experts)


# -- running a loop: on a rank (rank >= 0, its rows of each batch) or in one process
# -- (rank None, the whole batch)

def _make(dtype: torch.dtype, experts: bool = False) -> Net:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return (MoENet() if experts else Net()).to(dtype)


def _batch(n: int, i: int, rank: int | None, dtype: torch.dtype) -> tuple:
    g = torch.Generator().manual_seed(1000 + i)
    x = torch.randn(n, 8, generator=g).to(dtype)
    y = torch.randn(n, 4, generator=g).to(dtype)
    # the sum of squared errors over the whole batch's rows, per element: each rank's
    # share is scaled by the world size, as the gradients are averaged
    scale = 1.0 / (n * 4)
    if rank is not None:
        cut = [0, n // 2, n]
        x, y = x[cut[rank]:cut[rank + 1]], y[cut[rank]:cut[rank + 1]]
        scale *= WORLD
    return x, y, scale


def _optimizers(loop: Loop, model: nn.Module) -> list[torch.optim.Optimizer]:
    def make(params):
        if loop.optimizer == "adamw":
            return torch.optim.AdamW(params, lr=0.02)
        return torch.optim.SGD(params, lr=0.05, momentum=0.9 if loop.optimizer == "momentum"
                               else 0.0)

    if loop.two_optimizers:
        first = list(model.fc1.parameters())
        rest = [p for n, p in model.named_parameters() if not n.startswith("fc1.")]
        return [torch.optim.SGD(first, lr=0.05), make(rest)]
    return [make(model.parameters())]


def _extra(model: nn.Module, rank: int | None) -> torch.Tensor:
    weight = 1.5 if rank is None else 1.0 + rank  # the ranks' average is one process's
    return 0.01 * weight * (model.fc2.weight ** 2).sum()


def _run_module_loop(loop: Loop, rank: int | None) -> dict:
    model = _make(torch.float64, loop.experts)
    if rank is not None:
        model = spmd.parallelize(model, strategy=loop.strategy,
                                 placements=spmd.ep.experts() if loop.experts else None)
    opts = _optimizers(loop, model)
    schedules = [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.7) for o in opts] \
        if loop.schedule else []
    for i, move in enumerate(loop.moves):
        model.fc1.requires_grad_(not move.frozen)
        for o in opts:
            o.zero_grad()
        for k in range(move.micro):
            x, y, scale = _batch(move.batch, 10 * i + k, rank, torch.float64)
            last = k == move.micro - 1
            mode = "none" if last or rank is None else move.no_sync
            off = contextlib.nullcontext
            with model.no_sync() if mode in ("both", "forward") else off():
                loss = F.mse_loss(model(x), y, reduction="sum") * scale * move.weight
            if move.extra:
                loss = loss + _extra(model, rank)
            with model.no_sync() if mode in ("both", "backward") else off():
                (loss / move.micro).backward()
        for o in opts:
            o.step()
        for s in schedules:
            s.step()
        if move.evaluate:
            model.eval()
            with torch.no_grad():
                model(_batch(4, 99, rank, torch.float64)[0])
            model.train()
    model.fc1.requires_grad_(True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_step(model, x, y, opt, weight):
    opt.zero_grad()
    loss = F.mse_loss(model(x), y, reduction="sum") * weight
    loss.backward()
    opt.step()
    return loss


def accumulate_step(model, x, y, weight):
    loss = F.mse_loss(model(x), y, reduction="sum") * weight
    loss.backward()
    return loss


def last_accumulated_step(model, x, y, opt, weight):
    loss = F.mse_loss(model(x), y, reduction="sum") * weight
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


@torch.no_grad()
def eval_step(model, x):
    return model(x).sum()


def _run_step_loop(loop: Loop, rank: int | None) -> dict:
    model = _make(torch.float32)
    (opt,) = _optimizers(loop, model)
    schedule = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7) if loop.schedule else None

    def wrap(fn):
        return fn if rank is None else spmd.parallelize(fn, strategy=loop.strategy)

    train, accumulate, last, evaluate = map(wrap, (train_step, accumulate_step,
                                                   last_accumulated_step, eval_step))
    for i, move in enumerate(loop.moves):
        model.fc1.requires_grad_(not move.frozen)
        if move.micro == 1:
            x, y, scale = _batch(move.batch, 10 * i, rank, torch.float32)
            train(model, x, y, opt, scale * move.weight)
        else:  # accumulation over calls: backward-only steps, then one with the optimizer
            opt.zero_grad()
            for k in range(move.micro):
                x, y, scale = _batch(move.batch, 10 * i + k, rank, torch.float32)
                w = scale * move.weight / move.micro
                if k < move.micro - 1:
                    accumulate(model, x, y, w)
                else:
                    last(model, x, y, opt, w)
        if schedule is not None:
            schedule.step()
        if move.evaluate:
            evaluate(model, _batch(4, 99, rank, torch.float32)[0])
    model.fc1.requires_grad_(True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_loop(loop: Loop, rank: int | None) -> dict:
    return (_run_module_loop if loop.path == "module" else _run_step_loop)(loop, rank)


def job(rank: int, batch: list[Loop]) -> list:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))  # a hang names its rank
    out = []
    for loop in batch:
        try:
            out.append(run_loop(loop, rank))
        except Exception as e:  # reported with the loop that raised it
            out.append(f"{type(e).__name__}: {e}")
    dist.destroy_process_group()
    return out


def check(batch: list[Loop]) -> None:
    results = dist.spawn(job, args=(batch,), nprocs=WORLD, start_method="forkserver",
                         timeout=110)
    TRIED.append(len(batch))
    for i, loop in enumerate(batch):
        expected = run_loop(loop, None)
        exact = loop.path == "module"
        for rank, got in enumerate(r[i] for r in results):
            assert not isinstance(got, str), f"rank {rank} raised on {loop}: {got}"
            for key, value in expected.items():
                rtol, atol = (1e-10, 1e-12) if exact else (1e-4, 2e-5)
                assert torch.allclose(got[key], value, rtol=rtol, atol=atol), (
                    f"rank {rank}, {key} differs by {(got[key] - value).abs().max():.3g} "
                    f"after {loop}")


# A fixed set run first on every profile: each move at least once, each path, each strategy.
_M = Move(batch=8, micro=1, no_sync="none", frozen=False, weight=1.0, extra=False,
          evaluate=False)
SEEDS = [
    Loop("module", "ddp", "adamw", True, True, (
        _M, Move(11, 2, "backward", True, 2.0, True, True), Move(6, 2, "forward", False, 0.5,
                                                                 False, False))),
    Loop("module", "fsdp", "momentum", False, False, (
        Move(12, 2, "both", False, 1.0, True, True), Move(4, 1, "none", True, 1.0, False, False),
        Move(11, 1, "none", False, 2.0, False, False))),
    Loop("step", "ddp", "adamw", False, True, (
        _M, Move(11, 2, "none", True, 2.0, False, True), Move(6, 1, "none", False, 0.5,
                                                              False, False))),
    Loop("step", "fsdp", "sgd", False, False, (
        Move(12, 2, "none", False, 1.0, False, False), Move(4, 1, "none", True, 2.0, False,
                                                            True))),
    Loop("step", "fsdp", "adamw", False, False, (
        _M, Move(11, 1, "none", True, 1.0, False, False), Move(2, 2, "none", False, 0.5,
                                                               False, True))),
]


# zero1/zero2: parameters kept whole between steps through every move (a layer frozen and
# unfrozen, a parameter read outside the compiled forward, no_sync, whole steps)
SEEDS += [
    Loop("module", "zero2", "momentum", True, True, (
        Move(12, 2, "both", True, 1.0, True, True), Move(6, 1, "none", False, 2.0, True, False),
        Move(11, 2, "backward", False, 0.5, False, True))),
    Loop("step", "zero1", "adamw", False, True, (
        _M, Move(11, 2, "none", True, 2.0, False, True), Move(4, 1, "none", False, 1.0, False,
                                                              False))),
]

# expert parallelism (spmd.ep) through the moves users make: accumulation with no_sync
# around either half, a frozen layer, a loss term outside the forward, two optimizers,
# evaluation, under each strategy it composes with
SEEDS += [
    Loop("module", "ddp", "adamw", True, True, (
        Move(8, 2, "backward", True, 2.0, True, True), Move(4, 2, "forward", False, 0.5,
                                                            False, False)), experts=True),
    Loop("module", "zero2", "momentum", False, False, (
        Move(12, 2, "both", False, 1.0, True, True), Move(6, 1, "none", True, 1.0, False,
                                                          False)), experts=True),
]

# found by the fuzzer: rank 1's batch is a view at another storage offset, so its graph
# has dynamic shapes and AOTAutograd planned its backward at once, while rank 0 planned
# its static one at the first backward: one rank waited in the store, the other in a
# collective
SEEDS.append(Loop("module", "fsdp", "sgd", False, True, (
    Move(4, 1, "backward", True, 2.0, False, True), Move(2, 2, "both", False, 2.0, False, True),
    Move(2, 2, "both", False, 0.5, False, False))))


def test_fixed_loops_equal_one_process():
    check(SEEDS)


# every drawn batch is one example of this one test: the full profile runs for minutes
@pytest.mark.timeout(0 if PROFILE == "full" else 120)
@settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=PROFILE == "ci",
          suppress_health_check=list(HealthCheck))
@given(batch=st.lists(loops(), min_size=LOOPS_PER_EXAMPLE, max_size=LOOPS_PER_EXAMPLE))
def test_drawn_loops_equal_one_process(batch):
    check(batch)
    print(f"\nfuzz: {sum(TRIED)} loops tried so far")
