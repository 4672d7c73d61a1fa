"""Graceful shutdown: every worker stops only when no work is left anywhere.

PyTorch's TensorPipe agent's rule: a worker's *outstanding* work is its requests still
waiting for an answer (every call running anywhere answers one of them), plus here its
lent buffers and RRef forks in flight. Workers meet in rounds at a coordinator (rank 0):

    round 0     everyone has called shutdown()           (no user code issues new work)
    round r>0   each worker first deletes its remaining user RRefs, waits until its own
                outstanding count is 0, then reports its count at that instant; when
                the sum is 0 everywhere, nothing is left in flight, else another round
    bye         the others tell the coordinator they have the final answer, so it does
                not close while an answer is still on its way

Never forever: the coordinator names the workers that did not report within the
timeout (or whose connection closed) and tells the others; a worker whose coordinator
does not answer names the coordinator.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from spmd.runtime.errors import DistError, DistTimeoutError
from spmd.runtime import config
from spmd.runtime.rpc.agent import RpcAgent
from spmd.runtime.rpc.futures import AsyncResult, done_within
from spmd.runtime.rpc.api import _stop_local, current_agent, wait_sync
from spmd.runtime.rpc.options import _positive
from spmd.runtime.rpc.wire import Kind

__all__ = ["shutdown"]

log = logging.getLogger("spmd.runtime.rpc")
_LEADER = 0
_create_lock = threading.Lock()


class _Rounds:
    """The coordinator's view of the rounds (and, on every worker, the peer-loss hook)."""

    def __init__(self, agent: RpcAgent) -> None:
        self.agent = agent
        self.lock = threading.Lock()
        self.reports: dict[int, dict[int, int]] = {}
        self.futures: dict[int, list[torch.futures.Future]] = {}
        self.failure: BaseException | None = None
        self.byes: set[int] = set()
        self.bye_event = threading.Event()
        self.bye_answers: list[torch.futures.Future] = []
        self.released = False
        if agent.world_size == 1:
            self.bye_event.set()

    def arrive(self, round_no: int, rank: int, count: int) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        with self.lock:
            if self.failure is not None:
                future.set_exception(self.failure)
                return future
            reports = self.reports.setdefault(round_no, {})
            reports[rank] = count
            self.futures.setdefault(round_no, []).append(future)
            if len(reports) < self.agent.world_size:
                return future
            total, done = sum(reports.values()), self.futures.pop(round_no)
        for f in done:
            f.set_result(total)
        return future

    def missing(self, round_no: int) -> list[int]:
        with self.lock:
            arrived = self.reports.get(round_no, {})
        return [r for r in range(self.agent.world_size) if r not in arrived]

    def fail(self, error: BaseException) -> None:
        with self.lock:
            if self.failure is None:
                self.failure = error
            waiting = [f for fs in self.futures.values() for f in fs]
            self.futures.clear()
        for f in waiting:
            if not f.done():
                f.set_exception(error)

    def peer_lost(self, peer: int, reason: str) -> None:
        if self.agent.rank == _LEADER and not self.bye_event.is_set():
            self.fail(DistError(f"shutdown: {self.agent.describe(peer)} is gone ({reason}) "
                                f"before the shutdown finished"))

    def bye(self, rank: int) -> torch.futures.Future:
        """Answered once the coordinator has closed its store: a worker that starts again
        at once then meets a fresh store, never the old one."""
        answer: torch.futures.Future = torch.futures.Future()
        with self.lock:
            self.byes.add(rank)
            if len(self.byes) >= self.agent.world_size - 1:
                self.bye_event.set()
            if not self.released:
                self.bye_answers.append(answer)
                return answer
        answer.set_result(None)
        return answer

    def release_byes(self) -> None:
        with self.lock:
            self.released = True
            answers, self.bye_answers = self.bye_answers, []
        for answer in answers:
            answer.set_result(None)


def _rounds(agent: RpcAgent) -> _Rounds:
    with _create_lock:
        if agent.shutdown_state is None:
            agent.shutdown_state = _Rounds(agent)
        return agent.shutdown_state


def _shutdown_report(round_no: int, rank: int, count: int) -> AsyncResult:
    return AsyncResult(_rounds(current_agent("shutdown")).arrive(round_no, rank, count))


def _shutdown_bye(rank: int) -> AsyncResult:
    return AsyncResult(_rounds(current_agent("shutdown")).bye(rank))


def _report(agent: RpcAgent, rounds: _Rounds, round_no: int, count: int,
            deadline: float, timeout: float) -> int:
    if agent.rank == _LEADER:
        future = rounds.arrive(round_no, agent.rank, count)
        if not done_within(future, max(deadline - time.monotonic(), 0.0)):
            names = ", ".join(agent.describe(r) for r in rounds.missing(round_no))
            error = DistTimeoutError(f"shutdown: {names} did not shut down within the "
                                     f"{timeout:g}s timeout")
            rounds.fail(error)
            raise error
        return future.wait()
    # a little longer than the coordinator, whose verdict names the worker at fault
    left = max(deadline - time.monotonic(), 0.0) + 1.0
    leader = agent.describe(_LEADER)
    entry = agent.request(_LEADER, Kind.SHUTDOWN, _shutdown_report, (round_no, agent.rank, count),
                          {}, timeout=left, sync=True,
                          what=f"shutdown: waiting for the coordinator, {leader},")
    try:
        return wait_sync(agent, entry)
    except DistError as e:
        if entry.reply is not None:  # the coordinator's verdict, naming the worker at fault
            raise type(e)(str(e).split("\n\nRemote traceback")[0]) from None
        if not isinstance(e, DistTimeoutError):
            raise
        raise DistTimeoutError(
            f"shutdown: the coordinator, {leader}, did not answer within the {timeout:g}s "
            f"timeout: it has not called shutdown(), or it waits for a worker that has not"
            ) from None


def _wait_idle(agent: RpcAgent, deadline: float, timeout: float) -> None:
    while agent.outstanding():
        if time.monotonic() >= deadline:
            stuck = [e.what for e in list(agent.pending.values())][:5]
            raise DistTimeoutError(f"shutdown: {agent.outstanding()} operations of "
                                   f"{agent.describe(agent.rank)} did not finish within the "
                                   f"{timeout:g}s timeout: {stuck}")
        time.sleep(0.002)


def _run_rounds(agent: RpcAgent, timeout: float) -> None:
    """Run the rounds; raises naming the peers at fault."""
    deadline = time.monotonic() + timeout
    rounds = _rounds(agent)
    if agent.lost:
        peer, reason = next(iter(agent.lost.items()))
        raise DistError(f"shutdown: {agent.describe(peer)} is gone ({reason})")
    if agent.rank == _LEADER:
        for peer in range(agent.world_size):  # connect, so a peer's death is noticed
            try:
                agent.transport.ensure(peer, deadline)
            except DistError as e:
                error = DistError(f"shutdown: {e}")
                rounds.fail(error)
                raise error from None
    _report(agent, rounds, 0, 0, deadline, timeout)
    round_no = 0
    while True:
        round_no += 1
        agent.rrefs.sweep_users()
        _wait_idle(agent, deadline, timeout)
        if _report(agent, rounds, round_no, agent.outstanding(), deadline, timeout) == 0:
            break
    agent.closing.update(range(agent.world_size))  # closing connections are expected now
    if agent.rank == _LEADER:
        rounds.bye_event.wait(min(max(deadline - time.monotonic(), 0.0), 10.0))
        agent.drop_store()  # before the byes: a worker that starts again meets a fresh one
        rounds.release_byes()
    else:
        try:
            entry = agent.request(_LEADER, Kind.SHUTDOWN, _shutdown_bye, (agent.rank,), {},
                                  timeout=min(max(deadline - time.monotonic(), 0.1), 10.0),
                                  sync=True, what="shutdown: saying goodbye")
            wait_sync(agent, entry)
        except Exception as e:
            log.debug("rpc: goodbye to the coordinator failed: %s", e)


def shutdown(graceful: bool = True, timeout: float | None = None) -> None:
    """Stop this worker's RPC agent.

    With ``graceful`` (the default), wait until every worker has called ``shutdown`` and
    no call, RRef message or lent buffer is left in flight anywhere, then stop. A worker
    of a dynamic group (``init_rpc`` without ``world_size``) leaves on its own: it
    finishes its own outstanding work, then tells the members it leaves. It never
    waits forever: after ``timeout`` seconds (default ``SPMD_RPC_SHUTDOWN_TIMEOUT``,
    1800) it raises ``DistTimeoutError`` naming the workers that did not shut down, and
    ``DistError`` at once when one of them dies. The agent is stopped either way.

    Example::

        rpc.init_rpc("worker0", rank=0, world_size=2)
        ...
        rpc.shutdown()                  # waits for worker1's calls to this worker too
    """
    if not isinstance(graceful, bool):
        raise TypeError(f"shutdown: graceful must be a bool, got {type(graceful).__name__}")
    seconds = config.rpc_shutdown_timeout() if timeout is None else _positive(timeout,
                                                                             "shutdown timeout")
    agent = current_agent("shutdown")
    try:
        if agent.members is not None:  # a dynamic group: this worker leaves on its own
            if graceful:
                agent.rrefs.sweep_users()
                _wait_idle(agent, time.monotonic() + seconds, seconds)
            agent.members.leave(graceful, seconds)
        elif graceful:
            _run_rounds(agent, seconds)
    finally:
        # graceful: answers still queued (the verdict of a failed shutdown too) get a moment
        _stop_local(agent, 1.0 if graceful else 0.0)

