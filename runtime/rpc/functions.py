"""Decorators for functions run over RPC."""

from __future__ import annotations

from typing import Callable, TypeVar

__all__ = ["async_execution"]

F = TypeVar("F", bound=Callable)


def async_execution(fn: F) -> F:
    """Mark ``fn`` as returning a ``torch.futures.Future``: run over RPC (``rpc_sync``,
    ``rpc_async``, ``remote``, or an RRef proxy), the call is answered when that future
    completes, and the worker thread is free in the meantime. Put it innermost, under
    ``@staticmethod`` or ``@classmethod``.

    Example::

        @rpc.functions.async_execution
        def add_later(x):
            fut = torch.futures.Future()
            pending.append((fut, x))        # completed by another call, in a batch
            return fut
    """
    if not callable(fn):
        raise TypeError(f"async_execution decorates a function, got {type(fn).__name__}")
    fn._spmd_async_execution = True  # type: ignore[attr-defined]
    fn._wrapped_async_rpc_function = fn  # type: ignore[attr-defined]  # PyTorch's marker
    return fn
