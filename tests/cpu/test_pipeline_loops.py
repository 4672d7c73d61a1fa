"""Pipelines (pp=2) in the loops users write around ``model.step``, each against one
process in float64 running the same microbatches (tolerance 1e-12): gradients accumulated
over two ``step`` calls before ``opt.step()`` with a head tied to the embedding (1f1b and
zb-h1); a tied embedding frozen at the first trace and unfrozen later; an evaluation step
(``model.eval()``, ``torch.no_grad()``) before training and after it, with BatchNorm and a
forward that reads ``self.training``; a plain attribute the forward reads changed between
steps; and the state-dict contract (the plain module's names restricted to each rank's
stages, tied aliases and ``num_batches_tracked`` included, non-persistent buffers not,
what no stage reads on the first rank).

One process on the whole batch is not the reference where BatchNorm trains: its batch
statistics are the microbatch's, on one process as in the pipeline, so the reference runs
the same microbatches in order (``loss / microbatches`` each, as the pipeline scales)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd
import spmd.runtime as dist

MICRO = 2
VOCAB, DIM = 16, 8


class Block(nn.Module):
    def __init__(self, bn: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.bn = nn.BatchNorm1d(DIM) if bn else None
        self.gain = 1.0  # a plain attribute the forward reads

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.lin(h)
        if self.bn is not None:
            h = self.bn(h.flatten(0, 1)).view_as(h)
        # a forward that reads self.training itself (as dropout does, deterministically)
        return torch.tanh(h) * (self.gain if self.training else 0.5 * self.gain)


class Net(nn.Module):
    """Embedding, blocks, a head tied to the embedding; a non-persistent buffer."""

    def __init__(self, bn: bool = False, tied: bool = True, frozen: tuple[str, ...] = (),
                 layers: int = 2, unused: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        if unused:  # read by no stage: kept by the first pipeline rank, not lost
            self.spare = nn.Linear(2, 2)
            self.register_buffer("spare_count", torch.arange(3.0))
        self.layers = nn.ModuleList([Block(bn) for _ in range(layers)])
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        self.register_buffer("mask", torch.linspace(0.5, 1.5, DIM), persistent=False)
        for name in frozen:
            self.get_parameter(name).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) * self.mask
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def batch(i: int, rows: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    seq = torch.randint(0, VOCAB, (rows, 6), generator=g)
    return seq[:, :-1], seq[:, 1:]


def build(**kw: Any) -> nn.Module:
    torch.manual_seed(0)
    return Net(**kw).double()


def run(schedule: str, ops: list[tuple], **kw: Any) -> dict:
    """``ops`` on one process and on the pipeline, side by side; what they hold after.

    ops: ``("step", i)`` a training step on batch i (``("eval", i)``: under no_grad),
    ``("opt",)``, ``("zero",)``, ``("mode", training)``, ``("grad", name, flag)``
    (requires_grad), ``("set", module, attribute, value)``. A stage per block (2 on 2
    ranks; 4 for interleaved-1f1b), the embedding in the first, the head in the last."""
    mesh = spmd.Mesh((2,), ("pp",))
    kw.setdefault("layers", 4 if schedule == "interleaved-1f1b" else 2)
    ref, model = build(**kw), build(**kw)
    pm = spmd.parallelize(model, mesh=mesh, pipeline=spmd.pp.schedule(
        schedule, MICRO, split_points=[f"layers.{i}" for i in range(1, kw["layers"])]))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, model)]
    losses = []
    for op in ops:
        kind = op[0]
        if kind in ("step", "eval"):
            x, y = batch(op[1])
            with torch.set_grad_enabled(kind == "step"):
                got = pm.step(x, y, loss_fn).item()
                parts = [loss_fn(ref(a), b) / MICRO
                         for a, b in zip(x.chunk(MICRO), y.chunk(MICRO))]
                if kind == "step":
                    for p in parts:
                        if p.requires_grad:
                            p.backward()
            losses.append((got, sum(p.item() for p in parts)))
        elif kind == "opt":
            for o in opts:
                o.step()
        elif kind == "zero":
            for o in opts:
                o.zero_grad()
        elif kind == "mode":
            ref.train(op[1])
            model.train(op[1])
        elif kind == "grad":
            ref.get_parameter(op[1]).requires_grad_(op[2])
            model.get_parameter(op[1]).requires_grad_(op[2])
        elif kind == "set":
            setattr(ref.get_submodule(op[1]), op[2], op[3])
            setattr(model.get_submodule(op[1]), op[2], op[3])
        else:
            raise ValueError(op)
    state = pm.state_dict()
    reference = ref.state_dict()
    diff = max(((state[k].double() - reference[k].double()).abs().max().item()
                for k in state if state[k].numel()), default=0.0)
    params = dict(ref.named_parameters())
    grad_diff = 0.0
    for name, p in model.named_parameters():
        if not p.numel():
            continue  # another rank's
        q = params[name].grad
        if (p.grad is None) != (q is None):
            grad_diff = float("inf")
        elif q is not None:
            grad_diff = max(grad_diff, (p.grad - q).abs().max().item())
    return {"diff": diff, "grad_diff": grad_diff, "losses": losses,
            "state": {k: v.detach().clone() for k, v in state.items()},
            "reference": {k: v.detach().clone() for k, v in reference.items()},
            "tied": dict(pm._last_cut.tied), "traces": pm._traces}


ACCUMULATE = [("step", 0), ("step", 1), ("opt",), ("zero",), ("step", 2), ("step", 3)]
FROZEN = [("step", 0), ("opt",), ("zero",), ("grad", "embed.weight", True), ("step", 1),
          ("opt",), ("zero",), ("step", 2)]
MODES = [("mode", False), ("eval", 0), ("mode", True), ("step", 1), ("opt",), ("zero",),
         ("step", 2), ("opt",), ("mode", False), ("eval", 3)]
ATTRIBUTE = [("step", 0), ("opt",), ("zero",), ("set", "layers.0", "gain", 2.0),
             ("step", 1), ("opt",), ("zero",), ("step", 2)]

CASES: dict[str, tuple[str, list, dict]] = {
    "accumulate-1f1b": ("1f1b", ACCUMULATE, {}),
    "accumulate-zb-h1": ("zb-h1", ACCUMULATE, {}),
    "frozen-tied": ("1f1b", FROZEN, {"frozen": ("embed.weight",)}),
    "modes-batchnorm": ("1f1b", MODES, {"bn": True, "unused": True}),
    "attribute": ("gpipe", ATTRIBUTE, {}),
}


def job(rank: int, names: list[str]) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        return {name: run(*CASES[name][:2], **CASES[name][2]) for name in names}
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs():
    return dist.spawn(job, args=(list(CASES),), nprocs=2, start_method="forkserver",
                      timeout=150)


def _same(run: dict) -> None:
    assert run["diff"] < 1e-12, run["diff"]
    assert run["grad_diff"] < 1e-12, run["grad_diff"]
    for got, want in run["losses"]:
        assert got == pytest.approx(want, rel=1e-12, abs=1e-12)


@pytest.mark.timeout(170)
@pytest.mark.parametrize("name", ["accumulate-1f1b", "accumulate-zb-h1"])
def test_accumulating_over_step_calls_with_a_tied_head(runs, name):
    """The tied weight's gradient: this step's share summed across its two stages, added
    to what .grad held (it was summed again on top: 8e-3 off after two steps)."""
    for out in runs:
        assert out[name]["tied"] == {"embed.weight": (0, 1)}
        _same(out[name])


@pytest.mark.timeout(170)
def test_a_tied_embedding_frozen_at_the_first_trace_is_still_tied(runs):
    for out in runs:
        run = out["frozen-tied"]
        assert run["tied"] == {"embed.weight": (0, 1)}
        assert run["traces"] == 1  # requires_grad is not part of the cut
        _same(run)


@pytest.mark.timeout(170)
def test_eval_before_and_after_training_each_runs_its_own_mode(runs):
    """BatchNorm and a forward reading self.training: eval, train, eval."""
    for out in runs:
        run = out["modes-batchnorm"]
        assert run["traces"] == 2  # eval under no_grad, then training
        assert len(run["losses"]) == 4
        _same(run)


@pytest.mark.timeout(170)
def test_batchnorm_statistics_are_one_process_on_the_same_microbatches(runs):
    for rank, out in enumerate(runs):
        run = out["modes-batchnorm"]
        name = f"layers.{rank}.bn."
        for leaf in ("running_mean", "running_var", "num_batches_tracked"):
            assert name + leaf in run["state"], (rank, leaf)
        # written once per microbatch of each of the two training steps, not in eval
        assert run["state"][name + "num_batches_tracked"].item() == 2 * MICRO
        assert not torch.equal(run["state"][name + "running_mean"],
                               torch.zeros(DIM, dtype=torch.float64))


@pytest.mark.timeout(170)
def test_a_plain_attribute_changed_between_steps_takes_effect(runs):
    for out in runs:
        run = out["attribute"]
        assert run["traces"] == 2
        _same(run)


@pytest.mark.timeout(170)
def test_state_dict_is_the_plain_modules_restricted_to_each_ranks_stages(runs):
    """And what no stage reads (a module never called, a buffer never read) is the first
    rank's: released on every rank, it was lost from every state dict."""
    plain = list(build(bn=True, unused=True).state_dict())
    merged: dict[str, torch.Tensor] = {}
    for rank, out in enumerate(runs):
        state = out["modes-batchnorm"]["state"]
        keys = list(state)
        assert keys == [k for k in plain if k in state]  # the plain names, in its order
        assert "embed.weight" in keys and "head.weight" in keys  # both names of the tie
        assert "mask" not in keys  # non-persistent
        other = f"layers.{1 - rank}."
        assert not any(k.startswith(other) for k in keys)  # the other stage's
        assert ("spare.weight" in keys) == (rank == 0)
        merged.update(state)
    assert sorted(merged) == sorted(plain)
    fresh = build(bn=True, unused=True)
    fresh.load_state_dict(merged, strict=True)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, runs[0]["modes-batchnorm"]["reference"][k]) or \
            (v - runs[0]["modes-batchnorm"]["reference"][k]).abs().max() < 1e-12, k
