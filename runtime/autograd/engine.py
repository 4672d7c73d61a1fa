"""The distributed backward pass.

Each worker runs torch's own engine on its part of the graph. One *pass* on a worker
starts from some tensors and their gradients (the loss and ones on the caller; the
tensors of one recorded send elsewhere), walks the local graph to the leaves it reaches,
and runs torch's engine for their gradients:

- a leaf that arrived in a message of this context (a "recv") sends its gradient back
  to the sender (AUTOGRAD_BACKWARD), whose pass starts from the tensors it sent;
- any other leaf accumulates its gradient in the context.

Because gradients are linear, passes that reach a shared part of a graph from different
sends sum to what one pass would give; the graph is therefore kept (``retain_graph``)
until the context ends or its tensors are dropped. A send whose tensors never reach the
loss gets no gradient and starts no pass: unused branches cannot hang the backward.

When the whole backward is done, the worker that called ``backward`` (the *root*) learns
by credit: its first pass holds a credit of 1, a pass that starts others splits its
credit between their messages, and a pass that starts none gives its credit back to the
root (AUTOGRAD_DONE; nothing is sent when that pass ran on the root). The backward is
done when all of the credit is back, exactly (fractions). A message is answered as soon
as the pass it started is done here (not when the passes it started elsewhere are), so
a pass still running always has a message waiting for its answer: a worker that dies or
times out fails that message on its sender, which tells the root. Before this, every
answer waited for the passes after it: a step through one remote layer cost two round
trips on its critical path instead of one (0.75x torch's dist autograd step).

A pass runs ``torch.autograd.backward(..., inputs=leaves)`` rather than
``torch.autograd.grad``, so each leaf's ``AccumulateGrad`` node runs with its hooks, as in
torch's distributed engine. That is where torch's ``DistributedDataParallel`` hooks its
C++ reducer: with ``grad`` its all-reduce never ran, and a DDP module inside a context
got this rank's own gradients, silently. For the pass, the leaves' ``.grad`` holds the
context's gradients (see ``_accumulate``) and is put back after it, under the agent's
lock, so passes on one worker take turns. (A pass that reaches only received tensors,
whose gradients go back to their senders and accumulate nothing here, takes ``grad``.)
The root's waiting thread runs the passes that come back to it (``rpc.inbox``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from fractions import Fraction
from typing import Any, Callable, Sequence

import torch

from spmd.runtime.autograd.contexts import DistAutogradContext
from spmd.runtime.errors import DistTimeoutError, InvalidArgumentError, also_runtime_error
from spmd.runtime.rpc.inbox import run_task
from spmd.runtime.rpc.serialize import pack_exception, unpack_exception
from spmd.runtime.rpc.wire import Kind

__all__ = ["backward", "get_gradients", "release"]

log = logging.getLogger(__name__)
_GRACE = 1.0  # seconds


def _agent(op: str) -> Any:
    from spmd.runtime.rpc.api import current_agent

    return current_agent(op)


def _context(agent: Any, context_id: Any, op: str) -> DistAutogradContext:
    if not isinstance(context_id, int) or isinstance(context_id, bool):
        raise TypeError(f"{op}: context_id must be an int, got {type(context_id).__name__} "
                        f"(incompatible function arguments)")
    ctx = agent.contexts.get(context_id)
    if ctx is None:
        raise InvalidArgumentError(
            f"{op}: no distributed autograd context {context_id} on "
            f"{agent.describe(agent.rank)} (it ended, or never started here): Could not find "
            f"autograd context with id: {context_id}")
    return ctx


class BackwardJob:
    """The root's record of one backward: the credit given back so far, the first failure.
    Done when the credit adds up to exactly 1 (see the module) or something failed. With
    an ``inbox`` (``spmd.runtime.rpc.inbox``) the waiting thread runs the context's passes
    that come to this worker itself."""

    def __init__(self, inbox: Any) -> None:
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._inbox = inbox
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
                run_task(task)
        while self._inbox is not None:  # what came meanwhile (answers to its messages)
            try:
                task = self._inbox.get_nowait()
            except queue.Empty:
                break
            if task is not None:
                run_task(task)
        if self.error is not None:
            raise self.error


def _leaves(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The leaf tensors requiring grad that ``tensors`` depend on."""
    out: list[torch.Tensor] = []
    seen_leaves: set[int] = set()
    seen_nodes: set[Any] = set()
    stack = []
    for t in tensors:
        if t.grad_fn is None:
            if t.requires_grad and id(t) not in seen_leaves:
                seen_leaves.add(id(t))
                out.append(t)
        else:
            stack.append(t.grad_fn)
    while stack:
        node = stack.pop()
        if node in seen_nodes:
            continue
        seen_nodes.add(node)
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            leaf = getattr(nxt, "variable", None)
            if leaf is not None:
                if id(leaf) not in seen_leaves:
                    seen_leaves.add(id(leaf))
                    out.append(leaf)
            elif nxt not in seen_nodes:
                stack.append(nxt)
    return out


def _accumulate(agent: Any, ctx: DistAutogradContext, tensors: list[torch.Tensor],
                grads: list[torch.Tensor], leaves: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """One local backward from ``tensors`` to ``leaves`` through their ``AccumulateGrad``
    nodes and hooks; returns each leaf's gradient from this pass (received leaves) or
    its context total so far (this worker's own leaves), which it also stores.

    For the pass, ``.grad`` of every leaf of the context here holds the context's total
    (a received leaf's, None), so what accumulates there is the context's: a DDP
    reducer that finishes a bucket in a later pass (its parameters' gradients came by
    different sends) writes the averaged bucket into the leaves of the earlier pass too.
    The leaves' own ``.grad`` is put back afterwards. A pass that reaches received
    tensors only (their gradients go back to the senders; nothing accumulates here) takes
    ``torch.autograd.grad``.
    """
    if all(ctx.received(t) is not None for t in leaves):
        with agent.autograd_lock:
            return list(torch.autograd.grad(tensors, leaves, grads, retain_graph=True,
                                            allow_unused=True))
    with agent.autograd_lock:
        with ctx.lock:
            held = dict(ctx.grads)
        swap = list({id(t): t for t in [*leaves, *held]}.values())
        saved = [t.grad for t in swap]
        try:
            for t in swap:
                t.grad = held.get(t)
            torch.autograd.backward(tensors, grads, retain_graph=True, inputs=leaves)
            after = {id(t): t.grad for t in swap}
        finally:
            for t, grad in zip(swap, saved):
                t.grad = grad
    with ctx.lock:
        for t in swap:
            if ctx.received(t) is None and after[id(t)] is not None:
                ctx.grads[t] = after[id(t)]
    return [after[id(t)] for t in leaves]


def _run_pass(agent: Any, ctx: DistAutogradContext, tensors: list[torch.Tensor],
              grads: list[torch.Tensor], job: tuple[int, int],
              credit: Fraction) -> list[torch.futures.Future]:
    """One pass here, then its messages to the senders of the received leaves it reached,
    ``credit`` split between them (given back to the root when there are none); the
    futures of their answers. A local failure raises; a message that cannot be sent or
    whose pass fails is reported to the root."""
    pairs = [(t, g) for t, g in zip(tensors, grads) if t.requires_grad and g is not None]
    leaves = _leaves([t for t, _ in pairs])
    outgoing: dict[int, tuple[int, dict[int, torch.Tensor]]] = {}
    if leaves:
        results = _accumulate(agent, ctx, [t for t, _ in pairs], [g for _, g in pairs], leaves)
        for leaf, grad in zip(leaves, results):
            origin = ctx.received(leaf)
            if grad is not None and origin is not None:
                peer, msg_id, slot = origin
                outgoing.setdefault(msg_id, (peer, {}))[1][slot] = grad
    if not outgoing:
        _give_back(agent, ctx.context_id, job, credit, None)
        return []
    share = credit / len(outgoing)
    futures = []
    for msg_id, (peer, by_slot) in outgoing.items():
        what = f"backward of context {ctx.context_id} on {agent.describe(peer)}"
        try:
            entry = agent.request(peer, Kind.AUTOGRAD_BACKWARD, _propagate,
                                  (ctx.context_id, msg_id, by_slot, job, share), {},
                                  timeout=agent.timeout, sync=False, what=what,
                                  route=ctx.context_id)
        except Exception as e:
            _give_back(agent, ctx.context_id, job, share, e)
            continue
        entry.future.add_done_callback(
            lambda f: _reported(agent, ctx.context_id, job, f))
        futures.append(entry.future)
    return futures


def _reported(agent: Any, context_id: int, job: tuple[int, int],
              answer: torch.futures.Future) -> None:
    """A pass's message was answered: a failure there (or of the worker) goes to the root."""
    try:
        answer.value()
    except Exception as e:
        _give_back(agent, context_id, job, Fraction(0), e)


def _give_back(agent: Any, context_id: int, job: tuple[int, int], credit: Fraction,
               error: BaseException | None) -> None:
    """Return ``credit`` (and the failure, if any) to the root of ``job``."""
    root, number = job
    if root == agent.rank:
        _credit(context_id, number, credit, error)
        return
    packed = None if error is None else pack_exception(error)
    try:
        agent.request(root, Kind.AUTOGRAD_DONE, _credit_from, (context_id, number, credit,
                                                               packed, agent.rank), {},
                      timeout=agent.timeout, sync=False, route=context_id,
                      what=f"end of a backward of context {context_id} on "
                           f"{agent.describe(root)}")
    except Exception as e:  # the root is gone: nobody waits for this backward any more
        log.info("dist_autograd: could not tell %s that a part of its backward ended: %s",
                 agent.describe(root), e)


def _credit(context_id: int, number: int, credit: Fraction,
            error: BaseException | None) -> None:
    agent = _agent("dist_autograd backward")
    ctx = agent.contexts.get(context_id)
    job = None if ctx is None else ctx.jobs.get(number)
    if job is not None:  # else the backward already ended (it failed, or timed out)
        job.give_back(credit, error)


def _credit_from(context_id: int, number: int, credit: Fraction, packed: tuple | None,
                 origin: int) -> None:
    """Runs on the root: a part of its backward ended on worker ``origin``."""
    agent = _agent("dist_autograd backward")
    error = None
    if packed is not None:
        error = unpack_exception(packed, f"on {agent.describe(origin)}, in the backward "
                                         f"of context {context_id}")
    _credit(context_id, number, credit, error)


def _propagate(context_id: int, msg_id: int, by_slot: dict[int, torch.Tensor],
               job: tuple[int, int], credit: Fraction) -> None:
    """Runs on the worker that sent message ``msg_id``: a pass from the tensors it sent.
    Answered when this pass is done; the passes it starts report to the root."""
    agent = _agent("dist_autograd backward")
    ctx = _context(agent, context_id, "dist_autograd backward")
    sent = ctx.sends.get(msg_id)
    if sent is None:
        raise ValueError(f"dist_autograd backward: context {context_id} on "
                         f"{agent.describe(agent.rank)} recorded no message {msg_id}")
    tensors = sent[1]
    slots = sorted(by_slot)
    _run_pass(agent, ctx, [tensors[s] for s in slots], [by_slot[s] for s in slots], job, credit)


def backward(context_id: int, roots: Sequence[torch.Tensor], retain_graph: bool = False) -> None:
    """Run the backward pass of ``roots`` across every worker of the context.

    Gradients accumulate in the context on each worker (``get_gradients``), never in
    ``.grad``. ``retain_graph`` is accepted for compatibility: graphs stay alive until
    the context ends or their tensors are dropped, because passes from several
    workers may cross one graph.

    Raises:
        TypeError/ValueError: an unknown context, roots that are not scalar tensors
            requiring grad (before anything is sent).
        The remote error of a worker whose part of the backward failed, with its
        traceback; DistTimeoutError/DistError for a worker that timed out or died.

    Example::

        with dist_autograd.context() as cid:
            loss = model(x).sum()
            dist_autograd.backward(cid, [loss])
    """
    agent = _agent("dist_autograd.backward")
    ctx = _context(agent, context_id, "dist_autograd.backward")
    if isinstance(roots, torch.Tensor) or not isinstance(roots, (list, tuple)):
        raise TypeError(f"dist_autograd.backward: roots must be a list of tensors, got "
                        f"{type(roots).__name__} (incompatible function arguments)")
    if not roots:
        raise InvalidArgumentError("dist_autograd.backward: roots is empty (No tensors "
                                   "provided for gradient computation)")
    for i, root in enumerate(roots):
        if not isinstance(root, torch.Tensor):
            raise TypeError(f"dist_autograd.backward: roots[{i}] is a {type(root).__name__}, "
                            f"not a tensor (incompatible function arguments)")
        if not root.requires_grad:
            raise InvalidArgumentError(f"dist_autograd.backward: roots[{i}] does not require "
                                       f"grad (requires_grad not set on root {i})")
        if root.numel() != 1:
            raise InvalidArgumentError(
                f"dist_autograd.backward: roots[{i}] has shape {tuple(root.shape)}; roots "
                f"must be scalars (Tensor is not a scalar, all roots need to be scalar)")
        if root.grad_fn is None:
            raise InvalidArgumentError(
                f"dist_autograd.backward: roots[{i}] is a leaf tensor: it does not have a "
                f"valid gradient function to start the backward from")
    if not isinstance(retain_graph, bool):
        raise TypeError("dist_autograd.backward: retain_graph must be a bool")
    inbox = agent.inboxes.take(context_id)
    job = BackwardJob(inbox)
    number = ctx.start_job(job)
    try:
        try:
            answers = _run_pass(agent, ctx, list(roots), [torch.ones_like(r) for r in roots],
                                (agent.rank, number), Fraction(1))
            # a message that is not answered fails on its sender after the timeout and
            # names the worker; the root's own limit comes a little later, for what
            # nobody reports
            job.wait(time.monotonic() + agent.timeout + _GRACE, lambda: _stalled(agent, ctx))
        finally:
            ctx.end_job(number)
            if inbox is not None:  # answers still to come go to the pool from here on
                agent.inboxes.give_back(context_id)
        for answer in answers:  # here already, or failed (and reported) by their deadline
            answer.wait()
    except RuntimeError:
        raise
    except Exception as e:  # torch's engine raises every backward failure as a RuntimeError
        raise also_runtime_error(e) from None


def _stalled(agent: Any, ctx: DistAutogradContext) -> str:
    with ctx.lock:
        peers = sorted(ctx.workers - {agent.rank})
    lost = [f"{agent.describe(p)} is gone ({agent.lost[p]})" for p in peers if p in agent.lost]
    return (f"dist_autograd.backward of context {ctx.context_id} (workers in it: "
            + (", ".join(agent.describe(p) for p in peers) or "none") + ")"
            + ("; " + "; ".join(lost) if lost else ""))


def get_gradients(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """This worker's gradients of the context: ``{leaf tensor: gradient}``.

    Example::

        grads = dist_autograd.get_gradients(cid)
        grads[w]        # the gradient of w, a parameter of this worker
    """
    agent = _agent("dist_autograd.get_gradients")
    ctx = _context(agent, context_id, "dist_autograd.get_gradients")
    return ctx.gradients()


def release(agent: Any, context_id: int, told_by: int | None = None) -> None:
    """Delete the context here and tell the workers it exchanged messages with (not the
    one that told us: it has deleted its own)."""
    with agent.contexts_lock:
        ctx = agent.contexts.pop(context_id, None)
    if ctx is None or agent.stopped:
        return
    with ctx.lock:
        peers = sorted(ctx.workers - {agent.rank, told_by})
    for peer in peers:
        if peer in agent.lost:
            continue
        try:
            agent.request(peer, Kind.AUTOGRAD_CLEANUP, _cleanup, (context_id, agent.rank), {},
                          timeout=agent.timeout, sync=False,
                          what=f"ending context {context_id} on {agent.describe(peer)}")
        except Exception:
            pass  # a peer that is gone keeps nothing


def _cleanup(context_id: int, told_by: int | None = None) -> None:
    release(_agent("dist_autograd cleanup"), context_id, told_by)
