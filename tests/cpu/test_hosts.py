"""Many hosts on one machine (tests/hosts.py): the harness itself, and the launcher
(``python -m spmd.runtime.run``, and torchrun) starting a job across hosts, joining in
any order, naming a host that never comes and stopping every host when a rank fails.

Each host is a network namespace on a shaped link; skipped where this machine cannot
make namespaces (not root, no iproute2 or no /dev/net/tun)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from tests import hosts as harness
from tests.hosts import Hosts, Link

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WHY = harness.unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no simulated hosts here: {WHY}")

ECHO = textwrap.dedent("""
    import socket, sys, time
    mode, addr, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if mode == "server":
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((addr, 5555)); s.listen(); print("listening", flush=True)
        while True:
            c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                while (b := c.recv(1 << 20)):
                    if b.endswith((b"x", b"y")): c.sendall(b[-1:])
            except ConnectionError:
                pass
    else:
        c = socket.create_connection((addr, 5555), timeout=30)
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t = time.perf_counter()
        for _ in range(5): c.sendall(b"x"); c.recv(1)
        rtt = (time.perf_counter() - t) / 5
        t = time.perf_counter(); c.sendall(b"\\0" * nbytes); c.sendall(b"y"); c.recv(1)
        print(rtt, time.perf_counter() - t)
""")


def _echo(hosts: Hosts, tmp_path, nbytes: int) -> tuple[float, float]:
    """(round trip, seconds to send ``nbytes`` and hear back) from host 0 to host 1."""
    script = tmp_path / "echo.py"
    script.write_text(ECHO)
    out = hosts.run(0, [sys.executable, str(script), "client", hosts.address(1), str(nbytes)],
                    capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rtt, seconds = (float(x) for x in out.stdout.split())
    return rtt, seconds


def _serve_echo(hosts: Hosts, tmp_path) -> None:
    script = tmp_path / "echo.py"
    script.write_text(ECHO)
    server = hosts.popen(1, [sys.executable, str(script), "server", hosts.address(1), "0"],
                         stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "listening"


def _namespaces() -> set[str]:
    return set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                              check=True).stdout.split())


def test_links_are_shaped_and_reshaped_while_running(tmp_path):
    # lower bounds only: a loaded machine makes things slower, never faster
    with Hosts(2, link=Link(latency_ms=20)) as hosts:
        _serve_echo(hosts, tmp_path)
        rtt, _ = _echo(hosts, tmp_path, 1)
        assert rtt >= 0.040  # 20 ms each way
        hosts.shape(1, Link(latency_ms=50))  # host 1's link, while the server runs
        rtt, _ = _echo(hosts, tmp_path, 1)
        assert rtt >= 0.070
        hosts.shape(0, Link(gbps=0.02))  # 20 Mbit/s: 1 MB takes at least 0.4 s
        hosts.shape(1, Link())
        _, seconds = _echo(hosts, tmp_path, 1_000_000)
        assert seconds >= 0.4
        hosts.shape(0, Link(loss=0.05))  # TCP retransmits what the link drops: it arrives
        hosts.shape(1, Link(loss=0.05))
        _echo(hosts, tmp_path, 2_000_000)


def test_hosts_are_separate_and_cleaned_up(tmp_path):
    with Hosts(2) as hosts:
        names = set(hosts.names)
        assert names <= _namespaces()
        sleeper = hosts.popen(0, [sys.executable, "-c", "import time; time.sleep(600)"])
        # each host has only its own address: host 0 cannot bind host 1's
        out = hosts.run(0, [sys.executable, "-c", textwrap.dedent(f"""
            import socket
            s = socket.socket()
            try:
                s.bind(("{hosts.address(1)}", 0)); print("bound")
            except OSError:
                print("refused")
        """)], capture_output=True, text=True)
        assert out.stdout.strip() == "refused"
    assert not names & _namespaces()
    assert sleeper.poll() is not None  # killed with its host


def test_a_killed_harness_leaves_nothing_behind():
    code = ("import sys, os, signal; sys.path.insert(0, %r)\n"
            "from tests.hosts import Hosts\n"
            "h = Hosts(2); print(' '.join(h.names), flush=True)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n" % REPO)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    left = set(out.stdout.split())
    assert len(left) == 2 and left <= _namespaces()  # the kill left them
    with Hosts(1):  # the next harness removes them
        assert not left & _namespaces()


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="1 to 250"):
        Hosts(0)
    with pytest.raises(ValueError, match="one Link or 2"):
        Hosts(2, link=[Link()])
    with pytest.raises(ValueError, match="loss"):
        Link(loss=1.5)
    with Hosts(1) as hosts:
        with pytest.raises(ValueError, match=r"\[0, 1\)"):
            hosts.address(1)


# the launcher across hosts ----------------------------------------------------------------

JOB = textwrap.dedent("""
    import json, sys, torch
    from spmd import runtime as dist
    dist.init_process_group("gloo")
    t = torch.ones(4) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    topo = dist.get_topology()
    mesh = dist.Mesh((2, 2), ("across", "within"))
    line = json.dumps({"rank": dist.get_rank(), "sum": t[0].item(), "hosts": topo.hosts,
                       "crosses": [mesh.crosses_hosts("across"), mesh.crosses_hosts("within")]})
    sys.stdout.write(line + "\\n")  # one write: ranks share the pipe, unbuffered (-u)
    sys.stdout.flush()
    dist.destroy_process_group()
""")


def _launch(hosts: Hosts, node: int, nnodes: int, script: str, *extra: str,
            launcher: tuple[str, ...] = ("-m", "spmd.runtime.run"), nproc: int = 2,
            master: str | None = None, args: tuple[str, ...] = ()) -> subprocess.Popen:
    return hosts.popen(node, [
        sys.executable, *launcher, "--nnodes", str(nnodes), "--node-rank", str(node),
        "--nproc-per-node", str(nproc), "--master-addr", master or hosts.address(0),
        "--master-port", "29500", *extra, script, *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)


def _finish(procs: list[subprocess.Popen], timeout: float = 100) -> list[tuple[int, str, str]]:
    outs = [p.communicate(timeout=timeout) for p in procs]
    return [(p.returncode, *out) for p, out in zip(procs, outs)]


def _records(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("launcher", ["spmd", "torchrun"])
def test_a_job_spans_two_hosts_joining_in_any_order(tmp_path, launcher):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    how = (("-m", "spmd.runtime.run", "--join-timeout", "90") if launcher == "spmd"
           else ("-m", "torch.distributed.run"))
    with Hosts(2, link=Link(gbps=1, latency_ms=0.2)) as hosts:
        procs = [_launch(hosts, node, 2, str(script), launcher=how) for node in (1, 0)]
        results = _finish(procs)
    records = []
    for code, out, err in results:
        assert code == 0, err[-3000:]
        records += _records(out)
    assert sorted(r["rank"] for r in records) == [0, 1, 2, 3]
    for r in records:
        assert r["sum"] == 10.0  # 1 + 2 + 3 + 4: every rank's value crossed the link
        assert r["hosts"] == [0, 0, 1, 1]  # ranks 0-1 on node 0, 2-3 on node 1
        assert r["crosses"] == [True, False]


def test_a_host_that_never_comes_is_named(tmp_path):
    script = tmp_path / "noop.py"
    script.write_text("print('ran')\n")
    with Hosts(2) as hosts:
        # 10 s: room for both agents to start on a loaded machine (2 of 3 must be in)
        procs = [_launch(hosts, node, 3, str(script), "--join-timeout", "10")
                 for node in (0, 1)]
        results = _finish(procs)
    for code, out, err in results:
        assert code == 1
        assert "node rank [2] never joined within 10 s (2 of 3 did" in err
        assert "ran" not in out  # nothing started before every host was there


def test_a_store_nobody_serves_is_named(tmp_path):
    script = tmp_path / "noop.py"
    script.write_text("print('ran')\n")
    with Hosts(2) as hosts:  # node 1 alone, pointed at host 0 where no agent runs
        master = hosts.address(0)
        (code, out, err), = _finish([_launch(hosts, 1, 2, str(script), "--join-timeout", "3")])
    assert code == 1
    assert f"store at {master}:29500 (served by node rank 0) did not answer" in err


def test_a_failed_rank_stops_every_host(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(textwrap.dedent("""
        import os, sys, time
        if os.environ["RANK"] == "3":
            sys.exit(3)
        time.sleep(600)   # the others would wait on rank 3 for ever
    """))
    with Hosts(2) as hosts:  # the agents end (not the others' 600 s) or _finish times out
        procs = [_launch(hosts, node, 2, str(script), "--join-timeout", "60") for node in (0, 1)]
        results = _finish(procs, timeout=100)
    for node, (code, _, err) in enumerate(results):
        assert code == 1
        where = "this host" if node == 1 else "node 1"
        assert f"rank 3 (local rank 1 on {where}) exited with code 3" in err


def test_launcher_arguments_are_checked(capsys):
    from spmd.runtime.run import parse_args

    def refused(argv: list[str], match: str) -> None:
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert match in capsys.readouterr().err, argv

    for argv, match in [
        (["--nnodes", "3:2", "x.py"], "MIN is above MAX"),
        (["--max-restarts", "-1", "x.py"], "0 or more"),
        (["--join-last-call", "-1", "x.py"], "0 or more"),
        (["--nnodes", "2", "--node-rank", "2", "x.py"], "outside"),
        (["--nnodes", "1:2", "--node-rank", "2", "x.py"], "outside"),
        (["--standalone", "--nnodes", "1:2", "x.py"], "one host"),
        (["--rdzv-endpoint", "nohost", "x.py"], "host:port"),
        (["--rdzv-endpoint", "a:1", "--master-addr", "b", "x.py"], "not both"),
        (["--standalone", "--nnodes", "2", "x.py"], "one host"),
        (["--nproc-per-node", "0", "x.py"], "positive"),
    ]:
        refused(argv, match)
    args = parse_args(["--nnodes=2", "--node_rank=1", "--rdzv_endpoint=10.0.0.1:1234", "t.py",
                       "--lr", "3"])
    assert (args.nnodes, args.node_rank, args.master_addr, args.master_port) == (
        2, 1, "10.0.0.1", 1234)
    assert args.script_args == ["--lr", "3"]
    args = parse_args(["--nnodes", "1:4", "--max_restarts", "2", "--node-rank", "3", "t.py"])
    assert (args.min_nodes, args.nnodes, args.max_restarts) == (1, 4, 2)


def test_local_address_is_the_one_routed_to_the_peer():
    from spmd.runtime.topology import local_address

    assert local_address("127.0.0.1") == "127.0.0.1"
    with Hosts(2) as hosts:
        out = hosts.run(1, [sys.executable, "-c", (
            f"import sys; sys.path.insert(0, {REPO!r}); "
            f"from spmd.runtime.topology import local_address; "
            f"print(local_address({hosts.address(0)!r}))")], capture_output=True, text=True)
        assert out.stdout.strip() == hosts.address(1)
    assert socket.gethostname()  # no reverse lookup was needed for any of it


@pytest.mark.parametrize("layouts", [["ddp", "hsdp"], ["fsdp", "zero1", "zero2", "tp"],
                                     ["pp", "cp", "auto"]], ids="-".join)
def test_every_strategy_on_two_shaped_hosts_equals_one_process(tmp_path, layouts):
    """The launcher on 2 namespaces joined by 1 Gbit/s, 0.2 ms links: each layout of
    tests/across_hosts.py ends equal to one process; data parallelism across the hosts
    runs its gradient all-reduces in two levels where the probe found the link slow."""
    import torch

    from tests import across_hosts

    script = os.path.join(REPO, "tests", "across_hosts.py")
    with Hosts(2, link=Link(gbps=1, latency_ms=0.2)) as hosts:
        procs = [_launch(hosts, node, 2, script, "--join-timeout", "90",
                         args=(str(tmp_path), *layouts)) for node in (0, 1)]
        results = _finish(procs, timeout=110)
    for code, _, err in results:
        assert code == 0, err[-3000:]
    outs = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(4)]
    across_hosts.check(outs, layouts)
    if "ddp" in layouts:
        for out in outs:
            assert "probed at start-up over 2 hosts" in out["ddp"]["summary"]
