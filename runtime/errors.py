"""The exceptions of the runtime.

Every runtime failure is a :class:`DistError`. A timeout is a :class:`DistTimeoutError`,
which is also the built-in :class:`TimeoutError`, so ``except TimeoutError`` works for
code that does not know this library. Bad arguments are never ``DistError``: they raise
``ValueError`` or ``TypeError`` before anything is sent.
"""

from __future__ import annotations

__all__ = ["DistError", "DistTimeoutError", "DistStoreError", "StoreTimeoutError",
           "QueueEmptyError", "InvalidArgumentError", "WrongTypeError"]


class DistError(RuntimeError):
    """Root of every runtime failure (a peer died, a server refused, a backend failed)."""


class DistTimeoutError(DistError, TimeoutError):
    """A blocking call gave up after its timeout; the message names what it waited for."""


class DistStoreError(DistError):
    """A key-value store failed: refused connection, lost server, a bad value for ``add``."""


class StoreTimeoutError(DistTimeoutError, DistStoreError):
    """A store's blocking call gave up: a timeout, and a store error (torch raises
    ``DistStoreError`` there, so code catching that catches this too)."""


class QueueEmptyError(DistStoreError):
    """``queue_pop(block=False)`` on an empty queue."""


class InvalidArgumentError(ValueError, RuntimeError):
    """A bad argument where torch.distributed raises ``RuntimeError`` (an unknown worker or
    rendezvous scheme, a rank outside the group, ``local_value()`` off the owner): a
    ``ValueError`` as our other bad arguments are, and a ``RuntimeError`` so code written
    for torch catches it."""


class WrongTypeError(TypeError, RuntimeError):
    """A value of the wrong type where torch raises ``RuntimeError`` (an
    ``async_execution`` function that returned no Future)."""


_RUNTIME_TWINS: dict[type, type] = {}


def also_runtime_error(e: Exception, note: str = "") -> Exception:
    """``e`` as an instance of a class that is both its own and ``RuntimeError`` (with
    ``note`` added to its message), where torch raises a ``RuntimeError``: code written for
    torch (``except RuntimeError``) and code that knows the type both catch it. ``e``
    itself where that class cannot be made or built."""
    cls = type(e)
    if isinstance(e, RuntimeError) and not note:
        return e
    twin = _RUNTIME_TWINS.get(cls)
    args = e.args
    if note:
        args = (f"{args[0]}{note}", *args[1:]) if args and isinstance(args[0], str) else (note,)
    try:
        if twin is None:
            twin = _RUNTIME_TWINS[cls] = (cls if issubclass(cls, RuntimeError) else
                                          type(cls.__name__, (RuntimeError, cls),
                                               {"__module__": cls.__module__,
                                                "_spmd_twin_of": cls}))
        out = twin(*args)
    except Exception:  # an incompatible layout, or a constructor that wants other arguments
        return e
    out.__dict__.update(getattr(e, "__dict__", {}))
    out.__traceback__ = e.__traceback__
    return out
