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
import threading
from contextlib import contextmanager
from typing import Any, Iterator

import torch

__all__ = ["DistAutogradContext", "context", "current_context", "join_context",
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
        self.jobs: dict[int, Any] = {}  # engine.BackwardJob by number

    def start_job(self, job: Any) -> int:
        """A backward started here (``engine.BackwardJob``): its number, which its
        messages carry."""
        number = next(_job_numbers)
        with self.lock:
            self.jobs[number] = job
        return number

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
