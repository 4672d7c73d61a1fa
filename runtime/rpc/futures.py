"""Async functions and futures of RPC: what an ``async_execution`` function (ours or
torch's) answers with, and waiting on a future without blocking its callbacks."""

from __future__ import annotations

import threading
from typing import Any

import torch

from spmd.runtime.errors import WrongTypeError

__all__ = ["AsyncResult", "is_async", "not_a_future_error", "done_within"]


class AsyncResult:
    """Returned by an internal function whose answer is the value of ``future``."""

    __slots__ = ("future",)

    def __init__(self, future: torch.futures.Future) -> None:
        self.future = future


def is_async(func: Any) -> bool:
    """Whether ``func`` was decorated with ``functions.async_execution`` (ours, or torch's
    ``torch.distributed.rpc.functions.async_execution``, which marks it the same way)."""
    return bool(getattr(func, "_spmd_async_execution", False)
                or getattr(func, "_wrapped_async_rpc_function", None) is not None)


def not_a_future_error(func: Any, value: Any) -> WrongTypeError:
    """The error of an ``async_execution`` function that returned ``value``, no Future."""
    return WrongTypeError(
        f"Functions decorated with @rpc.async_function must return a torch.futures.Future "
        f"object, but got {type(value).__name__}: {getattr(func, '__qualname__', func)!r} is "
        f"an async_execution function but returned {type(value).__name__}, not a "
        f"torch.futures.Future")


def done_within(future: torch.futures.Future, timeout: float) -> bool:
    """Whether ``future`` completes within ``timeout`` seconds (it is not waited on)."""
    if future.done():
        return True
    event = threading.Event()
    future.add_done_callback(lambda _: event.set())
    return event.wait(timeout)
