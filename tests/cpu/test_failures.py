"""Failures never hang: timeouts, dead ranks and mismatched calls end in errors naming ranks."""

from __future__ import annotations

import os
import queue
import signal
import time
from datetime import timedelta

import pytest
import torch

from spmd import runtime as dist
from spmd.runtime import FileStore, SpawnError


def _attempt(fn):
    try:
        fn()
    except Exception as e:  # returned to the test process for inspection
        return type(e).__name__, str(e), isinstance(e, TimeoutError)
    return None


def _signals(outbox):
    """A store of the test's own, outside the job under test, for ranks to say where they
    are (it outlives every rank, unlike the job's store on rank 0)."""
    return FileStore(os.path.join(outbox, "signals"), timeout=timedelta(seconds=30))


def _hanging_rank(rank, outbox):
    signals = _signals(outbox)
    dist.init_process_group("gloo", timeout=timedelta(seconds=3))
    dist.all_reduce(torch.ones(1))
    if rank == 2:
        time.sleep(8)
        signals.set("rank 2 is back", b"1")
        return None
    result = _attempt(lambda: dist.all_reduce(torch.ones(1)))
    result = (result, signals.check(["rank 2 is back"]))
    signals.set(f"diagnosed/{rank}", b"1")
    if rank == 0:  # rank 0 serves the store: it stays until rank 1 has its diagnosis
        signals.wait(["diagnosed/1"])
    return result


def test_timeout_names_the_rank_that_did_not_take_part(tmp_path):
    out = dist.spawn(_hanging_rank, args=(str(tmp_path),), nprocs=3, start_method="forkserver",
                     timeout=60)
    for (name, message, is_timeout), rank_2_was_back in out[:2]:
        assert name == "DistTimeoutError" and is_timeout
        assert "all_reduce on process group 'default' (collective 2) timed out after 3s" in message
        assert "rank 2 (at collective 1) did not take part in collective 2" in message
        assert not rank_2_was_back  # the timeout fired while rank 2 still hung


def _report(outbox, rank, result):
    """Survivors write their answer to a file: spawn stops them once the killed rank is seen."""
    import pickle

    tmp = os.path.join(outbox, f"{rank}.tmp")
    with open(tmp, "wb") as f:
        pickle.dump(result, f)
    os.rename(tmp, os.path.join(outbox, f"{rank}.pkl"))
    return result


def _answers(outbox, ranks, timeout=90.0):
    import pickle

    deadline = time.monotonic() + timeout
    paths = [os.path.join(outbox, f"{r}.pkl") for r in ranks]
    while not all(os.path.exists(p) for p in paths):
        assert time.monotonic() < deadline, f"no answer from ranks {ranks}"
        time.sleep(0.05)
    out = []
    for p in paths:
        with open(p, "rb") as f:
            out.append(pickle.load(f))
    return out


def _dying_rank(rank, where, outbox):
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    dist.all_reduce(torch.ones(1))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if where == "collective":
        result = _attempt(lambda: dist.all_reduce(torch.ones(1000)))
    else:
        result = _attempt(lambda: dist.recv(torch.ones(4), src=1))
    _report(outbox, rank, result)
    time.sleep(60)  # stay alive: the test, not this rank, decides when it is over


@pytest.mark.parametrize("where", ["collective", "p2p"])
def test_a_killed_rank_is_named_within_the_timeout(where, tmp_path):
    nprocs = 3 if where == "collective" else 2
    ctx = dist.spawn(_dying_rank, args=(where, str(tmp_path)), nprocs=nprocs,
                     start_method="forkserver", join=False, timeout=60)
    survivors = [r for r in range(nprocs) if r != 1]
    for name, message, is_timeout in _answers(str(tmp_path), survivors):
        assert name == "DistError", message
        assert "rank 1 is gone" in message, message
        assert not is_timeout  # the death was seen, not the 20 s timeout waited out
    with pytest.raises(SpawnError, match="rank 1 was killed by SIGKILL"):
        ctx.join()


def _store_host_dies(rank, outbox):
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    dist.all_reduce(torch.ones(1))
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    _report(outbox, rank, _attempt(lambda: dist.all_reduce(torch.ones(1))))
    time.sleep(60)


def test_death_of_the_store_host_is_explained(tmp_path):
    ctx = dist.spawn(_store_host_dies, args=(str(tmp_path),), nprocs=2,
                     start_method="forkserver", join=False, timeout=60)
    ((name, message, _),) = _answers(str(tmp_path), [1])
    assert "rank 0" in message and "store" in message, message
    with pytest.raises(SpawnError, match="rank 0 was killed"):
        ctx.join()


def _mismatch(rank, outbox):
    signals = _signals(outbox)
    dist.init_process_group("gloo", timeout=timedelta(seconds=10), debug="detail")
    dist.all_reduce(torch.ones(2))
    if rank == 1:
        result = _attempt(lambda: dist.broadcast(torch.ones(3), src=0))
    else:
        result = _attempt(lambda: dist.all_reduce(torch.ones(2)))
    signals.set(f"diagnosed/{rank}", b"1")
    if rank == 0:  # rank 0 serves the store: it stays until the others have read from it
        signals.wait(["diagnosed/1", "diagnosed/2"])
    return result


def test_debug_mode_reports_what_every_rank_called(tmp_path):
    out = dist.spawn(_mismatch, args=(str(tmp_path),), nprocs=3, start_method="forkserver",
                     timeout=60)
    for name, message, _ in out:
        assert name == "DistError"
        assert "collective mismatch on process group 'default' at collective 2" in message
        assert "rank 0: all_reduce((2,):float32, op=SUM)" in message
        assert "rank 1: broadcast((3,):float32, src=0)" in message
        assert "rank 2: all_reduce((2,):float32, op=SUM)" in message


def _skipper(rank):
    os.environ["SPMD_DEBUG"] = "detail"  # the environment switch, not the argument
    dist.init_process_group("gloo", timeout=timedelta(seconds=2))
    if rank == 1:
        time.sleep(4)
        return None
    return _attempt(lambda: dist.all_reduce(torch.ones(2)))


def test_debug_mode_names_a_rank_that_never_calls():
    out = dist.spawn(_skipper, nprocs=2, start_method="forkserver", timeout=60)
    name, message, is_timeout = out[0]
    assert is_timeout and "rank 1 never called collective 1" in message


def _late_for_barrier(rank, wait_all):
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    if rank >= 2:
        time.sleep(4)
        return None
    return _attempt(lambda: dist.monitored_barrier(timeout=timedelta(seconds=1),
                                                   wait_all_ranks=wait_all))


@pytest.mark.parametrize("wait_all", [False, True])
def test_monitored_barrier_names_missing_ranks(wait_all):
    out = dist.spawn(_late_for_barrier, args=(wait_all,), nprocs=4, start_method="thread",
                     timeout=60)
    name, message, is_timeout = out[0]
    assert is_timeout
    assert ("rank 2, 3 did not arrive" if wait_all else "rank 2 did not arrive") in message
    assert out[1][0] == "DistTimeoutError" and "did not arrive" in out[1][1]


def _barriers_back_to_back(rank):
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    try:
        for i in range(40):
            dist.monitored_barrier(timeout=timedelta(seconds=2), wait_all_ranks=i % 2 == 1)
            if i % 10 == 0:
                dist.all_reduce(torch.ones(1))  # other collectives between barriers
        return dist.get_rank()
    finally:
        dist.destroy_process_group()


def test_monitored_barriers_back_to_back_all_pass():
    """Rank 0 used to delete a barrier's answer as it entered the next one, which it may
    do before a slower rank has read it: that rank then waited for an answer that was
    gone and timed out (torch's test_monitored_barrier_gloo found it)."""
    assert dist.spawn(_barriers_back_to_back, nprocs=3, start_method="forkserver",
                      timeout=60) == [0, 1, 2]


def _raise_while_others_wait(rank, outcomes):
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    if rank == 2:
        raise KeyError("rank two gives up")
    outcomes.put((rank, _attempt(lambda: dist.all_reduce(torch.ones(1)))))


def test_thread_rank_failure_aborts_the_others_quickly():
    outcomes = queue.Queue()  # thread-ranks: the test sees what the others ran into
    with pytest.raises(SpawnError, match="rank 2 raised KeyError"):
        dist.spawn(_raise_while_others_wait, args=(outcomes,), nprocs=3,
                   start_method="thread", timeout=60)
    # The failure of rank 2 ends the others' all_reduce: their 60 s timeout never fires.
    try:
        others = dict(outcomes.get(timeout=30) for _ in range(2))
    except queue.Empty:
        pytest.fail("ranks 0 and 1 still wait in all_reduce: rank 2's failure did not abort them")
    for rank in (0, 1):
        name, message, is_timeout = others[rank]
        assert not is_timeout, message
        assert "was aborted: rank 2 failed" in message, message


def _short_wait(rank):
    # the size check on (the default): a small async call rides on its row and returns at
    # once, so rank 0's operation is in flight while rank 1 still sleeps
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    if rank == 1:
        time.sleep(2)
    work = dist.all_reduce(torch.ones(1), async_op=True)
    result = _attempt(lambda: work.wait(timeout=timedelta(seconds=0.2))) if rank == 0 else None
    work.wait()
    return result


def test_work_wait_with_a_short_timeout():
    out = dist.spawn(_short_wait, nprocs=2, start_method="forkserver", timeout=60)
    name, message, is_timeout = out[0]
    assert is_timeout and "still running" in message
