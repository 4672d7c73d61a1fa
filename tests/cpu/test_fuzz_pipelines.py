"""A differential fuzzer of pipelines in training loops: each draw picks a schedule
(gpipe, 1f1b, interleaved-1f1b, zb-h1 at pp=2), a model (a head tied to the embedding or
not, BatchNorm or not, a layer frozen from the start or not) and a loop of the moves users
make around ``model.step`` (training steps accumulated over calls before ``opt.step()``,
evaluation steps under ``torch.no_grad()``, ``model.eval()``/``model.train()``, freezing
and unfreezing a parameter, a plain attribute the forward reads changed, ``zero_grad``),
runs it on 2 ranks and on one process running the same microbatches (float64), and
compares the parameters, buffers, gradients and losses (1e-12: any difference is a bug).

By default three fixed draws (the same every run); ``SPMD_FUZZ=full`` draws
``SPMD_FUZZ_EXAMPLES`` (default 24) loops from a fresh seed, printed so that a failure can
be replayed with ``SPMD_FUZZ_SEED``."""

from __future__ import annotations

import os
import random
from datetime import timedelta

import pytest
import torch

import spmd.runtime as dist
from spmd.pp import SCHEDULES
from tests.cpu.test_pipeline_loops import run

PROFILE = os.environ.get("SPMD_FUZZ", "ci")
if PROFILE not in ("ci", "full"):
    raise ValueError(f"SPMD_FUZZ must be 'ci' or 'full', got {PROFILE!r}")
if PROFILE == "full":
    SEED = int(os.environ.get("SPMD_FUZZ_SEED", random.randrange(2**31)))
    DRAWS = [SEED + i for i in range(int(os.environ.get("SPMD_FUZZ_EXAMPLES", "24")))]
    print(f"test_fuzz_pipelines: SPMD_FUZZ_SEED={SEED}, {len(DRAWS)} draws")
else:
    DRAWS = [0, 4, 7]  # zb-h1, 1f1b, interleaved; BatchNorm, ties, freezing, eval, accumulation

CANDIDATES = ("embed.weight", "layers.0.lin.weight", "layers.1.lin.bias")


def draw(seed: int) -> tuple[str, list[tuple], dict]:
    """(schedule, ops, model options) for ``run``."""
    r = random.Random(seed)
    schedule = r.choice(SCHEDULES)
    frozen = tuple(r.sample(CANDIDATES, r.randint(0, 1)))
    kw = {"bn": r.random() < 0.5, "tied": r.random() < 0.7, "frozen": frozen}
    ops: list[tuple] = []
    batch = 0
    for _ in range(r.randint(5, 9)):
        move = r.choices(["step", "eval", "opt", "zero", "mode", "grad", "set"],
                         weights=[5, 2, 3, 2, 1, 1, 1])[0]
        if move in ("step", "eval"):
            ops.append((move, batch))
            batch += 1
        elif move == "mode":
            ops.append(("mode", r.random() < 0.5))
        elif move == "grad":
            ops.append(("grad", r.choice(CANDIDATES), r.random() < 0.5))
        elif move == "set":
            ops.append(("set", f"layers.{r.randint(0, 1)}", "gain", r.choice([0.5, 2.0])))
        else:
            ops.append((move,))
    ops.append(("step", batch))  # the gradients a last step leaves, compared too
    return schedule, ops, kw


def job(rank: int, seeds: list[int]) -> list[dict]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        out = []
        for seed in seeds:
            schedule, ops, kw = draw(seed)
            result = run(schedule, ops, **kw)
            out.append({k: result[k] for k in ("diff", "grad_diff", "losses", "traces")})
        return out
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs():
    return dist.spawn(job, args=(DRAWS,), nprocs=2, start_method="forkserver",
                      timeout=150 if PROFILE == "ci" else 3600)


@pytest.mark.timeout(170 if PROFILE == "ci" else 3700)
@pytest.mark.parametrize("index", range(len(DRAWS)))
def test_drawn_pipeline_loop_is_one_process(runs, index):
    what = (DRAWS[index], *draw(DRAWS[index]))
    for rank, out in enumerate(runs):
        got = out[index]
        assert got["diff"] < 1e-12, (rank, got["diff"], what)
        assert got["grad_diff"] < 1e-12, (rank, got["grad_diff"], what)
        for a, b in got["losses"]:
            assert a == pytest.approx(b, rel=1e-12, abs=1e-12), (rank, what)
