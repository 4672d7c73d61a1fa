"""Rank contexts: what "this rank" means when ranks can be processes or threads.

A process started by ``spawn`` (or torchrun) is one rank: its environment variables say
which. When ``spawn(start_method="thread")`` runs ranks as threads of one process, each
thread gets its own :class:`RankContext` whose ``env`` overrides the process environment
and whose ``state`` holds what would otherwise be process-global (the default process
group). Everything in the runtime that asks "which rank am I" goes through here.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

__all__ = ["RankContext", "current", "getenv", "rank_context"]


class RankContext:
    """The per-rank state of one thread-rank (or of the whole process)."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.env: dict[str, str] = dict(env or {})
        self.state: dict[str, Any] = {}
        self._close_hooks: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self.aborted: str | None = None

    def on_close(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` when the rank ends (thread-ranks release what they built)."""
        with self._lock:
            self._close_hooks.append(hook)

    def close(self) -> None:
        """Run the close hooks, newest first; errors in them are swallowed."""
        with self._lock:
            hooks, self._close_hooks = self._close_hooks[::-1], []
        for hook in hooks:
            try:
                hook()
            except Exception:
                pass

    def abort(self, reason: str) -> None:
        """Make this rank's blocking calls fail soon (threads cannot be killed)."""
        self.aborted = reason


class _Local(threading.local):
    context: RankContext | None = None  # a class default: no AttributeError on the hot path


_process_context = RankContext()
_local = _Local()


def current() -> RankContext:
    """The context of the calling thread-rank, or the process's when it is not one."""
    return _local.context or _process_context


def getenv(name: str, default: str | None = None) -> str | None:
    """An environment variable as this rank sees it (thread-ranks have their own)."""
    ctx = _local.context
    if ctx is not None and name in ctx.env:
        return ctx.env[name]
    return os.environ.get(name, default)


@contextmanager
def rank_context(context: RankContext) -> Iterator[RankContext]:
    """Run the body as the rank ``context`` describes (used by thread-ranks)."""
    previous = _local.context
    _local.context = context
    try:
        yield context
    finally:
        _local.context = previous
