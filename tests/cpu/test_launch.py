"""spawn(): ranks as processes or threads, results back intact, failures named by rank; and
the launcher (python -m spmd.runtime.run) on this machine: restarts, hosts coming and going."""

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


# the launcher's restarts and elastic membership: agents on this machine over 127.0.0.1
# (tests/cpu/test_hosts.py runs the launcher across network namespaces)

KILLED_ONCE = """
import json, os, pathlib, signal, sys
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
    os.kill(os.getpid(), signal.SIGKILL)
import torch
from spmd import runtime as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
keys = ("RANK", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
        "SPMD_AGENT_STORE")
record = {**{k: os.environ[k] for k in keys}, "sum": t.item()}
name = os.environ["TORCHELASTIC_RESTART_COUNT"] + "-" + os.environ["RANK"] + ".json"
pathlib.Path(sys.argv[1], name).write_text(json.dumps(record))
dist.destroy_process_group()
"""


def _launcher(*args: str) -> list[str]:
    import sys

    return [sys.executable, "-m", "spmd.runtime.run", *args]


def _written(folder) -> dict[str, dict]:
    import json

    return {p.stem: json.loads(p.read_text()) for p in folder.glob("*.json")}


@pytest.mark.parametrize("restarts", [1, 0])
def test_a_killed_rank_restarts_the_job(tmp_path, restarts):
    import subprocess

    script = tmp_path / "job.py"
    script.write_text(KILLED_ONCE)
    out = subprocess.run(_launcher("--standalone", "--nproc-per-node", "2", "--max-restarts",
                                   str(restarts), str(script), str(tmp_path)),
                         capture_output=True, text=True, timeout=100)
    killed = "rank 1 (local rank 1 on this host) was killed by signal SIGKILL"
    if restarts == 0:
        assert out.returncode == 1, out.stderr
        assert killed in out.stderr and "restarting" not in out.stderr
        assert _written(tmp_path) == {}
        return
    assert out.returncode == 0, out.stderr
    assert f"restarting the job (restart 1 of 1) after {killed}" in out.stderr
    assert _written(tmp_path) == {  # round 1's ranks, and only theirs
        f"1-{rank}": {"RANK": str(rank), "WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "1",
                      "TORCHELASTIC_MAX_RESTARTS": "1", "SPMD_AGENT_STORE": "launch/none/job/1",
                      "sum": 2.0}
        for rank in (0, 1)}


def test_restarts_stop_at_max_restarts(tmp_path):
    import subprocess

    script = tmp_path / "fail.py"
    script.write_text("import os, pathlib, sys\n"
                      "pathlib.Path(sys.argv[1], os.environ['TORCHELASTIC_RESTART_COUNT'] +"
                      " '.json').write_text('{}')\n"
                      "sys.exit(3)\n")
    out = subprocess.run(_launcher("--standalone", "--max-restarts", "2", str(script),
                                   str(tmp_path)),
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 1, out.stderr
    assert sorted(_written(tmp_path)) == ["0", "1", "2"]  # N + 1 rounds ran
    assert "(restart 1 of 2)" in out.stderr and "(restart 2 of 2)" in out.stderr
    assert "restart 3" not in out.stderr
    assert ("rank 0 (local rank 0 on this host) exited with code 3 (no restarts left: 2 used)"
            in out.stderr)


# Node 1's ranks sleep until the test kills their agent; node 0's wait for them in an
# all-reduce, which fails once they are gone. A round that node 1 missed (it came after
# the last call) waits for it to join.
TWO_HOSTS = """
import json, os, pathlib, sys, time
import torch
from spmd import runtime as dist
keys = ("RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT")
env = {k: os.environ[k] for k in keys}
round = os.environ["SPMD_AGENT_STORE"].rsplit("/", 1)[1]
if env["GROUP_WORLD_SIZE"] == "1" and env["TORCHELASTIC_RESTART_COUNT"] == "0":
    time.sleep(600)
dist.init_process_group("gloo")
pathlib.Path(sys.argv[1], round + "-" + env["RANK"] + ".json").write_text(json.dumps(env))
if env["GROUP_RANK"] == "1":
    time.sleep(600)
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == float(env["WORLD_SIZE"])
"""


@pytest.mark.parametrize("nnodes", ["1:2", "2"])
def test_a_host_whose_agent_is_killed(tmp_path, nnodes):
    """Two agents over 127.0.0.1; node 1's is killed (SIGKILL) while its ranks run. With
    ``--nnodes 1:2`` node 0 goes on alone in the next round; with ``--nnodes 2`` that round
    needs node 1, which is named once the join timeout has passed."""
    import signal
    import subprocess

    from spmd.runtime.launch import free_port

    script = tmp_path / "job.py"
    script.write_text(TWO_HOSTS)
    common = ("--nnodes", nnodes, "--max-restarts", "1", "--join-last-call", "3",
              "--join-timeout", "5", "--master-addr", "127.0.0.1",
              "--master-port", str(free_port()))
    # node 1 first: it waits for node 0's store, and so joins the first round in time
    node1 = subprocess.Popen(_launcher(*common, "--node-rank", "1", str(script),
                                       str(tmp_path)),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    node0 = subprocess.Popen(_launcher(*common, "--node-rank", "0", "--nproc-per-node", "2",
                                       str(script), str(tmp_path)),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not any(r["GROUP_RANK"] == "1" for r in _written(tmp_path).values()):
            assert time.monotonic() < deadline, "node 1's rank did not start"
            assert node0.poll() is None, node0.communicate()[1]
            time.sleep(0.1)
        node1.send_signal(signal.SIGKILL)
        _, err = node0.communicate(timeout=60)
    finally:
        for agent in (node0, node1):
            if agent.poll() is None:
                agent.kill()
            agent.wait()
    assert "restarting the job (restart 1 of 1) after rank" in err, err
    if nnodes == "2":
        assert node0.returncode == 1, err
        assert "host(s) with node rank [1] never joined within 5 s (1 of 2 did" in err
        return
    assert node0.returncode == 0, err
    last = max(int(name.split("-")[0]) for name in _written(tmp_path))
    assert {k: r for k, r in _written(tmp_path).items() if k.startswith(f"{last}-")} == {
        f"{last}-{rank}": {"RANK": str(rank), "WORLD_SIZE": "2", "GROUP_RANK": "0",
                           "GROUP_WORLD_SIZE": "1", "TORCHELASTIC_RESTART_COUNT": "1"}
        for rank in (0, 1)}


def test_a_late_host_joins_in_a_new_round(tmp_path):
    """``--nnodes 1:2``: node 0 starts alone after the last call; node 1, started later,
    makes both agents start a new round with it, which uses no restart."""
    import subprocess

    from spmd.runtime.launch import free_port

    script = tmp_path / "job.py"
    script.write_text(
        "import json, os, pathlib, sys, time\n"
        "keys = ('RANK', 'WORLD_SIZE', 'GROUP_RANK', 'TORCHELASTIC_RESTART_COUNT')\n"
        "round = os.environ['SPMD_AGENT_STORE'].rsplit('/', 1)[1]\n"
        "pathlib.Path(sys.argv[1], round + '-' + os.environ['RANK'] + '.json').write_text(\n"
        "    json.dumps({k: os.environ[k] for k in keys}))\n"
        "if os.environ['GROUP_WORLD_SIZE'] == '1':\n"
        "    time.sleep(600)  # until node 1 comes\n")
    common = ("--nnodes", "1:2", "--join-last-call", "1", "--join-timeout", "30",
              "--master-addr", "127.0.0.1", "--master-port", str(free_port()))
    node0 = subprocess.Popen(_launcher(*common, "--node-rank", "0", str(script), str(tmp_path)),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    node1 = None
    try:
        deadline = time.monotonic() + 60
        while "0-0" not in _written(tmp_path):  # node 0's rank runs alone
            assert time.monotonic() < deadline, "node 0's rank did not start"
            assert node0.poll() is None, node0.communicate()[1]
            time.sleep(0.1)
        node1 = subprocess.Popen(_launcher(*common, "--node-rank", "1", str(script),
                                           str(tmp_path)),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        results = [(p.communicate(timeout=60)[1], p.returncode) for p in (node0, node1)]
    finally:
        for agent in (node0, node1):
            if agent is not None and agent.poll() is None:
                agent.kill()
                agent.wait()
    for err, code in results:
        assert code == 0, err
    assert "node rank(s) [1] joined (round 1; a host joining uses no restart)" in results[0][0]
    assert _written(tmp_path) == {
        "0-0": {"RANK": "0", "WORLD_SIZE": "1", "GROUP_RANK": "0",
                "TORCHELASTIC_RESTART_COUNT": "0"},
        **{f"1-{rank}": {"RANK": str(rank), "WORLD_SIZE": "2", "GROUP_RANK": str(rank),
                         "TORCHELASTIC_RESTART_COUNT": "0"} for rank in (0, 1)}}
