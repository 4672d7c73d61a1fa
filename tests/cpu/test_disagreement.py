"""Ranks that disagree, with ``SPMD_SIZE_CHECK=1``: a collective whose sizes differ across ranks, a
tensor- or context-parallel model fed other sequence lengths on one rank (after the
first steps: that rank alone would recompile), and ``state_dict()`` of an fsdp model
called on rank 0 only. Each rank must get a Python error naming every rank's call, and
no rank may die by a signal: before ``spmd.runtime.sizecheck``, Gloo's size check killed
the receiving rank by SIGABRT with no Python error anywhere, and a context-parallel rank
fed a shorter sequence trained on alone (2.5e-2 off its peer).

One spawn of two process ranks runs every case: none of these errors moves any data,
so the groups survive each (the last case proves it with an all-reduce).
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F

import spmd
from spmd import runtime as dist

from ..models import Transformer, tokens


def _attempt(fn):
    try:
        fn()
    except Exception as e:  # returned to the test process for inspection
        return f"{type(e).__name__}: {e}"
    return "ok"


def _train(model, lengths, rank):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, length in enumerate(lengths):
        x, y = tokens(step, rows=2, length=length[rank])
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad()


def _model():
    torch.manual_seed(0)
    return Transformer(layers=1, dim=8).double()


class _Branch(torch.nn.Module):
    def __init__(self, second: bool) -> None:
        super().__init__()
        self.first, self.second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.use_second = second

    def forward(self, x):
        x = self.first(x)
        return self.second(x) if self.use_second else x


def _branching(rank):
    torch.manual_seed(0)
    model = spmd.parallelize(_Branch(second=rank == 1))
    model(torch.ones(2, 4)).sum().backward()


def _eager_cases(rank):
    return {
        "all_reduce": lambda: dist.all_reduce(torch.ones(4 + rank)),
        "all_reduce op": lambda: dist.all_reduce(
            torch.ones(4), op=dist.ReduceOp.MAX if rank else dist.ReduceOp.SUM),
        "all_gather": lambda: dist.all_gather([torch.empty(3 + rank) for _ in range(2)],
                                              torch.ones(3 + rank)),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(
            torch.empty(2 * (3 + rank)), torch.ones(3 + rank)),
        "reduce_scatter": lambda: dist.reduce_scatter(torch.empty(2 + rank),
                                                      [torch.ones(2 + rank)] * 2),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(
            torch.empty(2 + rank), torch.ones(2 * (2 + rank))),
        "broadcast": lambda: dist.broadcast(torch.ones(5 * (rank + 1)), src=0),
        "broadcast dtype": lambda: dist.broadcast(
            torch.ones(4, dtype=torch.float64 if rank else torch.float32), src=0),
        "barrier against all_reduce": lambda: dist.barrier() if rank else
        dist.all_reduce(torch.ones(2)),
    }


def disagree_job(rank: int) -> dict:
    os.environ["SPMD_SIZE_CHECK"] = "1"  # off by default (its cost, runtime.config)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        out = {name: _attempt(fn) for name, fn in _eager_cases(rank).items()}
        # tensor parallelism: one step alike, then rank 1 alone gets 6 tokens (it alone
        # would recompile, and send activations of another size)
        tp = spmd.parallelize(_model(), mesh=spmd.Mesh((2,), dim_names=("tp",)),
                              placements=spmd.tp.megatron())
        out["tp"] = _attempt(lambda: _train(tp, [(8, 8), (8, 6)], rank))
        # context parallelism: two steps alike (planned graphs), then rank 1 alone gets a
        # shorter sequence (it fell back to eager and trained on alone)
        cp = spmd.parallelize(_model(), mesh=spmd.Mesh((2,), dim_names=("cp",)),
                              placements=spmd.cp.ring())
        out["cp"] = _attempt(lambda: _train(cp, [(8, 8), (8, 8), (8, 4)], rank))
        # fsdp: `if rank == 0: torch.save(model.state_dict(), ...)`, then the others go on
        # to a barrier, or to the next step
        fsdp = spmd.parallelize(_model(), strategy="fsdp")
        _train(fsdp, [(8, 8)], rank)
        out["state_dict vs barrier"] = _attempt(
            lambda: fsdp.state_dict() if rank == 0 else dist.barrier())
        out["state_dict vs a step"] = _attempt(
            lambda: fsdp.state_dict() if rank == 0 else _train(fsdp, [(8, 8)], rank))
        # ddp: data-dependent control flow, rank 1 alone runs its second layer: its
        # backward graph reduces other gradients, named at the graph's header (every
        # run, before the first run's plan comparison)
        out["ddp branch"] = _attempt(lambda: _branching(rank))
        # every group survived: collectives that agree still run, with the right values
        alive = torch.full((3,), float(rank + 1))
        dist.all_reduce(alive)
        out["survives"] = alive.tolist()
        whole = fsdp.state_dict()  # called on every rank, as it must be
        out["state_dict on every rank"] = sorted(whole) == sorted(_model().state_dict())
        return out
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs():
    # spawn raises if a rank dies by a signal (SpawnError "killed by SIGABRT"): every
    # case below returned on both ranks
    return dist.spawn(disagree_job, nprocs=2, start_method="forkserver", timeout=150)


EAGER = list(_eager_cases(0))


@pytest.mark.parametrize("case", EAGER)
def test_eager_collectives_that_disagree_raise_on_every_rank(runs, case):
    for run in runs:
        message = run[case]
        assert message.startswith("DistError: collectives disagree on process group "
                                  "'default'"), message
        assert "rank 0: " in message and "rank 1: " in message, message
        assert "rank(s) 1 differ from rank 0" in message, message


def test_the_message_names_each_ranks_call(runs):
    message = runs[0]["all_reduce"]
    assert "rank 0: all_reduce((4,):float32, op=SUM)" in message, message
    assert "rank 1: all_reduce((5,):float32, op=SUM)" in message, message
    assert "op=MAX" in runs[1]["all_reduce op"]
    assert "rank 1: barrier()" in runs[0]["barrier against all_reduce"]


@pytest.mark.parametrize("case,given", [("tp", "(2,8)"), ("cp", "(2,8)")])
def test_model_parallel_ranks_fed_other_sequence_lengths_raise(runs, case, given):
    shorter = "(2,6)" if case == "tp" else "(2,4)"
    for run in runs:
        message = run[case]
        assert message.startswith("DistError: collectives disagree on process group "
                                  f"'mesh"), message
        assert f"rank 0: the model's forward on inputs of shapes {given}" in message, message
        assert f"rank 1: the model's forward on inputs of shapes {shorter}" in message, message
        assert "must be given the same batch" in message


@pytest.mark.parametrize("case", ["state_dict vs barrier", "state_dict vs a step"])
def test_fsdp_state_dict_on_rank_0_only_says_every_rank_must_call_it(runs, case):
    for run in runs:
        message = run[case]
        assert message.startswith("DistError: collectives disagree"), message
        assert "in state_dict() (every rank must call it" in message, message
    assert "rank 1: barrier()" in runs[0]["state_dict vs barrier"]
    assert "rank 1: graph" in runs[0]["state_dict vs a step"]


def test_ranks_running_different_graphs_are_named_at_the_backward(runs):
    for run in runs:
        message = run["ddp branch"]
        assert message.startswith("DistError: collectives disagree"), message
        assert "rank 0: graph0 backward" in message and "rank 1: graph0 backward" in message
        assert "rank(s) 1 differ from rank 0" in message, message


def test_the_groups_survive_and_agreeing_calls_still_work(runs):
    for run in runs:
        assert run["survives"] == [3.0, 3.0, 3.0]
        assert run["state_dict on every rank"] is True
