"""all_reduce_hierarchical: the same result as all_reduce on groups that span hosts
(hosts named per rank with SPMD_HOST, so it runs on loopback; tests/cpu/test_hosts.py
runs it across network namespaces), and the plain all-reduce where the group does not
span hosts evenly."""

from __future__ import annotations

import os

import pytest
import torch

from spmd import runtime as dist


def _cases(rank: int, hosts: list[str]) -> dict:
    os.environ["SPMD_HOST"] = hosts[rank]
    dist.init_process_group("gloo")
    out = {}
    g = torch.Generator().manual_seed(rank)
    for numel in (1, 7, 1000, 4099):
        for op in ("SUM", "AVG", "MAX", "MIN"):
            x = torch.randn(numel, dtype=torch.float64, generator=g)
            flat, hier = x.clone(), x.clone()
            dist.all_reduce(flat, getattr(dist.ReduceOp, op))
            dist.all_reduce_hierarchical(hier, getattr(dist.ReduceOp, op))
            out[(numel, op)] = (flat, hier)
    # not contiguous, asynchronous, two in flight
    base = torch.arange(24, dtype=torch.float64).view(4, 6) * (rank + 1)
    a, b = base.t(), base.clone()
    w1 = dist.all_reduce_hierarchical(a, async_op=True)
    w2 = dist.all_reduce_hierarchical(b, async_op=True)
    w2.wait()
    w1.wait()
    out["strided"] = (a.clone(), b.clone())
    levels = dist.hierarchy()
    out["levels"] = None if levels is None else (levels.hosts, levels.per_host,
                                                 levels.within.ranks, levels.across.ranks)
    for m in (1, 5):  # gathers and reduce-scatters, in group rank order
        piece = torch.arange(m, dtype=torch.float64) + 100 * rank
        flat, hier = torch.empty(4 * m, dtype=torch.float64), torch.zeros(4 * m, dtype=torch.float64)
        dist.all_gather_into_tensor(flat, piece)
        dist.all_gather_hierarchical(hier, piece)
        out[("gather", m)] = (flat, hier)
        grid = torch.randn(4 * m, dtype=torch.float64, generator=g)
        for op in ("SUM", "AVG"):
            flat, hier = torch.empty(m, dtype=torch.float64), torch.zeros(m, dtype=torch.float64)
            dist.reduce_scatter_tensor(flat, grid.clone(), getattr(dist.ReduceOp, op))
            work = dist.reduce_scatter_hierarchical(hier, grid.clone(), getattr(dist.ReduceOp, op),
                                                    async_op=True)
            work.wait()
            out[("scatter", m, op)] = (flat, hier)
    ints = torch.tensor([rank, 10 * rank], dtype=torch.int64)
    dist.all_reduce_hierarchical(ints)
    out["ints"] = ints
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("hosts", [["a", "a", "b", "b"], ["a", "b", "a", "b"],
                                   ["a", "b", "b", "a"], ["a", "a", "a", "b"]],
                         ids=["blocked", "interleaved", "crossed", "uneven"])
def test_hierarchical_all_reduce_equals_the_flat_one(hosts):
    results = dist.spawn(_cases, args=(hosts,), nprocs=4, start_method="forkserver",
                         timeout=100)
    world = len(hosts)
    for rank, out in enumerate(results):
        for key, (flat, hier) in ((k, v) for k, v in out.items() if isinstance(k, tuple)):
            if key[0] in ("gather", "scatter"):
                torch.testing.assert_close(hier, flat, rtol=1e-13, atol=1e-13)
                continue
            numel, op = key
            # the same sum in another order: equal to rounding (float64), max/min exactly
            if op in ("MAX", "MIN"):
                assert torch.equal(flat, hier), (rank, numel, op)
            else:
                torch.testing.assert_close(hier, flat, rtol=1e-13, atol=1e-13)
            torch.testing.assert_close(hier, results[0][(numel, op)][1], rtol=0, atol=0)
        a, b = out["strided"]
        expect = torch.arange(24, dtype=torch.float64).view(4, 6) * sum(range(1, world + 1))
        assert torch.equal(a, expect.t()) and torch.equal(b, expect)
        assert out["ints"].tolist() == [sum(range(world)), 10 * sum(range(world))]
    levels = [out["levels"] for out in results]
    if hosts == ["a", "a", "a", "b"]:
        assert levels == [None] * 4  # 3 and 1 per host: the flat all-reduce
    elif hosts == ["a", "b", "b", "a"]:  # local 1 of host a (rank 3) after host b's (2)
        assert levels[3] == (2, 2, [0, 3], [2, 3])
    elif hosts[1] == "a":
        assert levels[0] == (2, 2, [0, 1], [0, 2]) and levels[3] == (2, 2, [2, 3], [1, 3])
    else:
        assert levels[0] == (2, 2, [0, 2], [0, 1]) and levels[3] == (2, 2, [1, 3], [2, 3])


def _threaded(rank: int) -> tuple:
    import threading

    from spmd.runtime.context import current

    current().env["SPMD_HOST"] = f"h{rank // 2}"  # thread ranks: each its own variables
    dist.init_process_group("gloo")
    t = torch.ones(3) * rank
    dist.all_reduce_hierarchical(t)
    group = dist.new_group()
    dist.all_reduce_hierarchical(t, group=group)
    runner = group._hier_runner._thread
    dist.destroy_process_group()
    runner.join(30)
    return t.tolist(), runner.is_alive(), threading.current_thread().name


def test_thread_ranks_and_the_stage_thread_ends_with_its_group():
    results = dist.spawn(_threaded, nprocs=4, start_method="thread", timeout=60)
    for values, alive, _ in results:
        assert values == [24.0] * 3  # (0+1+2+3) = 6, then 4 x 6
        assert not alive


def _disagree(rank: int) -> str:
    os.environ["SPMD_HOST"] = f"h{rank // 2}"
    dist.init_process_group("gloo")
    try:
        dist.all_reduce_hierarchical(torch.ones(4 if rank == 0 else 5))
        return "ran"
    except dist.DistError as e:
        return str(e)
    finally:
        dist.destroy_process_group()


def test_ranks_that_disagree_are_named_before_any_stage_runs():
    """One size check on the group for the whole call (its stages run unchecked)."""
    results = dist.spawn(_disagree, nprocs=4, start_method="forkserver", timeout=100)
    for message in results:
        assert "all_reduce_hierarchical" in message and "rank 0" in message, message
