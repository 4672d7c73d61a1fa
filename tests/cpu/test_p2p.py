"""Point-to-point between real ranks: send/recv, any-source, async, batches, tags."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from spmd import runtime as dist


def exchange(rank: int) -> dict:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    n = dist.get_world_size()
    out: dict = {}
    # a ring with blocking calls: even ranks send first, odd ranks receive first
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    got = torch.zeros(3)
    if rank % 2 == 0:
        dist.send(torch.full((3,), float(rank)), dst=nxt)
        out["recv from"] = dist.recv(got, src=prv)
    else:
        out["recv from"] = dist.recv(got, src=prv)
        dist.send(torch.full((3,), float(rank)), dst=nxt)
    out["ring"] = got
    # any source: everyone sends to rank 0. A tag of its own keeps these apart from the
    # batch below (a rank that is done here may already be sending its batch to rank 0).
    if rank == 0:
        senders = []
        for _ in range(n - 1):
            buf = torch.zeros(2)
            sender = dist.recv(buf, tag=7)
            senders.append((sender, buf[0].item()))
        out["any"] = sorted(senders)
    else:
        dist.send(torch.full((2,), float(rank * 11)), dst=0, tag=7)
    # tags keep messages apart: send tag 2 then tag 1, receive tag 1 first
    if rank == 0:
        a, b = torch.zeros(1), torch.zeros(1)
        w1 = dist.irecv(a, src=1, tag=1)
        w2 = dist.irecv(b, src=1, tag=2)
        w1.wait()
        w2.wait()
        out["tags"] = (a.item(), b.item(), w1.result(), w2.result())
    elif rank == 1:
        dist.isend(torch.tensor([2.0]), dst=0, tag=2).wait()
        dist.isend(torch.tensor([1.0]), dst=0, tag=1).wait()
    # batch: everyone sends to next and receives from previous at once
    buf = torch.zeros(1000)
    works = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, torch.full((1000,), float(rank)), nxt),
        dist.P2POp(dist.irecv, buf, prv),
    ])
    for w in works:
        w.wait()
    out["batch"] = buf[:3].tolist()
    # large and complex payloads
    if rank == 0:
        dist.send(torch.arange(1 << 20, dtype=torch.float64), dst=1)
        dist.send(torch.tensor([1 + 2j, 3 - 4j]), dst=1)
    elif rank == 1:
        big = torch.zeros(1 << 20, dtype=torch.float64)
        dist.recv(big, src=0)
        out["big ok"] = bool(torch.equal(big, torch.arange(1 << 20, dtype=torch.float64)))
        c = torch.zeros(2, dtype=torch.complex64)
        dist.recv(c, src=0)
        out["complex"] = c.tolist()
    dist.barrier()
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module", params=[(2, "forkserver"), (3, "forkserver"), (4, "thread")],
                ids=["2-procs", "3-procs", "4-threads"])
def runs(request):
    n, method = request.param
    return dist.spawn(exchange, nprocs=n, start_method=method, timeout=100)


def test_ring_with_blocking_send_recv(runs):
    n = len(runs)
    for k, r in enumerate(runs):
        assert r["recv from"] == (k - 1) % n
        assert r["ring"].tolist() == [float((k - 1) % n)] * 3


def test_recv_from_any_source_names_the_sender(runs):
    n = len(runs)
    assert runs[0]["any"] == [(r, 11.0 * r) for r in range(1, n)]


def test_tags_and_async_results(runs):
    assert runs[0]["tags"] == (1.0, 2.0, 1, 1)


def test_batch_isend_irecv(runs):
    n = len(runs)
    for k, r in enumerate(runs):
        assert r["batch"] == [float((k - 1) % n)] * 3


def test_large_and_complex_payloads(runs):
    assert runs[1]["big ok"] is True
    assert runs[1]["complex"] == [1 + 2j, 3 - 4j]
