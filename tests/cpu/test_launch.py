"""spawn(): ranks as processes or threads, results back intact, failures named by rank."""

from __future__ import annotations

import os
import time

import pytest

from spmd.runtime import DistTimeoutError, SpawnError, spawn
from spmd.runtime.context import getenv


def _identity(rank, extra):
    return {
        "rank": rank, "extra": extra, "env": {k: getenv(k) for k in
                                              ("RANK", "LOCAL_RANK", "WORLD_SIZE",
                                               "MASTER_ADDR")},
        "port": int(getenv("MASTER_PORT")),
    }


@pytest.mark.parametrize("method", ["spawn", "fork", "forkserver", "thread"])
def test_every_start_method_returns_results_in_rank_order(method):
    out = spawn(_identity, args=("x",), nprocs=3, start_method=method, timeout=60)
    assert [o["rank"] for o in out] == [0, 1, 2]
    for r, o in enumerate(out):
        assert o["extra"] == "x"
        assert o["env"] == {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "3",
                            "MASTER_ADDR": "127.0.0.1"}
    assert len({o["port"] for o in out}) == 1


def _tensor(rank):
    import torch

    return torch.full((1000,), float(rank))


def test_tensor_results_survive_the_process():
    import torch

    out = spawn(_tensor, nprocs=2, start_method="forkserver", timeout=60)
    assert torch.equal(out[1], torch.full((1000,), 1.0))


def _raise_on_one(rank):
    if rank == 1:
        raise ValueError("rank one is unhappy")
    time.sleep(30)


@pytest.mark.parametrize("method", ["forkserver", "thread"])
def test_a_raising_rank_stops_the_others_and_is_named(method):
    start = time.monotonic()
    with pytest.raises(SpawnError, match="rank 1 raised ValueError: rank one is unhappy") as e:
        spawn(_raise_on_one, nprocs=3, start_method=method, timeout=60)
    assert time.monotonic() - start < 15
    assert e.value.rank == 1
    assert "_raise_on_one" in e.value.remote_traceback
    assert isinstance(e.value.__cause__, ValueError)


def _exit_on_zero(rank):
    if rank == 0:
        os._exit(3)
    time.sleep(30)


def test_a_rank_that_exits_without_returning_is_named():
    with pytest.raises(SpawnError, match="rank 0 exited with code 3 without returning"):
        spawn(_exit_on_zero, nprocs=2, start_method="forkserver", timeout=60)


def _kill_self(rank):
    if rank == 1:
        os.kill(os.getpid(), 9)
    time.sleep(30)


def test_a_killed_rank_is_named():
    with pytest.raises(SpawnError, match="rank 1 was killed by SIGKILL"):
        spawn(_kill_self, nprocs=2, start_method="forkserver", timeout=60)


def _hang_on_two(rank):
    if rank == 2:
        time.sleep(90)
    return rank


@pytest.mark.parametrize("method,timeout", [("forkserver", 15), ("thread", 8)])
def test_a_hanging_rank_is_reported_after_the_timeout(method, timeout):
    # ranks 0 and 1 start and return well within the timeout on a loaded machine (1 s did
    # not: every rank was named; a process rank also imports this module, pytest with
    # it, so it has more room than a thread); rank 2 sleeps 90
    start = time.monotonic()
    with pytest.raises(DistTimeoutError,
                       match=rf"rank\(s\) 2 did not finish within {timeout}s"):
        spawn(_hang_on_two, nprocs=3, start_method=method, timeout=timeout)
    assert time.monotonic() - start < 60  # reported at the timeout, not at rank 2's end


def test_join_false_gives_a_context():
    ctx = spawn(_identity, args=(1,), nprocs=2, start_method="forkserver", join=False)
    assert len(ctx.pids()) == 2
    assert [o["rank"] for o in ctx.join()] == [0, 1]


def test_threads_accept_closures():
    seen = []
    out = spawn(lambda rank: seen.append(rank) or rank * 10, nprocs=4, start_method="thread")
    assert out == [0, 10, 20, 30] and sorted(seen) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "kwargs, exc",
    [
        ({"fn": 3}, TypeError),
        ({"args": [1]}, TypeError),
        ({"nprocs": 0}, ValueError),
        ({"start_method": "clone"}, ValueError),
        ({"timeout": -1}, ValueError),
    ],
)
def test_bad_spawn_arguments(kwargs, exc):
    call = {"fn": _identity, "args": (0,), **kwargs}
    with pytest.raises(exc):
        spawn(**call)


def test_the_launcher_runs_ranks_on_one_host(tmp_path):
    """``spmd-run --standalone``: torchrun's environment for each local rank, every rank
    a client of the agent's store (no network namespaces needed: tests/cpu/test_hosts.py
    runs it across hosts)."""
    import json
    import subprocess
    import sys

    script = tmp_path / "show.py"
    script.write_text(
        "import json, os, sys\n"  # one write a line: the ranks share an unbuffered pipe
        "from spmd.runtime.rendezvous import rendezvous\n"
        "store, rank, world = rendezvous('env://')\n"
        "store.set(f'seen/{rank}', 'yes')\n"
        "store.wait([f'seen/{r}' for r in range(world)])\n"
        "keys = ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE', 'GROUP_RANK',\n"
        "        'MASTER_ADDR', 'SPMD_HOST')\n"
        "sys.stdout.write(json.dumps({k: os.environ.get(k) for k in keys}) + '\\n')\n")
    command = os.path.join(os.path.dirname(sys.executable), "spmd-run")
    out = subprocess.run([command, "--standalone", "--nproc-per-node", "3", str(script)],
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    seen = sorted((json.loads(line) for line in out.stdout.splitlines()
                   if line.startswith("{")), key=lambda e: int(e["RANK"]))
    assert [e["RANK"] for e in seen] == ["0", "1", "2"]
    assert all(e["LOCAL_RANK"] == e["RANK"] and e["WORLD_SIZE"] == "3"
               and e["LOCAL_WORLD_SIZE"] == "3" and e["GROUP_RANK"] == "0"
               and e["MASTER_ADDR"] == "127.0.0.1" and e["SPMD_HOST"].startswith("node0:")
               for e in seen)


def test_ranks_die_with_their_agent(tmp_path):
    """An agent killed outright takes its ranks with it (PR_SET_PDEATHSIG), instead of
    leaving them to run on until their peers' collectives time out."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "sleep.py"
    script.write_text(
        "import os, pathlib, sys, time\n"
        f"pathlib.Path({str(tmp_path)!r}, 'pid' + os.environ['RANK']).write_text(str(os.getpid()))\n"
        "time.sleep(600)\n")
    agent = subprocess.Popen([sys.executable, "-m", "spmd.runtime.run", "--standalone",
                              "--nproc-per-node", "2", str(script)])
    pids = []
    deadline = time.monotonic() + 60
    while len(pids) < 2 and time.monotonic() < deadline:  # until both ranks said who they are
        pids = [int(p.read_text()) for p in tmp_path.glob("pid*") if p.read_text()]
        time.sleep(0.1)
    assert len(pids) == 2, "the ranks did not start"
    agent.send_signal(signal.SIGKILL)
    agent.wait(10)

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        with open(f"/proc/{pid}/stat") as f:  # a zombie (not yet reaped) is dead
            return f.read().split(")")[-1].split()[0] != "Z"

    deadline = time.monotonic() + 30
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids)
