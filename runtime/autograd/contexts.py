"""Distributed autograd contexts: what each worker recorded for one backward pass.

A context has one id across the job (the creating worker's rank in the top 16 bits). On
every worker that took part it holds:

- ``sends``: per message id, the tensors requiring grad that this worker sent (in a
  request or a response); gradients for them come back from the receiver;
- ``recvs``: the tensors requiring grad that arrived here, with who sent them and under
  which message id and slot, so their gradients can go back;
- ``grads``: the gradients accumulated for this worker's leaves (never in ``.grad``);
- ``workers``: the peers it exchanged messages with, told when the context ends;
- ``jobs``: on the worker that called ``backward``, each running backward's credit.

The context a thread works in is thread-local: the user's ``with context()`` block, or
the request a worker thread is serving.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from contextlib import contextmanager
from fractions import Fraction
from typing import Any, Callable, Iterator

import torch

__all__ = ["BackwardJob", "DistAutogradContext", "context", "current_context", "join_context",
           "find_context", "running_in"]


class DistAutogradContext:
    """One worker's record of a distributed autograd context."""

    def __init__(self, agent: Any, context_id: int) -> None:
        self.agent = agent
        self.context_id = context_id
        self.lock = threading.Lock()
        self.workers: set[int] = set()
        self.sends: dict[int, tuple[int, list[torch.Tensor]]] = {}
        self.recvs: dict[int, tuple[torch.Tensor, int, int, int]] = {}
        self.grads: dict[torch.Tensor, torch.Tensor] = {}
        self.jobs: dict[int, BackwardJob] = {}

    def start_job(self, inbox: Any = None) -> tuple[int, BackwardJob]:
        """A backward started here: its number (sent with its messages) and record;
        ``inbox``: the agent's queue of this context's passes, for its waiting thread."""
        number, job = next(_job_numbers), BackwardJob(inbox, self.agent)
        with self.lock:
            self.jobs[number] = job
        return number, job

    def end_job(self, number: int) -> None:
        with self.lock:
            self.jobs.pop(number, None)

    def record_send(self, dest: int, tensors: list[torch.Tensor]) -> int:
        """Remember tensors sent to ``dest``; their message id (-1 when there are none)."""
        with self.lock:
            self.workers.add(dest)
            if not tensors:
                return -1
            msg_id = (self.agent.rank << 48) | next(_message_ids)
            self.sends[msg_id] = (dest, list(tensors))
            return msg_id

    def record_recv(self, tensor: torch.Tensor, peer: int, msg_id: int, slot: int) -> None:
        with self.lock:
            self.workers.add(peer)
            self.recvs[id(tensor)] = (tensor, peer, msg_id, slot)

    def received(self, tensor: torch.Tensor) -> tuple[int, int, int] | None:
        """(sender, message id, slot) when ``tensor`` arrived in this context."""
        entry = self.recvs.get(id(tensor))
        if entry is None or entry[0] is not tensor:
            return None
        return entry[1], entry[2], entry[3]

    def gradients(self) -> dict[torch.Tensor, torch.Tensor]:
        """``{leaf: gradient}``, each gradient the caller's own (a DDP bucket view,
        which DDP overwrites at its next backward, is copied)."""
        with self.lock:
            return {t: g.clone() if g._is_view() else g for t, g in self.grads.items()}


class BackwardJob:
    """The root's record of one backward: the credit given back so far, the first failure.
    Done when the credit adds up to exactly 1 (see ``engine``) or something failed. With
    an ``inbox`` (``RpcAgent.take_requests``) the waiting thread runs the context's passes
    that come to this worker itself."""

    def __init__(self, inbox: Any, agent: Any) -> None:
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._inbox, self._agent = inbox, agent
        self.credit = Fraction(0)
        self.error: BaseException | None = None

    def give_back(self, credit: Fraction, error: BaseException | None) -> None:
        with self._lock:
            self.credit += credit
            if error is not None and self.error is None:
                self.error = error
            if self.error is None and self.credit != 1:
                return
            self._done.set()
        if self._inbox is not None:
            self._inbox.put(None)  # wakes the waiting thread

    def wait(self, deadline: float, what: Callable[[], str]) -> None:
        """Until done; raises the first failure, or DistTimeoutError past ``deadline``."""
        while not self._done.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                from spmd.runtime.errors import DistTimeoutError

                raise DistTimeoutError(f"{what()} did not finish on every worker before its "
                                       f"timeout (RPC ran for more than its timeout)")
            if self._inbox is None:
                self._done.wait(left)
                continue
            try:
                task = self._inbox.get(timeout=left)
            except queue.Empty:
                continue
            if task is not None:
                self._agent.run_task(task)
        while self._inbox is not None:  # what came meanwhile (answers to its messages)
            try:
                task = self._inbox.get_nowait()
            except queue.Empty:
                break
            if task is not None:
                self._agent.run_task(task)
        if self.error is not None:
            raise self.error


_message_ids = itertools.count(1)
_job_numbers = itertools.count(1)
_context_ids = itertools.count(1)


class _Local(threading.local):
    ctx: DistAutogradContext | None = None


_local = _Local()


def current_context(agent: Any) -> DistAutogradContext | None:
    """The context this thread works in, if it belongs to ``agent``."""
    ctx = _local.ctx
    return ctx if ctx is not None and ctx.agent is agent else None


@contextmanager
def running_in(ctx: DistAutogradContext | None) -> Iterator[None]:
    """Serve a request inside ``ctx`` (or inside none)."""
    previous = _local.ctx
    _local.ctx = ctx
    try:
        yield
    finally:
        _local.ctx = previous


def join_context(agent: Any, context_id: int, peer: int) -> DistAutogradContext:
    """The context a request from ``peer`` carries, created here on first sight."""
    with agent.contexts_lock:
        ctx = agent.contexts.get(context_id)
        if ctx is None:
            ctx = agent.contexts[context_id] = DistAutogradContext(agent, context_id)
    with ctx.lock:
        ctx.workers.add(peer)
    return ctx


def find_context(agent: Any, context_id: int) -> DistAutogradContext | None:
    """The context of a response, if it still exists here."""
    return agent.contexts.get(context_id)


class context:
    """A distributed autograd context: ``with context() as context_id:``.

    Every RPC made inside the block carries the context; tensors requiring grad that
    it sends or receives are recorded on both sides, and ``backward(context_id, ...)``
    follows them across workers. On exit the context is deleted on every worker that
    took part.

    Example::

        with dist_autograd.context() as context_id:
            loss = rpc.rpc_sync("worker1", torch.add, args=(x, y)).sum()
            dist_autograd.backward(context_id, [loss])
            grads = dist_autograd.get_gradients(context_id)   # {x: ..., y: ...}
    """

    def __enter__(self) -> int:
        from spmd.runtime.rpc.api import current_agent

        agent = current_agent("dist_autograd.context")
        if _local.ctx is not None:
            raise RuntimeError("dist_autograd.context: this thread is already inside context "
                               f"{_local.ctx.context_id}; contexts do not nest (Already have "
                               f"an autograd context id for this thread)")
        context_id = (agent.rank << 48) | next(_context_ids)
        self._ctx = ctx = DistAutogradContext(agent, context_id)
        with agent.contexts_lock:
            agent.contexts[context_id] = ctx
        _local.ctx = ctx
        return context_id

    def __exit__(self, *exc: object) -> None:
        from spmd.runtime.autograd.engine import release

        _local.ctx = None
        release(self._ctx.agent, self._ctx.context_id)
