"""``python -m spmd.runtime.run`` (or ``spmd-run``): start a job's local ranks on each host, as
torchrun does.

    # on every host (node rank 0 serves the rendezvous at --master-addr)
    python -m spmd.runtime.run --nnodes 2 --node-rank R --nproc-per-node 4 \\
        --master-addr 10.0.0.1 --master-port 29500 train.py --lr 3e-4

Each host runs one agent. The agent of node rank 0 serves the job's store at
``--master-addr:--master-port`` (``--rdzv-endpoint host:port`` says the same in one
argument); every agent, node 0's included, registers there with its number of ranks and
waits until all ``--nnodes`` hosts have, in any order, for ``--join-timeout`` seconds. A
host that never comes is named (its node rank); a host that cannot reach the store says
where it looked. Then each agent starts its ranks with the environment torchrun gives
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
``GROUP_WORLD_SIZE``, ``ROLE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``,
``TORCHELASTIC_RESTART_COUNT``, ``TORCHELASTIC_RUN_ID``), so
``init_process_group("env://")`` (ours or torch's scripts pointed at ours) joins as under
torchrun, as a client of the agent's store, and ``SPMD_HOST`` naming the host, which
:mod:`spmd.runtime.topology` reads.

Global ranks are laid out host by host: node rank 0's ranks first. When a rank fails
(exits non-zero or is killed) its agent records it in the store and stops its other
ranks; every other agent sees the record and stops its ranks too, so a job never waits
on a dead peer's collectives for the full timeout. The agent exits 0 when every rank of
the job succeeded, else 1 with the first failure named (rank, host, exit code).

Restarts (``--max-restarts``) and membership changes belong to fault tolerance and are
refused here with that reason.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from typing import Sequence

from spmd.runtime.errors import DistError, DistTimeoutError
from spmd.runtime.store.prefix_store import PrefixStore
from spmd.runtime.store.tcp_store import TCPStore
from spmd.runtime.topology import local_address

__all__ = ["main", "parse_args", "LaunchError"]

_POLL = 0.2  # seconds between looks at the local ranks and the store while they run


def _say(message: str) -> None:
    """The launcher's own report (a command line's output, on stderr like torchrun's)."""
    sys.stderr.write(f"spmd.runtime.run: {message}\n")
    sys.stderr.flush()


class LaunchError(DistError):
    """The job could not start or a rank failed; the message names which."""


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _nnodes(text: str) -> int:
    if ":" in text:
        low, high = text.split(":", 1)
        if low != high:
            raise argparse.ArgumentTypeError(
                f"--nnodes {text}: an elastic range needs membership changes, which this "
                f"launcher does not do yet; give one number of hosts")
        text = low
    return _positive(text)


def _nproc(text: str) -> int:
    if text in ("auto", "cpu"):
        return os.cpu_count() or 1
    if text == "gpu":
        import torch

        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError("--nproc-per-node gpu: no CUDA device here")
        return torch.cuda.device_count()
    return _positive(text)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The launcher's arguments; torchrun's spellings (dashes or underscores) are accepted."""
    parser = argparse.ArgumentParser(
        prog="python -m spmd.runtime.run",
        description="Start a job's local ranks on this host (torchrun-compatible arguments).")
    add = parser.add_argument
    add("--nnodes", type=_nnodes, default=1, help="number of hosts (default 1)")
    add("--node-rank", "--node_rank", type=int, default=None,
        help="this host's index in [0, nnodes) (default: NODE_RANK, GROUP_RANK or 0)")
    add("--nproc-per-node", "--nproc_per_node", type=_nproc, default=1,
        help="ranks on this host: a number, 'cpu'/'auto' (one per core) or 'gpu'")
    add("--master-addr", "--master_addr", default=None,
        help="node rank 0's address, where the store is served (default MASTER_ADDR or "
             "127.0.0.1)")
    add("--master-port", "--master_port", type=int, default=None,
        help="the store's port (default MASTER_PORT or 29500)")
    add("--rdzv-endpoint", "--rdzv_endpoint", default=None,
        help="host:port of the store, instead of --master-addr/--master-port")
    add("--rdzv-backend", "--rdzv_backend", default="static",
        help="accepted for torchrun's command lines: 'static' or 'c10d' (one store either way)")
    add("--rdzv-id", "--rdzv_id", default="none", help="the job's id (TORCHELASTIC_RUN_ID)")
    add("--standalone", action="store_true",
        help="one host, a free port on 127.0.0.1 (no --master-* needed)")
    add("--join-timeout", "--join_timeout", type=float, default=300.0,
        help="seconds to wait for every host to join (default 300)")
    add("--max-restarts", "--max_restarts", type=int, default=0,
        help="only 0: restarting lost ranks is not done by this launcher yet")
    add("--local-addr", "--local_addr", default=None,
        help="this host's address that the others reach (default: the one routed to the "
             "master)")
    add("-m", "--module", action="store_true", help="run the script as a module (python -m)")
    add("--no-python", "--no_python", action="store_true",
        help="run the script as a program, not with this python")
    add("script", help="the training script (or module with -m, program with --no-python)")
    add("script_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.max_restarts != 0:
        parser.error("--max-restarts: restarting after a failure is not done by this "
                     "launcher yet; run with --max-restarts 0 (under torchrun it works)")
    if args.module and args.no_python:
        parser.error("-m and --no-python are exclusive")
    if args.rdzv_backend not in ("static", "c10d", "spmd"):
        parser.error(f"--rdzv-backend {args.rdzv_backend!r}: expected static, c10d or spmd")
    if args.standalone:
        if args.nnodes != 1:
            parser.error("--standalone is one host; drop --nnodes or --standalone")
        from spmd.runtime.launch import free_port

        args.master_addr, args.master_port, args.rdzv_endpoint = "127.0.0.1", free_port(), None
    if args.rdzv_endpoint is not None:
        if args.master_addr is not None or args.master_port is not None:
            parser.error("give --rdzv-endpoint or --master-addr/--master-port, not both")
        host, sep, port = args.rdzv_endpoint.rpartition(":")
        if not sep or not host or not port.isdigit():
            parser.error(f"--rdzv-endpoint must be host:port, got {args.rdzv_endpoint!r}")
        args.master_addr, args.master_port = host, int(port)
    if args.master_addr is None:
        args.master_addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    if args.master_port is None:
        args.master_port = int(os.environ.get("MASTER_PORT", "29500"))
    if not 1 <= args.master_port <= 65535:
        parser.error(f"--master-port must be in [1, 65535], got {args.master_port}")
    if args.node_rank is None:
        args.node_rank = int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", "0")))
    if not 0 <= args.node_rank < args.nnodes:
        parser.error(f"--node-rank {args.node_rank} is outside [0, {args.nnodes}) for "
                     f"--nnodes {args.nnodes}")
    if args.join_timeout <= 0:
        parser.error(f"--join-timeout must be positive, got {args.join_timeout}")
    if args.script_args[:1] == ["--"]:
        args.script_args = args.script_args[1:]
    return args


# A rank's first moments: ask the kernel to kill it when its agent dies (PR_SET_PDEATHSIG,
# kept across exec), make sure the agent is still there, then become the rank's command.
# A preexec_fn would do it in the forked child of a threaded agent, where that is unsafe.
_DIE_WITH_AGENT = ("import ctypes, os, signal, sys\n"
                   "ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)\n"
                   "if os.getppid() != int(sys.argv[1]):\n"
                   "    sys.exit('spmd.runtime.run: the agent died before this rank started')\n"
                   "os.execvp(sys.argv[2], sys.argv[2:])\n")


def _dying_with_us(command: list[str]) -> list[str]:
    """``command`` started so that the rank dies with this agent (Linux), instead of
    running on, orphaned, until its peers' collectives time out."""
    if not sys.platform.startswith("linux"):
        return command
    return [sys.executable, "-c", _DIE_WITH_AGENT, str(os.getpid()), *command]


class _Agent:
    """One host's agent: rendezvous with the other hosts, then start and watch its ranks."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.node = args.node_rank
        self.server: TCPStore | None = None
        timeout = timedelta(seconds=args.join_timeout)
        if self.node == 0:  # node 0 serves the store; it binds the master address
            self.server = TCPStore(args.master_addr, args.master_port, None, True, timeout,
                                   wait_for_workers=False, rank=0)
        try:
            client = TCPStore(args.master_addr, args.master_port, None, False, timeout,
                              rank=self.node)
        except DistTimeoutError:
            raise LaunchError(
                f"node {self.node}: the rendezvous store at {args.master_addr}:"
                f"{args.master_port} (served by node rank 0) did not answer within "
                f"{args.join_timeout:g} s; is node rank 0 started, and is that its address?"
            ) from None
        self.store = PrefixStore(f"launch/{args.rdzv_id}", client)
        self.client = client

    def join(self) -> list[dict]:
        """Register this host and wait for all of them; each host's entry in node order."""
        args = self.args
        try:
            address = args.local_addr or local_address(args.master_addr, args.master_port)
        except OSError as e:
            raise LaunchError(str(e)) from None
        me = {"node": self.node, "nproc": args.nproc_per_node, "address": address,
              "hostname": socket.gethostname(), "pid": os.getpid()}
        previous = self.store.compare_set(f"host/{self.node}", "", json.dumps(me))
        if json.loads(previous) != me:
            raise LaunchError(f"node rank {self.node} joined twice (already there: "
                              f"{previous.decode()}); give each host its own --node-rank")
        keys = [f"host/{i}" for i in range(args.nnodes)]
        deadline = time.monotonic() + args.join_timeout
        while not self.store.check(keys):
            if self.store.check(["abort"]):  # another host gave up first: say what it saw
                raise LaunchError(self.store.get("abort").decode())
            if time.monotonic() > deadline:
                missing = [i for i, k in enumerate(keys) if not self.store.check([k])]
                message = (f"host(s) with node rank {missing} never joined within "
                           f"{args.join_timeout:g} s ({args.nnodes - len(missing)} of "
                           f"{args.nnodes} did; the store is at {args.master_addr}:"
                           f"{args.master_port})")
                raise LaunchError(self.store.compare_set("abort", "", message).decode())
            try:
                self.store.wait(keys, timedelta(seconds=min(1.0, args.join_timeout)))
            except DistTimeoutError:
                pass
        return [json.loads(v) for v in self.store.multi_get(keys)]

    def environment(self, hosts: list[dict], local_rank: int) -> dict[str, str]:
        args = self.args
        first = sum(h["nproc"] for h in hosts[:self.node])
        world = sum(h["nproc"] for h in hosts)
        env = dict(os.environ)
        env.update({
            "RANK": str(first + local_rank), "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(args.nproc_per_node),
            "GROUP_RANK": str(self.node), "GROUP_WORLD_SIZE": str(args.nnodes),
            "NODE_RANK": str(self.node),
            "ROLE_NAME": "default", "ROLE_RANK": str(first + local_rank),
            "ROLE_WORLD_SIZE": str(world),
            "MASTER_ADDR": args.master_addr, "MASTER_PORT": str(args.master_port),
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": args.rdzv_id,
            "SPMD_AGENT_STORE": f"launch/{args.rdzv_id}/job",
            "SPMD_HOST": f"node{self.node}:{hosts[self.node]['address']}",
        })
        if args.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = "1"  # as torchrun: ranks sharing cores, one thread each
        return env

    def command(self) -> list[str]:
        args = self.args
        if args.no_python:
            return [args.script, *args.script_args]
        if args.module:
            return [sys.executable, "-u", "-m", args.script, *args.script_args]
        return [sys.executable, "-u", args.script, *args.script_args]

    def run(self) -> int:
        try:
            return self._run()
        finally:
            self.store.set(f"done/{self.node}", "1")
            if self.server is not None:  # serve until every host that came has the outcome
                joined = [i for i in range(self.args.nnodes) if self.store.check([f"host/{i}"])]
                try:
                    self.store.wait([f"done/{i}" for i in joined], timedelta(seconds=30))
                except DistTimeoutError:
                    pass

    def _run(self) -> int:
        hosts = self.join()
        first = sum(h["nproc"] for h in hosts[:self.node])
        procs = [subprocess.Popen(_dying_with_us(self.command()), env=self.environment(hosts, i))
                 for i in range(self.args.nproc_per_node)]
        try:
            failure = self._watch(procs, first)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        if failure is None and self.store.check(["failed"]):
            failure = json.loads(self.store.get("failed"))
        if failure is not None:
            where = "this host" if failure["node"] == self.node else f"node {failure['node']}"
            _say(f"rank {failure['rank']} (local rank {failure['local_rank']} on {where}) "
                 f"{failure['why']}")
            return 1
        return 0

    def _watch(self, procs: list[subprocess.Popen], first: int) -> dict | None:
        """Wait for the local ranks; the first failure here or anywhere stops them all."""
        while True:
            running = False
            for i, proc in enumerate(procs):
                code = proc.poll()
                if code is None:
                    running = True
                elif code != 0:
                    why = (f"was killed by signal {signal.Signals(-code).name}" if code < 0
                           else f"exited with code {code}")
                    record = {"rank": first + i, "local_rank": i, "node": self.node, "why": why}
                    stored = self.store.compare_set("failed", "", json.dumps(record))
                    return json.loads(stored)
            if not running:
                return None
            if self.store.check(["failed"]):
                return json.loads(self.store.get("failed"))
            try:  # wakes at once on another host's failure, else looks again in _POLL
                self.store.wait(["failed"], timedelta(seconds=_POLL))
            except DistTimeoutError:
                pass

    def close(self) -> None:
        self.client.close()
        if self.server is not None:
            self.server.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the launcher; returns the exit status (0 when every rank succeeded)."""
    args = parse_args(argv)
    try:
        agent = _Agent(args)
    except (DistError, OSError) as e:
        _say(str(e))
        return 1
    try:
        return agent.run()
    except DistError as e:  # LaunchError, or the store gone (node rank 0's agent stopped)
        _say(f"node {args.node_rank}: {e}")
        return 1
    finally:
        agent.close()


def cli() -> None:
    """The ``spmd-run`` command."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
