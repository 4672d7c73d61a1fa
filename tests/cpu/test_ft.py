"""Live recovery of data-parallel replicas (spmd.runtime.ft): a replica killed in a
step is dropped from that step's average, the others go on without a restart, and a
replacement joins at a step boundary, healed from a peer (no checkpoint); the run equals,
step by step, one process fed exactly the batches of the replicas that took part."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from datetime import timedelta

import pytest
import torch

from spmd.runtime.store.tcp_store import TCPStore
from tests import ft_job as job

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _replica(port, name, out, *extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    return subprocess.Popen([sys.executable, os.path.join(REPO, "tests", "ft_job.py"),
                             str(port), name, str(out), "--steps", "6", *extra],
                            cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@contextlib.contextmanager
def _store():
    """A store that outlives the replicas (the test serves it); its port."""
    from spmd.runtime.launch import free_port

    port = free_port()
    server = TCPStore("127.0.0.1", port, None, True, timedelta(seconds=60),
                      wait_for_workers=False)
    try:
        yield port
    finally:
        server.close()


def _finished(procs, tmp_path, names):
    """Wait for the replicas (each must succeed); what each wrote, by name."""
    for proc in procs:
        _, proc.err_text = proc.communicate(timeout=100)
        assert proc.returncode == 0, proc.err_text[-3000:]
    return {r: torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in names}


def _one_process(steps):
    """The run one process makes fed, at each step, the batches of its members."""
    net = job.model()
    opt = job.optimizer(net)
    for step, members in steps:
        xs, ys = zip(*(job.batch(step, r) for r in members))
        (net(torch.cat(xs)) - torch.cat(ys)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return net, opt


def test_a_lost_replica_is_dropped_and_a_replacement_is_healed_from_a_peer(tmp_path):
    with _store() as port:
        first = [_replica(port, "r0", tmp_path, "--wait-for", "r3:4"),
                 _replica(port, "r1", tmp_path, "--wait-for", "r3:4"),
                 _replica(port, "r2", tmp_path, "--die", "2")]
        assert first[2].wait(timeout=100) == -9  # killed in step 2, after its backward
        replacement = _replica(port, "r3", tmp_path)
        results = _finished((*first[:2], replacement), tmp_path, ("r0", "r1", "r3"))
    steps = results["r0"]["steps"]
    assert [s for s, _ in steps] == list(range(6))
    assert steps[0][1] == ["r0", "r1", "r2"] and steps[2][1] == ["r0", "r1"]  # dropped
    assert "r3" in steps[-1][1]  # the replacement took part by the end
    joined = next(s for s, members in steps if "r3" in members)
    assert [s for s, _ in results["r3"]["steps"]] == list(range(joined, 6))
    net, opt = _one_process(steps)
    for name, out in results.items():
        for got, want in zip(out["params"], net.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-12)
        for got, p in zip(out["momenta"], net.parameters()):
            torch.testing.assert_close(got, opt.state[p]["momentum_buffer"], rtol=0,
                                       atol=1e-12)
    for got, want in zip(results["r3"]["params"], results["r0"]["params"]):
        assert torch.equal(got, want)  # healed, then stepped alike: the same bits


def test_a_replica_beating_is_awaited_by_the_next_quorum_before_it_asks_to_join():
    """A newcomer that has started (its Manager beats) but not yet asked for a quorum is
    waited for by the others' next one, which then heals it; it used to be registered
    only once it proposed, so a quorum closing in between went on without it (and a
    survivor that finished left it with no peer to heal from: CI saw that)."""
    import threading

    from spmd.runtime.ft import Manager

    with _store() as port:
        store = TCPStore("127.0.0.1", port, None, False, timedelta(seconds=30))

        def manager(rid, state):
            return Manager(store, rid, timeout=timedelta(seconds=20), rank=0, world_size=1,
                           state_dict=lambda: dict(state),
                           load_state_dict=lambda got: state.update(got))

        old_state, new_state = {"w": torch.arange(3.0)}, {"w": torch.zeros(3)}
        old = manager("old", old_state)
        assert old.start_step() == ["old"]
        old.end_step()
        new = manager("new", new_state)  # beating; it asks for a quorum later
        got = {}
        thread = threading.Thread(target=lambda: got.update(old=old.start_step()))
        thread.start()
        store.wait(["ft/q/1/join/old/0"], timedelta(seconds=30))  # old asked for its quorum
        got["new"] = new.start_step()
        thread.join(timeout=60)
        assert not thread.is_alive()
        old.close()
        new.close()
    assert got == {"old": ["new", "old"], "new": ["new", "old"]}
    assert new.step == old.step == 1 and torch.equal(new_state["w"], old_state["w"])


def _progress(out, name):
    try:
        return int((out / f"{name}.progress").read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def test_a_replica_stalled_past_its_heartbeat_is_left_out_then_healed(tmp_path):
    """r2 stops (SIGSTOP) in step 2 after its backward: the others, its heartbeat 2 s
    old, average step 2 without it and go on; continued once r0 finished step 3, r2
    finds its step done without it, drops its state and is healed by the next quorum.
    Nothing it computed while behind reaches the others."""
    import signal
    import time

    with _store() as port:
        short = ("--timeout", "5", "--wait-dropped", "r2:5")
        procs = [_replica(port, "r0", tmp_path, *short), _replica(port, "r1", tmp_path, *short),
                 _replica(port, "r2", tmp_path, "--stall", "2", "--timeout", "5")]
        deadline = time.monotonic() + 90
        while _progress(tmp_path, "r0") < 4:  # polling files the replicas write
            assert time.monotonic() < deadline and procs[0].poll() is None
            time.sleep(0.05)
        os.kill(int((tmp_path / "r2.stalled").read_text()), signal.SIGCONT)
        results = _finished(procs, tmp_path, ("r0", "r1", "r2"))
    steps = results["r0"]["steps"]
    assert steps[1][1] == ["r0", "r1", "r2"] and steps[2][1] == ["r0", "r1"]
    assert [m for s, m in results["r2"]["steps"] if s == 2] == [[]]  # left out
    net, opt = _one_process(steps)
    for out in results.values():
        for got, want in zip(out["params"], net.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-12)


def _replica_job(port, name, out, strategy, *extra, restarts=0):
    """A replica that is a job of its own: 2 ranks under spmd-run, ``strategy`` inside."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    return subprocess.Popen(
        [sys.executable, "-m", "spmd.runtime.run", "--standalone", "--nproc-per-node", "2",
         "--max-restarts", str(restarts), os.path.join(REPO, "tests", "ft_job.py"),
         str(port), name, str(out), "--steps", "6", "--strategy", strategy, *extra],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_a_replica_sharded_inside_loses_a_rank_and_comes_back_healed(tmp_path, strategy):
    """hsdp with a replicate dimension that loses and gains members: 3 replicas of 2
    ranks each (the model sharded, or replicated, inside each), rank 1 of r2 killed in
    step 2 after its backward: the others average step 2 without r2 and go on; r2's
    launcher stops its rank 0 and restarts the replica, which joins as r2.1 and is
    healed shard by shard from a peer. Equal, step by step, to one process
    fed the batches of each step's members."""
    with _store() as port:
        survivors = [_replica_job(port, r, tmp_path, strategy, "--wait-for", "r2.1:4")
                     for r in ("r0", "r1")]
        lost = _replica_job(port, "r2", tmp_path, strategy, "--die", "2", "--die-rank", "1",
                            restarts=1)
        results = _finished((*survivors, lost), tmp_path, ("r0", "r1", "r2.1"))
    assert "restarting the job (restart 1 of 1) after rank 1" in lost.err_text
    steps = results["r0"]["steps"]
    assert [s for s, _ in steps] == list(range(6))
    assert steps[0][1] == ["r0", "r1", "r2"] and steps[2][1] == ["r0", "r1"]
    assert "r2.1" in steps[-1][1]
    net, opt = _one_process(steps)
    for out in results.values():
        for got, want in zip(out["params"], net.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-12)
        for got, p in zip(out["momenta"], net.parameters()):
            torch.testing.assert_close(got, opt.state[p]["momentum_buffer"], rtol=0,
                                       atol=1e-12)


def test_a_replica_whose_rank_stalls_names_it_and_is_replaced(tmp_path):
    """Rank 1 of r2 (fsdp inside) stops (SIGSTOP) in step 2 after its backward, which its
    launcher cannot see: the others average step 2 without r2; r2's rank 0 finds its
    replica's rank 1 silent, names it and fails, so the launcher restarts the replica,
    healed as r2.1. No hang, and the run equals one process as above."""
    with _store() as port:
        short = ("--timeout", "5")
        survivors = [_replica_job(port, r, tmp_path, "fsdp", *short, "--wait-for", "r2.1:4")
                     for r in ("r0", "r1")]
        lost = _replica_job(port, "r2", tmp_path, "fsdp", *short, "--stall", "2",
                            "--die-rank", "1", restarts=1)
        results = _finished((*survivors, lost), tmp_path, ("r0", "r1", "r2.1"))
    assert "ft: replica r2: rank(s) [1] of this replica stopped beating" in lost.err_text
    steps = results["r0"]["steps"]
    assert steps[1][1] == ["r0", "r1", "r2"] and steps[2][1] == ["r0", "r1"]
    assert "r2.1" in steps[-1][1]
    net, _ = _one_process(steps)
    for out in results.values():
        for got, want in zip(out["params"], net.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-12)
