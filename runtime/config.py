"""Every tunable of the library, in one place, each with its environment override.

Values are read from the environment when they are asked for, so a test or a notebook
can change a variable and see the effect without re-importing anything.

=========================  ===============  ================================================
variable                   default          meaning
=========================  ===============  ================================================
``SPMD_STORE_TIMEOUT``     ``300``          seconds a store waits for a key, a peer, a join
``SPMD_AUTH_TOKEN``        unset            shared secret stores and RPC agents demand
``SPMD_STORE_MAX_MESSAGE`` ``1073741824``   largest request a store server accepts (bytes)
=========================  ===============  ================================================
"""

from __future__ import annotations

import os
from datetime import timedelta

__all__ = ["store_timeout", "auth_token", "store_max_message"]


def _float_env(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None
    if value <= 0:
        raise ValueError(f"{name}={raw!r} must be positive")
    return value


def store_timeout() -> timedelta:
    """Default timeout of every store (``SPMD_STORE_TIMEOUT`` seconds, 300 like PyTorch)."""
    return timedelta(seconds=_float_env("SPMD_STORE_TIMEOUT", 300.0))


def auth_token() -> str | None:
    """The shared secret from ``SPMD_AUTH_TOKEN``, or None when unset or empty."""
    return os.environ.get("SPMD_AUTH_TOKEN") or None


def store_max_message() -> int:
    """Largest request frame a store server accepts (``SPMD_STORE_MAX_MESSAGE`` bytes).

    The cap protects the server from a length prefix that would make it buffer gigabytes;
    it is far above what any real key or value needs (64 MiB values are tested).
    """
    return int(_float_env("SPMD_STORE_MAX_MESSAGE", float(1 << 30)))
