"""``python -m spmd.runtime.run`` (or ``spmd-run``): start a job's local ranks on each host, as
torchrun does, and start them all again after a failure or when hosts come and go.

    # on every host (node rank 0 serves the rendezvous at --master-addr)
    python -m spmd.runtime.run --nnodes 2 --node-rank R --nproc-per-node 4 \\
        --master-addr 10.0.0.1 --master-port 29500 train.py --lr 3e-4

Each host runs one agent. The agent of node rank 0 serves the job's store at
``--master-addr:--master-port`` (``--rdzv-endpoint host:port`` says the same in one
argument); every agent, node 0's included, registers there with its number of ranks.

A job runs in rounds, and node 0's agent starts each one. With ``--nnodes N`` a round needs
all N hosts, joining in any order within ``--join-timeout`` seconds; with torchrun's elastic
``--nnodes MIN:MAX`` it starts once MAX hosts have joined, or once at least MIN have and no
more joined for ``--join-last-call`` seconds. Node 0 is always in. A host that never comes
is named (its node rank); a host that cannot reach the store says where it looked.

Then each agent starts its ranks with the environment torchrun gives (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``GROUP_WORLD_SIZE``,
``ROLE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_RESTART_COUNT``,
``TORCHELASTIC_MAX_RESTARTS``, ``TORCHELASTIC_RUN_ID``), so ``init_process_group("env://")``
(ours or torch's scripts pointed at ours) joins as under torchrun, as a client of the
agent's store under the round's own key prefix (``SPMD_AGENT_STORE``), and ``SPMD_HOST``
naming the host, which :mod:`spmd.runtime.topology` reads. A round's hosts are numbered in
the order of their ``--node-rank`` (``GROUP_RANK``) and its global ranks laid out host by
host, node 0's first, so ``RANK`` and ``WORLD_SIZE`` may change from one round to the next.

When a rank fails (exits non-zero or is killed) its agent records it in the store and
stops its other ranks; every other agent sees the record and stops its ranks too, so a job
never waits on a dead peer's collectives for the full timeout. With ``--max-restarts N``
the agents then start the whole group again in a new round, at most N times
(``TORCHELASTIC_RESTART_COUNT`` says how many so far). An agent killed outright takes its
ranks with it; their peers' collectives fail, and the next round goes on without that host
where MIN allows. A host that starts while a round with room for it runs makes the agents
start a new round with it, which uses no restart (torchrun's rule).

Agents beat in the store while a round runs; one silent for ``--agent-timeout`` seconds
(an agent that died before its ranks joined, a host that hangs or is cut off) ends the
round, named, as a failed rank does.

When the host serving the store dies, every agent's store stops answering within
``SPMD_STORE_RECONNECT`` seconds. With a restart left and at least MIN hosts of the last
round besides it, the survivors elect a new store host: the last round's hosts in node-rank
order, the first of them alive serving a new store at its address and ``--master-port``
(each agent waits for a candidate a while, then takes the next; the candidate itself
serves at once). The job restarts there, in a new round (a restart), and a script resumes
from its latest checkpoint. A partition must not leave two jobs running: after a failure
the store's host starts a round only with at least half of the last round's hosts back,
and an elected one only with more than half, so at most one side goes on (of two hosts,
the store's; a lone host cut off from the store stops, naming why). An agent exits 0 when
every rank of a round succeeded, else 1 with the last failure named (rank, host, exit code
or signal).
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

from spmd.runtime import config
from spmd.runtime.errors import DistError, DistTimeoutError
from spmd.runtime.run_args import parse_args
from spmd.runtime.store.prefix_store import PrefixStore
from spmd.runtime.store.tcp_store import TCPStore
from spmd.runtime.topology import local_address

__all__ = ["main", "parse_args", "LaunchError"]

_POLL = 0.2  # seconds between looks at the local ranks and the store while they run
_SERVE_AFTER = 30.0  # seconds node 0 keeps serving, after the job, for the others to read how it ended


def _say(message: str) -> None:
    """The launcher's own report (a command line's output, on stderr like torchrun's)."""
    sys.stderr.write(f"spmd.runtime.run: {message}\n")
    sys.stderr.flush()


class LaunchError(DistError):
    """The job could not start or a rank failed; the message names which."""


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
    """One host's agent: join each round of the job, start and watch its ranks in it, and
    go on to the next round after a failure (restarts permitting) or a host joining.

    The rounds live in the store under ``launch/<id>/round/<r>/``: ``host/<node>`` (each
    host's record, first come), ``arrival/<k>`` (the k-th host to join, in order),
    ``start`` (node 0's decision: the round's hosts and restart count, or why it will not
    run), ``ok/<node>`` (that host's ranks all exited 0) and ``end`` (how the round ended,
    the first agent to say winning: a failure, hosts joining, or every rank done)."""

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
        _answer_within(client, args)
        self.store = PrefixStore(f"launch/{args.rdzv_id}", client)
        self.client = client
        self.last: dict = {"round": -1}  # node 0: the last start it published
        self.leader = 0  # the node rank serving the store (another after an election)
        self.hosts: list[dict] = []  # the last round's hosts (an election's candidates)
        # after a failure: the last round's node ranks, and whether more than half of
        # them (an elected store) or at least half (the store's host) must be back
        self.guard: tuple[set[int], bool] | None = None

    def _me(self) -> dict:
        args = self.args
        try:
            address = args.local_addr or local_address(args.master_addr, args.master_port)
        except OSError as e:
            raise LaunchError(str(e)) from None
        return {"node": self.node, "nproc": args.nproc_per_node, "address": address,
                "hostname": socket.gethostname(), "pid": os.getpid()}

    # -- joining a round ----------------------------------------------------------------

    def _register(self, r: int, me: dict) -> None:
        """Put this host on round ``r``'s list, in the order hosts came."""
        previous = self.store.compare_set(f"round/{r}/host/{self.node}", "", json.dumps(me))
        if json.loads(previous) != me:
            raise LaunchError(f"node rank {self.node} joined twice (already there: "
                              f"{previous.decode()}); give each host its own --node-rank")
        self.store.add(f"round/{r}/beat/{self.node}", 0)  # (its beat exists from now on)
        arrival = self.store.add(f"round/{r}/joined", 1)
        self.store.set(f"round/{r}/arrival/{arrival}", str(self.node))

    def _arrivals(self, r: int) -> list[int]:
        """The node ranks that joined round ``r`` so far, in the order they came."""
        nodes = []
        while self.store.check([f"round/{r}/arrival/{len(nodes) + 1}"]):
            nodes.append(int(self.store.get(f"round/{r}/arrival/{len(nodes) + 1}")))
        return nodes

    def _form(self, r: int, restarts: int, me: dict) -> dict:
        """Node 0: wait for round ``r``'s hosts, decide which are in, publish the start."""
        args = self.args
        self._register(r, me)
        hosts: dict[int, dict] = {}
        seen = 0
        deadline = time.monotonic() + args.join_timeout
        last_call = None  # once MIN are in: the round starts then unless another host comes
        while len(hosts) < args.nnodes:
            key = f"round/{r}/arrival/{seen + 1}"
            if not self.store.check([key]):  # every host already there is read first
                until = deadline if last_call is None else min(deadline, last_call)
                left = until - time.monotonic()
                if left <= 0:
                    break
                try:
                    self.store.wait([key], timedelta(seconds=left))
                except DistTimeoutError:
                    continue
            seen += 1
            node = int(self.store.get(key))
            if node < args.nnodes:  # one given a larger --nnodes has no place
                hosts[node] = json.loads(self.store.get(f"round/{r}/host/{node}"))
            if len(hosts) >= args.min_nodes and self.node in hosts and self._enough(hosts):
                last_call = time.monotonic() + args.join_last_call
        if len(hosts) >= args.min_nodes and not self._enough(hosts):
            before, strict = self.guard or (set(), False)
            start = {"round": r, "abort": (
                f"only {len(before & set(hosts))} of the last round's {len(before)} hosts "
                f"({sorted(before)}) came back within {args.join_timeout:g} s; "
                f"{'more than' if strict else 'at least'} half must, or the others may run "
                f"on as a job of their own (a partition)")}
        elif len(hosts) >= args.min_nodes:
            start = {"round": r, "hosts": [hosts[n] for n in sorted(hosts)],
                     "restarts": restarts, "max_restarts": args.max_restarts}
        else:
            missing = [n for n in range(args.nnodes) if n not in hosts]
            need = (f"{len(hosts)} of {args.nnodes} did" if args.min_nodes == args.nnodes
                    else f"{len(hosts)} did; --nnodes {args.min_nodes}:{args.nnodes} needs "
                         f"{args.min_nodes}")
            start = {"round": r, "abort": (
                f"host(s) with node rank {missing} never joined within {args.join_timeout:g} "
                f"s ({need}; the store is at {args.master_addr}:{args.master_port})")}
        self.store.set(f"round/{r}/start", json.dumps(start))
        self.last = start
        return start

    def _enough(self, hosts: dict[int, dict]) -> bool:
        """Enough of the last round's hosts are in ``hosts`` for a round after a failure
        (see the module doc: at most one side of a partition goes on)."""
        if self.guard is None:
            return True
        before, strict = self.guard
        back = 2 * len(before & set(hosts))
        return back > len(before) if strict else back >= len(before)

    def _join(self, r: int, me: dict) -> dict:
        """Any other host: join the first round not yet started, from ``r`` on, and wait
        for node 0 to start it; a round started without this host sends it to the next."""
        # node 0 decides within one join timeout (and a last call); the rest is slack
        wait = 2 * self.args.join_timeout + self.args.join_last_call
        while True:
            key = f"round/{r}/start"
            if not self.store.check([key]):
                self._refuse_if_running(r, me)
                self._register(r, me)
                try:
                    self.store.wait([key], timedelta(seconds=wait))
                except DistTimeoutError:
                    raise LaunchError(f"node 0's agent did not start round {r} within "
                                      f"{wait:g} s of this host's joining it") from None
            start = json.loads(self.store.get(key))
            if "hosts" not in start or me in start["hosts"]:
                return start
            r += 1

    def _refuse_if_running(self, r: int, me: dict) -> None:
        """A second agent with a node rank that round ``r - 1`` runs is refused at once,
        rather than left waiting for that round to end."""
        before = f"round/{r - 1}/start"
        if r == 0 or self.store.check([f"round/{r - 1}/end"]) or not self.store.check([before]):
            return  # (a store elected after a loss has no earlier round)
        for host in json.loads(self.store.get(before)).get("hosts", ()):
            if host["node"] == self.node and host != me:
                raise LaunchError(
                    f"node rank {self.node} is already in the running job (pid "
                    f"{host['pid']} on {host['hostname']}); give each host its own --node-rank")

    # -- running a round ----------------------------------------------------------------

    def environment(self, start: dict, me: dict, local_rank: int) -> dict[str, str]:
        args = self.args
        hosts = start["hosts"]
        group = hosts.index(me)
        first = sum(h["nproc"] for h in hosts[:group])
        world = sum(h["nproc"] for h in hosts)
        env = dict(os.environ)
        env.update({
            "RANK": str(first + local_rank), "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(args.nproc_per_node),
            "GROUP_RANK": str(group), "GROUP_WORLD_SIZE": str(len(hosts)),
            "NODE_RANK": str(group),
            "ROLE_NAME": "default", "ROLE_RANK": str(first + local_rank),
            "ROLE_WORLD_SIZE": str(world),
            "MASTER_ADDR": args.master_addr, "MASTER_PORT": str(args.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(start["restarts"]),
            "TORCHELASTIC_MAX_RESTARTS": str(start["max_restarts"]),
            "TORCHELASTIC_RUN_ID": args.rdzv_id,
            # the round's own keys: nothing a previous round's ranks left is seen
            "SPMD_AGENT_STORE": f"launch/{args.rdzv_id}/job/{start['round']}",
            "SPMD_HOST": f"node{self.node}:{me['address']}",
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

    def _run_round(self, start: dict, me: dict) -> dict:
        """Start this host's ranks for the round, watch them; how the round ended."""
        hosts = start["hosts"]
        first = sum(h["nproc"] for h in hosts[:hosts.index(me)])
        procs = [subprocess.Popen(_dying_with_us(self.command()),
                                  env=self.environment(start, me, i))
                 for i in range(self.args.nproc_per_node)]
        try:
            return self._watch(start, procs, first)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()

    def _end(self, r: int, record: dict) -> dict:
        """Say how round ``r`` ended, unless another agent did first; the record that stands."""
        return json.loads(self.store.compare_set(f"round/{r}/end", "", json.dumps(record)))

    def _watch(self, start: dict, procs: list[subprocess.Popen], first: int) -> dict:
        """Wait for the round's end: the first failure here or anywhere, node 0 seeing a
        host join that has room, or every host's ranks done. Once this host's ranks are
        done, the others get ``--join-timeout`` seconds to finish theirs."""
        r, hosts, args = start["round"], start["hosts"], self.args
        key = f"round/{r}/end"
        ok = [f"round/{r}/ok/{h['node']}" for h in hosts]
        finished = None  # when this host's ranks had all exited 0
        beats = _Beats(self.store, r, self.node, [h["node"] for h in hosts], args.agent_timeout)
        while True:
            if self.store.check([key]):
                return json.loads(self.store.get(key))
            silent = beats.silent()
            if silent is not None:  # an agent that died before its ranks started, or
                # whose host hangs or is cut off: its peers would wait on its ranks
                return self._end(r, {"kind": "failed", "why": (
                    f"node {silent}'s agent stopped answering (no beat for "
                    f"{args.agent_timeout:g} s): its host may be down or cut off")})
            for i, proc in enumerate(procs):
                code = proc.poll()
                if code is not None and code != 0:
                    why = (f"was killed by signal {signal.Signals(-code).name}" if code < 0
                           else f"exited with code {code}")
                    return self._end(r, {"kind": "failed", "rank": first + i, "local_rank": i,
                                         "node": self.node, "why": why})
            if finished is None and all(proc.poll() == 0 for proc in procs):
                self.store.set(f"round/{r}/ok/{self.node}", "1")
                finished = time.monotonic()
            if finished is not None:
                if self.store.check(ok):
                    return self._end(r, {"kind": "done"})
                if time.monotonic() - finished > args.join_timeout:
                    late = [h["node"] for h, k in zip(hosts, ok) if not self.store.check([k])]
                    return self._end(r, {"kind": "failed", "why": (
                        f"the ranks of node(s) {late} had not finished {args.join_timeout:g} s "
                        f"after those of node {self.node} had")})
            elif self.server is not None and len(hosts) < args.nnodes:
                inside = {h["node"] for h in hosts}
                joining = sorted({n for n in self._arrivals(r + 1)
                                  if n not in inside and n < args.nnodes})
                if joining:
                    return self._end(r, {"kind": "joined", "nodes": joining})
            try:  # wakes at once on another host's record, else looks again in _POLL
                self.store.wait([key], timedelta(seconds=_POLL))
            except DistTimeoutError:
                pass

    def _describe(self, end: dict) -> str:
        if "rank" not in end:
            return end["why"]
        where = "this host" if end["node"] == self.node else f"node {end['node']}"
        return f"rank {end['rank']} (local rank {end['local_rank']} on {where}) {end['why']}"

    # -- the job ------------------------------------------------------------------------

    def run(self) -> int:
        me = self._me()
        code = 1
        try:
            code = self._run(me)
            return code
        finally:
            try:
                self.store.set(f"done/{_tag(me)}", "1")
            except DistError:
                pass  # the store is gone: nobody is left to read it
            if self.server is not None:
                self._serve_the_rest(code, me)

    def _run(self, me: dict) -> int:
        r, restarts, limit = 0, 0, self.args.max_restarts
        while True:
            try:
                start = self._form(r, restarts, me) if self.server else self._join(r, me)
                if "abort" in start:
                    raise LaunchError(start["abort"])
                if "over" in start:
                    _say(f"node {self.node}: the job ended (exit status {start['over']}) "
                         f"before this host was in a round; nothing ran here")
                    return start["over"]
                r, restarts, limit = start["round"], start["restarts"], start["max_restarts"]
                self.hosts = start["hosts"]
                end = self._run_round(start, me)
            except LaunchError:
                raise
            except DistError as e:  # the store stopped answering: its host is gone
                self._elect(e, me, restarts, limit)
                self.guard = ({h["node"] for h in self.hosts}, True)
                restarts += 1
                r += 1
                continue
            self.guard = None if end["kind"] == "joined" else ({h["node"] for h in self.hosts},
                                                               False)
            if end["kind"] == "done":
                return 0
            if end["kind"] == "joined":
                _say(f"restarting the job as node rank(s) {end['nodes']} joined (round {r + 1}; "
                     f"a host joining uses no restart)")
            elif restarts < limit:
                restarts += 1
                _say(f"restarting the job (restart {restarts} of {limit}) after "
                     f"{self._describe(end)}")
            else:
                _say(self._describe(end) + (f" (no restarts left: {limit} used)" if limit else ""))
                return 1
            r += 1

    def _elect(self, error: DistError, me: dict, restarts: int, limit: int) -> None:
        """The store's host is gone: make the first of the last round's other hosts that is
        alive serve a new store (this agent, when it is that one), and use it; raise
        ``LaunchError`` when no restart is left or too few hosts are."""
        args, lost = self.args, f"{self.args.master_addr}:{self.args.master_port}"
        gone = f"the store's host (node {self.leader} at {lost}) is gone ({error})"
        candidates = [h for h in self.hosts if h["node"] != self.leader]
        if self.server is not None or not self.hosts:
            raise error  # this agent's own store failed, or it never was in a round
        if restarts >= limit:
            raise LaunchError(gone + (f"; no restarts left ({limit} used)" if limit else
                                      "; --max-restarts 0"))
        if len(candidates) < args.min_nodes:
            raise LaunchError(f"{gone}; {len(candidates)} host(s) of the last round are left "
                              f"and --nnodes needs {args.min_nodes}: no new store")
        if 2 * len(candidates) <= len(self.hosts):
            raise LaunchError(f"{gone}; {len(candidates)} of the last round's "
                              f"{len(self.hosts)} hosts are left, not more than half: no new "
                              f"store (if the store's host is cut off, not dead, its side "
                              f"goes on)")
        wait = timedelta(seconds=config.store_reconnect() + 10)  # for one to notice, too
        for host in candidates:
            address = host["address"]
            try:
                if host == me:
                    server = TCPStore(address, args.master_port, None, True, wait,
                                      wait_for_workers=False, rank=0)
                    client = TCPStore(address, args.master_port, None, False, wait,
                                      rank=self.node)
                else:
                    server, client = None, TCPStore(address, args.master_port, None, False,
                                                    wait, rank=self.node)
            except (DistError, OSError):
                continue  # that host is gone too (or cannot serve): the next one
            try:
                self.client.close()
            except Exception:
                pass  # (the old store's client: its server is gone)
            _answer_within(client, args)
            self.server, self.client = server, client
            self.store = PrefixStore(f"launch/{args.rdzv_id}", client)
            self.leader, args.master_addr = host["node"], address
            _say(f"node {self.node}: {gone}; node {host['node']} serves the store now at "
                 f"{address}:{args.master_port}: restarting the job (restart "
                 f"{restarts + 1} of {limit})")
            return
        raise LaunchError(f"{gone}; none of the last round's other hosts "
                          f"{[h['node'] for h in candidates]} serves a new store")

    def _serve_the_rest(self, code: int, me: dict) -> None:
        """Node 0, leaving: close the next round with the job's outcome, then serve the
        store until every host that joined the last round or waits for the next has read
        how the job ended."""
        r = self.last["round"]
        self.store.compare_set(f"round/{r + 1}/start", "",
                               json.dumps({"round": r + 1, "over": code}))
        others = {f"done/{_tag(json.loads(self.store.get(f'round/{i}/host/{n}')))}"
                  for i in (r, r + 1) for n in self._arrivals(i)} - {f"done/{_tag(me)}"}
        try:
            self.store.wait(sorted(others), timedelta(seconds=_SERVE_AFTER))
        except DistTimeoutError:
            pass

    def close(self) -> None:
        self.client.close()
        if self.server is not None:
            self.server.close()


def _answer_within(client: TCPStore, args: argparse.Namespace) -> None:
    """Once connected, an agent's store calls (every wait names its own) must be answered
    within twice ``--agent-timeout``: a store whose host hangs is then taken as lost
    (and another elected), not waited on for the whole ``--join-timeout``."""
    client.set_timeout(timedelta(seconds=2 * args.agent_timeout))


class _Beats:
    """The agents' liveness in a round: each adds to its own counter about once a second;
    a counter not seen to change for ``timeout`` seconds (this agent's clock, so no two
    hosts' clocks are compared) names that host. Ranks that die with a lost agent are
    noticed by their peers' collectives anyway; this covers an agent lost before its
    ranks started, or a host that hangs or is cut off, for which they would wait the
    rendezvous's or the collectives' whole timeout."""

    def __init__(self, store: PrefixStore, r: int, me: int, nodes: list[int],
                 timeout: float) -> None:
        self.store, self.me, self.timeout = store, me, timeout
        self.keys = {n: f"round/{r}/beat/{n}" for n in nodes}
        now = time.monotonic()
        self.seen = {n: (b"", now) for n in nodes if n != me}  # (last value, when it changed)
        self.next = now

    def silent(self) -> int | None:
        """Beat, and look at the others' (about once a second): a silent one's node."""
        now = time.monotonic()
        if now < self.next:
            return None
        self.next = now + min(1.0, self.timeout / 4)
        self.store.add(self.keys[self.me], 1)
        nodes = list(self.seen)
        if not nodes:
            return None
        # every host of the round registered its counter when it joined: one request
        values = dict(zip(nodes, self.store.multi_get([self.keys[n] for n in nodes])))
        for n in nodes:
            value, since = self.seen[n]
            if values[n] != value:
                self.seen[n] = (values[n], now)
            elif now - since > self.timeout:
                return n
        return None


def _tag(host: dict) -> str:
    """One agent's name in the store: its node rank, machine and process."""
    return f"{host['node']}/{host['hostname']}/{host['pid']}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the launcher; returns the exit status (0 when every rank of a round succeeded)."""
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
