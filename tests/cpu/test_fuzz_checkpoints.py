"""A differential fuzzer of checkpoint round trips across compositions: each draw picks a
source (a layout of the checkpoint matrix, pp included, or torch's own DCP on a plain
model), a destination (a layout, or the plain module through torch's own functions), the
steps before the save (1-3) and after it (1-2), SGD with momentum or AdamW, maybe two
batches accumulated per optimizer step, maybe a frozen parameter (the tied embedding
among them), and for a pipeline destination whether a step under ``torch.no_grad()`` cut
it before the load; it trains under the source, saves with DCP through
``spmd.checkpoint.get_state_dict``, loads under the destination, trains on, and compares
with one process that never stopped (float64, 1e-12: any difference is a bug): the state
just loaded, the state after training on, and that the optimizer's step counts went on.

The model, the layouts and the training loop are the checkpoint matrix's
(``tests/cpu/test_checkpoint_matrix.py``). By default four fixed draws on 2 ranks, saved
and loaded in one job (``tests.jobs``); ``SPMD_FUZZ=full`` draws ``SPMD_FUZZ_EXAMPLES``
(default 20) from a fresh seed, printed so that a failure can be replayed with
``SPMD_FUZZ_SEED``, from every layout (the 4-rank fsdp x tp and fsdp on 4 ranks, and pp
composed with fsdp, among them): checkpoints saved by a job per world size, loaded by the
jobs of the destination's."""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
import torch

import spmd
from spmd import runtime as dist

from ..jobs import TIMEOUT, Jobs
from .test_checkpoint_matrix import batch, build, loss_fn, make, train, whole

PROFILE = os.environ.get("SPMD_FUZZ", "ci")
if PROFILE not in ("ci", "full"):
    raise ValueError(f"SPMD_FUZZ must be 'ci' or 'full', got {PROFILE!r}")
TOL = 1e-12
LR, MOMENTUM = 0.05, 0.9
TWO = ["ddp", "fsdp", "hsdp", "zero1", "zero2", "tp", "cp", "pp"]  # layouts on 2 ranks
FOUR = ["fsdp_tp", "fsdp4", "pp_fsdp"]  # on 4 ranks
FROZEN = ("embed.weight", "proj.weight", "proj.bias")


@dataclass(frozen=True, kw_only=True)
class Draw:
    """One round trip."""

    seed: int
    source: str  # a layout, or "torch": torch's own DCP on a plain model
    destination: str  # a layout, or "plain": torch's own functions, one process
    before: int  # optimizer steps before the save
    after: int  # and after the load
    optim: str  # "sgd" (momentum) or "adamw"
    accumulate: bool  # two batches per optimizer step, each loss halved
    frozen: tuple[str, ...]  # parameters not trained (under both layouts and the reference)
    cut_first: bool  # a pipeline destination: a step under no_grad cuts it before the load


def draw(seed: int, layouts: list[str]) -> Draw:
    """A round trip from ``layouts`` (sources: those and "torch"; destinations: those and
    "plain")."""
    r = random.Random(seed)
    destination = r.choice(layouts + ["plain"])
    return Draw(seed=seed, source=r.choice(layouts + ["torch"]), destination=destination,
                before=r.randint(1, 3), after=r.randint(1, 2),
                optim=r.choice(["sgd", "adamw"]), accumulate=r.random() < 0.4,
                frozen=tuple(r.sample(FROZEN, 1)) if r.random() < 0.4 else (),
                cut_first=destination.startswith("pp") and r.random() < 0.5)


if PROFILE == "full":
    SEED = int(os.environ.get("SPMD_FUZZ_SEED", random.randrange(2**31)))
    DRAWS = [draw(SEED + i, TWO + FOUR)
             for i in range(int(os.environ.get("SPMD_FUZZ_EXAMPLES", "20")))]
else:  # on 2 ranks: the pipeline saved and loaded, each optimizer, accumulation, freezing
    DRAWS = [
        Draw(seed=0, source="pp", destination="fsdp", before=2, after=1, optim="sgd",
             accumulate=True, frozen=("proj.bias",), cut_first=False),
        Draw(seed=1, source="zero2", destination="pp", before=1, after=2, optim="adamw",
             accumulate=False, frozen=("embed.weight",), cut_first=True),
        Draw(seed=2, source="tp", destination="pp", before=3, after=1, optim="adamw",
             accumulate=True, frozen=(), cut_first=False),
        Draw(seed=3, source="pp", destination="plain", before=1, after=1, optim="adamw",
             accumulate=False, frozen=("proj.weight",), cut_first=False),
    ]


def world(layout: str) -> int:
    return 4 if layout in FOUR else 2


def _build(layout: str, rank: int, frozen: tuple[str, ...]) -> tuple[Any, int, int]:
    """The matrix's layouts, and pp=2 composed with fsdp=2 (each stage sharded)."""
    if layout == "pp_fsdp":
        mesh = spmd.Mesh((2, 2), dim_names=("pp", "fsdp"))
        model = spmd.parallelize(make(frozen), mesh=mesh, strategy="fsdp",
                                 pipeline=spmd.pp.schedule("1f1b", 2, split_points=["proj"]))
        return model, mesh.coordinate()[1], 2
    return build(layout, rank, frozen)


def optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    return torch.optim.AdamW(model.parameters(), lr=LR)


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """The step counts the optimizer holds (none for SGD), and whether this rank holds a
    parameter it trains (a pipeline rank may hold only a frozen one)."""
    return {"steps": sorted({int(s["step"]) for s in opt.state.values() if "step" in s}),
            "trains": any(p.requires_grad and p.numel() for p in model.parameters())}


def save(d: Draw, rank: int, path: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    layout = "plain" if d.source == "torch" else d.source
    model, data_rank, data_size = _build(layout, rank, d.frozen)
    opt = optimizer(d.optim, model)
    train(model, opt, range(d.before), data_rank, data_size, d.accumulate)
    if d.source == "torch":
        model_sd, optim_sd = get_state_dict(model, opt)
    else:
        model_sd, optim_sd = spmd.checkpoint.get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{path}/{d.seed}")
    return {"keys": sorted(model_sd)}


def load(d: Draw, rank: int, path: str) -> dict:
    import torch.distributed.checkpoint as dcp

    model, data_rank, data_size = _build(d.destination, rank, d.frozen)
    opt = optimizer(d.optim, model)
    if d.cut_first:
        with torch.no_grad():
            model.step(*batch(0), loss_fn)
    model_sd, optim_sd = spmd.checkpoint.get_state_dict(model, opt)
    keys = sorted(model_sd)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{path}/{d.seed}")
    spmd.checkpoint.set_state_dict(model, opt, model_state_dict=model_sd,
                                   optim_state_dict=optim_sd)
    loaded = whole(model)
    train(model, opt, range(d.before, d.before + d.after), data_rank, data_size,
          d.accumulate)
    return {"keys": keys, "loaded": loaded, "resumed": whole(model), **_steps(model, opt)}


def load_plain(d: Draw, path: str) -> dict:
    """torch's own functions, in the test process (no process group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = make(d.frozen)
    opt = optimizer(d.optim, model)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{path}/{d.seed}",
             no_dist=True)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    loaded = whole(model)
    train(model, opt, range(d.before, d.before + d.after), accumulate=d.accumulate)
    return {"keys": sorted(model_sd), "loaded": loaded, "resumed": whole(model),
            **_steps(model, opt)}


def job(rank: int, cases: list[tuple[str, Draw]], path: str) -> dict:
    """Each case in order: ``("save", draw)`` trains and saves the draw's source,
    ``("load", draw)`` loads it under the draw's destination and trains on. (The draws
    travel with the cases: a spawned rank imports this module and would draw its own.)"""
    from torch.distributed.checkpoint.api import CheckpointException

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=90))
    try:
        out: dict = {}
        for kind, d in cases:
            try:
                out[(kind, d)] = (save if kind == "save" else load)(d, rank, path)
            # one draw's failure is that draw's, not the job's (DCP's errors are
            # BaseExceptions)
            except (Exception, CheckpointException) as e:
                out[(kind, d)] = {"error": f"{type(e).__name__}: {e}"}
        return out
    finally:
        dist.destroy_process_group()


def _source_world(d: Draw) -> int:
    return 2 if d.source == "torch" else world(d.source)


def _groups() -> list[list[tuple[str, Draw]]]:
    """Per world size, its saves and the loads of its own checkpoints on the same ranks;
    then per world size the loads of the other's (in jobs of their own: a job holding
    both saves and loads of checkpoints saved by the other world's jobs could wait on
    itself). Plain destinations load in the test process. At most eight cases a job (a
    case takes one to three seconds quiet)."""
    same: list[list[tuple[str, Draw]]] = []
    cross: list[list[tuple[str, Draw]]] = []
    for w in (2, 4):
        cases = [c for d in DRAWS if _source_world(d) == w
                 for c in [("save", d)] + ([("load", d)] if world(d.destination) == w
                                           and d.destination != "plain" else [])]
        same += [cases[k:k + 8] for k in range(0, len(cases), 8)]
        cases = [("load", d) for d in DRAWS if d.destination != "plain"
                 and world(d.destination) == w and _source_world(d) != w]
        cross += [cases[k:k + 8] for k in range(0, len(cases), 8)]
    return same + cross


def _world_of(cases: list[tuple[str, Draw]]) -> int:
    kind, d = cases[0]
    return _source_world(d) if kind == "save" else world(d.destination)


PATH = os.path.join(tempfile.gettempdir(), f"spmd-fuzz-ckpt-{os.getpid()}")
JOBS = Jobs(job, _groups(), nprocs=_world_of, args=(PATH,))


@pytest.fixture(scope="module", autouse=True)
def _cleanup():
    if PROFILE == "full":  # here, not at import: each spawned rank imports it, drawing anew
        print(f"\ntest_fuzz_checkpoints: SPMD_FUZZ_SEED={SEED}, {len(DRAWS)} draws")
    shutil.rmtree(PATH, ignore_errors=True)
    os.makedirs(PATH)
    yield
    shutil.rmtree(PATH, ignore_errors=True)


def _results(case: tuple[str, Draw]) -> list[dict]:
    """Each rank's result of ``case``, its job run once every checkpoint that job loads
    from another job is saved."""
    group = next(g for g in JOBS.groups if case in g)
    for kind, d in group:
        if kind == "load" and ("save", d) not in group:
            _results(("save", d))
    return JOBS.results(case)


def reference(d: Draw) -> tuple[dict, dict]:
    """One process that never stopped: its state at the save and after training on."""
    model = make(d.frozen)
    opt = optimizer(d.optim, model)
    train(model, opt, range(d.before), accumulate=d.accumulate)
    at_save = whole(model)
    train(model, opt, range(d.before, d.before + d.after), accumulate=d.accumulate)
    return at_save, whole(model)


def _worst(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max((got[k] - want[k]).abs().max().item() for k in want)


# a draw's test may start three spawns: its save's job, the job of another checkpoint its
# load's job reads, and that job
@pytest.mark.timeout(3 * TIMEOUT + 30)
@pytest.mark.parametrize("index", range(len(DRAWS)),
                         ids=[f"{d.seed}-{d.source}-to-{d.destination}" for d in DRAWS])
def test_round_trip_resumes_as_if_never_stopped(index):
    d = DRAWS[index]
    saved = _results(("save", d))
    runs = [load_plain(d, PATH)] if d.destination == "plain" else _results(("load", d))
    at_save, after = reference(d)
    for rank, out in enumerate(saved):  # every rank's: the plain module's keys
        assert "error" not in out, (rank, out["error"], d)
        assert out["keys"] == sorted(at_save), (rank, d)
    for rank, run in enumerate(runs):
        assert "error" not in run, (rank, run["error"], d)
        assert run["keys"] == sorted(at_save), (rank, d)
        assert _worst(run["loaded"], at_save) <= TOL, (rank, d)
        assert _worst(run["resumed"], after) <= TOL, (rank, d)
        # AdamW's state, every parameter's, went on from the checkpoint's (none left behind)
        if d.optim == "adamw":
            want = [d.before + d.after] if run["trains"] else []
            assert run["steps"] == want, (rank, run["steps"], d)
