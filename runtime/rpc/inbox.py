"""Inboxes: a distributed autograd context's messages run by the thread waiting in it.

The I/O thread hands every request, and every answer that needs unpickling, to the
worker pool. While ``dist_autograd.backward`` waits for a backward to finish, the
passes that come back to its worker and the answers to its own messages would each wake
a pool thread, which then wakes the waiting one. Instead, while it waits, the waiting
thread takes them itself from its context's inbox: the ``ROUTED`` requests whose header
names the context, and the answers to requests sent with ``route=`` that context. That
is two thread hand-offs fewer per pass, and no pool thread competing with the pass for
the interpreter. When the backward ends, whatever is left goes to the pool.
"""

from __future__ import annotations

import logging
import queue
import threading

__all__ = ["Inboxes", "run_task"]

log = logging.getLogger("spmd.runtime.rpc")


class Inboxes:
    """The agent's inboxes, one per context with a thread waiting in it."""

    def __init__(self, pool: queue.SimpleQueue) -> None:
        self._pool = pool
        self._boxes: dict[int, queue.SimpleQueue] = {}
        self._lock = threading.Lock()

    def take(self, context_id: int) -> queue.SimpleQueue | None:
        """The inbox of ``context_id`` for the calling thread until ``give_back``; None
        when another thread holds it already."""
        with self._lock:
            if context_id in self._boxes:
                return None
            box = self._boxes[context_id] = queue.SimpleQueue()
            return box

    def route(self, context_id: int, task: tuple) -> bool:
        """Put ``task`` (a pool task: ``(fn, args)``) in the inbox of ``context_id``, if a
        thread holds one; False otherwise (the caller gives it to the pool)."""
        if context_id < 0 or not self._boxes:
            return False
        with self._lock:
            box = self._boxes.get(context_id)
            if box is None:
                return False
            box.put(task)
            return True

    def give_back(self, context_id: int) -> None:
        """The context's messages go to the pool again, with any not taken yet."""
        with self._lock:
            box = self._boxes.pop(context_id, None)
        while box is not None and not box.empty():
            task = box.get_nowait()
            if task is not None:
                self._pool.put(task)


def run_task(task: tuple) -> None:
    """Run a pool task on this thread; a failure is logged, as the pool logs it."""
    fn, args = task
    try:
        fn(*args)
    except BaseException:
        log.exception("rpc: a worker task failed")
