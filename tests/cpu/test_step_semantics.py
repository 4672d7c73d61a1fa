"""A whole step that clips its gradients, or whose learning rate a scheduler drives, gives
the parameters and learning rates of one process training on the whole batch; on process
ranks and on thread ranks (which trace their steps at the same time)."""

from __future__ import annotations

import contextlib
import threading
import warnings
from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F

import spmd
from spmd import runtime as dist

from ..models import MODELS, batch

STEPS = 4
_BUILD = threading.Lock()  # thread ranks share torch's generator: build models one at a time
OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.05),
}


def clipped_step(model, x, y, opt):
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # clips on every step here
    opt.step()
    return loss


def plain_step(model, x, y, opt):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _complaints(caught: list) -> list[str]:
    """The warnings of torch's LR scheduler about the order of ``step()`` calls."""
    return [str(w.message) for w in caught if "lr_scheduler" in str(w.message)
            or "optimizer.step()" in str(w.message)]


@contextlib.contextmanager
def _recording(alone: bool):
    """The warnings raised in the block, recorded in a rank that is a process of its own;
    thread ranks leave them to ``runs``: ``warnings.catch_warnings`` swaps process-wide
    state, so two thread ranks inside one each record the other's warnings, and the one
    leaving last restores the other's recorder for good."""
    if not alone:
        yield []
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def job(rank: int, alone: bool) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    world = dist.get_world_size()
    out: dict = {}
    for fn in (clipped_step, plain_step):
        for opt_name, make in OPTIMIZERS.items():
            step = spmd.parallelize(fn)
            with _BUILD:
                model = MODELS["mlp"]()
            opt = make(model.parameters())
            scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            lrs = []
            with _recording(alone) as caught:
                for i in range(STEPS):
                    x, y = batch("mlp", step=i)
                    rows = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
                    step(model, x[rows], y[rows], opt)
                    scheduler.step()
                    lrs.append(opt.param_groups[0]["lr"])
            plan = spmd.inspect(step)
            out[(fn.__name__, opt_name)] = (
                {k: v.clone() for k, v in model.state_dict().items()}, lrs,
                _complaints(caught), plan.optimizer["step0"])
    dist.destroy_process_group()
    return out


def reference(fn, opt_name) -> tuple[dict, list]:
    model = MODELS["mlp"]()
    opt = OPTIMIZERS[opt_name](model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    lrs = []
    for i in range(STEPS):
        fn(model, *batch("mlp", step=i), opt)
        scheduler.step()
        lrs.append(opt.param_groups[0]["lr"])
    return model.state_dict(), lrs


@pytest.fixture(scope="module", params=["forkserver", "thread"])
def runs(request):
    """Each rank's results, and the scheduler's complaints that thread ranks made (they
    are recorded around the whole run, see ``_recording``)."""
    threads = request.param == "thread"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = dist.spawn(job, args=(not threads,), nprocs=2, start_method=request.param,
                         timeout=110)
    return out, _complaints(caught) if threads else []


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("fn", [clipped_step, plain_step], ids=lambda f: f.__name__)
def test_parameters_and_learning_rates_equal_one_process(runs, fn, opt_name):
    state, lrs = reference(fn, opt_name)
    ranks, thread_complaints = runs
    assert thread_complaints == []
    for r in ranks:
        got, got_lrs, complaints, how = r[(fn.__name__, opt_name)]
        assert got_lrs == lrs and complaints == []
        for k, v in state.items():
            assert torch.allclose(got[k], v, atol=2e-5, rtol=1e-4), (fn.__name__, opt_name, k)
        if fn is clipped_step:  # the optimizer must see the clipped gradients
            assert how.startswith("torch.optim after the graph") and "clip" in how
        else:
            assert how.startswith("fused")
