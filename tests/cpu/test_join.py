"""Uneven inputs: with ``model.join()`` the rank with fewer batches shadows the others'
collectives, and training ends on every rank with the parameters torch DDP's ``join()``
gives on the same data; without it, the waiting rank's error names the rank that left."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F

import spmd
from spmd import runtime as dist

from ..models import MODELS, batch

BATCHES = {0: 5, 1: 8}  # rank -> how many batches it has


class SparseBag(torch.nn.Module):
    """An nn.Embedding(sparse=True): its gradient is all-reduced as a sparse tensor."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(12, 8, sparse=True)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).mean(1))


FACTORIES = {**MODELS, "sparse": SparseBag}


def _batches(name: str, rank: int) -> list:
    out = []
    for step in range(BATCHES[rank]):
        x, y = batch("mlp" if name == "sparse" else name, step=step)
        if name == "sparse":
            x = (x[:, :3].abs() * 4).long() % 12
        out.append((x[rank * 6:(rank + 1) * 6], y[rank * 6:(rank + 1) * 6]))
    return out


def _train(model, name, rank, context) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0 if name == "sparse" else 0.9)
    with context(model):
        for x, y in _batches(name, rank):
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _job(rank: int, name: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        ours = _train(spmd.parallelize(FACTORIES[name]()), name, rank, lambda m: m.join())
        theirs = _train(DistributedDataParallel(FACTORIES[name]()), name, rank,
                        lambda m: m.join())  # torch's DDP on our group, as torch sees it
        # two models in one context: each step trains both
        first, second = spmd.parallelize(FACTORIES[name]()), spmd.parallelize(FACTORIES[name]())
        opt = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.05,
                              momentum=0 if name == "sparse" else 0.9)
        with spmd.Join([first, second]):
            for x, y in _batches(name, rank):
                (F.mse_loss(first(x), y) + F.mse_loss(second(x), y)).backward()
                opt.step()
                opt.zero_grad()
        together = {k: v.detach().clone() for k, v in second.state_dict().items()}
        return {"ours": ours, "theirs": {k.removeprefix("module."): v for k, v in theirs.items()},
                "together": together}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", ["mlp", "batchnorm", "sparse"])
def test_uneven_inputs_end_like_torch_ddp_join(name):
    runs = dist.spawn(_job, args=(name,), nprocs=2, start_method="forkserver", timeout=110)
    for rank, run in enumerate(runs):
        for key, want in run["theirs"].items():
            assert torch.allclose(run["ours"][key], want, atol=1e-5), (rank, key)
            assert torch.allclose(run["together"][key], want, atol=1e-5), (rank, key)
    for key in runs[0]["ours"]:  # every rank ends with the same model
        assert torch.equal(runs[0]["ours"][key], runs[1]["ours"][key]), key


def _throw(rank: int) -> str:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        model = spmd.parallelize(MODELS["mlp"]())
        try:
            _train(model, "mlp", rank, lambda m: m.join(throw_on_early_termination=True))
        except RuntimeError as e:
            return str(e)
        return "no error"
    finally:
        dist.destroy_process_group()


def test_throw_on_early_termination_raises_on_every_rank():
    out = dist.spawn(_throw, nprocs=2, start_method="forkserver", timeout=110)
    assert "this rank ran out of inputs" in out[0]
    assert "1 rank(s) ran out of inputs" in out[1]


def _without_join(rank: int) -> tuple[str, bool, float]:
    import time

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    model = spmd.parallelize(MODELS["mlp"]())
    start = time.monotonic()
    try:
        _train(model, "mlp", rank, lambda m: torch.enable_grad())
    except Exception as e:  # rank 1 waits for rank 0, which left its loop and the group
        return f"{type(e).__name__}: {e}", isinstance(e, TimeoutError), time.monotonic() - start
    finally:
        dist.destroy_process_group()
    return "done", False, time.monotonic() - start


def test_without_join_the_waiting_rank_names_the_rank_that_stopped():
    out = dist.spawn(_without_join, nprocs=2, start_method="forkserver", timeout=110)
    assert out[0][0] == "done"
    message, is_timeout, seconds = out[1]
    assert "rank 0 left the group" in message and "model.join()" in message, message
    # seen when rank 0 left, not the group's 60 s timeout waited out (timed on the rank
    # itself, so a slow start on a loaded machine does not count)
    assert not is_timeout and seconds < 60, (message, seconds)


def test_join_refuses_sharded_models():
    model = spmd.parallelize(MODELS["mlp"](), mesh=spmd.Mesh.simulated(2), strategy="fsdp")
    with pytest.raises(ValueError, match="drop_last=True"):
        model.join()
    with pytest.raises(ValueError, match="divide_by_initial_world_size=False"):
        spmd.parallelize(MODELS["mlp"](), mesh=spmd.Mesh.simulated(2)).join(
            divide_by_initial_world_size=False)
