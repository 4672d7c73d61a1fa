"""Checkpoints across layouts: saved under one (ddp, fsdp, hsdp, zero1, zero2, tp,
fsdp x tp, cp, pp, or torch's own DCP on a plain model), loaded under another and into a
plain module, training resumes equal to one process that never stopped (float64, 1e-12).

The model is tiny and holds what state dicts get wrong: an embedding tied to the output
head (two keys, one tensor), a linear, an odd vocabulary (fsdp pads), a non-persistent
buffer (never saved nor asked for) and a persistent one; tp splits the linear
``StridedShard(0, 2)`` (two blocks a rank), fsdp x tp ``Shard(0)`` twice over (a shard of
a piece); pp cuts it in two stages at ``proj`` (1f1b, 2 microbatches): the embedding on
the first, the linear, the persistent buffer and the head (the tied weight again) on the
second, so each pipeline rank writes its stages' tensors and the tied one is written by
both (DCP keeps one). A job per checkpoint saves it and loads it on the same ranks
(tests.jobs), a 4-rank job loads 2-rank checkpoints into the 4-rank layouts. The plain
module loads in the test process through torch's own functions. ``SPMD_CKPT=full`` runs
the whole cross product (10 checkpoints x 11 destinations: the 9 layouts, fsdp on 4
ranks, the plain module); by default every checkpoint loads once into another layout and
once into the plain module, fsdp x tp's also back into itself and fsdp's also into pp; and
torch's whole state dicts of a plain model go into fsdp x tp through set_state_dict (23
cells, 111 in full).
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from datetime import timedelta

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd
from spmd import runtime as dist

from ..jobs import Jobs

VOCAB, DIM, ROWS, LENGTH = 11, 8, 4, 4
SAVED_AT, LR, TOL = 2, 0.05, 1e-12
FULL = os.environ.get("SPMD_CKPT") == "full"

SOURCES = ["ddp", "fsdp", "hsdp", "zero1", "zero2", "tp", "fsdp_tp", "cp", "pp", "torch"]
LAYOUTS = [s for s in SOURCES if s != "torch"]
# by default: each checkpoint into one other layout (fsdp x tp's into fsdp on its own 4
# ranks, fsdp x tp's back into itself: the silent 0.5; pp's into fsdp x tp, a
# shard of a piece read from the stages' whole tensors; fsdp's padded shards into pp),
# and into the plain module
ONE_OTHER = {"ddp": ["cp"], "fsdp": ["tp", "pp"], "hsdp": ["zero1"], "zero1": ["zero2"],
             "zero2": ["hsdp"], "tp": ["fsdp_tp"], "fsdp_tp": ["fsdp4", "fsdp_tp"],
             "cp": ["ddp"], "pp": ["fsdp_tp"], "torch": ["fsdp"]}
CELLS = [(s, d) for s in SOURCES for d in LAYOUTS + ["fsdp4", "plain"]] if FULL else \
    [(s, d) for s in SOURCES for d in ONE_OTHER[s] + ["plain"]]
# and torch's whole state dicts of a plain model, no DCP, through set_state_dict
CELLS.append(("whole", "fsdp_tp"))
FOUR = ("fsdp_tp", "fsdp4")  # layouts on 4 ranks


class Tiny(nn.Module):
    def __init__(self, frozen: tuple[str, ...] = ()) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, DIM), persistent=False)
        self.register_buffer("shift", torch.full((DIM,), 0.1))
        for name in frozen:
            self.get_parameter(name).requires_grad_(False)

    def forward(self, ids):
        return self.head(torch.tanh(self.proj(self.embed(ids))) * self.scale + self.shift)


def make(frozen: tuple[str, ...] = ()) -> Tiny:
    """The model in float64, ``frozen`` parameters (names) not trained."""
    return Tiny(frozen).double()


def batch(step: int):
    """(ids, target) of training step ``step`` (the same on every rank)."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (ROWS, LENGTH + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


TP = {"tp": {"proj.weight": spmd.Shard(0), "proj.bias": spmd.Shard(0)}}
# tp alone splits proj as fused query-key-value projections are (each rank its part of
# each half): two chunks a rank in the checkpoint
STRIDED = {"tp": {"proj.weight": spmd.StridedShard(0, 2), "proj.bias": spmd.StridedShard(0, 2)}}


def build(layout: str, rank: int, frozen: tuple[str, ...] = ()):
    """(the model under ``layout``, this rank's data rank, data ranks)."""
    if layout == "plain" or layout == "torch":
        return make(frozen), 0, 1
    if layout in ("ddp", "fsdp", "zero1", "zero2", "fsdp4"):
        world = dist.get_world_size()
        return spmd.parallelize(make(frozen), strategy=layout.rstrip("4")), rank, world
    if layout == "hsdp":
        mesh = spmd.Mesh((1, 2), dim_names=("dp", "fsdp"))
        return spmd.parallelize(make(frozen), strategy="hsdp", mesh=mesh), rank, 2
    if layout == "tp":
        return spmd.parallelize(make(frozen), mesh=spmd.Mesh((2,), dim_names=("tp",)),
                                placements=STRIDED), 0, 1
    if layout == "fsdp_tp":
        mesh = spmd.Mesh((2, 2), dim_names=("fsdp", "tp"))
        return spmd.parallelize(make(frozen), strategy="fsdp", mesh=mesh, placements=TP), \
            rank // 2, 2
    if layout == "cp":
        return spmd.parallelize(make(frozen), mesh=spmd.Mesh((2,), dim_names=("cp",)),
                                placements=spmd.cp.ring()), 0, 1
    if layout == "pp":  # every pipeline rank steps the whole batch
        return spmd.parallelize(make(frozen), mesh=spmd.Mesh((2,), dim_names=("pp",)),
                                pipeline=spmd.pp.schedule("1f1b", 2, split_points=["proj"])), \
            0, 1
    raise ValueError(layout)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def half_loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Half of it: each of two batches accumulated before an optimizer step."""
    return loss_fn(logits, target) / 2


def train(model, opt, steps, data_rank: int = 0, data_size: int = 1,
          accumulate: bool = False) -> None:
    """An optimizer step for each of ``steps``, on this rank's rows of its batch; with
    ``accumulate``, on the gradients of two batches (``2 * step``, ``2 * step + 1``), each
    loss halved. A pipeline steps its rows through ``model.step``."""
    from spmd.pipeline.module import PipelineModule

    loss = half_loss_fn if accumulate else loss_fn
    rows = slice(data_rank * ROWS // data_size, (data_rank + 1) * ROWS // data_size)
    for step in steps:
        for i in [2 * step, 2 * step + 1] if accumulate else [step]:
            ids, target = batch(i)
            if isinstance(model, PipelineModule):
                model.step(ids[rows], target[rows], loss)
            else:
                loss(model(ids[rows]), target[rows]).backward()
        opt.step()
        opt.zero_grad()


def optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=LR)


def whole(model) -> dict:
    """The model's whole state dict; a pipeline's, its ranks' merged (every rank gets it),
    a tensor two ranks hold (the tied weight) the same on both or ``AssertionError``."""
    from spmd.pipeline.module import PipelineModule

    mine = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if not isinstance(model, PipelineModule):
        return mine
    every: list = [None] * dist.get_world_size(model._group)
    dist.all_gather_object(every, mine, group=model._group)
    merged: dict = {}
    for rank, part in enumerate(every):
        for k, v in part.items():
            if k in merged and not torch.equal(merged[k], v):
                raise AssertionError(f"pipeline ranks hold {k} differently (rank {rank}: "
                                     f"{(merged[k] - v).abs().max().item():.3g} off)")
            merged[k] = v
    order = list(model.module.state_dict(keep_vars=True))
    return {k: merged[k] for k in order if k in merged}


def save(layout: str, rank: int, path: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, data_rank, data_size = build(layout, rank)
    opt = optimizer(model)
    train(model, opt, range(SAVED_AT), data_rank, data_size)
    if layout == "torch":
        model_sd, optim_sd = get_state_dict(model, opt)
    else:
        model_sd, optim_sd = spmd.checkpoint.get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{path}/{layout}")
    return {"model_keys": sorted(model_sd), "optim_keys": sorted(optim_sd["state"]),
            "optim_params": [g["params"] for g in optim_sd["param_groups"]]}


def load(layout: str, source: str, rank: int, path: str) -> dict:
    import torch.distributed.checkpoint as dcp

    model, data_rank, data_size = build(layout, rank)
    opt = optimizer(model)
    if source == "whole":
        from torch.distributed.checkpoint.state_dict import get_state_dict

        plain = make()
        plain_opt = optimizer(plain)
        train(plain, plain_opt, range(SAVED_AT))
        model_sd, optim_sd = get_state_dict(plain, plain_opt)
    else:
        model_sd, optim_sd = spmd.checkpoint.get_state_dict(model, opt)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{path}/{source}")
    spmd.checkpoint.set_state_dict(model, opt, model_state_dict=model_sd,
                                   optim_state_dict=optim_sd)
    loaded = whole(model)
    train(model, opt, [SAVED_AT], data_rank, data_size)
    return {"loaded": loaded, "resumed": whole(model),
            "steps": sorted({int(s["step"]) for s in opt.state.values()})}


def job(rank: int, cases: list[tuple[str, str]], path: str) -> dict:
    """Each case in order: ``("save", layout)`` trains and saves under ``layout``,
    ``(source, layout)`` loads ``source``'s checkpoint under ``layout`` and resumes."""
    from torch.distributed.checkpoint.api import CheckpointException

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=90))
    try:
        out: dict = {}
        for source, layout in cases:
            try:
                out[(source, layout)] = (save(layout, rank, path) if source == "save"
                                         else load(layout, source, rank, path))
            # one cell's failure is that cell's, not the job's (DCP's errors are
            # BaseExceptions)
            except (Exception, CheckpointException) as e:
                out[(source, layout)] = {"error": f"{type(e).__name__}: {e}"}
        return out
    finally:
        dist.destroy_process_group()


def load_plain(source: str, path: str) -> dict:
    """torch's own functions, one process, no process group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = make()
    opt = optimizer(model)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{path}/{source}")
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    loaded = whole(model)
    train(model, opt, [SAVED_AT])
    return {"loaded": loaded, "resumed": whole(model),
            "steps": sorted({int(s["step"]) for s in opt.state.values()})}


def reference(steps: int) -> dict:
    model = make()
    train(model, optimizer(model), range(steps))
    return whole(model)


def _world(case: tuple[str, str]) -> int:
    return 4 if case[1] in FOUR else 2


def _groups() -> list[list[tuple[str, str]]]:
    """Checkpoints saved, then loaded on the same ranks, three to a job (a tiny model:
    a checkpoint's cells take a second or two); then jobs for each world size's loads of
    the other world size's checkpoints, six to a job."""
    groups: list[list[tuple[str, str]]] = []
    for world in (2, 4):
        sources = [s for s in SOURCES if _world(("save", s)) == world]
        for i in range(0, len(sources), 3):
            groups.append([])
            for source in sources[i:i + 3]:
                saved = ("save", source)
                groups[-1] += [saved] + [c for c in CELLS if c[0] == source
                                         and c[1] != "plain" and _world(c) == world]
    for world in (2, 4):
        other = [c for c in CELLS if c[1] != "plain" and _world(c) == world
                 and not any(c in g for g in groups)]
        # six to a job: 18 of them on 4 ranks took 84 s with the saves they wait for, in
        # one test (pytest's limit: 120 s)
        groups += [other[i:i + 6] for i in range(0, len(other), 6)]
    return groups


# made by the fixture, not at import: each spawned rank imports this module too (it left
# an empty directory behind per rank and job)
PATH = os.path.join(tempfile.gettempdir(), f"spmd-ckpt-{os.getpid()}")
JOBS = Jobs(job, _groups(), nprocs=lambda cases: _world(cases[0]), args=(PATH,))
_PLAIN: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _cleanup():
    shutil.rmtree(PATH, ignore_errors=True)
    os.makedirs(PATH)
    yield
    shutil.rmtree(PATH, ignore_errors=True)


@functools.cache
def _reference() -> tuple[dict, dict]:
    return reference(SAVED_AT), reference(SAVED_AT + 1)


def _cell(source: str, layout: str) -> list[dict]:
    """Each rank's result of loading ``source``'s checkpoint under ``layout`` (saved
    first, by its own job, when another job loads it: every checkpoint that job loads)."""
    group = [(source, layout)] if layout == "plain" else \
        next(g for g in JOBS.groups if (source, layout) in g)
    for loaded in sorted({s for s, _ in group if s in SOURCES}):
        JOBS.results(("save", loaded))
    if layout == "plain":
        if source not in _PLAIN:
            _PLAIN[source] = load_plain(source, PATH)
        return [_PLAIN[source]]
    return JOBS.results((source, layout))


def _worst(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max((got[k] - want[k]).abs().max().item() for k in want)


@pytest.mark.parametrize("source, layout", CELLS, ids=[f"{s}-to-{d}" for s, d in CELLS])
def test_resumes_as_if_never_stopped(source, layout):
    at_save, after = _reference()
    for run in _cell(source, layout):
        assert "error" not in run, run.get("error")
        assert _worst(run["loaded"], at_save) <= TOL
        assert _worst(run["resumed"], after) <= TOL
        assert run["steps"] == [SAVED_AT + 1]


@pytest.mark.parametrize("source", SOURCES)
def test_keys_are_the_plain_modules(source):
    """On every rank, a pipeline's too (another stage's tensors as entries with no chunk
    here); optimizer state for what the rank holds: together, every parameter's."""
    plain = make()
    saved = JOBS.results(("save", source))
    optim_keys: set = set()
    for rank in saved:
        assert rank["model_keys"] == sorted(plain.state_dict())  # head.weight kept, no scale
        assert rank["optim_params"] == [["embed.weight", "proj.weight", "proj.bias"]]
        optim_keys.update(rank["optim_keys"])
    assert sorted(optim_keys) == ["embed.weight", "proj.bias", "proj.weight"]
    if source == "pp":  # the first stage holds the embedding only
        assert saved[0]["optim_keys"] == ["embed.weight"]


def test_counts():
    ran = [c for c in CELLS]
    passed = [c for c in CELLS if all("error" not in r for r in _cell(*c))]
    print(f"checkpoint matrix: {len(ran)} cells run, {len(passed)} loaded without error")
    assert len(ran) == (111 if FULL else 23)
