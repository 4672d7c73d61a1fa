"""Every collective on 2 and 3 process-ranks and 4 thread-ranks, against values computed here.

One job per world size runs every operation once and returns what each rank saw; the
tests below check it, so each world size costs one spawn.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from spmd import runtime as dist

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int32, torch.int64, torch.int8, torch.uint8]
FLOAT_OPS = ["SUM", "PRODUCT", "MIN", "MAX", "AVG"]
INT_OPS = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]


def base(rank: int, dtype: torch.dtype = torch.float32, n: int = 4) -> torch.Tensor:
    """Rank-dependent small values whose products fit in int8 for 4 ranks."""
    return ((torch.arange(n) % 2) + rank + 1).to(dtype)


def sparse(rank: int) -> torch.Tensor:
    """A (6, 2) hybrid COO tensor: row ``rank`` and row 5, values depending on the rank."""
    values = torch.tensor([[rank + 1.0, 2.0], [3.0, rank * 10.0]])
    return torch.sparse_coo_tensor(torch.tensor([[rank, 5]]), values, (6, 2))


def expected_reduce(op: str, world: int, dtype: torch.dtype) -> torch.Tensor:
    stack = torch.stack([base(r, torch.int64) for r in range(world)])
    if op == "SUM":
        out = stack.sum(0)
    elif op == "PRODUCT":
        out = stack.prod(0)
    elif op == "MIN":
        out = stack.min(0).values
    elif op == "MAX":
        out = stack.max(0).values
    elif op == "AVG":
        return stack.double().mean(0).to(dtype)
    else:
        fn = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op]
        out = stack[0]
        for row in stack[1:]:
            out = fn(out, row)
    return out.to(dtype)


def every_op(rank: int) -> dict:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    n = dist.get_world_size()
    out: dict = {"rank": dist.get_rank(), "world": n, "backend": dist.get_backend()}
    for dtype in FLOATS + INTS:
        for op in FLOAT_OPS if dtype.is_floating_point else INT_OPS:
            t = base(rank, dtype)
            dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
            out[("all_reduce", dtype, op)] = t
    c = base(rank).to(torch.complex64) * (1 + 1j)
    dist.all_reduce(c)
    out["all_reduce complex"] = c
    flags = torch.tensor([rank % 2 == 0, True, False])
    dist.all_reduce(flags, op=dist.ReduceOp.BAND)
    out["all_reduce bool BAND"] = flags
    torch_op = base(rank)
    dist.all_reduce(torch_op, op=torch.distributed.ReduceOp.MAX)  # torch's enum works too
    out["all_reduce torch op"] = torch_op
    out["all_reduce sparse"] = {}
    for op in ("SUM", "AVG"):  # each rank's own indices, one shared; a hybrid tensor too
        sp = sparse(rank)
        work = dist.all_reduce(sp, op=getattr(dist.ReduceOp, op), async_op=op == "AVG")
        if work is not None:
            work.wait()
        out["all_reduce sparse"][op] = sp
    strided = base(rank, n=8)[::2]  # a non-contiguous view is reduced in place
    dist.all_reduce(strided)
    out["all_reduce strided"] = strided

    t = base(rank)
    work = dist.all_reduce(t, async_op=True)
    out["async"] = (work.wait(), work.is_completed(), work.exception(), t.clone())
    t = base(rank)
    avg = dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=True)
    out["async avg future"] = avg.get_future().wait()
    out["async avg tensor"] = t
    # a callback on the future, then wait(): the backend runs the callback while wait()
    # is blocked on it, and both complete the same work
    t = base(rank)
    work = dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=True)
    seen: list = []
    fut = work.get_future()
    fut.add_done_callback(lambda f: seen.append(f.value()))
    work.wait(timeout=30)
    fut.wait()
    out["callback then wait"] = (t.clone(), len(seen))

    for src in range(n):
        t = base(rank)
        dist.broadcast(t, src=src)
        out[("broadcast", src)] = t
    for dst in range(n):
        t = base(rank)
        dist.reduce(t, dst=dst, op=dist.ReduceOp.AVG)
        out[("reduce avg", dst)] = t
    t = base(rank)
    dist.reduce(t, dst=n - 1)
    out["reduce sum"] = t

    gathered = [torch.zeros(4) for _ in range(n)]
    dist.all_gather(gathered, base(rank))
    out["all_gather"] = gathered
    flat = torch.zeros(4 * n)
    dist.all_gather_into_tensor(flat, base(rank))
    out["all_gather_into_tensor"] = flat
    stacked = torch.zeros(n, 4)
    dist.all_gather_into_tensor(stacked, base(rank))
    out["all_gather_into_tensor stacked"] = stacked
    dst = n - 1
    glist = [torch.zeros(4) for _ in range(n)] if rank == dst else None
    dist.gather(base(rank), glist, dst=dst)
    out["gather"] = glist
    mine = torch.zeros(4)
    dist.scatter(mine, [base(r) * 10 for r in range(n)] if rank == 0 else None, src=0)
    out["scatter"] = mine
    rs = torch.zeros(4)
    dist.reduce_scatter(rs, [base(rank) + i for i in range(n)])
    out["reduce_scatter"] = rs
    for op in ("SUM", "AVG", "MAX"):
        rst = torch.zeros(4)
        dist.reduce_scatter_tensor(rst, torch.cat([base(rank) + i for i in range(n)]),
                                   op=getattr(dist.ReduceOp, op))
        out[("reduce_scatter_tensor", op)] = rst
    a2a = [torch.zeros(2) for _ in range(n)]
    dist.all_to_all(a2a, [torch.full((2,), float(10 * rank + j)) for j in range(n)])
    out["all_to_all"] = a2a
    single = torch.zeros(2 * n)
    dist.all_to_all_single(single, torch.arange(2 * n, dtype=torch.float32) + 100 * rank)
    out["all_to_all_single"] = single
    # uneven: rank r sends j+1 rows to rank j
    send = torch.cat([torch.full((j + 1,), float(rank)) for j in range(n)])
    recv = torch.zeros(n * (rank + 1))
    dist.all_to_all_single(recv, send, [rank + 1] * n, [j + 1 for j in range(n)])
    out["all_to_all_single uneven"] = recv

    # the same operations again with async_op=True: a Work each, waited on at the end
    works = []
    t = base(rank)
    works.append(dist.broadcast(t, src=0, async_op=True))
    out[("async", "broadcast")] = t
    t = base(rank)
    works.append(dist.reduce(t, dst=0, async_op=True))
    out[("async", "reduce")] = t
    ag = [torch.zeros(4) for _ in range(n)]
    works.append(dist.all_gather(ag, base(rank), async_op=True))
    out[("async", "all_gather")] = ag
    agt = torch.zeros(4 * n)
    works.append(dist.all_gather_into_tensor(agt, base(rank), async_op=True))
    out[("async", "all_gather_into_tensor")] = agt
    gl = [torch.zeros(4) for _ in range(n)] if rank == 0 else None
    works.append(dist.gather(base(rank), gl, dst=0, async_op=True))
    out[("async", "gather")] = gl
    sc = torch.zeros(4)
    works.append(dist.scatter(sc, [base(r) * 10 for r in range(n)] if rank == 0 else None,
                              src=0, async_op=True))
    out[("async", "scatter")] = sc
    rsa = torch.zeros(4)
    works.append(dist.reduce_scatter(rsa, [base(rank) + i for i in range(n)], async_op=True))
    out[("async", "reduce_scatter")] = rsa
    rsta = torch.zeros(4)
    works.append(dist.reduce_scatter_tensor(rsta, torch.cat([base(rank) + i for i in range(n)]),
                                            async_op=True))
    out[("async", "reduce_scatter_tensor")] = rsta
    a2 = [torch.zeros(2) for _ in range(n)]
    works.append(dist.all_to_all(a2, [torch.full((2,), float(10 * rank + j)) for j in range(n)],
                                 async_op=True))
    out[("async", "all_to_all")] = a2
    a2s = torch.zeros(2 * n)
    works.append(dist.all_to_all_single(a2s, torch.arange(2 * n, dtype=torch.float32)
                                        + 100 * rank, async_op=True))
    out[("async", "all_to_all_single")] = a2s
    works.append(dist.barrier(async_op=True))
    out["async waits"] = [w.wait() for w in works]

    out["barrier"] = dist.barrier()
    dist.monitored_barrier(timeout=timedelta(seconds=30))
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": rank, "data": list(range(rank))})
    out["all_gather_object"] = objs
    blist = [f"from {rank}", rank] if rank == 1 else [None, None]
    dist.broadcast_object_list(blist, src=1)
    out["broadcast_object_list"] = blist
    gol = [None] * n if rank == 0 else None
    dist.gather_object(("hi", rank), gol, dst=0)
    out["gather_object"] = gol
    sol = [None]
    dist.scatter_object_list(sol, [{"to": r} for r in range(n)] if rank == n - 1 else None,
                             src=n - 1)
    out["scatter_object_list"] = sol[0]
    dist.destroy_process_group()
    out["initialized after destroy"] = dist.is_initialized()
    return out


@pytest.fixture(scope="module", params=[(2, "forkserver"), (3, "forkserver"), (4, "thread")],
                ids=["2-procs", "3-procs", "4-threads"])
def runs(request):
    n, method = request.param
    return dist.spawn(every_op, nprocs=n, start_method=method, timeout=100)


def test_identity(runs):
    n = len(runs)
    assert [r["rank"] for r in runs] == list(range(n))
    assert all(r["world"] == n and r["backend"] == "gloo" for r in runs)
    assert not any(r["initialized after destroy"] for r in runs)


@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=str)
def test_all_reduce_every_op_and_dtype(runs, dtype):
    n = len(runs)
    for op in FLOAT_OPS if dtype.is_floating_point else INT_OPS:
        want = expected_reduce(op, n, dtype)
        for r in runs:
            got = r[("all_reduce", dtype, op)]
            assert got.dtype == dtype
            assert torch.allclose(got.double(), want.double(), rtol=1e-2), (op, got, want)


def test_all_reduce_complex_bool_torch_enum_and_strided(runs):
    n = len(runs)
    want = expected_reduce("SUM", n, torch.float32)
    for r in runs:
        assert torch.equal(r["all_reduce complex"], want.to(torch.complex64) * (1 + 1j))
        assert r["all_reduce bool BAND"].tolist() == [n == 1, True, False]
        assert torch.equal(r["all_reduce torch op"], expected_reduce("MAX", n, torch.float32))
        strided_want = sum(base(k, n=8)[::2] for k in range(n))
        assert torch.equal(r["all_reduce strided"], strided_want)


def test_sparse_all_reduce_sums_every_ranks_entries(runs):
    n = len(runs)
    total = sum(sparse(k).to_dense() for k in range(n))
    for r in runs:
        got = r["all_reduce sparse"]
        assert got["SUM"].is_sparse and got["AVG"].is_sparse
        assert torch.equal(got["SUM"].to_dense(), total)
        assert torch.allclose(got["AVG"].to_dense(), total / n)


def test_async_work_and_future(runs):
    n = len(runs)
    for r in runs:
        ok, completed, exc, t = r["async"]
        assert ok is True and completed and exc is None
        assert torch.equal(t, expected_reduce("SUM", n, torch.float32))
        avg = expected_reduce("AVG", n, torch.float32)
        assert torch.allclose(r["async avg tensor"], avg)
        t, callbacks = r["callback then wait"]
        assert torch.allclose(t, avg) and callbacks == 1  # averaged once, not twice


def test_broadcast_from_every_source(runs):
    for src in range(len(runs)):
        for r in runs:
            assert torch.equal(r[("broadcast", src)], base(src))


def test_reduce_to_every_destination(runs):
    n = len(runs)
    for dst in range(n):
        got = runs[dst][("reduce avg", dst)]
        assert torch.allclose(got, expected_reduce("AVG", n, torch.float32))
    assert torch.equal(runs[n - 1]["reduce sum"], expected_reduce("SUM", n, torch.float32))


def test_all_gather_family(runs):
    n = len(runs)
    every = [base(k) for k in range(n)]
    for r in runs:
        assert all(torch.equal(a, b) for a, b in zip(r["all_gather"], every))
        assert torch.equal(r["all_gather_into_tensor"], torch.cat(every))
        assert torch.equal(r["all_gather_into_tensor stacked"], torch.stack(every))


def test_gather_and_scatter(runs):
    n = len(runs)
    gathered = runs[n - 1]["gather"]
    assert all(torch.equal(g, base(k)) for k, g in enumerate(gathered))
    assert all(r["gather"] is None for r in runs[:-1])
    for k, r in enumerate(runs):
        assert torch.equal(r["scatter"], base(k) * 10)


def test_reduce_scatter_family(runs):
    n = len(runs)
    for k, r in enumerate(runs):
        summed = sum(base(j) + k for j in range(n))
        assert torch.equal(r["reduce_scatter"], summed)
        assert torch.equal(r[("reduce_scatter_tensor", "SUM")], summed)
        assert torch.allclose(r[("reduce_scatter_tensor", "AVG")], summed / n)
        assert torch.equal(r[("reduce_scatter_tensor", "MAX")], base(n - 1) + k)


def test_all_to_all_family(runs):
    n = len(runs)
    for k, r in enumerate(runs):
        assert [t.tolist() for t in r["all_to_all"]] == [[10.0 * j + k] * 2 for j in range(n)]
        want = torch.cat([torch.arange(2 * k, 2 * k + 2, dtype=torch.float32) + 100 * j
                          for j in range(n)])
        assert torch.equal(r["all_to_all_single"], want)
        assert r["all_to_all_single uneven"].tolist() == [float(j) for j in range(n)
                                                          for _ in range(k + 1)]


def test_barriers_and_objects(runs):
    n = len(runs)
    for k, r in enumerate(runs):
        assert r["barrier"] is None
        assert r["all_gather_object"] == [{"rank": j, "data": list(range(j))} for j in range(n)]
        assert r["broadcast_object_list"] == ["from 1", 1]
        assert r["scatter_object_list"] == {"to": k}
    assert runs[0]["gather_object"] == [("hi", j) for j in range(n)]


def test_every_operation_also_runs_async(runs):
    n = len(runs)
    for k, r in enumerate(runs):
        assert r["async waits"] == [True] * 11
        assert torch.equal(r[("async", "broadcast")], base(0))
        assert torch.equal(r[("async", "all_gather_into_tensor")],
                           torch.cat([base(j) for j in range(n)]))
        assert all(torch.equal(a, b) for a, b in zip(r[("async", "all_gather")], r["all_gather"]))
        assert torch.equal(r[("async", "scatter")], r["scatter"])
        assert torch.equal(r[("async", "reduce_scatter")], r["reduce_scatter"])
        assert torch.equal(r[("async", "reduce_scatter_tensor")],
                           r[("reduce_scatter_tensor", "SUM")])
        assert [t.tolist() for t in r[("async", "all_to_all")]] == \
            [t.tolist() for t in r["all_to_all"]]
        assert torch.equal(r[("async", "all_to_all_single")], r["all_to_all_single"])
    assert torch.equal(runs[0][("async", "reduce")], expected_reduce("SUM", n, torch.float32))
    assert all(torch.equal(g, base(j)) for j, g in enumerate(runs[0][("async", "gather")]))
